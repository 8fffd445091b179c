"""A seeded, resumable prompt loader, run in the calling process (docs/data.md, "The prompt batch")."""

from __future__ import annotations

from typing import Any, Iterator, Sequence

import torch

from easyvlm.data.settings import DataConfig
from easyvlm.data.batch import Batch
from easyvlm.data.collate import collate_prompts
from easyvlm.data.dataset import RLDataset
from easyvlm.data.loading import DataError


class PromptDataLoader:
    """Prompt Batches of ``batch_size`` rows of ``dataset``. shuffle: a permutation seeded with (seed,
    epoch) every epoch (else file order); drop_last: drop an epoch's last, smaller batch."""

    def __init__(self, dataset: RLDataset, batch_size: int, shuffle: bool, seed: int, drop_last: bool):
        if batch_size <= 0:
            raise ValueError(f"PromptDataLoader: batch_size must be positive, got {batch_size}")
        if drop_last and len(dataset) < batch_size:
            raise DataError(
                f"{dataset.key}: {len(dataset)} usable rows, fewer than the {batch_size} prompts one step needs "
                f"(data.rollout_batch_size / mini_rollout_batch_size); lower it or add rows ({dataset.report.summary()})"
            )
        self.dataset = dataset
        self.batch_size = batch_size
        self.shuffle = shuffle
        self.seed = int(seed)
        self.drop_last = drop_last
        self.epoch = 0
        self.position = 0  # batches of this epoch already handed out

    def __len__(self) -> int:
        """Batches per epoch."""
        n = len(self.dataset)
        return n // self.batch_size if self.drop_last else -(-n // self.batch_size)

    def order(self, epoch: int) -> list[int]:
        """Row order of ``epoch``."""
        n = len(self.dataset)
        if not self.shuffle:
            return list(range(n))
        generator = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
        return torch.randperm(n, generator=generator).tolist()

    def __iter__(self) -> Iterator[Batch]:
        """The batches of the current epoch from the current position; then the epoch advances."""
        if self.position >= len(self):
            self.epoch, self.position = self.epoch + 1, 0
        order = self.order(self.epoch)
        while self.position < len(self):
            start = self.position * self.batch_size
            indices = order[start : start + self.batch_size]
            batch = collate_prompts([self.dataset[i] for i in indices], self.dataset.pad_token_id)
            self.position += 1
            yield batch
        self.epoch, self.position = self.epoch + 1, 0

    def state_dict(self) -> dict[str, Any]:
        return {
            "epoch": self.epoch,
            "position": self.position,
            "seed": self.seed,
            "shuffle": self.shuffle,
            "batch_size": self.batch_size,
            "num_rows": len(self.dataset),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue where the saved loader stopped. The data, seed and batch size must be the same."""
        mismatched = {
            k: (state.get(k), now)
            for k, now in (("num_rows", len(self.dataset)), ("seed", self.seed), ("batch_size", self.batch_size), ("shuffle", self.shuffle))
            if state.get(k) != now
        }
        if mismatched:
            details = ", ".join(f"{k}: checkpoint {old!r}, now {new!r}" for k, (old, new) in mismatched.items())
            raise ValueError(
                f"dataloader state does not fit this run ({details}); the checkpoint's data order cannot be "
                f"continued. Use the same data and data.seed / rollout_batch_size, or start without the checkpoint"
            )
        self.epoch = int(state["epoch"])
        self.position = int(state["position"])


def create_dataloaders(
    config: DataConfig, tokenizer: Any, processor: Any, model_config: Any, prompts_per_round: int,
    tools: Sequence[dict] = (),
) -> tuple[PromptDataLoader, PromptDataLoader | None]:
    """(train loader of ``prompts_per_round`` prompts per batch, validation loader or None). tools: the
    JSON schemas the prompts show (multi-turn)."""
    train = RLDataset(config.train_files, config, tokenizer, processor, model_config, "data.train_files", "train", tools)
    train_loader = PromptDataLoader(train, prompts_per_round, config.shuffle, config.seed, drop_last=True)
    if not config.val_files:
        return train_loader, None
    return train_loader, create_val_loader(config, tokenizer, processor, model_config, tools)


def create_val_loader(
    config: DataConfig, tokenizer: Any, processor: Any, model_config: Any, tools: Sequence[dict] = ()
) -> PromptDataLoader:
    """The validation loader: ``val_batch_size`` prompts per batch (-1 = all), file order, nothing dropped."""
    val = RLDataset(config.val_files, config, tokenizer, processor, model_config, "data.val_files", "val", tools)
    val_batch_size = len(val) if config.val_batch_size == -1 else config.val_batch_size
    return PromptDataLoader(val, val_batch_size, False, 0, drop_last=False)
