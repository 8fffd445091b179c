"""Shared pieces of the training-step benchmarks (bench/vs_trl.py, bench/trl_grpo.py).

- ``eos_free_model``: a copy of a built-in model that can never sample an EOS token, so that every
  response of both frameworks runs to the maximum length (equal work, no forcing flag needed);
- ``model_params`` / ``essential_flops``: the FLOP count the efficiency figure divides by;
- ``matmul_peak`` / ``machine_matmul_peak``: the machine's fp32 matmul throughput, measured (MKL's and oneDNN's);
- ``TreeMemory``: peak resident memory of a process tree (the driver plus Ray's processes);
- ``cpu_description``: the CPU every figure is measured on (model, family/model, vector ISA, caps);
- ``example_args`` / ``bench_plan``: the run plan of the demo config with a benchmark's settings,
  built as ``easyvlm.trainer.main`` builds it, so workers and engines get the trainer's specs.
"""

from __future__ import annotations

import dataclasses
import json
import os
import platform
import shutil
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import torch

import easyvlm.builtin

REPO = Path(__file__).resolve().parents[1]
# what every easyvlm command does first (easyvlm.trainer.main's load_bundle): `builtin:` model paths
# and data sets resolve in the benchmark scripts' own processes too (eos_free_model, engines, workers)
easyvlm.builtin.register()


def example_args(*overrides: str) -> list[str]:
    """Command-line arguments of the demo config (examples/config.yaml) with ``overrides``; its
    relative paths made absolute, so that a script may run from any directory."""
    return [
        f"config={REPO / 'examples' / 'config.yaml'}",
        f"data.format_prompt={REPO / 'format_prompts' / 'synthetic.jinja'}",
        f"worker.reward.reward_function={REPO / 'reward_functions' / 'synthetic.py'}:compute_score",
        *overrides,
    ]


def bench_plan(args: Sequence[str], total_steps: int = 1):
    """The `RunPlan` of ``args`` (``config=...`` and ``key=value``, see :func:`example_args`), built
    as ``easyvlm.trainer.main`` builds it: validated (exit 2 with every problem), model files loaded
    once; the trained roles' schedule is ``total_steps`` long (``easyvlm.trainer.loop`` sets it)."""
    from easyvlm.plan.roles import with_total_steps
    from easyvlm.plan.launch import plan_run

    plan = plan_run(list(args))
    critic = with_total_steps(plan.critic, total_steps) if plan.critic is not None else None
    return dataclasses.replace(plan, actor=with_total_steps(plan.actor, total_steps), critic=critic)

# the residual-stream channel that carries the constant which keeps EOS logits far below the others
EOS_CHANNEL = 0
EOS_CHANNEL_VALUE = 1.0
EOS_LOGIT_SCALE = 200.0


