"""The rollout interface: ``RolloutEngine.generate(prompt_batch, sampling=None) -> Batch``.

Engines (``vllm.py``, ``hf.py``) only sample token ids; this base class checks the input, repeats
each prompt n times and builds the output Batch (``postprocess.py``), so every engine returns
exactly the same keys, shapes and order.

Sampling comes from the run plan (``worker.rollout``: n, temperature, top_p, top_k, ignore_eos;
``data.max_response_length``); a call may pass other settings, e.g. the plan's validation sampling
(``worker.rollout.val_override_config`` applied) or ReMax's greedy baseline.

Seeded sampling: a prompt Batch may carry an int per prompt under ``SEED_KEY`` (the trainer derives
them from ``worker.rollout.seed``, the step and the prompt's place in it: :func:`prompt_seeds`).
Sample j of a prompt then draws its noise from its own seed, ``request_seed(prompt_seed, j)``, so
what it samples does not depend on what the engine generated before: a resumed run samples what an
uninterrupted one did. Without the key, engines sample from their own seeded RNG stream.

The generation stream (``stream_*``, partial rollouts; the vLLM engine only): prompt groups go
in, the engine advances a bounded number of steps at a time, each group comes back when all its n
samples are done, and new weights can be loaded between two steps; the unfinished samples keep
their tokens and go on with the new weights, every token tagged with the version that sampled it
(docs/rollout.md, "Partial rollouts: the generation stream").
"""

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
    """A 63-bit seed from non-negative ints (numpy's SeedSequence hashing: nearby inputs give
    unrelated seeds)."""
    return int(np.random.SeedSequence([int(v) for v in values]).generate_state(1, np.uint64)[0] >> 1)


def prompt_seeds(seed: int, key: tuple[int, ...], count: int) -> list[int]:
    """``count`` prompt seeds for one generation call identified by ``key``, e.g. (step, round).
    Prompt i gets ``mix_seeds(seed, *key, i)``; different keys give unrelated seeds."""
    return [mix_seeds(seed, *key, i) for i in range(count)]


# the kinds of generation calls (the trainer's rounds, validation and eval), part of their sampling seeds
TRAIN_CALL, VAL_CALL = 0, 1


def seeded_prompts(prompts: Batch, seed: int, call: tuple[int, ...]) -> Batch:
    """A copy of ``prompts`` with a sampling seed per prompt (``SEED_KEY``), derived from ``seed``
    (worker.rollout.seed) and the generation call (kind, step, round or batch): a resumed run then
    samples exactly what an uninterrupted run did."""
    prompts = prompts.copy()
    prompts[SEED_KEY] = prompt_seeds(seed, call, len(prompts))
    return prompts


def request_seed(prompt_seed: int, sample_index: int) -> int:
    """The seed of sample ``sample_index`` (j < n) of the prompt seeded ``prompt_seed``."""
    return mix_seeds(prompt_seed, sample_index)


def is_greedy(sampling: Sampling) -> bool:
    return sampling.temperature == 0


def checked_sampling(sampling: Sampling, response_length: int) -> Sampling:
    """``sampling``, after asserting the invariants the engines rely on (``easyvlm.config.validate``
    judged the values)."""
    assert sampling.n >= 1 and sampling.temperature >= 0 and 0 < sampling.top_p <= 1, sampling
    assert sampling.top_k == -1 or sampling.top_k >= 1, sampling
    assert 1 <= sampling.max_tokens <= response_length, (sampling, response_length)
    return sampling


def sampling_with_overrides(base: Sampling, overrides: Mapping[str, Any]) -> Sampling:
    """``base`` with ``overrides`` applied: Sampling fields replace theirs, other keys (vLLM
    SamplingParams fields) go to ``extra``."""
    own = {f.name for f in dataclasses.fields(Sampling)} - {"extra"}
    changed = {k: v for k, v in overrides.items() if k in own}
    extra = dict(base.extra)
    extra.update({k: v for k, v in overrides.items() if k not in own})
    return dataclasses.replace(base, **changed, extra=tuple(sorted(extra.items())))


