"""A rollout engine that returns canned responses, so trainer tests run without a model.

``FakeRolloutEngine(respond)`` calls ``respond(prompt_ids, sample_index)`` for every row and
returns its token ids, with log-prob ``token_logprob`` each; everything else (repeat order, padding,
response mask, position ids) is the real ``RolloutEngine.generate`` path.
"""

from __future__ import annotations

import time
from typing import Callable, Iterable, Sequence

import torch
from torch import Tensor

from easyvlm.data.batch import Batch
from easyvlm.rollout.base import RolloutEngine
from easyvlm.rollout.specs import Sampling

Respond = Callable[[list[int], int], Sequence[int]]


class FakeRolloutEngine(RolloutEngine):
    """respond(prompt_ids, j) -> response ids for sample j of a prompt (cut at max_tokens here).

    ``weight_updates`` counts ``update_weights`` calls; ``awake`` tracks sleep / wake_up, so tests can
    check that the worker drives the engine in the right order.
    """

    def __init__(
        self,
        respond: Respond,
        sampling: Sampling,
        response_length: int,
        pad_token_id: int,
        eos_token_ids: Sequence[int],
        token_logprob: float = -1.0,
    ):
        super().__init__(sampling, response_length, pad_token_id, eos_token_ids, blocked_token_ids=())
        self.respond = respond
        self.token_logprob = token_logprob
        self.weight_updates = 0
        self.awake = True
        self._stream: dict = {}  # (tag, prompt) -> (its n prompt rows, their responses, their tokens' versions so far)
        self._version = 0

    def _sample(
        self, prompts: Batch, sampling: Sampling, seeds: list[int] | None = None
    ) -> tuple[list[list[int]], list[list[float]]]:
        if not self.awake:
            raise RuntimeError("FakeRolloutEngine.generate called while asleep; call wake_up() first")
        input_ids, mask = prompts["input_ids"], prompts["attention_mask"].bool()
        responses = []
        for row in range(len(prompts)):
            ids = list(self.respond(input_ids[row][mask[row]].tolist(), row % sampling.n))[: sampling.max_tokens]
            if not sampling.ignore_eos:
                ends = [k for k, token in enumerate(ids) if token in self.eos_token_ids]
                ids = ids[: ends[0] + 1] if ends else ids
            responses.append(ids)
        return responses, [[self.token_logprob] * len(ids) for ids in responses]

    def update_weights(self, named_tensors: Iterable[tuple[str, Tensor]]) -> None:
        for _ in named_tensors:
            pass
        self.weight_updates += 1

    # ------------------------------------------------------------------ the generation stream
    # One token per request per step, so that tests control where new weights land. A token's
    # log-prob is ``token_logprob - version_shift * version``: the behaviour log-prob of the
    # weights that sampled it, which tests follow to the loss.
    version_shift = 0.1
    step_seconds = 0.0  # each stream step takes this long (fault tests kill the process meanwhile)

    def stream_submit(self, batch: Batch, tag: int, sampling: Sampling | None = None) -> None:
        sampling = sampling or self.sampling
        prompts, seeds = self._repeated_prompts(batch, sampling)
        responses, _ = self._sample(prompts, sampling, seeds)
        stream = self._stream
        for i in range(len(batch)):
            rows = list(range(i * sampling.n, (i + 1) * sampling.n))
            stream[(tag, i)] = (prompts.index(rows), [responses[r] for r in rows], [[] for _ in rows])

    def stream_advance(self, max_steps: int) -> list[tuple[tuple[int, int], Batch]]:
        stream = self._stream
        for _ in range(max_steps):
            unfinished = [(key, k) for key, (_, responses, versions) in stream.items()
                          for k, ids in enumerate(responses) if len(versions[k]) < len(ids)]
            if not unfinished:
                break
            time.sleep(self.step_seconds)
            for key, k in unfinished:
                stream[key][2][k].append(self.stream_version())
        done = []
        for key in [key for key, (_, responses, versions) in stream.items()
                    if all(len(v) == len(ids) for v, ids in zip(versions, responses))]:
            prompts, responses, versions = stream.pop(key)
            logprobs = [[self.token_logprob - self.version_shift * v for v in vs] for vs in versions]
            out = self._rollout_batch(prompts, responses, logprobs)
            token_versions = torch.full(out["responses"].shape, -1, dtype=torch.long)
            for row, vs in enumerate(versions):
                token_versions[row, : len(vs)] = torch.tensor(vs, dtype=torch.long)
            out["rollout_token_versions"] = token_versions
            out["rollout_version"] = torch.tensor([min(vs, default=self.stream_version()) for vs in versions])
            done.append((key, out))
        return done

    def stream_set_weights(self, named_tensors: Iterable[tuple[str, Tensor]], version: int) -> None:
        self.update_weights(named_tensors)
        self._version = version

    def stream_start_version(self, version: int) -> None:
        self._version = version

    def stream_version(self) -> int:
        return self._version

    def stream_pending(self) -> int:
        return len(self._stream)

    def stream_cancel(self) -> list[tuple[int, int]]:
        keys = list(self._stream)
        self._stream = {}
        return keys

    def sleep(self) -> None:
        self.awake = False

    def wake_up(self, tags: Sequence[str] | None = None) -> None:
        self.awake = True
