"""The rollout's settings, declared once: the generation engine and its sampling, the keys
``worker.rollout.name`` ... ``disable_tqdm`` and ``val_override_config`` (`GenerationSettings`), and
where the engines run and how far ahead of the trainer they may generate, ``placement`` ...
``weight_transfer`` (`PlacementSettings`), which the config schema composes in their place. The
placement's own range rules are `PlacementSettings.problems`; the config check adds the rules that
involve other sections. Torch-free: the config check imports this module."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal, Optional

from easyvlm.rollout.staleness import StalenessBound
from easyvlm.utils.dtypes import DType

PREFIX = "worker.rollout"


@dataclass(frozen=True)
class GenerationSettings:
    """The generation engine and its sampling; the plan's `EngineSpec` holds them whole (its
    ``generation``), and the sampling keys make the training call's `Sampling`. The multi-turn keys
    (``easyvlm.agents.settings``) sit between ``disable_tqdm`` and ``val_override_config`` in the
    config section."""

    name: Literal["vllm", "hf"] = "vllm"
    """Generation engine: vllm, or hf (transformers' generate: slow, for comparison and
    debugging)."""
    n: int = 1
    """Samples per prompt, G (GRPO's group size)."""
    temperature: float = 1.0
    """Sampling temperature; 0 = greedy."""
    top_p: float = 1.0
    """Nucleus sampling threshold; 1 = off."""
    top_k: int = -1
    """Top-k sampling; -1 = off."""
    seed: int = 1
    """Seed of the generation engine."""
    per_request_seed: bool = False
    """easyvlm extra. Seed each sample from (seed, step, prompt, sample), so a resumed run samples
    exactly what an uninterrupted run did. Costs ~6% of vLLM decode throughput on the CPU, likely
    more on GPUs; vLLM on the CPU needs enable_chunked_prefill=false with it."""
    limit_images: int = 0
    """Most images per prompt the engine accepts; 0 = no limit set."""
    dtype: DType = "bf16"
    """Dtype of the generation engine's weights."""
    gpu_memory_utilization: float = 0.6
    """Fraction of GPU memory vLLM may use (weights plus KV cache)."""
    ignore_eos: bool = False
    """Keep generating after EOS up to `data.max_response_length`."""
    enforce_eager: bool = False
    """vLLM without torch.compile and CUDA graphs (slower, less memory, quicker start). On the CPU, false compiles
    the model too (Inductor; no CUDA graphs there): ~45 s more at start, generation 1.0-1.2x (docs/benchmarks.md)."""
    enable_chunked_prefill: bool = False
    """vLLM chunked prefill."""
    tensor_parallel_size: int = 1
    """Devices per vLLM engine. Default differs from EasyR1 (2): 1 runs everywhere, including the
    CPU and single-GPU machines."""
    max_model_len: Optional[int] = None
    """vLLM's context length; None = max_prompt_length + max_response_length."""
    max_num_batched_tokens: int = 8192
    """Most tokens vLLM processes in one scheduler step."""
    max_num_seqs: Optional[int] = None
    """easyvlm extra. Most sequences the engine runs at once (vLLM; transformers' generate: per
    call). None = the most one generation call gives an engine: ceil(prompts per round / devices) x
    `n`, or a validation batch's if larger (the whole validation set counts as 256), at most 256. On
    the CPU the KV cache holds this many sequences of `data.max_prompt_length +
    data.max_response_length` tokens and no more."""
    disable_log_stats: bool = True
    """Silence vLLM's periodic statistics."""
    disable_tqdm: bool = False
    """Hide the generation progress bar."""
    val_override_config: dict[str, Any] = field(default_factory=dict)
    """Sampling settings that differ for validation, e.g. `{n: 1, temperature: 0.6}`: any field of
    vLLM's `SamplingParams` (n, temperature, top_p, top_k, min_p, repetition_penalty, seed, stop, ...)
    except those easyvlm sets itself (the check lists them). With `name: hf`, only n, temperature,
    top_p, top_k, max_tokens, ignore_eos."""


@dataclass(frozen=True)
class PlacementSettings:
    """The rollout's placement and asynchrony; the rollout service (``easyvlm.service.rollout_service``)
    reads them whole, and `staleness_bound` gives its producers the bound."""

    placement: Literal["colocated", "separate"] = "colocated"
    """easyvlm extra. `colocated`: the engine shares each actor rank's process and device (the
    hybrid engine; weights copied in memory). `separate`: the engines run in their own worker group
    on `num_devices` more devices (GPUs, or processes on the CPU); the actor's weights are sent to
    them after every update. docs/rollout.md, "Separate placement and asynchronous rollout"."""
    num_devices: int = 1
    """easyvlm extra. Devices of the separate rollout group (one engine each, data-parallel);
    only with `placement: separate`."""
    one_step_off: bool = False
    """easyvlm extra. verl's one-step-off, kept as shorthand for `max_staleness: 1` (the same code
    path): the next step's batch is generated on the separate rollout group while this step trains.
    Needs `placement: separate`."""
    max_staleness: int = 0
    """easyvlm extra. Asynchronous rollout with bounded staleness: the rollout service keeps
    generating while the trainer updates and never hands out a sample whose oldest token was
    sampled by weights more than this many updates older than those it trains on. 0 = synchronous.
    The integer AReaL's `max_head_offpolicyness`, TRL's `max_staleness` and prime-rl's
    `max_off_policy_steps` bound, each its own way; verl's `staleness_threshold` is another knob
    (a fraction of extra samples per weight sync). Logged per step (rollout/staleness_mean,
    rollout/staleness_max); corrected by default (`correct_staleness`). Needs `placement:
    separate`. docs/rollout.md, "How `max_staleness` compares"."""
    correct_staleness: bool = True
    """easyvlm extra. With `max_staleness` >= 1 (or `one_step_off`) and nothing set in
    `algorithm.rollout_correction`: train the stale samples with the off-policy objective, token-level
    truncated importance weights pi_old / pi_rollout (`rollout_correction.rollout_is=token` at its
    `rollout_is_threshold`; with the old-log-prob pass this turns on, AReaL's decoupled PPO). false:
    train them as if fresh. docs/rollout.md, "The off-policy objective, by default"."""
    partial_rollout: bool = False
    """easyvlm extra. With `max_staleness` >= 1: new weights reach the engines while samples are
    unfinished, which keep their tokens and go on with the new weights, every token remembering the
    version that sampled it (rollout/partial_fraction). Single-turn (vLLM): between two decoding
    steps (KV cache recomputed), and groups are handed to the trainer as they complete. With
    `tools` or an `environment`: each turn starts on the newest weights (a turn in flight ends on
    its own), and the step's batch is handed over whole."""
    weight_transfer: Literal["auto", "collective", "object_store"] = "auto"
    """easyvlm extra. How separate engines get the weights. `collective`: broadcast from the actor's
    rank 0 in buckets through a process group of their own (gloo on the CPU, NCCL on GPUs); needs
    synchronous rollout (`max_staleness: 0`), and a group that does not form stops the run.
    `object_store`: the full state dict as a Ray object. `auto`: `collective` for synchronous
    engines (the Ray objects if the group does not form, said in the log), `object_store` for
    asynchronous ones (each version is published for the producer). Only with `placement: separate`.
    docs/rollout.md, "Weight sync"."""

    @property
    def separate(self) -> bool:
        return self.placement == "separate"

    @property
    def by_collective(self) -> bool:
        """Whether separate engines take the weights by the collective (`weight_transfer`)."""
        return self.separate and self.staleness == 0 and self.weight_transfer != "object_store"

    @property
    def staleness(self) -> int:
        """k: the bound in updates (``one_step_off`` is shorthand for 1); 0 = synchronous."""
        return max(self.max_staleness, int(self.one_step_off))

    def staleness_bound(self, batch_groups: int) -> StalenessBound:
        return StalenessBound(self.staleness, batch_groups)

    @staticmethod
    def problems(s: Any) -> list[tuple[str, str]]:
        """(key under ``worker.rollout``, message) for each rule these keys break among themselves:
        ``s`` is this class or the config section that composes it (the values need not be valid)."""
        p, found = PREFIX, []
        if not (isinstance(s.max_staleness, int) and s.max_staleness >= 0):
            found.append(("max_staleness", f"must be >= 0, got {s.max_staleness}"))
        asynchronous = s.max_staleness > 0 or s.one_step_off
        if not s.correct_staleness and not asynchronous:
            found.append(("correct_staleness", f"acts only with {p}.max_staleness >= 1 (synchronous samples are "
                          "never stale); remove it or set max_staleness"))
        if s.placement == "colocated":
            if s.num_devices != 1:
                found.append(("num_devices", f"acts only with {p}.placement=separate (colocated engines use the "
                              "actor's devices); set placement=separate or leave num_devices at 1"))
            for key, on in (("one_step_off", s.one_step_off), ("max_staleness", s.max_staleness > 0),
                            ("partial_rollout", s.partial_rollout)):
                if on:
                    found.append((key, f"needs {p}.placement=separate: a colocated engine shares the actor's "
                                  "process, so generation cannot overlap training; set placement=separate"))
            if s.weight_transfer != "auto":
                found.append(("weight_transfer", f"acts only with {p}.placement=separate (a colocated engine shares "
                              "the actor's process: the weights are copied in memory, nothing is transferred); "
                              "set placement=separate or leave weight_transfer at auto"))
            return found
        if not s.num_devices >= 1:
            found.append(("num_devices", f"must be >= 1, got {s.num_devices}"))
        if s.one_step_off and s.max_staleness not in (0, 1):
            found.append(("one_step_off", f"is shorthand for {p}.max_staleness=1, but max_staleness={s.max_staleness} "
                          "is set too; keep one of them"))
        if s.weight_transfer == "collective" and asynchronous:
            found.append(("weight_transfer", f"collective needs synchronous rollout ({p}.max_staleness=0, "
                          "one_step_off=false): asynchronous engines take each version's weights as published Ray "
                          "objects; set weight_transfer to auto or object_store"))
        if s.partial_rollout and not asynchronous:
            found.append(("partial_rollout", f"needs {p}.max_staleness >= 1: with synchronous rollout the weights "
                          "never change during a generation, so there is nothing to resume; set max_staleness (e.g. 2)"))
        return found
