"""GRPO steps of a real model's shapes through easyvlm's own workers, phase by phase: seconds,
tokens/s, MFU, peak GPU memory, and the operators of one actor update.

    PYTHONPATH=. python bench/gpu_step.py [--shape qwen2.5-vl-3b] [--prompts 16] [--n 8] [--response-length 256]
        [--image-size 448] [--steps 2] [--rollout auto|hf|vllm] [--peak-tflops T] [--expert-parallel-size N]
        [key=value ...]
    PYTHONPATH=. python bench/gpu_step.py --tiny --steps 1    # the builtin tiny model's shapes, CPU, fp32

The model: random weights with the shapes of ``--shape`` (Qwen2.5-VL-3B or -7B, Qwen3-VL-8B, their
public config.json values written out below; ``--tiny``: builtin:tiny-qwen2.5-vl's) and the builtin
byte-level tokenizer, so nothing is downloaded. Its vocabulary is the tokenizer's (264 tokens, as
every builtin model: a larger one lets a random model sample ids the tokenizer cannot decode), so
lm_head and the log-softmax are far smaller than the real ~152 K; the rest is the real model's. It
is initialised in bf16 on the GPU (fp32 on the CPU), made EOS-free (``bench_support.eos_free_model``'s
edit, applied in memory: every response runs to ``--response-length``) and written to a temporary
directory the workers load it from. The prompts: ``--prompts`` rows of one random ``--image-size``
square image and a question of ``--question-tokens`` bytes, through the real data loader.

The run: the plan of the GPU recipes' base (examples/qwen2_5_vl_gpu.yaml: bf16 compute over fp32
master weights, gradient checkpointing, padding-free, shared prompts, GRPO with a k3 KL loss; the
shape's own recipe's micro-batches and offloading: EasyR1's 7B memory settings for 7B and 8B) on one
device, one PPO mini-batch per step, built as the trainer builds it (``bench_support.bench_plan``;
trailing ``key=value`` arguments override it); ``--tiny`` uses the demo's (examples/config.yaml).
``--expert-parallel-size N`` (MoE shapes, qwen3-vl-30b-a3b) adds ``worker.actor.expert_parallel_size=N``
(the reference follows it) before those arguments, only for N > 1. N must divide the devices and this
script runs one process on one device, so the config check refuses N > 1 until it runs one process
per GPU (torchrun); bench/moe_cost_model.py models expert parallelism on 8+ GPUs.
The trainer's hybrid worker runs in this process (no Ray), each phase timed between
``torch.cuda.synchronize()`` calls: weight sync (the actor's full state into the engine), generation,
old log-probs, reference log-probs, update. Rewards are random (the work does not depend on them);
advantages are GRPO's. Old log-probs are timed every step but count in the step (and reach the
update) only where the trainer computes them (``update_is_on_policy``). The first of ``--steps``
steps is a warm-up (torch.compile, allocator) when there are more; the figures are the mean of the
others. Then one more update of the last batch runs under torch.profiler (``--no-profile``: none).

MFU = model FLOPs / seconds / the chip's peak (``--peak-tflops``, else a table by device name: dense
bf16; on the CPU the measured fp32 matmul peak). Model FLOPs count the matrix products: 2 per
parameter per token forward, 6 forward and backward, over the text decoder's parameters per token
(lm_head included) and the vision tower's per patch (``bench_support.ModelParams``); the recomputed
forward of gradient checkpointing and the attention scores (~1-3% here) are left out.
``update_mfu`` / ``ref_mfu`` count what easyvlm executes: with shared prompts a group's prompt and
image once (``*_per_sample``: each sample's own, as a layout without shared prompts runs them and as
verl's and EasyR1's MFU counts sequences, whole).
``tokens_per_s``: prompt + response tokens of every sample over the step's seconds (the trainer's
``perf/throughput`` on one device). The last stdout line is one JSON object of these figures.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

sys.path.insert(0, str(Path(__file__).resolve().parent))

REPO = Path(__file__).resolve().parents[1]
GiB = 2**30
PHASES = ("weight_sync", "generation", "old_logprobs", "ref_logprobs", "update")

# Dense bf16 peaks (FLOP/s) by a piece of torch.cuda.get_device_name(), most specific first
PEAK_FLOPS = (("H100 PCIe", 756e12), ("H100", 989e12), ("H200", 989e12), ("H20", 148e12), ("A100", 312e12),
              ("L40S", 362e12))


@dataclass(frozen=True)
class Shape:
    """A real model's sizes (``easyvlm.builtin.models.BuiltinModelSpec``) and its recipe's settings."""

    spec: Any
    overrides: tuple[str, ...] = ()


def shapes() -> dict[str, Shape]:
    from dataclasses import replace

    from easyvlm.builtin.models import BUILTIN_MODELS, BuiltinModelSpec

    qwen25_vision = dict(vision_depth=32, vision_hidden_size=1280, vision_intermediate_size=3420, vision_num_heads=16,
                         vision_fullatt_block_indexes=(7, 15, 23, 31), min_pixels=3136, max_pixels=12845056,
                         max_position_embeddings=128000)
    # examples/qwen2_5_vl_3b_geo3k_grpo.sh; the 7B and 8B recipes keep the base's (offload, micro 1 / 2)
    small = ("worker.actor.micro_batch_size_per_device_for_update=4",
             "worker.actor.micro_batch_size_per_device_for_experience=16",
             "worker.actor.offload.offload_params=false", "worker.actor.offload.offload_optimizer=false",
             "worker.ref.offload.offload_params=false")
    qwen3_tower = BuiltinModelSpec(  # Qwen/Qwen3-VL-8B-Instruct; the other Qwen3 shapes change its decoder
        hidden_size=4096, intermediate_size=12288, num_hidden_layers=36, num_attention_heads=32,
        num_key_value_heads=8, mrope_section=(24, 20, 20), vision_depth=27, vision_hidden_size=1152,
        vision_intermediate_size=4304, vision_num_heads=16, vision_fullatt_block_indexes=(), patch_size=16,
        min_pixels=4096, max_pixels=16777216, max_position_embeddings=262144, family="qwen3_vl",
        vision_deepstack_indexes=(8, 16, 24), vision_num_position_embeddings=2304)
    return {
        # Qwen/Qwen2.5-VL-3B-Instruct (its embeddings are tied; here untied, over the builtin vocabulary)
        "qwen2.5-vl-3b": Shape(BuiltinModelSpec(
            hidden_size=2048, intermediate_size=11008, num_hidden_layers=36, num_attention_heads=16,
            num_key_value_heads=2, mrope_section=(16, 24, 24), **qwen25_vision), small),
        # Qwen/Qwen2.5-VL-7B-Instruct
        "qwen2.5-vl-7b": Shape(BuiltinModelSpec(
            hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28,
            num_key_value_heads=4, mrope_section=(16, 24, 24), **qwen25_vision)),
        # Qwen/Qwen3-VL-8B-Instruct
        "qwen3-vl-8b": Shape(qwen3_tower),
        # Qwen/Qwen3.5-9B (transformers' Qwen3_5TextConfig defaults): 3 gated-DeltaNet layers to 1
        # gated attention layer, a quarter of the 256-wide heads rotating; Qwen3-VL's tower sizes
        "qwen3.5-9b": Shape(replace(
            qwen3_tower, hidden_size=4096, intermediate_size=12288, num_hidden_layers=32, num_attention_heads=16,
            num_key_value_heads=4, head_dim=256, partial_rotary_factor=0.25, mrope_section=(11, 11, 10),
            layer_types=(("linear_attention",) * 3 + ("full_attention",)) * 8, linear_key_heads=16,
            linear_value_heads=32, linear_head_dim=128, family="qwen3_5", vision_deepstack_indexes=())),
        # Qwen/Qwen3-VL-30B-A3B-Instruct: 48 layers, 128 experts of 768, 8 per token
        "qwen3-vl-30b-a3b": Shape(replace(
            qwen3_tower, hidden_size=2048, intermediate_size=6144, num_hidden_layers=48, num_attention_heads=32,
            num_key_value_heads=4, head_dim=128, mrope_section=(24, 20, 20), family="qwen3_vl_moe", num_experts=128,
            num_experts_per_tok=8, moe_intermediate_size=768)),
        "tiny": Shape(BUILTIN_MODELS["tiny-qwen2.5-vl"]),
        # the CPU benchmarks' ~40 M model (bench/vs_trl.py): with --cpu
        "bench": Shape(BUILTIN_MODELS["bench-qwen2.5-vl"]),
        # its width as Qwen3-VL-MoE (16 experts, top-2) and the dense twin of equal active parameters
        # (bench/moe_experts.py): with --cpu
        "bench-qwen3-vl-moe": Shape(BUILTIN_MODELS["bench-qwen3-vl-moe"]),
        "bench-qwen3-vl": Shape(BUILTIN_MODELS["bench-qwen3-vl"]),
    }


# ----------------------------------------------------------------------------------- the model
def make_eos_free(model: Any, eos_ids: list[int]) -> None:
    """``bench_support.eos_free_model``'s edit on a model in memory: residual channel ``EOS_CHANNEL``
    a constant, and EOS's lm_head rows reading it with a large negative weight (see there)."""
    import torch
    from bench_support import EOS_CHANNEL, EOS_CHANNEL_VALUE, EOS_LOGIT_SCALE

    state = dict(model.named_parameters())
    prefix = "model.language_model." if "model.language_model.embed_tokens.weight" in state else "model."
    with torch.no_grad():
        state[f"{prefix}embed_tokens.weight"][:, EOS_CHANNEL] = EOS_CHANNEL_VALUE
        for name, tensor in state.items():
            # every write to the residual stream: attention, linear attention (Qwen3.5), MLP, shared expert
            if name.startswith(f"{prefix}layers.") and name.endswith(
                    ("self_attn.o_proj.weight", "linear_attn.out_proj.weight", "mlp.down_proj.weight",
                     "shared_expert.down_proj.weight")):
                tensor[EOS_CHANNEL] = 0.0
            elif name.startswith(f"{prefix}layers.") and name.endswith("mlp.experts.down_proj"):  # (E, H, I)
                tensor[:, EOS_CHANNEL] = 0.0
        state[f"{prefix}norm.weight"][EOS_CHANNEL] = 1.0
        lm_head = state["lm_head.weight"]
        lm_head[:, EOS_CHANNEL] = 0.0
        lm_head[eos_ids] = 0.0
        lm_head[eos_ids, EOS_CHANNEL] = -EOS_LOGIT_SCALE


