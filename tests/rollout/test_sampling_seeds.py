"""Seeds of seeded sampling (easyvlm.rollout.base): pure functions, and how generate() hands them
to the engine (one per row, sample j of prompt i at row i*n+j)."""

from __future__ import annotations

import dataclasses

import numpy as np
import torch

from easyvlm.data.batch import Batch
from easyvlm.rollout.base import SEED_KEY, mix_seeds, prompt_seeds, request_seed
from easyvlm.rollout.specs import Sampling
from rollout_testing import FakeRolloutEngine


def test_prompt_and_request_seeds():
    # mix_seeds is numpy's SeedSequence hash of the inputs, first 64-bit word, top bit dropped
    expected = int(np.random.SeedSequence([1, 0, 7, 0, 2]).generate_state(1, np.uint64)[0]) >> 1
    assert prompt_seeds(1, (0, 7, 0), 3)[2] == expected
    assert request_seed(expected, 5) == mix_seeds(expected, 5)
    seeds = prompt_seeds(1, (0, 7, 0), 64) + prompt_seeds(1, (0, 8, 0), 64) + prompt_seeds(2, (0, 7, 0), 64)
    assert len(set(seeds)) == len(seeds)  # other step, other base seed: other seeds
    assert all(0 <= s < 2**63 for s in seeds)  # fits vLLM's and torch's seed types
    assert prompt_seeds(1, (0, 7, 0), 3) == prompt_seeds(1, (0, 7, 0), 3)


class RecordingEngine(FakeRolloutEngine):
    def _sample(self, prompts, sampling, seeds=None):
        self.seeds = seeds
        return super()._sample(prompts, sampling, seeds)


def prompt_batch(count: int) -> Batch:
    ids = torch.arange(1, 3 * count + 1).reshape(count, 3)
    return Batch(
        {"input_ids": ids, "attention_mask": torch.ones_like(ids, dtype=torch.bool), "position_ids": torch.arange(3).repeat(count, 1)},
        {"raw_prompt_ids": ids.tolist()},
    )


def test_generate_gives_each_sample_its_own_seed():
    sampling = Sampling(n=2, temperature=1.0, top_p=1.0, top_k=-1, max_tokens=2, ignore_eos=False)
    engine = RecordingEngine(lambda ids, j: [5, 6], sampling, response_length=2, pad_token_id=0, eos_token_ids=[9])
    batch = prompt_batch(2)
    engine.generate(batch)
    assert engine.seeds is None  # no seeds in the batch: the engine's own stream
    batch[SEED_KEY] = [11, 22]
    engine.generate(batch)
    # rows: prompt 0 sample 0, prompt 0 sample 1, prompt 1 sample 0, prompt 1 sample 1
    assert engine.seeds == [request_seed(11, 0), request_seed(11, 1), request_seed(22, 0), request_seed(22, 1)]
    engine.generate(batch, dataclasses.replace(sampling, temperature=0.0))
    assert engine.seeds is None  # greedy: nothing to seed
