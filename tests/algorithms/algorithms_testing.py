"""Helpers for tests/algorithms (a uniquely named module: tests/ has no __init__.py files)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
from torch import Tensor

from easyvlm.algorithms.policy_losses import PolicyLossInputs
from easyvlm.algorithms.settings import PolicyLossSettings


@dataclass
class TinyPolicy:
    """logits = features @ weight: (B, T, D) @ (D, V) -> (B, T, V); fixed sampled tokens (B, T)."""

    features: Tensor  # (B, T, D)
    tokens: Tensor  # (B, T) int64
    weight: torch.nn.Parameter  # (D, V)

    def logits(self, rows: slice | Tensor = slice(None), weight: Tensor | None = None) -> Tensor:
        return self.features[rows] @ (self.weight if weight is None else weight)

    def logprobs(self, rows: slice | Tensor = slice(None), weight: Tensor | None = None) -> Tensor:
        logp = torch.log_softmax(self.logits(rows, weight), dim=-1)  # (b, T, V)
        return logp.gather(-1, self.tokens[rows].unsqueeze(-1)).squeeze(-1)  # (b, T)


def make_tiny_policy() -> TinyPolicy:
    gen = torch.Generator().manual_seed(0)
    batch, length, dim, vocab = 8, 5, 4, 7
    return TinyPolicy(
        features=torch.randn(batch, length, dim, generator=gen),
        tokens=torch.randint(0, vocab, (batch, length), generator=gen),
        weight=torch.nn.Parameter(0.5 * torch.randn(dim, vocab, generator=gen)),
    )


def lengths_to_mask(lengths: list[int], width: int) -> Tensor:
    """[3, 1] -> [[T, T, T, F], [T, F, F, F]] for width 4: (B, T) bool, right padded."""
    return torch.arange(width).unsqueeze(0) < torch.tensor(lengths).unsqueeze(1)


SETTINGS_FIELDS = {f.name for f in dataclasses.fields(PolicyLossSettings)}


def policy_loss_inputs(**kwargs) -> PolicyLossInputs:
    """PolicyLossInputs from flat keyword arguments: the loss's hyperparameters (clip_ratio_low,
    loss_avg_mode, ...) go into its PolicyLossSettings, the rest (tensors, normalizer) as they are."""
    settings = PolicyLossSettings(**{k: kwargs.pop(k) for k in list(kwargs) if k in SETTINGS_FIELDS})
    return PolicyLossInputs(settings=settings, **kwargs)
