"""rollout.base.seeded_prompts: the sampling seeds the loop attaches to a generation call's prompts."""

from __future__ import annotations

import torch

from easyvlm.data.batch import Batch
from easyvlm.rollout.base import SEED_KEY, TRAIN_CALL, VAL_CALL, mix_seeds, seeded_prompts


def test_seeds_follow_the_call_and_leave_the_prompts_alone():
    prompts = Batch({"input_ids": torch.zeros(3, 2, dtype=torch.long)}, {"uid": ["a", "b", "c"]})
    seeded = seeded_prompts(prompts, 5, (TRAIN_CALL, 7, 0))
    # prompt i of the call (kind, step, round) gets mix_seeds(seed, kind, step, round, i)
    assert seeded[SEED_KEY] == [mix_seeds(5, TRAIN_CALL, 7, 0, i) for i in range(3)]
    assert SEED_KEY not in prompts  # a copy: the loader's batch is not modified
    # a filtering round, another step, validation and another seed each get their own seeds
    others = [
        seeded_prompts(prompts, 5, (TRAIN_CALL, 7, 1))[SEED_KEY],
        seeded_prompts(prompts, 5, (TRAIN_CALL, 8, 0))[SEED_KEY],
        seeded_prompts(prompts, 5, (VAL_CALL, 7, 0))[SEED_KEY],
        seeded_prompts(prompts, 6, (TRAIN_CALL, 7, 0))[SEED_KEY],
    ]
    assert all(not set(o) & set(seeded[SEED_KEY]) for o in others)
