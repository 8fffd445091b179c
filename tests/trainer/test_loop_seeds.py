"""Trainer._seeded: the sampling seeds the loop attaches to a generation call's prompts."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from easyvlm.data.batch import Batch
from easyvlm.rollout.base import SEED_KEY, prompt_seeds
from easyvlm.trainer.loop import TRAIN_CALL, VAL_CALL, Trainer


def trainer_with(per_request_seed: bool, seed: int = 5) -> SimpleNamespace:
    rollout = SimpleNamespace(seed=seed, per_request_seed=per_request_seed)
    return SimpleNamespace(cfg=SimpleNamespace(worker=SimpleNamespace(rollout=rollout)))


def test_seeds_follow_the_call_and_leave_the_prompts_alone():
    prompts = Batch({"input_ids": torch.zeros(3, 2, dtype=torch.long)}, {"uid": ["a", "b", "c"]})
    seeded = Trainer._seeded(trainer_with(True), prompts, TRAIN_CALL, 7, 0)
    assert seeded[SEED_KEY] == prompt_seeds(5, (TRAIN_CALL, 7, 0), 3)
    assert SEED_KEY not in prompts  # a copy: the loader's batch is not modified
    # a filtering round, another step and validation each get their own seeds
    others = [
        Trainer._seeded(trainer_with(True), prompts, TRAIN_CALL, 7, 1)[SEED_KEY],
        Trainer._seeded(trainer_with(True), prompts, TRAIN_CALL, 8, 0)[SEED_KEY],
        Trainer._seeded(trainer_with(True), prompts, VAL_CALL, 7, 0)[SEED_KEY],
    ]
    assert all(not set(o) & set(seeded[SEED_KEY]) for o in others)
    assert Trainer._seeded(trainer_with(False), prompts, TRAIN_CALL, 7, 0) is prompts  # switch off
