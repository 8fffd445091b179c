"""The runs of a packed row: trunks (whole sequences) and branches (responses continuing a trunk's first tokens)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass(frozen=True)
class Segment:
    """A run of a packed row: tokens ``start .. start + length - 1``. ``prefix`` = 0 for a trunk
    (a sequence of its own); > 0 for a branch, which also attends to tokens ``trunk_start ..
    trunk_start + prefix - 1`` (the first ``prefix`` tokens of the latest trunk)."""

    start: int
    length: int
    prefix: int = 0
    trunk_start: int = 0


def packed_segments(positions: Tensor | list[int]) -> list[Segment]:
    """Trunks and branches of a packed row from its text positions ((N,) or (1, N)): a segment starts where the
    position is not its predecessor's + 1. [0 1 2 3 | 2 3 | 0 1] -> trunk (0, 4), branch (4, 2) on 2 tokens of
    trunk 0, trunk (6, 2). Raises ValueError when a branch's prefix is longer than its trunk."""
    flat = torch.as_tensor(positions).reshape(-1)
    N = flat.numel()
    breaks = torch.ones(N, dtype=torch.bool, device=flat.device)
    breaks[1:] = flat[1:] != flat[:-1] + 1
    starts_t = torch.nonzero(breaks).reshape(-1)
    bounds = torch.stack([starts_t, flat[starts_t]]).tolist()  # [starts, first positions]
    starts, firsts = bounds[0], bounds[1]
    segments: list[Segment] = []
    trunk: Segment | None = None
    for start, end, first in zip(starts, [*starts[1:], N], firsts):
        if first == 0:
            trunk = Segment(start, end - start)
            segments.append(trunk)
        elif trunk is None or first > trunk.length:
            raise ValueError(
                f"packed row: tokens {start}..{end - 1} start at position {first} but the preceding sequence "
                f"has {0 if trunk is None else trunk.length} tokens; a shared-prompt response must follow its prompt"
            )
        else:
            segments.append(Segment(start, end - start, first, trunk.start))
    return segments
