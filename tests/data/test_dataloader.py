"""PromptDataLoader: seeded order, epochs, resume from state_dict, validation loader."""

from __future__ import annotations

import pytest
import torch
from data_testing import data_config, write_jsonl

from easyvlm.data.dataloader import PromptDataLoader, create_dataloaders
from easyvlm.data.loading import DataError


@pytest.fixture
def dataset(tmp_path, build):
    rows = [{"problem": f"q{i}", "answer": str(i)} for i in range(10)]
    return build(write_jsonl(tmp_path / "d.jsonl", rows))


def answers(loader):
    return [batch["ground_truth"] for batch in loader]


def test_order_is_seeded_and_changes_per_epoch(dataset):
    loader = PromptDataLoader(dataset, batch_size=3, shuffle=True, seed=7, drop_last=True)
    assert len(loader) == 3  # 10 rows // 3, last partial batch dropped
    epoch0, epoch1 = answers(loader), answers(loader)
    # independent reference: the permutation torch draws for (seed, epoch)
    expected = torch.randperm(10, generator=torch.Generator().manual_seed(7 * 1_000_003)).tolist()
    assert [a for batch in epoch0 for a in batch] == [str(i) for i in expected[:9]]
    assert epoch0 != epoch1 and loader.epoch == 2
    again = PromptDataLoader(dataset, batch_size=3, shuffle=True, seed=7, drop_last=True)
    assert answers(again) == epoch0
    other = PromptDataLoader(dataset, batch_size=3, shuffle=True, seed=8, drop_last=True)
    assert answers(other) != epoch0


def test_resume_continues_with_the_next_batch(dataset):
    full = PromptDataLoader(dataset, batch_size=2, shuffle=True, seed=1, drop_last=True)
    reference = answers(full) + answers(full)  # two epochs, 5 batches each

    run = PromptDataLoader(dataset, batch_size=2, shuffle=True, seed=1, drop_last=True)
    seen = []
    for batch in run:
        seen.append(batch["ground_truth"])
        if len(seen) == 3:
            break
    state = run.state_dict()
    assert state == {"epoch": 0, "position": 3, "seed": 1, "shuffle": True, "batch_size": 2, "num_rows": 10}

    resumed = PromptDataLoader(dataset, batch_size=2, shuffle=True, seed=1, drop_last=True)
    resumed.load_state_dict(state)
    assert seen + answers(resumed) + answers(resumed) == reference


def test_resume_at_the_end_of_an_epoch_starts_the_next(dataset):
    loader = PromptDataLoader(dataset, batch_size=5, shuffle=True, seed=3, drop_last=True)
    first = answers(loader)
    second = answers(loader)
    restored = PromptDataLoader(dataset, batch_size=5, shuffle=True, seed=3, drop_last=True)
    restored.load_state_dict({"epoch": 0, "position": 2, "seed": 3, "shuffle": True, "batch_size": 5, "num_rows": 10})
    assert answers(restored) == second != first


def test_state_from_another_run_is_refused(dataset):
    loader = PromptDataLoader(dataset, batch_size=2, shuffle=True, seed=1, drop_last=True)
    state = dict(loader.state_dict(), num_rows=11, seed=2)
    with pytest.raises(ValueError, match=r"num_rows: checkpoint 11, now 10, seed: checkpoint 2, now 1"):
        loader.load_state_dict(state)


def test_too_few_rows_for_one_step(dataset):
    with pytest.raises(DataError, match=r"10 usable rows, fewer than the 16 prompts one step needs"):
        PromptDataLoader(dataset, batch_size=16, shuffle=True, seed=1, drop_last=True)


def test_create_dataloaders(tmp_path, processor, model_config):
    train = write_jsonl(tmp_path / "train.jsonl", [{"problem": f"t{i}", "answer": str(i)} for i in range(6)])
    val = write_jsonl(tmp_path / "val.jsonl", [{"problem": f"v{i}", "answer": str(i)} for i in range(5)])
    config = data_config(train_files=str(train), val_files=str(val), rollout_batch_size=4, shuffle=False)
    train_loader, val_loader = create_dataloaders(config, processor.tokenizer, processor, model_config, 4)
    assert answers(train_loader) == [["0", "1", "2", "3"]]  # file order, partial batch dropped
    assert answers(val_loader) == [["0", "1", "2", "3", "4"]]  # val_batch_size -1: all rows at once
    assert [batch["uid"] for batch in val_loader] == [[f"val-{i}" for i in range(5)]]

    config = data_config(train_files=str(train), val_files=str(val), rollout_batch_size=4, mini_rollout_batch_size=2, val_batch_size=2)
    # one batch per generation round of mini_rollout_batch_size prompts (Derived.prompts_per_generation_round)
    train_loader, val_loader = create_dataloaders(config, processor.tokenizer, processor, model_config, 2)
    assert len(train_loader) == 3 and [len(b) for b in val_loader] == [2, 2, 1]

    _, no_val = create_dataloaders(data_config(train_files=str(train), rollout_batch_size=4), processor.tokenizer, processor, model_config, 4)
    assert no_val is None


def test_create_dataloaders_shuffle_and_seed(tmp_path, processor, model_config):
    """data.shuffle and data.seed reach the training loader; the validation loader keeps file order."""
    train = write_jsonl(tmp_path / "train.jsonl", [{"problem": f"t{i}", "answer": str(i)} for i in range(6)])

    def first_epoch(**overrides):
        config = data_config(train_files=str(train), rollout_batch_size=6, **overrides)
        loader, _ = create_dataloaders(config, processor.tokenizer, processor, model_config, 6)
        return answers(loader)[0]

    # independent reference: the permutation torch draws for (seed, epoch 0)
    for seed in (1, 5):
        expected = torch.randperm(6, generator=torch.Generator().manual_seed(seed * 1_000_003)).tolist()
        assert first_epoch(shuffle=True, seed=seed) == [str(i) for i in expected]
    assert first_epoch(shuffle=True, seed=1) != first_epoch(shuffle=True, seed=5)
    assert first_epoch(shuffle=False, seed=5) == [str(i) for i in range(6)]