def eos_free_model(model: str, out_root: str | os.PathLike | None = None) -> str:
    """A copy of ``model`` (``builtin:<name>`` or a directory) whose EOS tokens are never sampled.

    Why: a random (or warm-started) model ends its responses at random points, and the two
    frameworks then do different amounts of work. Forcing flags differ between them (vLLM's
    ``min_tokens`` is not exposed by easyvlm's config; ``ignore_eos`` keeps sampling but masks the
    tokens after an EOS out of the loss), so the benchmark removes EOS from the model instead.

    How: residual channel c = ``EOS_CHANNEL`` of the text decoder is made a constant: every token
    embedding holds ``EOS_CHANNEL_VALUE`` there and no attention or MLP block writes to it (row c of
    every ``o_proj`` and ``down_proj`` is 0). After the final RMSNorm that channel is positive at
    every position, so lm_head rows of the EOS ids set to ``-EOS_LOGIT_SCALE`` on channel c (0
    elsewhere) give EOS a logit of about -100 or lower: probability < 1e-40 per token. The copy is
    cached next to the source (``<dir>-eosfree``) and rebuilt when the source changes.
    """
    from safetensors.torch import load_file, save_file

    from easyvlm.models.paths import resolve_model_path

    src = Path(resolve_model_path(model))
    out = Path(out_root or src.parent) / f"{src.name}-eosfree"
    stamp = str((src / "model.safetensors").stat().st_mtime_ns)
    if (out / "eosfree.json").is_file() and json.loads((out / "eosfree.json").read_text())["source_mtime"] == stamp:
        return str(out)
    tmp = out.with_name(out.name + f".tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.copytree(src, tmp)
    config = json.loads((src / "config.json").read_text())
    generation = json.loads((src / "generation_config.json").read_text())
    eos = generation.get("eos_token_id", config.get("text_config", config).get("eos_token_id"))
    eos_ids = sorted({*([eos] if isinstance(eos, int) else eos), config.get("text_config", config)["eos_token_id"]})
    state = load_file(str(src / "model.safetensors"))
    prefix = "model.language_model." if "model.language_model.embed_tokens.weight" in state else "model."
    state[f"{prefix}embed_tokens.weight"][:, EOS_CHANNEL] = EOS_CHANNEL_VALUE
    for name, tensor in state.items():
        if name.startswith(f"{prefix}layers.") and name.endswith(("self_attn.o_proj.weight", "mlp.down_proj.weight")):
            tensor[EOS_CHANNEL] = 0.0
    state[f"{prefix}norm.weight"][EOS_CHANNEL] = 1.0  # a trained norm weight could flip the sign
    lm_head = state["lm_head.weight"]
    lm_head[:, EOS_CHANNEL] = 0.0
    lm_head[eos_ids] = 0.0
    lm_head[eos_ids, EOS_CHANNEL] = -EOS_LOGIT_SCALE
    save_file(state, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    (tmp / "eosfree.json").write_text(json.dumps({"source": str(src), "source_mtime": stamp, "eos_ids": eos_ids}))
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    return str(out)


@dataclass(frozen=True)
class ModelParams:
    total: int
    """All parameters."""
    decoder: int
    """Parameters the text decoder multiplies with per token: all text weights except the input
    embedding table (a lookup), lm_head included; of an MoE layer's experts, the share a token is
    routed to (top-k of E: the active parameters)."""
    vision: int
    """The vision tower (patch embedding, blocks, merger): runs once per image patch."""


def cpu_description(cpuinfo: str | os.PathLike = "/proc/cpuinfo") -> str:
    """The CPU a figure was measured on: model name, family and model numbers (which tell a Zen 3 from
    a Zen 4 when the name is just "AMD EPYC"), the widest vector ISA and the flags that matter for
    float32 products, and any ISA cap set in the environment (speeds differ 2-4x between machines)."""
    from easyvlm.models.kernel_choice import ISA_VARIABLES

    fields: dict[str, str] = {}
    try:
        for line in Path(cpuinfo).read_text().splitlines():
            key, _, value = line.partition(":")
            fields.setdefault(key.strip(), value.strip())  # the first processor's
    except OSError:
        pass
    flags = set(fields.get("flags", "").split())
    isa = "AVX-512" if "avx512f" in flags else "AVX2, no AVX-512" if "avx2" in flags else "no AVX2"
    extras = sorted(flags & {"avx512_bf16", "avx512_vp2intersect", "amx_tile"})
    caps = [f"{name}={os.environ[name]}" for name in ISA_VARIABLES if os.environ.get(name)]
    parts = [
        fields.get("model name") or platform.processor() or platform.machine(),
        f"family {fields['cpu family']} model {fields['model']}" if "cpu family" in fields else "",
        isa + (f" ({', '.join(extras)})" if extras else ""),
        f"capped by {' '.join(caps)}" if caps else "",
    ]
    return "; ".join(part for part in parts if part)


def model_params(model_dir: str) -> ModelParams:
    from safetensors import safe_open

    from transformers import AutoConfig

    text = AutoConfig.from_pretrained(model_dir).get_text_config()  # names as transformers reads them
    routed = getattr(text, "num_experts_per_tok", 1) / (getattr(text, "num_experts", 0) or 1)  # 1: dense
    total = decoder = vision = 0
    with safe_open(str(Path(model_dir) / "model.safetensors"), "pt") as f:
        for name in f.keys():
            numel = 1
            for dim in f.get_slice(name).get_shape():
                numel *= dim
            total += numel
            if "visual" in name:
                vision += numel
            elif name.endswith(("experts.gate_up_proj", "experts.down_proj")):  # the fused experts (E, ...)
                decoder += round(numel * routed)
            elif not name.endswith("embed_tokens.weight"):
                decoder += numel
    return ModelParams(total, decoder, vision)


def essential_flops(params: ModelParams, prompt_tokens: list[int], image_patches: list[int], n: int, response_length: int) -> dict:
    """FLOPs a GRPO step cannot avoid, per prompt i (``prompt_tokens[i]`` tokens, image tokens
    included; ``image_patches[i]`` vision patches before merging), n samples of ``response_length``:

    - generation: prefill each prompt once (2 * decoder * P_i + 2 * vision * patches_i) and decode
      every sampled token (2 * decoder per token, n * response_length per prompt);
    - training: one forward and backward over every real token of every sample (6 * decoder per
      token, n * (P_i + response_length) per prompt) and the vision tower over its patches
      (6 * vision per patch, n times per prompt).

    ``train_shared_prompts``: the training FLOPs when each prompt's tokens and patches run once for
    its n samples (easyvlm's ``share_prompts``), not part of ``total``: what easyvlm executes.

    Left out: attention scores (2 * layers * context * width per token: ~2% of the matmul FLOPs
    at 170 tokens), norms and activations, the old/reference log-prob passes (avoidable: TRL and
    easyvlm skip them here) and anything a padded layout or a repeated prefill adds.
    """
    prefill = sum(2 * params.decoder * p + 2 * params.vision * v for p, v in zip(prompt_tokens, image_patches))
    decode = 2 * params.decoder * n * response_length * len(prompt_tokens)
    train = sum(6 * params.decoder * n * (p + response_length) + 6 * params.vision * n * v for p, v in zip(prompt_tokens, image_patches))
    shared = sum(6 * params.decoder * (p + n * response_length) + 6 * params.vision * v for p, v in zip(prompt_tokens, image_patches))
    return {"prefill": prefill, "decode": decode, "train": train, "total": prefill + decode + train,
            "train_shared_prompts": shared}


def matmul_peak(threads: int, size: int = 2048, repeats: int = 10, kernel: str = "aten") -> float:
    """Median fp32 matrix-product throughput (FLOP/s) of two size x size matrices on ``threads``:
    ``kernel="aten"``: ``torch.matmul`` (MKL's sgemm, AVX2 on non-Intel CPUs); ``"onednn"``: the
    oneDNN product easyvlm's CPU linears use (easyvlm.models.cpu_linear), in strict float32."""
    from easyvlm.models.cpu_linear import onednn_mm_t

    # oneDNN's kernel itself: easyvlm's linear would take the kernel measured faster for the shape
    product = torch.matmul if kernel == "aten" else lambda a, b: onednn_mm_t(a, b.t())
    saved = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        gen = torch.Generator().manual_seed(0)
        a, b = torch.randn(size, size, generator=gen), torch.randn(size, size, generator=gen)
        product(a, b)  # warm-up
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            product(a, b)
            times.append(time.perf_counter() - start)
        return 2 * size**3 / statistics.median(times)
    finally:
        torch.set_num_threads(saved)


def machine_matmul_peak(threads: int) -> dict[str, float]:
    """The fp32 matrix-product throughput of each kernel torch offers here (FLOP/s; oneDNN only where
    easyvlm uses it) and ``"peak"``, the faster: the machine's peak the efficiency figures divide by."""
    from easyvlm.models.cpu_linear import onednn_linear_available

    peaks = {"aten": matmul_peak(threads)}
    if onednn_linear_available():
        peaks["onednn"] = matmul_peak(threads, kernel="onednn")
    return {**peaks, "peak": max(peaks.values())}


class TreeMemory:
    """Samples the resident memory of a process and all its descendants (Ray's raylet, GCS and
    workers are children of the driver) every ``interval`` seconds, in a thread
    (``process_tree_memory.TreeSampler``: RSS every sample, PSS every 5th and at RSS highs).

    ``peak_sum``: the largest sum of RSS over the tree at one sample (what the issues' figures
    quote); ``sum_of_peaks``: each process's own peak, summed (an upper bound). RSS counts shared
    pages (torch's libraries) once per process, so both overstate the unique memory; ``peak_pss_sum``
    (proportional set size: a page shared by k processes counts 1/k in each) does not. ``pss=False``
    reads only RSS (/proc/<pid>/statm): reading PSS walks every process's page tables, which on 2
    cores slows the run being measured (``bench/vs_trl.py --pss``).
    """

    def __init__(self, pid: int, interval: float = 0.25, pss: bool = True):
        from process_tree_memory import TreeSampler

        self.sampler = TreeSampler(pid, interval, pss_every=5 if pss else 0)

    @property
    def peak_sum(self) -> int:
        return self.sampler.peak_rss_sum

    @property
    def peak_pss_sum(self) -> int:
        return self.sampler.peak_pss_sum

    @property
    def sum_of_peaks(self) -> int:
        return sum(p["peak_rss"] for p in self.sampler.per_process.values())

    def __enter__(self) -> "TreeMemory":
        self.sampler.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self.sampler.__exit__(*exc)


def fit_exponent(xs: list[float], ys: list[float]) -> float:
    """Least-squares slope of log(y) against log(x): y ~ x^k."""
    import numpy as np

    return float(np.polyfit(np.log(xs), np.log(ys), 1)[0])
