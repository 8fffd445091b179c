"""The rollout interface: ``RolloutEngine.generate(prompt_batch, **overrides) -> Batch``.

Engines (``vllm.py``, ``hf.py``) only sample token ids; this base class checks the input, repeats
each prompt n times and builds the output Batch (``postprocess.py``), so every engine returns
exactly the same keys, shapes and order.

Sampling comes from the config (``worker.rollout``: n, temperature, top_p, top_k, ignore_eos;
``data.max_response_length``) and can be overridden per call, e.g. greedy validation with
``generate(batch, n=1, temperature=0)`` (``worker.rollout.val_override_config``).

Seeded sampling: a prompt Batch may carry an int per prompt under ``SEED_KEY`` (the trainer derives
them from ``worker.rollout.seed``, the step and the prompt's place in it: :func:`prompt_seeds`).
Sample j of a prompt then draws its noise from its own seed, ``request_seed(prompt_seed, j)``, so
what it samples does not depend on what the engine generated before: a resumed run samples what an
uninterrupted one did. Without the key, engines sample from their own seeded RNG stream.
"""

from __future__ import annotations

import dataclasses
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, Iterable, Mapping, Sequence

import numpy as np
from torch import Tensor

from easyvlm.data.batch import Batch
from easyvlm.rollout.postprocess import build_rollout_batch

# What a prompt Batch must hold (see easyvlm/data/batch.py and the data pipeline).
PROMPT_KEYS = ("input_ids", "attention_mask", "position_ids", "raw_prompt_ids")
# Optional object key of a prompt Batch: one int seed per prompt (seeded sampling).
SEED_KEY = "sampling_seed"


def mix_seeds(*values: int) -> int:
    """A 63-bit seed from non-negative ints (numpy's SeedSequence hashing: nearby inputs give
    unrelated seeds)."""
    return int(np.random.SeedSequence([int(v) for v in values]).generate_state(1, np.uint64)[0] >> 1)


def prompt_seeds(seed: int, key: tuple[int, ...], count: int) -> list[int]:
    """``count`` prompt seeds for one generation call identified by ``key``, e.g. (step, round).
    Prompt i gets ``mix_seeds(seed, *key, i)``; different keys give unrelated seeds."""
    return [mix_seeds(seed, *key, i) for i in range(count)]


def request_seed(prompt_seed: int, sample_index: int) -> int:
    """The seed of sample ``sample_index`` (j < n) of the prompt seeded ``prompt_seed``."""
    return mix_seeds(prompt_seed, sample_index)


@dataclass(frozen=True)
class SamplingOverrides:
    """Per-call changes to the configured sampling; None = keep the configured value."""

    n: int | None = None
    """Samples per prompt (G)."""
    temperature: float | None = None
    """0 = greedy."""
    top_p: float | None = None
    top_k: int | None = None
    """-1 = no top-k."""
    max_tokens: int | None = None
    """At most ``max_response_length``; responses are still padded to ``max_response_length``."""
    ignore_eos: bool | None = None

    @classmethod
    def from_mapping(cls, values: Mapping[str, Any], where: str = "generate()") -> "SamplingOverrides":
        """Build from a dict such as ``worker.rollout.val_override_config``; unknown keys are an error."""
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ValueError(f"{where}: unknown sampling override(s) {unknown}; known: {sorted(known)}")
        return cls(**dict(values))


@dataclass(frozen=True)
class Sampling:
    """Resolved sampling settings of one generate() call."""

    n: int
    temperature: float
    top_p: float
    top_k: int
    max_tokens: int
    ignore_eos: bool

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def override(self, overrides: SamplingOverrides, response_length: int) -> "Sampling":
        """A copy with the non-None overrides applied, validated; raises ValueError naming the field."""
        changed = {k: v for k, v in dataclasses.asdict(overrides).items() if v is not None}
        return dataclasses.replace(self, **changed).validate(response_length)

    def validate(self, response_length: int) -> "Sampling":
        problems = []
        if self.n < 1:
            problems.append(f"n={self.n} must be >= 1")
        if self.temperature < 0:
            problems.append(f"temperature={self.temperature} must be >= 0 (0 = greedy)")
        if not 0 < self.top_p <= 1:
            problems.append(f"top_p={self.top_p} must be in (0, 1]")
        if self.top_k == 0 or self.top_k < -1:
            problems.append(f"top_k={self.top_k} must be -1 (off) or >= 1")
        if not 1 <= self.max_tokens <= response_length:
            problems.append(f"max_tokens={self.max_tokens} must be in [1, data.max_response_length={response_length}]")
        if problems:
            raise ValueError("rollout sampling settings (worker.rollout.*): " + "; ".join(problems))
        return self