class RolloutEngine(ABC):
    """Samples responses for a prompt Batch. One engine lives in the rollout worker's process.

    Subclasses implement ``_sample`` (and ``update_weights``; ``sleep``/``wake_up`` on GPUs).
    """

    weight_sync_device: str = "cpu"
    """Where ``update_weights`` takes its tensors from the hybrid worker's actor (in-process): an
    engine on a GPU that copies them into place takes them on its device, with no host round trip."""

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
        """Sample n responses per prompt.

        batch: a prompt Batch with ``input_ids`` (B, P) left padded, ``attention_mask`` (B, P),
        ``position_ids`` (B, P) or (B, R, P), ``raw_prompt_ids`` (unpadded ids, one vision
        placeholder per image), ``images`` (PIL images per sample) and ``multi_modal_inputs``.
        sampling: this call's settings (e.g. the run plan's validation sampling); None = the engine's.

        Returns a Batch of B*n rows (sample j of prompt i at row i*n+j) with ``prompts`` (B*n, P),
        ``responses``, ``response_mask``, ``rollout_logprobs`` (B*n, T), ``input_ids``,
        ``attention_mask`` (B*n, P+T), ``position_ids`` (B*n, P+T) or (B*n, R, P+T), and every other
        key of ``batch`` repeated. T = max_response_length. ``rollout_logprobs`` are the log-probs
        of the distribution sampled from: logits / temperature with blocked tokens removed (and
        top-k / top-p applied), 0 after the end of each response. With ``batch[SEED_KEY]`` (an
        int per prompt) sampling is seeded per request (see the module docstring).
        """
        sampling = checked_sampling(sampling or self.sampling, self.response_length)
        prompts, seeds = self._repeated_prompts(batch, sampling)
        responses, logprobs = self._sample(prompts, sampling, seeds)
        out = self._rollout_batch(prompts, responses, logprobs)
        routed = self.take_routing(out["input_ids"].shape[1])
        if routed is not None:  # MoE, router replay R3: the experts each sampled token went to
            out[ROUTED_EXPERTS_KEY] = routed
        return out

    def _repeated_prompts(self, batch: Batch, sampling: Sampling) -> tuple[Batch, list[int] | None]:
        """``batch`` repeated n times (row i*n+j is sample j of prompt i) and the rows' seeds (None
        without ``SEED_KEY`` or when greedy): what generate() samples from, and the generation
        stream too, so that a group streamed samples what generate() would."""
        batch.require(*PROMPT_KEYS)
        prompts = batch.repeat(sampling.n, interleave=True)
        seeds = None
        if SEED_KEY in prompts and not is_greedy(sampling):
            seeds = [request_seed(s, row % sampling.n) for row, s in enumerate(prompts[SEED_KEY])]
        return prompts, seeds

    def _rollout_batch(self, prompts: Batch, responses: list[list[int]], logprobs: list[list[float]]) -> Batch:
        """The rollout Batch of sampled rows (``postprocess.build_rollout_batch``)."""
        return build_rollout_batch(
            prompts, responses, logprobs, self.response_length, self.pad_token_id, self.eos_token_ids
        )

    def take_routing(self, width: int) -> Tensor | None:
        """(rows, width = P + T, layers, k) int16: the experts each token of the last ``_sample`` call's
        rows went to (FREE where no token was routed), aligned with the rollout batch's ``input_ids``;
        None when the engine does not record routing (``EngineSpec.record_routing``)."""
        return None

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
        """Release accelerator memory (weights and KV cache) for the actor's turn. On the CPU, vLLM
        releases its KV cache's pages (the transformers engine holds none)."""

    def wake_up(self, tags: Sequence[str] | None = None) -> None:
        """Take the memory back before ``update_weights``/``generate`` (on the CPU: vLLM returns the
        heap's free memory first; the KV pages come back as generation writes them).

        tags: None = everything; ``["weights"]`` first, then ``["kv_cache"]`` keeps the peak lower
        (weights can be synced before the KV cache is allocated).
        """


@runtime_checkable
class StreamingEngine(Protocol):
    """A rollout engine with an interruptible generation stream (partial rollouts): prompt groups
    are submitted, the engine is advanced a few decoding steps at a time and returns each group as
    soon as all its n samples are done, and new weights can be loaded between two steps without
    throwing away what the unfinished samples have sampled (each token is tagged with the weights'
    version that sampled it). The vLLM engine is one (it drives its scheduler step by step); the
    transformers engine is not (`streaming` refuses it)."""

    def stream_submit(self, batch: Batch, tag: int, sampling: Sampling | None = None) -> None:
        """Add the prompts of ``batch`` (a prompt Batch as generate() takes; n samples each, seeded
        per request as generate() seeds them when it carries ``SEED_KEY``) to the engine's running
        work as prompt groups. ``tag``: the caller's id of this submission; a group is identified by
        (tag, index of its prompt in ``batch``)."""
        ...

    def stream_advance(self, max_steps: int) -> list[tuple[tuple[int, int], Batch]]:
        """Run at most ``max_steps`` engine steps (fewer when nothing is left) and return the groups
        completed since the last call: ((tag, prompt index), rollout Batch of its n rows, as
        generate() builds them, plus ``rollout_token_versions`` (n, T) int64, the weights' version
        that sampled each response token, -1 after the end of the response, and ``rollout_version``
        (n,) int64, the oldest version among a sample's tokens)."""
        ...

    def stream_set_weights(self, named_tensors: Iterable[tuple[str, Tensor]], version: int) -> None:
        """Load new weights between two engine steps; unfinished samples keep their tokens and go on
        with the new weights. Tokens sampled from now on are tagged ``version``."""
        ...

    def stream_start_version(self, version: int) -> None:
        """Tag the tokens sampled from now on with ``version`` (the weights already loaded, e.g. by
        update_weights before the first submission), without loading anything."""
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


def streaming(engine: RolloutEngine) -> StreamingEngine:
    """``engine`` as a `StreamingEngine`; NotImplementedError naming the engine that has a stream."""
    if not isinstance(engine, StreamingEngine):
        raise NotImplementedError(STREAM_ENGINE_ONLY)
    return engine