def write_random_model(spec: Any, out_dir: Path, device: str, dtype: Any) -> Path:
    """A Hugging Face model directory of ``spec``'s shapes with random weights, initialised on
    ``device`` in ``dtype``, EOS-free; tokenizer, processor and generation config as the builtin
    models' (``easyvlm.builtin.models.build_model``, which builds in fp32 on the CPU)."""
    import torch
    import transformers
    from transformers import GenerationConfig

    from easyvlm.builtin.families import FAMILIES, model_config, processor
    from easyvlm.builtin.models import CHAT_TEMPLATE, SPECIAL_TOKENS, build_tokenizer

    tokenizer = build_tokenizer(spec.word_tokens)
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS}
    config = model_config(spec, ids, len(tokenizer))
    torch.manual_seed(spec.seed)
    with torch.device(device):
        model = getattr(transformers, FAMILIES[spec.family][1])._from_config(config, dtype=dtype).eval()
    eos_ids = [ids["<|im_end|>"], ids["<|endoftext|>"]]
    make_eos_free(model, eos_ids)
    model.save_pretrained(out_dir)
    del model
    GenerationConfig(bos_token_id=ids["<|endoftext|>"], eos_token_id=eos_ids,
                     pad_token_id=ids["<|endoftext|>"]).save_pretrained(out_dir)
    processor(spec, tokenizer, CHAT_TEMPLATE).save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    if device != "cpu":
        torch.cuda.empty_cache()
    return out_dir


