"""The rollout interface: ``RolloutEngine.generate(prompt_batch, sampling=None) -> Batch``. Engines
only sample token ids; the base class repeats prompts and builds the output Batch, so every engine
returns the same keys, shapes and order. Seeded sampling: docs/rollout.md, "Sampling"."""

from __future__ import annotations

import dataclasses
from abc import ABC, abstractmethod
from typing import Any, Iterable, Mapping, Protocol, Sequence, runtime_checkable

import numpy as np
from torch import Tensor

from easyvlm.data.batch import PROMPT_KEYS, ROUTED_EXPERTS_KEY, Batch
from easyvlm.rollout.postprocess import build_rollout_batch
from easyvlm.rollout.specs import Sampling

# Optional object key of a prompt Batch: one int seed per prompt (seeded sampling).
SEED_KEY = "sampling_seed"
# What the engines without a generation stream say (RolloutEngine.stream_*)
STREAM_ENGINE_ONLY = "partial rollouts need worker.rollout.name=vllm"


def mix_seeds(*values: int) -> int:
    """A 63-bit seed from non-negative ints (numpy's SeedSequence: nearby inputs give unrelated seeds)."""
    return int(np.random.SeedSequence([int(v) for v in values]).generate_state(1, np.uint64)[0] >> 1)


def prompt_seeds(seed: int, key: tuple[int, ...], count: int) -> list[int]:
    """``count`` prompt seeds for the generation call ``key``, e.g. (step, round): ``mix_seeds(seed, *key, i)``."""
    return [mix_seeds(seed, *key, i) for i in range(count)]


# the kinds of generation calls (the trainer's rounds, validation and eval), part of their sampling seeds
TRAIN_CALL, VAL_CALL = 0, 1


def seeded_prompts(prompts: Batch, seed: int, call: tuple[int, ...]) -> Batch:
    """A copy of ``prompts`` with a seed per prompt under ``SEED_KEY``, from ``seed`` and ``call``."""
    prompts = prompts.copy()
    prompts[SEED_KEY] = prompt_seeds(seed, call, len(prompts))
    return prompts


def request_seed(prompt_seed: int, sample_index: int) -> int:
    """The seed of sample ``sample_index`` (j < n) of the prompt seeded ``prompt_seed``."""
    return mix_seeds(prompt_seed, sample_index)


def is_greedy(sampling: Sampling) -> bool:
    return sampling.temperature == 0


def checked_sampling(sampling: Sampling, response_length: int) -> Sampling:
    """``sampling``, after asserting the invariants the engines rely on (the config check judged the values)."""
    assert sampling.n >= 1 and sampling.temperature >= 0 and 0 < sampling.top_p <= 1, sampling
    assert sampling.top_k == -1 or sampling.top_k >= 1, sampling
    assert 1 <= sampling.max_tokens <= response_length, (sampling, response_length)
    return sampling


def sampling_with_overrides(base: Sampling, overrides: Mapping[str, Any]) -> Sampling:
    """``base`` with ``overrides``: Sampling fields replace theirs, other keys go to ``extra``."""
    own = {f.name for f in dataclasses.fields(Sampling)} - {"extra"}
    changed = {k: v for k, v in overrides.items() if k in own}
    extra = dict(base.extra)
    extra.update({k: v for k, v in overrides.items() if k not in own})
    return dataclasses.replace(base, **changed, extra=tuple(sorted(extra.items())))


