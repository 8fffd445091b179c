"""One step's generation rounds (every placement but the streamed one), seeded per call, with DAPO's online
filtering; the rounds' batches and rewards joined into the step's."""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any, Callable, Hashable, Iterator, Mapping, Sequence

import ray
import torch

from easyvlm.data.batch import ROUTED_EXPERTS_KEY, Batch
from easyvlm.data.dataloader import PromptDataLoader
from easyvlm.pipeline.scoring import Scorer
from easyvlm.plan.specs import RoundsSpec
from easyvlm.models.moe_routing import FREE
from easyvlm.rewards.types import RewardResult
from easyvlm.rollout.base import TRAIN_CALL, seeded_prompts


class OnlineFilterError(RuntimeError):
    pass


@dataclass
class StepSamples:
    """A step's samples: its prompts (None when streamed groups come from several draws), the
    rollout batch and its reward (Ray refs, or the RewardResult online filtering waited for)."""

    prompts: Batch | None
    batch: Batch
    reward: Any


class GenerationRounds:
    """A step's rollout batch of ``data.rollout_batch_size`` prompt groups and its reward, generated
    in rounds of ``data.mini_rollout_batch_size`` prompts (default: one round of all)."""

    def __init__(self, spec: RoundsSpec, scorer: Scorer, loader: PromptDataLoader, pad_token_id: int):
        self.spec, self.scorer, self.loader, self.pad_token_id = spec, scorer, loader, pad_token_id

    def generate(self, prompts: Batch, metrics: dict[str, float], step: int,
                 engine: Callable[[Batch], Batch]) -> tuple[Batch, Any]:
        """The batch and its reward: Ray refs of the rounds' results, or the result itself where online filtering
        needed it; ``engine(prompts)`` generates one round. Online filtering (DAPO's dynamic sampling) keeps groups inside
        (filter_low, filter_high), for at most ``trainer.max_try_make_batch`` rounds (`OnlineFilterError` past them)."""
        spec, filtering = self.spec, self.spec.filtering
        wanted = spec.prompt_groups
        kept: list[Batch] = []
        results: list[Any] = []  # RewardResults (filtering) or Ray refs
        n_kept, rounds = 0, 0
        iterator = iter(self._refill(prompts))
        while n_kept < wanted:
            rounds += 1
            if filtering.online_filtering and spec.max_rounds > 0 and rounds > spec.max_rounds:
                raise filter_error(n_kept, wanted, f"{spec.max_rounds} generation rounds", filtering.filter_key)
            batch = engine(self.seeded(next(iterator), TRAIN_CALL, step, rounds - 1))
            reward_ref = self.scorer.submit(self.scorer.inputs(batch, training=True))
            if not filtering.online_filtering:  # every group is kept (rounds divide the step: validate)
                kept.append(batch)
                results.append(reward_ref)
                n_kept += len(set(batch["uid"]))
                continue
            result = ray.get(reward_ref)
            keep = kept_groups(batch, result, filtering)[: wanted - n_kept]
            rows = rows_of_groups(batch["uid"], keep)
            if rows:
                kept.append(batch.index(rows))
                results.append(select_result(result, rows))
            n_kept += len(keep)
        if filtering.online_filtering or rounds > 1:
            metrics["online_filtering/rounds" if filtering.online_filtering else "generation/rounds"] = float(rounds)
        batch = kept[0] if len(kept) == 1 else concat_rollouts(kept, self.pad_token_id)
        if filtering.online_filtering:
            return batch, concat_results(results)
        return batch, results  # refs: collected after the log-prob passes

    def seeded(self, prompts: Batch, *call: int) -> Batch:
        """``prompts`` seeded for one generation call when worker.rollout.per_request_seed is on."""
        if not self.spec.per_request_seed:
            return prompts
        return seeded_prompts(prompts, self.spec.seed, call)

    def _refill(self, first: Batch) -> Iterator[Batch]:
        """The step's prompts, then more prompts from the loader for further filtering rounds."""
        return itertools.chain([first], prompt_batches(self.loader))


def prompt_batches(loader: PromptDataLoader) -> Iterator[Batch]:
    """The loader's prompt batches across epochs (it resumes mid-epoch)."""
    while True:
        yielded = False
        for prompts in loader:
            yielded = True
            yield prompts
        if not yielded:
            raise RuntimeError("the training dataloader produced no batch; check data.train_files and rollout_batch_size")


