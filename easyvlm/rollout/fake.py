"""A rollout engine that returns canned responses, so trainer tests run without a model.

``FakeRolloutEngine(respond)`` calls ``respond(prompt_ids, sample_index)`` for every row and
returns its token ids, with log-prob ``token_logprob`` each; everything else (repeat order, padding,
response mask, position ids) is the real ``RolloutEngine.generate`` path.
"""

from __future__ import annotations

from typing import Callable, Iterable, Sequence

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

    def sleep(self) -> None:
        self.awake = False

    def wake_up(self, tags: Sequence[str] | None = None) -> None:
        self.awake = True