class RolloutEngine(ABC):
    """Samples responses for a prompt Batch, in the rollout worker's process. Subclasses implement
    ``_sample`` and ``update_weights`` (``sleep``/``wake_up`` where memory is shared)."""

    weight_sync_device: str = "cpu"
    """The device ``update_weights`` takes the in-process actor's tensors on (a GPU engine: its own)."""

    def __init__(
        self,
        sampling: Sampling,
        response_length: int,
        pad_token_id: int,
        eos_token_ids: Sequence[int],
        blocked_token_ids: Sequence[int],
    ):
        self.sampling = checked_sampling(sampling, response_length)
        self.response_length = response_length
        self.pad_token_id = pad_token_id
        self.eos_token_ids = list(eos_token_ids)
        self.blocked_token_ids = list(blocked_token_ids)

    def generate(self, batch: Batch, sampling: Sampling | None = None) -> Batch:
        """Sample n responses per prompt with ``sampling`` (None: the engine's). ``batch``: a prompt
        Batch (``PROMPT_KEYS``, ``input_ids`` (B, P) left padded, optionally ``SEED_KEY``). Returns
        B*n rows, sample j of prompt i at row i*n+j: ``responses``, ``response_mask``,
        ``rollout_logprobs`` (B*n, T; the sampled distribution's, 0 after the end), the sequences
        over P+T and ``batch``'s other keys repeated (docs/rollout.md, "What goes in and what comes out")."""
        sampling = checked_sampling(sampling or self.sampling, self.response_length)
        prompts, seeds = self._repeated_prompts(batch, sampling)
        responses, logprobs = self._sample(prompts, sampling, seeds)
        out = self._rollout_batch(prompts, responses, logprobs)
        routed = self.take_routing(out["input_ids"].shape[1])
        if routed is not None:  # MoE, router replay R3: the experts each sampled token went to
            out[ROUTED_EXPERTS_KEY] = routed
        return out

    def _repeated_prompts(self, batch: Batch, sampling: Sampling) -> tuple[Batch, list[int] | None]:
        """``batch`` repeated n times and the rows' seeds (None without ``SEED_KEY`` or when greedy)."""
        batch.require(*PROMPT_KEYS)
        prompts = batch.repeat(sampling.n, interleave=True)
        seeds = None
        if SEED_KEY in prompts and not is_greedy(sampling):
            seeds = [request_seed(s, row % sampling.n) for row, s in enumerate(prompts[SEED_KEY])]
        return prompts, seeds

    def _rollout_batch(self, prompts: Batch, responses: list[list[int]], logprobs: list[list[float]]) -> Batch:
        return build_rollout_batch(
            prompts, responses, logprobs, self.response_length, self.pad_token_id, self.eos_token_ids
        )

    def take_routing(self, width: int) -> Tensor | None:
        """(rows, P + T, layers, k) int16: the experts each token of the last ``_sample`` call went to
        (FREE where none), aligned with ``input_ids``; None unless ``EngineSpec.record_routing``."""
        return None

    @abstractmethod
    def _sample(
        self, prompts: Batch, sampling: Sampling, seeds: list[int] | None = None
    ) -> tuple[list[list[int]], list[list[float]]]:
        """One response per row of ``prompts`` (already repeated n times), seeded per row when ``seeds`` is
        given. Returns (token ids, log-prob per token) per row, in row order, each at most
        ``sampling.max_tokens`` long and ending at the first EOS unless ``sampling.ignore_eos``."""

    @abstractmethod
    def update_weights(self, named_tensors: Iterable[tuple[str, Tensor]]) -> None:
        """Load new weights, named as in the transformers model's in-memory ``state_dict()``."""

    def sleep(self) -> None:
        """Release accelerator memory (weights, KV cache) for the actor's turn."""

    def wake_up(self, tags: Sequence[str] | None = None) -> None:
        """Take the memory back before ``update_weights``/``generate``. tags: None = everything;
        ``["weights"]`` then ``["kv_cache"]`` keeps the peak lower."""


@runtime_checkable
class StreamingEngine(Protocol):
    """A rollout engine with an interruptible generation stream (partial rollouts): new weights load
    between two steps, unfinished samples keep their tokens, each tagged with its version."""

    def stream_submit(self, batch: Batch, tag: int, sampling: Sampling | None = None) -> None:
        """Add ``batch``'s prompts (as generate() takes them) as groups (``tag``, prompt index)."""
        ...

    def stream_advance(self, max_steps: int) -> list[tuple[tuple[int, int], Batch]]:
        """Run at most ``max_steps`` engine steps and return the groups completed since the last call:
        ((tag, prompt index), generate()'s rollout Batch of its n rows plus ``rollout_token_versions``
        (n, T) int64, the version that sampled each token, -1 after the response, and ``rollout_version``
        (n,) int64, the oldest version of a sample's tokens)."""
        ...

    def stream_set_weights(self, named_tensors: Iterable[tuple[str, Tensor]], version: int) -> None:
        """Load new weights between two steps; tokens sampled from now on are tagged ``version``."""
        ...

    def stream_start_version(self, version: int) -> None:
        """Tag tokens sampled from now on with ``version`` (weights already loaded), loading nothing."""
        ...

    def stream_version(self) -> int:
        """The version the tokens sampled now are tagged with."""
        ...

    def stream_pending(self) -> int:
        """Groups submitted and not yet returned by stream_advance (nor dropped by stream_cancel)."""
        ...

    def stream_cancel(self) -> list[tuple[int, int]]:
        """Abort every unfinished group's requests, forget them, and return their group ids."""
        ...


@runtime_checkable
class AdapterEngine(Protocol):
    """A rollout engine that serves LoRA adapters unmerged (`EngineSpec.lora`) over the base weights
    ``update_weights`` loads."""

    def update_adapter(self, named_tensors: Iterable[tuple[str, Tensor]]) -> None:
        """Load the ``lora_A``/``lora_B`` tensors under PEFT's in-memory names (``...lora_A.default.weight``)."""
        ...


def adapter_engine(engine: RolloutEngine) -> AdapterEngine:
    """``engine`` as an `AdapterEngine`; TypeError naming the engines that serve adapters unmerged."""
    if not isinstance(engine, AdapterEngine):
        raise TypeError(f"{type(engine).__name__} cannot serve LoRA adapters unmerged; the vllm and hf engines can "
                        "(worker.actor.model.lora.merge_for_rollout)")
    return engine


def streaming(engine: RolloutEngine) -> StreamingEngine:
    """``engine`` as a `StreamingEngine`; NotImplementedError naming the engine that has a stream."""
    if not isinstance(engine, StreamingEngine):
        raise NotImplementedError(STREAM_ENGINE_ONLY)
    return engine