def kept_groups(batch: Batch, result: Any, filtering: Any) -> list[str]:
    """The uids of the groups whose mean ``filter_key`` lies inside (filter_low, filter_high)."""
    if filtering.filter_key not in result.scores:
        raise OnlineFilterError(
            f"algorithm.filter_key={filtering.filter_key!r} is not a key the reward returns; keys: {sorted(result.scores)}"
        )
    return groups_in_range(batch["uid"], result.scores[filtering.filter_key], filtering.filter_low,
                                filtering.filter_high)


def filter_error(n_kept: int, wanted: int, after: str, filter_key: str) -> OnlineFilterError:
    return OnlineFilterError(
        f"online filtering kept {n_kept} of {wanted} prompt groups after {after} "
        f"(trainer.max_try_make_batch): almost every group scores all-right or all-wrong on "
        f"'{filter_key}'. Widen algorithm.filter_low/filter_high, raise max_try_make_batch "
        f"(-1 = no limit), or turn algorithm.online_filtering off"
    )


# ------------------------------------------------------------------ batches and rewards of several rounds
def groups_in_range(uids: Sequence[Hashable], values: Sequence[float], low: float, high: float) -> list[Hashable]:
    """Prompt uids whose group mean of ``values`` lies strictly inside (low, high), in order: DAPO's
    dynamic sampling (arXiv:2503.14476, sec. 3.2); an all-equal group has zero advantage."""
    sums: dict[Hashable, float] = {}
    counts: dict[Hashable, int] = {}
    for uid, value in zip(uids, values):
        sums[uid] = sums.get(uid, 0.0) + float(value)
        counts[uid] = counts.get(uid, 0) + 1
    return [uid for uid in sums if low < sums[uid] / counts[uid] < high]


def rows_of_groups(uids: Sequence[Hashable], keep: Sequence[Hashable]) -> list[int]:
    """Row indices of the samples whose uid is in ``keep``, in row order."""
    wanted = set(keep)
    return [i for i, uid in enumerate(uids) if uid in wanted]


def concat_rollouts(batches: Sequence[Batch], pad_token_id: int) -> Batch:
    """Batch.concat of rollout batches of several generation rounds: the prompt-side columns
    (`_prompt_side_fill`) are first left padded to the widest prompt with the collator's values."""
    width = max(b["prompts"].shape[1] for b in batches)
    padded = []
    for batch in batches:
        extra = width - batch["prompts"].shape[1]
        if extra:
            batch = batch.copy()
            for key, (value, dim) in _prompt_side_fill(pad_token_id).items():
                if key in batch:
                    t = batch[key]
                    shape = list(t.shape)
                    shape[dim] = extra
                    batch[key] = torch.cat([t.new_full(shape, value), t], dim=dim)
        padded.append(batch)
    return Batch.concat(padded)


def _prompt_side_fill(pad_token_id: int) -> dict[str, tuple[int | bool, int]]:
    """The rollout tensors whose columns include the prompt: key -> (fill value, dimension)."""
    return {"prompts": (pad_token_id, -1), "input_ids": (pad_token_id, -1), "attention_mask": (False, -1),
            "position_ids": (0, -1), ROUTED_EXPERTS_KEY: (FREE, 1)}


def reward_metrics(scores: Mapping[str, list[float]], prefix: str = "reward") -> dict[str, float]:
    """reward/<key> = mean of each score key over the batch (``overall`` included)."""
    return {f"{prefix}/{key}": float(torch.tensor(values, dtype=torch.float64).mean()) for key, values in scores.items() if values}


def select_result(result: RewardResult, rows: list[int]) -> RewardResult:
    return RewardResult({k: [v[i] for i in rows] for k, v in result.scores.items()}, {}, [], list(result.function_keys))


def concat_results(results: list[RewardResult]) -> RewardResult:
    """One result of several rounds' (or of one round's kept rows): scores in order, metrics
    recomputed over them (the error count summed)."""
    scores: dict[str, list[float]] = {}
    for r in results:
        for k, v in r.scores.items():
            scores.setdefault(k, []).extend(v)
    metrics = reward_metrics(scores)
    if any("reward/error_count" in r.metrics for r in results):
        metrics["reward/error_count"] = sum(r.metrics.get("reward/error_count", 0.0) for r in results)
    function_keys = list(results[0].function_keys) if results else []  # the same reward functions every round
    return RewardResult(scores, metrics, [e for r in results for e in r.errors], function_keys)


def collect(reward: Any) -> RewardResult:
    """The step's rewards: already a result (online filtering waited for it), or the rounds' refs."""
    return reward if isinstance(reward, RewardResult) else concat_results(ray.get(reward))
