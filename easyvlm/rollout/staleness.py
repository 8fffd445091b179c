"""The staleness bound of asynchronous rollout (``max_staleness`` = k), pure: the producers' rules and
the trainer's check. The trainer at version p has done p updates and trains step p + 1; a sample's
staleness, p minus the version of its oldest token, is <= k. docs/rollout.md, "Separate placement and
asynchronous rollout"."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Hashable, Mapping, Sequence, TypeVar

Key = TypeVar("Key", bound=Hashable)


class StalenessError(RuntimeError):
    """A batch holds samples older than the bound allows."""


@dataclass(frozen=True)
class StalenessBound:
    k: int
    """Updates a sample may lag behind the weights it is trained with (``max_staleness``)."""
    batch_groups: int
    """B: prompt groups per training step."""

    # ------------------------------------------------------------------ whole batches
    def batch_may_start(self, step: int, trainer_version: int, taken: int, limit: int) -> bool:
        """Whether step ``step``'s batch may be generated now: at most one ahead of ``taken``, not past the
        draw ``limit`` (next checkpoint), and the trainer at least at the batch's version."""
        return step <= min(limit, taken + 1) and trainer_version >= step - 1 - self.k

    def batch_version(self, step: int, floor: int) -> int:
        """The version that generates step ``step``'s batch: step - 1 - k exactly, so a seeded run
        samples the same whatever the timing (k = 1: verl's one-step-off), at least ``floor``."""
        return max(step - 1 - self.k, floor)

    # ------------------------------------------------------------------ streamed groups
    def admission_cap(self, version: int, limit: int) -> int:
        """Groups admitted in all at most at ``version``: (version + 1 + k) x B, none past ``limit``."""
        return min(version + 1 + self.k, limit) * self.batch_groups

    def may_admit(self, version: int, limit: int, admitted: int, generating: int, completed: int) -> bool:
        """Whether another B groups go into play: on demand (fewer than B ``generating`` and fewer than
        B ``completed``) within :meth:`admission_cap`, so a quick engine stays one step ahead, not k."""
        B = self.batch_groups
        wanted = generating < B and completed < B
        return wanted and admitted + B <= self.admission_cap(version, limit)

    def choose(self, version: int, untrained: Mapping[int, int], completed: Sequence[tuple[Key, int]]) -> list[Key] | None:
        """The B complete groups the step at ``version`` trains on, or None (wait for more).
        ``untrained``: admission version -> groups not yet trained; ``completed``: (group, admission
        version) in completion order. A group admitted at v is trained by v + k: for m < max(k, 1), this
        step takes at least (groups admitted at <= version - k + m) - m B of them, since the m steps after
        it take at most B each; the rest of B are the first completed (docs/cluster_model.md, "Selection")."""
        B, batch, chosen = self.batch_groups, [], set()
        for m in range(max(self.k, 1)):
            oldest = version - self.k + m
            due = sum(n for v, n in untrained.items() if v <= oldest) - m * B
            due -= sum(1 for _, v in batch if v <= oldest)
            pool = [(key, v) for key, v in completed if v <= oldest and key not in chosen]
            if due > len(pool) or due > B - len(batch):
                return None
            batch += pool[: max(0, due)]
            chosen.update(key for key, _ in pool[: max(0, due)])
        batch += [(key, v) for key, v in completed if key not in chosen][: B - len(batch)]
        return [key for key, _ in batch] if len(batch) == B else None

    # ------------------------------------------------------------------ the trainer's check
    def check(self, trainer_version: int, sample_versions: Sequence[int], step: int) -> None:
        """Raise :class:`StalenessError` if a sample is more than k updates older than ``trainer_version``
        (never, by the producers' contract; checked before training)."""
        oldest = min(sample_versions, default=trainer_version)
        if trainer_version - oldest > self.k:
            raise StalenessError(
                f"step {step}'s batch holds samples of version {oldest}, {trainer_version - oldest} updates behind "
                f"the trainer's {trainer_version}, beyond worker.rollout.max_staleness={self.k}: the rollout "
                "producer broke its bound (a bug: please report it with the run's log)")


# ------------------------------------------------------------------------------------------------
# what the trainer logs


def staleness_metrics(batch: Any, version: int) -> dict[str, float]:
    """``rollout/staleness_mean``/``_max`` of the batch trained at ``version`` (from ``rollout_version``);
    with per-token versions also ``rollout/partial_fraction``, samples spanning several versions."""
    if "rollout_version" not in batch:
        return {}
    import torch  # here: the bound's rules above import without torch (bench/cluster_model.py)

    staleness = (version - batch["rollout_version"]).float()
    out = {"rollout/staleness_mean": float(staleness.mean()), "rollout/staleness_max": float(staleness.max())}
    if "rollout_token_versions" in batch:
        versions, mask = batch["rollout_token_versions"], batch["response_mask"].bool()
        high = torch.where(mask, versions, torch.full_like(versions, -1)).amax(dim=1)
        low = torch.where(mask, versions, torch.full_like(versions, 2**62)).amin(dim=1)
        out["rollout/partial_fraction"] = float(((high > low) & mask.any(dim=1)).float().mean())
    return out
