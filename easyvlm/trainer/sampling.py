"""A step's samples: generation rounds (with DAPO's online filtering), seeded per call, ReMax's greedy
baseline, the next step's generation started ahead (one_step_off), and the separate rollout group
kept on the actor's weights by version."""

from __future__ import annotations

import dataclasses
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Iterator

import ray
import torch

from easyvlm.data.batch import Batch
from easyvlm.data.dataloader import PromptDataLoader
from easyvlm.pipeline.scoring import Scorer
from easyvlm.rollout.base import TRAIN_CALL, seeded_prompts
from easyvlm.plan.specs import RoundsSpec
from easyvlm.rollout.specs import Sampling
from easyvlm.trainer import core
from easyvlm.trainer.metrics import timed
from easyvlm.trainer.scoring import concat_results, select_result
from easyvlm.trainer.topology import Workers


class OnlineFilterError(RuntimeError):
    pass


class StepSampler:
    """Generates each step's rollout batch and starts its rewards.

    Weight versions: ``policy_version`` counts the actor's updates (and checkpoint loads); the
    separate rollout group holds ``rollout_version`` and is sent the weights when the two differ."""

    def __init__(self, spec: RoundsSpec, workers: Workers, scorer: Scorer, loader: PromptDataLoader,
                 sampling: Sampling, pad_token_id: int):
        self.spec, self.workers, self.scorer, self.loader = spec, workers, scorer, loader
        self.sampling, self.pad_token_id = sampling, pad_token_id
        # one_step_off: the next step's generation runs in this thread while the step trains
        self.background = ThreadPoolExecutor(1, "easyvlm-rollout") if spec.one_step_off else None
        self.prefetched: tuple[Batch, Future] | None = None
        self.policy_version = 0
        self.rollout_version = -1

    def generate(self, prompts: Batch, metrics: dict[str, float], step: int) -> tuple[Batch, Any]:
        """The step's rollout batch of ``data.rollout_batch_size`` prompt groups, and its reward: Ray
        refs of the rounds' results, or the result itself when online filtering needed it.

        Generation runs in rounds of ``data.mini_rollout_batch_size`` prompts (default: one round of
        all). Without online filtering every group is kept and rounds repeat until the step has its
        prompts; with it (DAPO's dynamic sampling) only groups whose mean ``filter_key`` lies inside
        (filter_low, filter_high) are kept, for at most ``trainer.max_try_make_batch`` rounds."""
        spec, filtering = self.spec, self.spec.filtering
        wanted = spec.prompt_groups
        kept: list[Batch] = []
        results: list[Any] = []  # RewardResults (filtering) or Ray refs
        n_kept, rounds = 0, 0
        iterator = iter(self._refill(prompts))
        while n_kept < wanted:
            rounds += 1
            if filtering.online_filtering and spec.max_rounds > 0 and rounds > spec.max_rounds:
                raise OnlineFilterError(
                    f"online filtering kept {n_kept} of {wanted} prompt groups after {spec.max_rounds} generation rounds "
                    f"(trainer.max_try_make_batch): almost every group scores all-right or all-wrong on "
                    f"'{filtering.filter_key}'. Widen algorithm.filter_low/filter_high, raise max_try_make_batch "
                    f"(-1 = no limit), or turn algorithm.online_filtering off"
                )
            batch = self.workers.rollout.generate(self.seeded(next(iterator), TRAIN_CALL, step, rounds - 1))
            reward_ref = self.scorer.submit(self.scorer.inputs(batch, training=True))
            if not filtering.online_filtering:  # every group is kept (rounds divide the step: validate)
                kept.append(batch)
                results.append(reward_ref)
                n_kept += len(set(batch["uid"]))
                continue
            result = ray.get(reward_ref)
            if filtering.filter_key not in result.scores:
                raise OnlineFilterError(
                    f"algorithm.filter_key={filtering.filter_key!r} is not a key the reward returns; keys: {sorted(result.scores)}"
                )
            keep = core.groups_in_range(batch["uid"], result.scores[filtering.filter_key], filtering.filter_low,
                                        filtering.filter_high)
            keep = keep[: wanted - n_kept]
            rows = core.rows_of_groups(batch["uid"], keep)
            if rows:
                kept.append(batch.index(rows))
                results.append(select_result(result, rows))
            n_kept += len(keep)
        if filtering.online_filtering or rounds > 1:
            metrics["online_filtering/rounds" if filtering.online_filtering else "generation/rounds"] = float(rounds)
        batch = kept[0] if len(kept) == 1 else core.concat_rollouts(kept, self.pad_token_id)
        if filtering.online_filtering:
            return batch, concat_results(results)
        return batch, results  # refs: collected after the log-prob passes

    def step_samples(self, prompts: Batch, pending: Future | None, step: int, metrics: dict[str, float]) -> tuple[Batch, Any]:
        """Step ``step``'s batch and reward: ``pending``'s (one_step_off: the generation started last
        step; timing_s/gen is the wait, its own time timing_s/gen_async), else generated now."""
        with timed("gen", metrics):
            if pending is not None:
                batch, reward, gen_metrics = pending.result()
                metrics.update(gen_metrics)
                return batch, reward
            self.sync(metrics)
            return self.generate(prompts, metrics, step)

    def start_next(self, prompt_iter: Iterator[Batch], step: int, metrics: dict[str, float]) -> None:
        """one_step_off: generate step ``step + 1``'s batch in the background with the current weights."""
        self.sync(metrics)
        following = next(prompt_iter)
        self.prefetched = (following, self.background.submit(self._generate_ahead, following, step + 1))

    def take_prefetched(self) -> tuple[Batch, Future] | None:
        prefetched, self.prefetched = self.prefetched, None
        return prefetched

    def _generate_ahead(self, prompts: Batch, step: int) -> tuple[Batch, Any, dict[str, float]]:
        """``generate`` for step ``step``, run in the background thread (one_step_off). It talks to
        the rollout group and the reward actor only; the hybrid group is the main thread's."""
        metrics: dict[str, float] = {}
        with timed("gen_async", metrics):
            batch, reward_ref = self.generate(prompts, metrics, step)
        return batch, reward_ref, metrics

    def may_prefetch(self, step: int, total_steps: int, save_freq: int) -> bool:
        """one_step_off: start the next step's generation now, unless this step is the last or saves
        a checkpoint (whose data-loader state must not include the next step's prompts)."""
        if self.background is None or step >= total_steps:
            return False
        return not (save_freq > 0 and step % save_freq == 0)

    def sync(self, metrics: dict[str, float] | None = None) -> None:
        """Send the actor's weights to the separate rollout group if they changed since the last
        time (main thread only: the call is collective on the hybrid ranks)."""
        rollout_group = self.workers.rollout_group
        if rollout_group is None or self.rollout_version == self.policy_version:
            return
        start = time.perf_counter()
        refs = self.workers.hybrid.call_all_async("weights_for_sync")  # full weights on rank 0, None elsewhere
        rollout_group.call_all("load_weights", refs[0], self.policy_version)
        ray.get(refs[1:])
        self.rollout_version = self.policy_version
        if metrics is not None:
            metrics["timing_s/weight_sync"] = metrics.get("timing_s/weight_sync", 0.0) + time.perf_counter() - start

    def seeded(self, prompts: Batch, *call: int) -> Batch:
        """``prompts`` seeded for one generation call when worker.rollout.per_request_seed is on."""
        if not self.spec.per_request_seed:
            return prompts
        return seeded_prompts(prompts, self.spec.seed, call)

    def _refill(self, first: Batch):
        """The step's prompts, then more prompts from the loader for further filtering rounds."""
        yield first
        while True:
            for prompts in self.loader:
                yield prompts

    def greedy_baseline(self, prompts: Batch, batch: Batch) -> torch.Tensor:
        """ReMax (arXiv:2310.10505): the reward of one greedy response per prompt, per sample."""
        greedy_sampling = dataclasses.replace(self.sampling, n=1, temperature=0.0)
        self.sync()
        greedy = self.workers.rollout.generate(prompts, greedy_sampling)
        result = self.scorer.score(greedy)
        by_uid = dict(zip(greedy["uid"], result.overall))
        return torch.tensor([by_uid[uid] for uid in batch["uid"]], dtype=torch.float32)

    def close(self) -> None:
        if self.background is not None:  # a generation in flight fails against the killed actors
            self.background.shutdown(wait=False, cancel_futures=True)