def write_prompts(out_dir: Path, count: int, image_size: int, question_tokens: int, seed: int = 0) -> Path:
    """``count`` rows in EasyR1's format (problem with ``<image>``, answer, images): one random
    ``image_size`` square RGB image each and a question of ``question_tokens`` bytes (the builtin
    tokenizer spells one token per byte)."""
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(seed)
    text = "How many shapes of each colour are in the picture, and which one is the largest? "
    question = (text * (question_tokens // len(text) + 1))[:question_tokens]
    rows = []
    for i in range(count):
        name = f"image_{i}.png"
        Image.fromarray(rng.integers(0, 256, (image_size, image_size, 3), dtype=np.uint8)).save(out_dir / name)
        rows.append({"problem": f"<image>{question}", "answer": str(i % 10), "images": [name]})
    path = out_dir / "prompts.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


# ----------------------------------------------------------------------------------- the work
@dataclass(frozen=True)
class Work:
    """What a phase's batch holds, counted from the tensors the workers received."""

    samples: int
    prompt_tokens: int  # every sample's own prompt (image tokens included), unpadded
    response_tokens: int
    patches: int  # vision patches before merging, every sample's own images
    group_prompt_tokens: int  # each prompt group's prompt once (shared prompts)
    group_patches: int


def count_work(batch: Any) -> Work:
    prompt_width = batch["prompts"].shape[1]
    prompt_lengths = batch["attention_mask"][:, :prompt_width].sum(1).tolist()
    responses = int(batch["response_mask"].sum())
    patches = []
    for mm in batch.get("multi_modal_inputs") or [{}] * len(batch):
        grids = [mm[key] for key in ("image_grid_thw", "video_grid_thw") if mm.get(key) is not None]
        patches.append(sum(int(grid.prod(-1).sum()) for grid in grids))
    firsts = {}
    for i, uid in enumerate(batch["uid"]):
        firsts.setdefault(uid, i)
    return Work(len(batch), int(sum(prompt_lengths)), responses, sum(patches),
                int(sum(prompt_lengths[i] for i in firsts.values())), sum(patches[i] for i in firsts.values()))


def model_flops(params: Any, work: Work, passes: int, shared: bool) -> float:
    """Matrix-product FLOPs of ``passes`` passes over ``work`` (1: a forward, as log-probs; 3: a forward
    and its backward, as the update): 2 x passes per parameter per token, the decoder's for every
    token (a group's prompt once if ``shared``) and the vision tower's for every patch."""
    tokens = (work.group_prompt_tokens if shared else work.prompt_tokens) + work.response_tokens
    patches = work.group_patches if shared else work.patches
    return 2.0 * passes * (params.decoder * tokens + params.vision * patches)


def mfu(flops: float, seconds: float, peak_flops: float) -> float:
    """Model FLOPs utilisation: the fraction of the chip's peak that ``flops`` in ``seconds`` is."""
    return flops / seconds / peak_flops


def chip_peak(device: str, peak_tflops: float | None) -> tuple[float, str]:
    """(FLOP/s, what it is): ``--peak-tflops``, else the GPU's dense bf16 peak by name, else (CPU) the
    measured fp32 matrix-product peak (``bench_support.machine_matmul_peak``)."""
    import torch

    if peak_tflops:
        return peak_tflops * 1e12, "--peak-tflops"
    if device == "cpu":
        from bench_support import machine_matmul_peak

        return machine_matmul_peak(torch.get_num_threads())["peak"], "measured fp32 matmul peak"
    name = torch.cuda.get_device_name()
    flops = gpu_peak(name)
    if flops is None:
        raise SystemExit(f"no peak known for {name!r}: pass --peak-tflops (dense bf16 TFLOP/s)")
    return flops, f"{name}: dense bf16"


def gpu_peak(device_name: str) -> float | None:
    """The dense bf16 peak (FLOP/s) of a GPU by its torch.cuda.get_device_name(); None if unknown."""
    return next((flops for piece, flops in PEAK_FLOPS if piece in device_name), None)


# ----------------------------------------------------------------------------------- the run
def plan_args(args: argparse.Namespace, model_dir: Path, prompts: Path, work_dir: Path, rollout: str) -> list[str]:
    """The trainer's arguments of this benchmark (see the module docstring)."""
    import importlib.util

    from bench_support import example_args

    shape = shapes()[args.shape]
    image_pixels = args.image_size**2
    common = [
        f"worker.actor.model.model_path={model_dir}", f"data.train_files={prompts}", "data.val_files=",
        "data.format_prompt=null", "data.shuffle=false", "data.filter_overlong_prompts_workers=1",
        f"data.rollout_batch_size={args.prompts}", f"worker.actor.global_batch_size={args.prompts}",
        f"data.max_response_length={args.response_length}", f"worker.rollout.n={args.n}",
        f"worker.rollout.name={rollout}", "worker.rollout.tensor_parallel_size=1",
        f"worker.reward.reward_function={REPO / 'reward_functions' / 'synthetic.py'}:compute_score",
        f"trainer.save_checkpoint_path={work_dir / 'checkpoints'}", "trainer.n_gpus_per_node=1", "trainer.logger=[console]",
        f"data.min_pixels={min(3136, image_pixels)}", "trainer.val_before_train=false", "trainer.val_freq=-1",
    ]
    experts = expert_parallel_args(getattr(args, "expert_parallel_size", 1))  # bench/hf_generate.py has none
    if args.cpu:  # one micro-batch of every sample, as the demo's 32 x 8
        samples = args.prompts * args.n
        return example_args(*common, f"data.max_pixels={max(50176, image_pixels)}", "trainer.device=cpu",
                            f"worker.actor.micro_batch_size_per_device_for_update={samples}",
                            f"worker.actor.micro_batch_size_per_device_for_experience={samples}", *experts,
                            *args.overrides)
    attn = "flash_attention_2" if importlib.util.find_spec("flash_attn") else "sdpa"
    return [f"config={REPO / 'examples' / 'qwen2_5_vl_gpu.yaml'}", *common, *shape.overrides,
            f"data.max_pixels={max(4194304, image_pixels)}", f"worker.actor.model.attn_implementation={attn}",
            "trainer.device=cuda", *experts, *args.overrides]


def expert_parallel_args(size: int) -> list[str]:
    """The overrides of ``--expert-parallel-size``: none for 1, else the actor's (the reference model
    follows the actor's expert parallelism)."""
    return [f"worker.actor.expert_parallel_size={size}"] if size > 1 else []


class Clock:
    """Seconds and peak GPU memory of each phase: ``with clock.phase(name):`` around the work."""

    def __init__(self, cuda: bool):
        self.cuda = cuda
        self.seconds: dict[str, float] = {}
        self.memory: dict[str, tuple[int, int] | None] = {}
        self.current = ""  # the phase running now

    def sync(self) -> None:
        if self.cuda:
            import torch

            torch.cuda.synchronize()

    def phase(self, name: str):
        from contextlib import contextmanager

        from easyvlm.utils.memory import cuda_peak_bytes

        @contextmanager
        def timing():
            import torch

            self.sync()
            if self.cuda:
                torch.cuda.reset_peak_memory_stats()
            # each phase's start and end on stdout as they happen: a run stopped by a time limit
            # (a device call's) still tells which phase it was in and what the finished ones cost
            print(f"  {name} ...", flush=True)
            self.current = name
            start = time.perf_counter()
            yield
            self.sync()
            seconds = time.perf_counter() - start
            self.seconds[name] = self.seconds.get(name, 0.0) + seconds
            self.memory[name] = cuda_peak_bytes() if self.cuda else None
            peak = f", peak {self.memory[name][0] / GiB:.2f} / {self.memory[name][1] / GiB:.2f} GiB allocated / " \
                   "reserved" if self.memory[name] else ""
            print(f"  {name} {seconds:.2f} s{peak}", flush=True)

        return timing()

    def watch_tower(self, model: Any) -> None:
        """Add the seconds of each forward of ``model``'s vision tower to ``vision_tower:<phase>`` (the
        tower's share of a phase; its calls are synchronized on GPUs, which costs a little)."""
        from easyvlm.models.loading import get_vision_tower

        tower, started = get_vision_tower(model), []
        if tower is None:
            return

        def before(*_):
            self.sync()
            started.append(time.perf_counter())

        def after(*_):
            self.sync()
            name = f"vision_tower:{self.current}"
            self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - started.pop()

        tower.register_forward_pre_hook(before)
        tower.register_forward_hook(after)

    def timed(self, name: str, fn: Callable) -> Callable:
        """``fn``, its time added to ``name`` (inside another phase: subtract it there)."""

        def call(*a, **kw):
            self.sync()
            start = time.perf_counter()
            out = fn(*a, **kw)
            self.sync()
            self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - start
            return out

        return call


def without_original_images(prompts: Any) -> Any:
    """The prompt batch as the trainer sends it to the workers (the loader's original images stay behind)."""
    from easyvlm.data.batch import ORIGINAL_IMAGES_KEY

    if ORIGINAL_IMAGES_KEY not in prompts:
        return prompts
    prompts = prompts.copy()
    prompts.pop(ORIGINAL_IMAGES_KEY)
    return prompts


def run_step(worker: Any, plan: Any, prompts: Any, clock: Clock, seed: int) -> tuple[Any, Work]:
    """One GRPO step of the trainer's phases on ``worker``; returns the update batch and the step's work."""
    import torch

    from easyvlm.algorithms import AdvantageInputs, get_advantage
    from easyvlm.data.batch import MODEL_INPUT_KEYS, UPDATE_INPUT_KEYS
    from easyvlm.trainer import core
    from easyvlm.workers.actor import update_is_on_policy

    prompts = without_original_images(prompts)
    with clock.phase("generation"):
        batch = worker.generate(prompts)
    clock.seconds["generation"] -= clock.seconds.get("weight_sync", 0.0)  # timed inside generate
    inputs = batch.select(*[k for k in MODEL_INPUT_KEYS if k in batch], meta=False)
    with clock.phase("old_logprobs"):
        old = worker.compute_logprobs(inputs)
    if plan.ref is not None:
        with clock.phase("ref_logprobs"):
            batch = batch.union(worker.compute_ref_logprobs(inputs))
    adv = plan.driver.advantage
    if not update_is_on_policy(plan.actor.update.optimizer_steps_per_step, adv.kl_in_reward):
        batch = batch.union(old)
    mask = batch["response_mask"].bool()
    scores = torch.rand(len(batch), generator=torch.Generator().manual_seed(seed))  # the work does not depend on them
    out = get_advantage(adv.estimator)(AdvantageInputs(
        token_rewards=core.place_seq_rewards(scores, mask), response_mask=mask,
        group_ids=core.group_ids_from_uids(batch["uid"]), values=None, baseline_rewards=None,
        gamma=adv.gamma, lam=adv.lam, norm_by_std=adv.norm_by_std))
    batch["advantages"], batch["returns"] = out.advantages, out.returns
    update = batch.select(*[k for k in UPDATE_INPUT_KEYS if k in batch], meta=False)
    with clock.phase("update"):
        worker.update_actor(update)
    return update, count_work(batch)


def profile_call(fn: Callable, cuda: bool, rows: int = 20) -> tuple[str, list, dict]:
    """``fn()`` under torch.profiler: its operator table (by self device time on GPUs, CPU time on the
    CPU), the top ``rows`` as [name, self ms], and {wall_s, device_busy_s}: the call's seconds and the
    sum of its kernels' (on GPUs; their ratio says whether the chip or the host sets the pace)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities) as prof:
        start = time.perf_counter()
        fn()
        if cuda:
            torch.cuda.synchronize()
        wall = time.perf_counter() - start
    events = prof.key_averages()
    key = "self_device_time_total" if cuda else "self_cpu_time_total"
    top = sorted(events, key=lambda e: getattr(e, key), reverse=True)[:rows]
    # the kernels' own events (an operator's row repeats its kernels' time: counting both doubles it)
    busy = sum(e.self_device_time_total for e in events
               if e.device_type == torch.autograd.DeviceType.CUDA and not e.is_user_annotation) / 1e6 if cuda else None
    return (events.table(sort_by=key, row_limit=rows), [[e.key, round(getattr(e, key) / 1e3, 3)] for e in top],
            {"wall_s": wall, "device_busy_s": busy})


# ----------------------------------------------------------------------------------- the report
def summarize(steps: list[tuple[dict, dict, dict]], params: Any, plan: Any, peak_flops: float) -> dict:
    """The JSON figures of the timed ``steps`` ((seconds, GPU memory, work) by phase, per step)."""
    from easyvlm.workers.actor import update_is_on_policy

    counted = [p for p in PHASES if p != "old_logprobs" or not update_is_on_policy(
        plan.actor.update.optimizer_steps_per_step, plan.driver.advantage.kl_in_reward)]
    seconds = {p: statistics.fmean(s.get(p, 0.0) for s, _, _ in steps) for p in PHASES}
    step_s = sum(seconds[p] for p in counted)
    work = steps[-1][2]  # EOS-free, same prompts' lengths: every step's work is the same
    shared = plan.actor.forward.settings.share_prompts
    # unrounded: the JSON's figures must recompute from one another (tests/bench/test_gpu_step.py)
    out: dict[str, Any] = {f"{p}_s": float(seconds[p]) for p in PHASES}
    tokens = work.prompt_tokens + work.response_tokens
    out.update(step_s=float(step_s), counted_phases=counted, tokens_per_s=tokens / step_s,
               generation_tokens_per_s=work.response_tokens / seconds["generation"],
               ref_tokens_per_s=tokens / seconds["ref_logprobs"] if seconds["ref_logprobs"] else None,
               update_tokens_per_s=tokens / seconds["update"])
    for name, phase, passes in (("update", "update", 3), ("ref", "ref_logprobs", 1), ("old", "old_logprobs", 1)):
        if seconds[phase] > 0:
            out[f"{name}_mfu"] = mfu(model_flops(params, work, passes, shared), seconds[phase], peak_flops)
            out[f"{name}_mfu_per_sample"] = mfu(model_flops(params, work, passes, False), seconds[phase], peak_flops)
        else:
            out[f"{name}_mfu"] = out[f"{name}_mfu_per_sample"] = None
    # the vision tower's seconds within each phase (absent: it did not run there)
    out["vision_tower_s"] = {p: float(statistics.fmean(s.get(f"vision_tower:{p}", 0.0) for s, _, _ in steps))
                             for p in PHASES if any(f"vision_tower:{p}" in s for s, _, _ in steps)}
    memory = {p: m[p] for _, m, _ in steps for p in m if m[p] is not None}
    out["phase_peak_gpu_memory_gib"] = {p: round(a / GiB, 3) for p, (a, _) in memory.items()} or None
    out["peak_gpu_memory_gib"] = max(a for a, _ in memory.values()) / GiB if memory else None
    out["peak_gpu_reserved_gib"] = max(r for _, r in memory.values()) / GiB if memory else None
    out["work"] = dataclasses.asdict(work)
    return out


def print_table(summary: dict) -> None:
    print(f"\n{'phase':<14}{'seconds':>10}{'MFU':>8}{'MFU/sample':>12}{'peak GiB':>10}", flush=True)
    mfus = {"update": "update", "ref_logprobs": "ref", "old_logprobs": "old"}
    memory = summary["phase_peak_gpu_memory_gib"] or {}
    for phase in PHASES:
        name = mfus.get(phase)
        value = summary.get(f"{name}_mfu") if name else None
        per_sample = summary.get(f"{name}_mfu_per_sample") if name else None
        cells = [f"{value:8.1%}" if value is not None else f"{'':8}",
                 f"{per_sample:12.1%}" if per_sample is not None else f"{'':12}",
                 f"{memory[phase]:10.2f}" if phase in memory else f"{'':10}"]
        print(f"{phase:<14}{summary[f'{phase}_s']:10.3f}{''.join(cells)}")
    print(f"{'step':<14}{summary['step_s']:10.3f}   ({' + '.join(summary['counted_phases'])})")
    ref = summary["ref_tokens_per_s"]
    print(f"tokens/s (prompt + response, every sample): step {summary['tokens_per_s']:.1f}, update "
          f"{summary['update_tokens_per_s']:.1f}" + (f", reference {ref:.1f}" if ref else "") +
          f"; generated tokens/s {summary['generation_tokens_per_s']:.1f}", flush=True)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_workload_args(parser)
    parser.add_argument("--steps", type=int, default=2, help="steps; the first is a warm-up when there are more")
    parser.add_argument("--rollout", choices=["auto", "hf", "vllm"], default="auto",
                        help="auto: vllm where it is installed (not with --tiny), else hf")
    parser.add_argument("--peak-tflops", type=float, default=None, help="the chip's peak (default: by device name)")
    parser.add_argument("--no-profile", action="store_true", help="skip the profiled extra phases")
    parser.add_argument("--profile", nargs="+", choices=["update", "generation", "ref_logprobs"], default=None,
                        help="the phases run once more under torch.profiler (default: update)")
    parser.add_argument("--work-dir", default=None, help="where the model and prompts go (default: a temporary "
                        "directory, removed at the end)")
    parser.add_argument("--expert-parallel-size", type=int, default=1,
                        help="MoE shapes: worker.actor.expert_parallel_size, passed only when > 1; it must divide "
                        "the devices, and this script runs one")
    parser.add_argument("overrides", nargs="*", help="key=value overrides of the run's config")
    return with_workload_defaults(parser.parse_args(argv))


def add_workload_args(parser: argparse.ArgumentParser) -> None:
    """The model and batch arguments (this script's and bench/hf_generate.py's)."""
    parser.add_argument("--tiny", action="store_true", help="the builtin tiny model's shapes on the CPU in fp32")
    parser.add_argument("--cpu", action="store_true", help="--shape's model on the CPU in fp32, the demo's config")
    parser.add_argument("--shape", choices=[s for s in shapes() if s != "tiny"], default="qwen2.5-vl-3b")
    parser.add_argument("--prompts", type=int, default=None, help="prompts per step (16; --tiny 2)")
    parser.add_argument("--n", type=int, default=None, help="samples per prompt (8; --tiny 2)")
    parser.add_argument("--response-length", type=int, default=None, help="tokens per response (256; --tiny 8)")
    parser.add_argument("--image-size", type=int, default=None, help="square image side, pixels (448; --tiny 56)")
    parser.add_argument("--question-tokens", type=int, default=None, help="question bytes = tokens (64; --tiny 16)")


def with_workload_defaults(args: argparse.Namespace) -> argparse.Namespace:
    """``args`` with the batch's unset sizes filled (the GPU's or, with --tiny, the CPU's)."""
    if args.tiny:
        args.shape, args.cpu = "tiny", True
    defaults = (2, 2, 8, 56, 16) if args.cpu else (16, 8, 256, 448, 64)
    for name, value in zip(("prompts", "n", "response_length", "image_size", "question_tokens"), defaults):
        if getattr(args, name) is None:
            setattr(args, name, value)
    return args


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    if args.cpu:  # the CPU, also where a GPU is visible (torch reads this when CUDA first initialises)
        os.environ["CUDA_VISIBLE_DEVICES"] = ""
    import torch
    from bench_support import bench_plan, model_params

    from easyvlm.plan.checks import _installed
    from easyvlm.plan.dataloaders import plan_dataloaders

    cuda = not args.cpu
    if cuda and not torch.cuda.is_available():
        raise SystemExit("no CUDA device here: run with --cpu (or --tiny) for the CPU")
    device, dtype = ("cuda", torch.bfloat16) if cuda else ("cpu", torch.float32)
    own_dir = args.work_dir is None
    work_dir = Path(args.work_dir or tempfile.mkdtemp(prefix="easyvlm-gpu-step-"))
    try:
        start = time.perf_counter()
        (work_dir / "model").mkdir(parents=True, exist_ok=True)
        model_dir = write_random_model(shapes()[args.shape].spec, work_dir / "model", device, dtype)
        params = model_params(str(model_dir))
        build_s = time.perf_counter() - start
        print(f"{args.shape}: {params.total / 1e6:,.1f} M parameters (decoder {params.decoder / 1e6:,.1f} M, vision "
              f"{params.vision / 1e6:,.1f} M), random, {dtype} on {device}: {build_s:.1f} s", flush=True)
        prompts = write_prompts(work_dir, args.prompts * args.steps, args.image_size, args.question_tokens)
        rollout = args.rollout if args.rollout != "auto" else "vllm" if cuda and _installed("vllm") else "hf"
        plan = bench_plan(plan_args(args, model_dir, prompts, work_dir, rollout),
                          total_steps=args.steps + (not args.no_profile) * len(args.profile or ['update']))
        summary = run(args, plan, plan_dataloaders(plan)[0], params, cuda)
        summary.update(shape=args.shape, rollout=rollout, attn_implementation=plan.actor.model.attn_implementation,
                       prompts=args.prompts, n=args.n, response_length=args.response_length, image_size=args.image_size,
                       params={"total": params.total, "decoder": params.decoder, "vision": params.vision},
                       model_build_s=round(build_s, 2))
    finally:
        if own_dir:
            shutil.rmtree(work_dir, ignore_errors=True)
    print(json.dumps(summary), flush=True)
    return summary


def run(args: argparse.Namespace, plan: Any, loader: Any, params: Any, cuda: bool) -> dict:
    """Build the hybrid worker, run the steps, profile one more update; the summary."""
    import torch

    from easyvlm.utils.memory import peak_rss_bytes
    from easyvlm.workers.dist import find_free_port
    from easyvlm.workers.hybrid import HybridWorker

    # a process group of one, on a port of its own: an inherited MASTER_PORT may be a parent's (pytest's)
    os.environ.update(RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(find_free_port()))
    start = time.perf_counter()
    worker = HybridWorker(plan.actor, plan.ref, plan.rollout)
    worker_s = time.perf_counter() - start
    peak_flops, peak_source = chip_peak("cuda" if cuda else "cpu", args.peak_tflops)
    print(f"workers built in {worker_s:.1f} s; peak {peak_flops / 1e9:,.0f} GFLOP/s ({peak_source})", flush=True)
    clock = Clock(cuda)
    for role in (worker.actor, worker.ref):
        if role is not None:
            clock.watch_tower(role.model)
    # the weight sync happens inside generate (the engine gathers the actor's weights as it loads
    # them): timed there, subtracted from the generation
    worker.rollout.update_weights = clock.timed("weight_sync", worker.rollout.update_weights)
    batches, steps = iter(loader), []
    for step in range(args.steps):
        clock.seconds, clock.memory = {}, {}
        last_prompts = next(batches)
        update, work = run_step(worker, plan, last_prompts, clock, seed=step)
        steps.append((dict(clock.seconds), dict(clock.memory), work))
        print(f"step {step + 1}: " + ", ".join(f"{p} {s:.2f} s" for p, s in clock.seconds.items()), flush=True)
    timed = steps[1:] if len(steps) > 1 else steps
    summary = summarize(timed, params, plan, peak_flops)
    print_table(summary)
    summary["profile_top"], summary["profiles"] = None, {}
    if not args.no_profile:
        calls = {"update": lambda: worker.update_actor(update),
                 "generation": lambda: worker.generate(without_original_images(last_prompts)),
                 "ref_logprobs": lambda: worker.compute_ref_logprobs(update) if plan.ref is not None else None}
        # the generation first: after the update it includes the weight sync, as in a step
        for phase in [p for p in ("generation", "ref_logprobs", "update") if p in (args.profile or ["update"])]:
            table, top, times = profile_call(calls[phase], cuda)
            summary["profiles"][phase] = dict(top=top, **times)
            busy = f", kernels {times['device_busy_s']:.2f} s" if cuda else ""
            print(f"\nthe operators of one more {phase} ({times['wall_s']:.2f} s{busy}; self "
                  f"{'device' if cuda else 'CPU'} time):\n{table}", flush=True)
        summary["profile_top"] = summary["profiles"].get("update", {}).get("top")
    summary.update(timed_steps=len(timed), peak_flops=peak_flops, peak_source=peak_source, worker_build_s=round(worker_s, 2),
                   device=torch.cuda.get_device_name() if cuda else "cpu", peak_rss_gib=peak_rss_bytes() / GiB)
    return summary


if __name__ == "__main__":
    main()