class RolloutEngine(ABC):
    """Samples responses for a prompt Batch. One engine lives in the rollout worker's process.

    Subclasses implement ``_sample`` (and ``update_weights``; ``sleep``/``wake_up`` on GPUs).
    """

    def __init__(
        self,
        sampling: Sampling,
        response_length: int,
        pad_token_id: int,
        eos_token_ids: Sequence[int],
        blocked_token_ids: Sequence[int],
    ):
        self.sampling = sampling.validate(response_length)
        self.response_length = response_length
        self.pad_token_id = pad_token_id
        self.eos_token_ids = list(eos_token_ids)
        self.blocked_token_ids = list(blocked_token_ids)

    def generate(self, batch: Batch, **overrides: Any) -> Batch:
        """Sample n responses per prompt.

        batch: a prompt Batch with ``input_ids`` (B, P) left padded, ``attention_mask`` (B, P),
        ``position_ids`` (B, P) or (B, R, P), ``raw_prompt_ids`` (unpadded ids, one vision
        placeholder per image), ``images`` (PIL images per sample) and ``multi_modal_inputs``.
        overrides: fields of ``SamplingOverrides`` (n, temperature, top_p, top_k, max_tokens, ignore_eos).

        Returns a Batch of B*n rows (sample j of prompt i at row i*n+j) with ``prompts`` (B*n, P),
        ``responses``, ``response_mask``, ``rollout_logprobs`` (B*n, T), ``input_ids``,
        ``attention_mask`` (B*n, P+T), ``position_ids`` (B*n, P+T) or (B*n, R, P+T), and every other
        key of ``batch`` repeated. T = max_response_length. ``rollout_logprobs`` are the log-probs
        of the distribution sampled from: logits / temperature with blocked tokens removed (and
        top-k / top-p applied), 0 after the end of each response. With ``batch[SEED_KEY]`` (an
        int per prompt) sampling is seeded per request (see the module docstring).
        """
        sampling = self.sampling.override(SamplingOverrides.from_mapping(overrides), self.response_length)
        batch.require(*PROMPT_KEYS)
        prompts = batch.repeat(sampling.n, interleave=True)
        seeds = None
        if SEED_KEY in prompts and not sampling.greedy:  # row i*n+j is sample j of prompt i
            seeds = [request_seed(s, row % sampling.n) for row, s in enumerate(prompts[SEED_KEY])]
        responses, logprobs = self._sample(prompts, sampling, seeds)
        return build_rollout_batch(
            prompts, responses, logprobs, self.response_length, self.pad_token_id, self.eos_token_ids
        )

    @abstractmethod
    def _sample(
        self, prompts: Batch, sampling: Sampling, seeds: list[int] | None = None
    ) -> tuple[list[list[int]], list[list[float]]]:
        """One response per row of ``prompts`` (already repeated n times; sample with n = 1 each).

        seeds: one per row (seeded sampling), or None: the engine's own RNG stream.

        Returns (token ids, log-prob of each token) per row, in row order, each at most
        ``sampling.max_tokens`` long and ending at the first EOS unless ``sampling.ignore_eos``.
        """

    @abstractmethod
    def update_weights(self, named_tensors: Iterable[tuple[str, Tensor]]) -> None:
        """Load new weights, named as in the transformers model's in-memory ``state_dict()``."""

    def sleep(self) -> None:
        """Release accelerator memory (weights and KV cache) for the actor's turn. No-op on the CPU."""

    def wake_up(self, tags: Sequence[str] | None = None) -> None:
        """Take the memory back before ``update_weights``/``generate``. No-op on the CPU.

        tags: None = everything; ``["weights"]`` first, then ``["kv_cache"]`` keeps the peak lower
        (weights can be synced before the KV cache is allocated).
        """
