"""The single-controller RL loop. `Trainer.fit` reads top to bottom as the data flow of one step:

    generate -> reward (async) -> old log-probs -> ref log-probs -> values -> [online filtering]
    -> KL in reward -> advantages -> critic update -> actor update -> validation -> checkpoint

The driver holds no model: every heavy call goes to a worker group through a `Batch`. The math in
between is pure functions (`easyvlm.algorithms`, `easyvlm.trainer.core`).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from concurrent.futures import Future, ThreadPoolExecutor
from functools import partial
from pathlib import Path
from typing import Any

import ray
import torch

from easyvlm.agents.loop import TRAJECTORY_KEY, trajectory_metrics
from easyvlm.agents.setup import DriverRollout
from easyvlm.algorithms import AdvantageInputs, apply_kl_penalty, build_kl_controller, get_advantage, kl_penalty
from easyvlm.algorithms.rollout_correction import parse_rollout_correction, rollout_correction
from easyvlm.data.batch import MODEL_INPUT_KEYS, UPDATE_INPUT_KEYS, Batch
from easyvlm.data.dataloader import PromptDataLoader
from easyvlm.distributed.worker_group import Resources, WorkerGroup, placement_report
from easyvlm.plan.build import RunPlan
from easyvlm.plan.roles import with_total_steps
from easyvlm.rewards.actor import build_reward_inputs, create_reward_actor
from easyvlm.rewards.judge import Judge
from easyvlm.rewards.model_scores import RewardModelScores
from easyvlm.rewards.types import RewardResult
from easyvlm.specs import Sampling
from easyvlm.trainer import core
from easyvlm.trainer.checkpoint import HF_EXPORT_DIR, CheckpointManager
from easyvlm.trainer.metrics import (
    data_metrics,
    reward_metrics,
    response_metrics,
    throughput_metrics,
    timed,
    timing_per_token_metrics,
    val_metrics,
)
from easyvlm.trainer.plot import write_learning_curve
from easyvlm.trainer.tracking import Generation, Tracker, data_order_log
from easyvlm.utils.memory import peak_rss_bytes, peak_rss_metrics
from easyvlm.utils.safe_state import load_state, rng_state, set_rng_state
from easyvlm.viewer.records import RolloutCapture, capture_rollouts
from easyvlm.viewer.writer import RolloutWriter
from easyvlm.workers.actor import update_is_on_policy
from easyvlm.workers.hybrid import CriticHost, HybridWorker, RewardModelHost, RolloutHost

logger = logging.getLogger("easyvlm")

# the kinds of generation calls, part of their sampling seeds (Trainer._seeded)
TRAIN_CALL, VAL_CALL = core.TRAIN_CALL, core.VAL_CALL


class OnlineFilterError(RuntimeError):
    pass


class Trainer:
    """The driver's loop over a `RunPlan`. ``train_loader`` hands out one generation round of
    prompts per batch; ``resume_from``: a checkpoint the driver checked before Ray started."""

    def __init__(
        self,
        plan: RunPlan,
        train_loader: PromptDataLoader,
        val_loader: PromptDataLoader | None,
        resources: Resources,
        resume_from: Path | None = None,
    ):
        self.plan, self.cfg, self.derived = plan, plan.config, plan.derived
        self.tokenizer = plan.bundle.tokenizer
        self.train_loader, self.val_loader = train_loader, val_loader
        self.total_steps = self.derived.total_steps(len(train_loader.dataset))
        self.resume_from = resume_from
        algo = self.cfg.algorithm
        self.kl_ctrl = build_kl_controller(algo.kl_type, algo.kl_coef, algo.kl_target, algo.kl_horizon)
        self.advantage_fn = get_advantage(algo.adv_estimator)
        rc = algo.rollout_correction  # checked by the config check, so parsing cannot fail here
        self.correction = parse_rollout_correction(
            rc.rollout_is, rc.rollout_is_threshold, rc.rollout_is_batch_normalize, rc.rollout_rs, rc.rollout_rs_threshold
        )
        self.ckpt = CheckpointManager(self.derived.save_checkpoint_path, self.cfg.trainer.save_limit)
        self.global_step = 0
        self._step_uids: list[str] = []  # prompts of the current step, for the data-order log
        self.tracker: Tracker | None = None  # made by fit()
        self.viewer: RolloutWriter | None = None  # made by fit() when trainer.rollout_log_freq > 0
        # ranks of a Ulysses group share their samples in the model passes (generation is not split)
        self.actor_sp = plan.actor.forward.ulysses_size
        self.critic_sp = plan.critic.forward.ulysses_size if plan.critic is not None else 1

        # workers: the reward actor first (it loads the reward files before anything heavy)
        self.reward_actor = create_reward_actor(plan.reward, self.cfg.worker.reward.num_cpus)
        self.hybrid: WorkerGroup | None = None
        self.critic: WorkerGroup | None = None
        self.reward_model: WorkerGroup | None = None
        self.reward_model_scores: RewardModelScores | None = None
        self.judge: Judge | None = None
        self.rollout_group: WorkerGroup | None = None  # worker.rollout.placement=separate
        # one_step_off: the next step's generation runs in this thread while the step trains
        self._background = ThreadPoolExecutor(1, "easyvlm-rollout") if self.cfg.worker.rollout.one_step_off else None
        self._prefetched: tuple[Batch, Future] | None = None
        self._policy_version = 0  # actor updates applied (and checkpoint loads)
        self._rollout_version = -1  # the version the separate rollout group holds
        self._scorer_metrics: dict[str, float] = {}  # the step's reward model and judge metrics
        self._peak_asks: dict[str, list] = {}  # perf/peak_rss_gb: questions not answered yet (a busy group's)
        self._peaks: dict[str, list[int]] = {}  # each process's last answer, bytes (a group's by rank)
        # the critic's and the reward model's rank r share rank r's device (and CPUs) with the hybrid worker
        share = 1.0 / (1 + (plan.critic is not None) + (plan.reward_model is not None))
        actor = with_total_steps(plan.actor, self.total_steps)
        try:
            if plan.judge is not None:
                self.judge = Judge(plan.judge)
            separate = self.cfg.worker.rollout.placement == "separate"
            engines = None if separate else plan.rollout  # colocated: each hybrid rank holds an engine
            self.hybrid = WorkerGroup("hybrid", resources, partial(HybridWorker, actor, plan.ref, engines), share=share)
            if separate:  # the engines on their own devices: as many ranks as worker.rollout.num_devices
                rollout_resources = dataclasses.replace(resources, world_size=self.cfg.worker.rollout.num_devices) \
                    if resources is not None else None
                self.rollout_group = WorkerGroup("rollout", rollout_resources, partial(RolloutHost, plan.rollout))
            # every generation goes through here: one engine call, or the multi-turn loop with tools
            engine_group = self.rollout_group or self.hybrid
            self.rollout = DriverRollout(plan, getattr(train_loader.dataset, "encoder", None),
                                         lambda batch, sampling: engine_group.dispatch("generate", batch, sampling=sampling))
            if plan.critic is not None:
                critic = partial(CriticHost, with_total_steps(plan.critic, self.total_steps))
                self.critic = WorkerGroup("critic", resources, critic, pg=self.hybrid.pg, share=share)
            if plan.reward_model is not None:
                self.reward_model = WorkerGroup("reward_model", resources, partial(RewardModelHost, plan.reward_model),
                                                pg=self.hybrid.pg, share=share)
                group = self.reward_model
                self.reward_model_scores = RewardModelScores(
                    lambda batch: group.dispatch("compute_scores", _model_inputs(batch)),
                    plan.reward_model.normalize,
                )
        except BaseException:
            self.shutdown()
            raise

    def placement(self) -> list[str]:
        """Where the ranks and the reward actor run, when the run spans nodes (nothing on one node):
        ``easyvlm.distributed.worker_group.placement_report``."""
        groups = {name: group.nodes for name, group in (("hybrid", self.hybrid), ("rollout", self.rollout_group))
                  if group is not None}
        return placement_report(groups, {"reward actor": ray.get(self.reward_actor.node.remote())}, self.cfg.trainer.nnodes)

    # ------------------------------------------------------------------ the loop
    def fit(self) -> dict[str, float]:
        cfg = self.cfg.trainer
        self._load_checkpoint()
        self.tracker = tracker = Tracker(
            cfg.logger,
            Path(self.derived.save_checkpoint_path),
            cfg.project_name,
            cfg.experiment_name,
            dataclasses.asdict(self.cfg),
            self.total_steps,
            self.global_step,
        )
        order_log = data_order_log(Path(self.derived.save_checkpoint_path), self.global_step)
        if cfg.rollout_log_freq > 0:
            self.viewer = RolloutWriter(
                Path(self.derived.save_checkpoint_path) / "rollouts",
                self.tokenizer,
                self.cfg.worker.reward.skip_special_tokens,
                on_page=tracker.log_rollouts,
            )
        last_metrics: dict[str, float] = {}
        curve_rows: list[dict] = []  # this launch's reward and validation values, for the learning curve
        try:
            if self.global_step == 0 and (cfg.val_before_train or cfg.val_only):
                last_metrics = self.validate()
                tracker.log(0, last_metrics)
                curve_rows.append(_curve_row(0, last_metrics))
            if cfg.val_only:
                return last_metrics
            self._prompt_iter = prompt_iter = self._prompt_batches()
            while True:
                # one_step_off: this step's prompts may already be generating (started last step)
                prompts, pending = self._prefetched or (next(prompt_iter), None)
                self._prefetched = None
                self.global_step += 1
                metrics = self.train_step(prompts, pending)
                if order_log is not None:  # the prompts of every generation round of the step
                    order_log.log(self.global_step, {"uids": self._step_uids})
                is_last = self.global_step >= self.total_steps
                if cfg.val_freq > 0 and (self.global_step % cfg.val_freq == 0 or is_last):
                    with timed("validation", metrics):  # EasyR1's name
                        metrics.update(self.validate())
                if cfg.save_freq > 0 and (self.global_step % cfg.save_freq == 0 or is_last):
                    with timed("save_checkpoint", metrics):
                        self.save_checkpoint(metrics.get("val/reward_score"))
                metrics.update(self._peak_memory())
                tracker.log(self.global_step, metrics)
                curve_rows.append(_curve_row(self.global_step, metrics))
                last_metrics = metrics
                if is_last:
                    break
        finally:
            if self.viewer is not None:  # before the tracker: it hands pages to the trackers
                self.viewer.close()
                self.viewer = None
            tracker.close()
            self._write_learning_curve(curve_rows)
            if order_log is not None:
                order_log.close()
            if cfg.ray_timeline:  # before shutdown: killed actors lose the events they have not flushed
                ray.timeline(filename=cfg.ray_timeline)
        return last_metrics

    def _write_learning_curve(self, rows: list[dict]) -> None:
        """<run dir>/learning_curve.png: from the file logger's whole history (a resumed run's
        earlier steps included) when it is on, else from this launch's rows. A failed plot is
        reported, never raised: the run itself is done."""
        try:
            history = None if "file" in self.cfg.trainer.logger else rows
            write_learning_curve(Path(self.derived.save_checkpoint_path), history)
        except Exception as e:  # noqa: BLE001
            logger.warning("easyvlm: could not draw the learning curve: %r", e)

    def _prompt_batches(self):
        """Prompt batches until total_steps, across epochs (the loader resumes mid-epoch)."""
        while self.global_step < self.total_steps:
            yielded = False
            for prompts in self.train_loader:
                yielded = True
                yield prompts
            if not yielded:
                raise RuntimeError("the training dataloader produced no batch; check data.train_files and rollout_batch_size")

    def train_step(self, prompts: Batch, pending: Future | None = None) -> dict[str, float]:
        """One step on ``prompts``; ``pending``: their generation, started during the last step
        (worker.rollout.one_step_off), else they are generated now."""
        metrics: dict[str, float] = {}
        algo = self.cfg.algorithm
        with timed("step", metrics):
            # 1. generate (+ rewards; with online filtering, until enough groups carry signal).
            # one_step_off: wait for the generation started last step (timing_s/gen is the wait, the
            # generation's own time is timing_s/gen_async), then start the next one with the current
            # weights before this step trains
            with timed("gen", metrics):
                if pending is not None:
                    batch, reward_ref, gen_metrics = pending.result()
                    metrics.update(gen_metrics)
                else:
                    self._sync_rollout(metrics)
                    batch, reward_ref = self._generate(prompts, metrics, self.global_step)
            self._step_uids = list(dict.fromkeys(batch["uid"]))
            if self._may_prefetch():
                self._sync_rollout(metrics)
                following = next(self._prompt_iter)
                self._prefetched = (following, self._background.submit(self._generate_ahead, following, self.global_step + 1))
            if "rollout_version" in batch:  # separate engines: how many updates behind the samples are
                staleness = (self._policy_version - batch["rollout_version"]).float()
                metrics["rollout/staleness_mean"] = float(staleness.mean())
                metrics["rollout/staleness_max"] = float(staleness.max())
            batch["group_ids"] = core.group_ids_from_uids(batch["uid"])
            if algo.adv_estimator == "remax":
                with timed("gen_baseline", metrics):
                    batch["baseline_rewards"] = self._greedy_baseline(prompts, batch)

            # 2. old log-probs, ref log-probs, values: the reward actor works meanwhile. An on-policy
            # update (one PPO epoch, one mini-batch, no KL in the reward) needs no old log-probs: the
            # actor uses its update's own forward pass, detached (then no timing_s/old is logged).
            # The rollout correction needs them in the driver; its bypass mode takes the sampler's.
            model_inputs = _model_inputs(batch)
            if algo.rollout_correction.bypass_mode:
                batch["old_logprobs"] = batch["rollout_logprobs"]
            elif self.correction.active or not update_is_on_policy(
                self.plan.actor.update.optimizer_steps_per_step, self.derived.kl_in_reward
            ):
                with timed("old", metrics):
                    batch = batch.union(self.hybrid.dispatch("compute_logprobs", model_inputs, self.actor_sp))
            # the full KL as a loss term is computed in the update itself (the reference's whole
            # distribution per micro-batch, in the actor's process); every other KL reads ref log-probs
            full_kl = algo.kl_penalty == "full"
            if self.derived.use_reference and not (full_kl and self.derived.kl_in_loss):
                with timed("ref", metrics):
                    ref = self.hybrid.dispatch("compute_ref_logprobs", model_inputs, self.actor_sp, full_kl=full_kl)
                    batch = batch.union(ref)
            if self.critic is not None:
                with timed("values", metrics):
                    batch = batch.union(self.critic.dispatch("compute_values", model_inputs, self.critic_sp))
            with timed("reward", metrics):
                result = reward_ref if isinstance(reward_ref, RewardResult) else _concat_results(ray.get(reward_ref))
            assert len(result.overall) == len(batch), "one reward per sample"
            metrics.update(result.metrics)
            metrics.update(self._scorer_metrics)
            self._scorer_metrics = {}
            seq_rewards = torch.tensor(result.overall, dtype=torch.float32)

            # 3. rewards per token, KL in the reward, advantages (pure functions)
            with timed("adv", metrics):
                token_rewards = core.place_seq_rewards(seq_rewards, batch["response_mask"].bool())
                if self.derived.kl_in_reward:
                    kl = batch["ref_kl"] if full_kl else kl_penalty(batch["old_logprobs"], batch["ref_logprobs"], algo.kl_penalty)
                    token_rewards, kl_metrics = apply_kl_penalty(token_rewards, kl, self.kl_ctrl.value, batch["response_mask"].bool())
                    self.kl_ctrl.update(kl_metrics["kl"], n_steps=len(batch))
                    metrics.update({"critic/kl": kl_metrics["kl"], "critic/kl_coef": kl_metrics["kl_coef"]})
                adv = self.advantage_fn(
                    AdvantageInputs(
                        token_rewards=token_rewards,
                        response_mask=batch["response_mask"].bool(),
                        group_ids=batch["group_ids"],
                        values=batch.get("values"),
                        baseline_rewards=batch.get("baseline_rewards"),
                        gamma=algo.gamma,
                        lam=algo.lam,
                        norm_by_std=algo.norm_adv_by_std_in_grpo,
                    )
                )
                batch["token_rewards"], batch["advantages"], batch["returns"] = token_rewards, adv.advantages, adv.returns

            # 4. updates
            update_batch = batch.select(*[k for k in UPDATE_INPUT_KEYS if k in batch], meta=False)
            if self.critic is not None:
                with timed("update_critic", metrics):
                    metrics.update(_rank0_metrics(self.critic.dispatch_collect("update_critic", update_batch, self.critic_sp)))
            if self.global_step > self.cfg.trainer.critic_warmup:
                actor_batch = self._corrected(update_batch, metrics) if self.correction.active else update_batch
                with timed("update_actor", metrics):
                    metrics.update(_rank0_metrics(self.hybrid.dispatch_collect("update_actor", actor_batch, self.actor_sp)))
                self._policy_version += 1

        prompt_mask = batch["attention_mask"][:, : batch["prompts"].shape[1]].bool()
        mask = batch["response_mask"].bool()
        data = self.cfg.data
        metrics.update(data_metrics(seq_rewards, batch["token_rewards"], batch["advantages"], batch["returns"], mask, batch.get("values")))
        metrics.update(response_metrics(mask, prompt_mask, data.max_response_length, data.max_prompt_length))
        if TRAJECTORY_KEY in batch:
            metrics.update(trajectory_metrics(batch[TRAJECTORY_KEY]))
        num_tokens = core.count_tokens(batch["attention_mask"])
        metrics.update(timing_per_token_metrics(metrics, int(mask.sum()), num_tokens))
        metrics.update(throughput_metrics(num_tokens, metrics["timing_s/step"], self.derived.world_size))
        metrics["training/global_step"] = float(self.global_step)
        metrics["training/epoch"] = float(self.train_loader.epoch)
        if self.viewer is not None and self.global_step % self.cfg.trainer.rollout_log_freq == 0:
            # plain lists and references here; the page is written in the viewer's thread
            self.viewer.submit([capture_rollouts(self.global_step, "train", batch, result.scores, result.overall)])
        return metrics

    def _corrected(self, update_batch: Batch, metrics: dict[str, float]) -> Batch:
        """The actor's update batch with the rollout correction: importance weights and the response
        mask without the rejected tokens (which then leave the loss's normaliser too, as in verl).
        The critic keeps the full mask: its value targets do not depend on the sampler's numerics."""
        weights, keep, corr_metrics = rollout_correction(
            update_batch["old_logprobs"], update_batch["rollout_logprobs"], update_batch["response_mask"].bool(),
            self.correction,
        )
        metrics.update({f"rollout_corr/{k}": v for k, v in corr_metrics.items()})
        actor_batch = update_batch.copy()
        actor_batch["response_mask"] = keep
        if weights is not None:
            actor_batch["rollout_is_weights"] = weights
        return actor_batch

    def _peak_memory(self) -> dict[str, float]:
        """``perf/peak_rss_gb/<process>``: the peak resident memory so far of the driver, of each worker
        group (its largest rank's) and of the reward actor (``easyvlm.utils.memory``). A group busy
        with the next step's generation in the background (``one_step_off``: the rollout group and the
        reward actor) is not waited for: it answers a later step, and its last answer is logged meanwhile."""
        groups = {"hybrid": self.hybrid, "critic": self.critic, "reward_model": self.reward_model,
                  "rollout": self.rollout_group}
        for name, group in groups.items():
            if group is not None and name not in self._peak_asks:
                self._peak_asks[name] = [w.peak_rss.remote() for w in group.workers]
        self._peak_asks.setdefault("reward", [self.reward_actor.peak_rss.remote()])
        for name, refs in list(self._peak_asks.items()):
            busy = name in ("rollout", "reward") and self._background is not None
            ready, _ = ray.wait(refs, num_returns=len(refs), timeout=0 if busy else None)
            if len(ready) == len(refs):
                self._peaks[name] = ray.get(refs)
                del self._peak_asks[name]
        return peak_rss_metrics({"driver": peak_rss_bytes(), **self._peaks})

    # ------------------------------------------------------------------ generation and rewards
    def _generate(self, prompts: Batch, metrics: dict[str, float], step: int) -> tuple[Batch, Any]:
        """The step's rollout batch of ``data.rollout_batch_size`` prompt groups, and its reward: Ray
        refs of the rounds' results, or the result itself when online filtering needed it.

        Generation runs in rounds of ``data.mini_rollout_batch_size`` prompts (default: one round of
        all). Without online filtering every group is kept and rounds repeat until the step has its
        prompts; with it (DAPO's dynamic sampling) only groups whose mean ``filter_key`` lies inside
        (filter_low, filter_high) are kept, for at most ``trainer.max_try_make_batch`` rounds."""
        algo = self.cfg.algorithm
        wanted = self.cfg.data.rollout_batch_size
        kept: list[Batch] = []
        results: list[Any] = []  # RewardResults (filtering) or Ray refs
        n_kept, rounds = 0, 0
        iterator = iter(self._refill(prompts))
        while n_kept < wanted:
            rounds += 1
            limit = self.cfg.trainer.max_try_make_batch
            if algo.online_filtering and limit > 0 and rounds > limit:
                raise OnlineFilterError(
                    f"online filtering kept {n_kept} of {wanted} prompt groups after {limit} generation rounds "
                    f"(trainer.max_try_make_batch): almost every group scores all-right or all-wrong on "
                    f"'{algo.filter_key}'. Widen algorithm.filter_low/filter_high, raise max_try_make_batch "
                    f"(-1 = no limit), or turn algorithm.online_filtering off"
                )
            batch = self.rollout.generate(self._seeded(next(iterator), TRAIN_CALL, step, rounds - 1))
            reward_ref = self.reward_actor.compute.remote(self._reward_inputs(batch, training=True))
            if not algo.online_filtering:  # every group is kept (rounds divide the step: validate)
                kept.append(batch)
                results.append(reward_ref)
                n_kept += len(set(batch["uid"]))
                continue
            result = ray.get(reward_ref)
            if algo.filter_key not in result.scores:
                raise OnlineFilterError(
                    f"algorithm.filter_key={algo.filter_key!r} is not a key the reward returns; keys: {sorted(result.scores)}"
                )
            keep = core.groups_in_range(batch["uid"], result.scores[algo.filter_key], algo.filter_low, algo.filter_high)
            keep = keep[: wanted - n_kept]
            rows = core.rows_of_groups(batch["uid"], keep)
            if rows:
                kept.append(batch.index(rows))
                results.append(_select_result(result, rows))
            n_kept += len(keep)
        if algo.online_filtering or rounds > 1:
            metrics["online_filtering/rounds" if algo.online_filtering else "generation/rounds"] = float(rounds)
        batch = kept[0] if len(kept) == 1 else core.concat_rollouts(kept, self.plan.bundle.tokens.pad)
        if algo.online_filtering:
            return batch, _concat_results(results)
        return batch, results  # refs: collected after the log-prob passes

    def _generate_ahead(self, prompts: Batch, step: int) -> tuple[Batch, Any, dict[str, float]]:
        """``_generate`` for step ``step``, run in the background thread (one_step_off). It talks to
        the rollout group and the reward actor only; the hybrid group is the main thread's."""
        metrics: dict[str, float] = {}
        with timed("gen_async", metrics):
            batch, reward_ref = self._generate(prompts, metrics, step)
        return batch, reward_ref, metrics

    def _may_prefetch(self) -> bool:
        """one_step_off: start the next step's generation now, unless this step is the last or saves
        a checkpoint (whose data-loader state must not include the next step's prompts)."""
        t = self.cfg.trainer
        if self._background is None or self.global_step >= self.total_steps:
            return False
        return not (t.save_freq > 0 and self.global_step % t.save_freq == 0)

    def _sync_rollout(self, metrics: dict[str, float] | None = None) -> None:
        """Send the actor's weights to the separate rollout group if they changed since the last
        time (main thread only: the call is collective on the hybrid ranks)."""
        if self.rollout_group is None or self._rollout_version == self._policy_version:
            return
        start = time.perf_counter()
        refs = self.hybrid.call_all_async("weights_for_sync")  # full weights on rank 0, None elsewhere
        self.rollout_group.call_all("load_weights", refs[0], self._policy_version)
        ray.get(refs[1:])
        self._rollout_version = self._policy_version
        if metrics is not None:
            metrics["timing_s/weight_sync"] = metrics.get("timing_s/weight_sync", 0.0) + time.perf_counter() - start

    def _reward_inputs(self, batch: Batch, training: bool = False) -> list:
        """The reward functions' inputs; with ``worker.reward_model``, its scores first (``training``:
        the step's own samples, which update the running statistics and are logged)."""
        scores = None
        if self.reward_model_scores is not None:
            start = time.perf_counter()
            scores, raw, rm_metrics = self.reward_model_scores.score(batch, training)
            if training:
                self._scorer_metrics.update(rm_metrics)  # several generation rounds: the last round's
                self._scorer_metrics["timing_s/reward_model"] = (
                    self._scorer_metrics.get("timing_s/reward_model", 0.0) + time.perf_counter() - start)
            scores = (scores, raw)
        inputs = build_reward_inputs(batch, self.tokenizer, self.cfg.worker.reward.skip_special_tokens, scores)
        if self.judge is not None:
            verdicts, judge_metrics = self.judge.score(inputs)
            for item, value in zip(inputs, verdicts):
                item.judge_score = value
            if training:
                for key, value in judge_metrics.items():  # several generation rounds: added up
                    self._scorer_metrics[key] = self._scorer_metrics.get(key, 0.0) + value
        return inputs

    def _seeded(self, prompts: Batch, *call: int) -> Batch:
        """``prompts`` seeded for one generation call when worker.rollout.per_request_seed is on."""
        if not self.plan.rollout.per_request_seed:
            return prompts
        return core.seeded_prompts(prompts, self.cfg.worker.rollout.seed, call)

    def _refill(self, first: Batch):
        """The step's prompts, then more prompts from the loader for further filtering rounds."""
        yield first
        while True:
            for prompts in self.train_loader:
                yield prompts

    def _greedy_baseline(self, prompts: Batch, batch: Batch) -> torch.Tensor:
        """ReMax (arXiv:2310.10505): the reward of one greedy response per prompt, per sample."""
        greedy_sampling = dataclasses.replace(self.plan.rollout.sampling, n=1, temperature=0.0)
        self._sync_rollout()
        greedy = self.rollout.generate(prompts, greedy_sampling)
        result = ray.get(self.reward_actor.compute.remote(self._reward_inputs(greedy)))
        by_uid = dict(zip(greedy["uid"], result.overall))
        return torch.tensor([by_uid[uid] for uid in batch["uid"]], dtype=torch.float32)

    # ------------------------------------------------------------------ validation
    def validate(self) -> dict[str, float]:
        if self.val_loader is None:
            return {}
        scores: dict[str, list[float]] = {}
        samples = []
        trajectories: list[dict] = []
        captures: list[RolloutCapture] = []
        sampling: Sampling = self.plan.rollout.val_sampling
        self._sync_rollout()  # the current weights (queued after a one_step_off generation in flight)
        for index, prompts in enumerate(self.val_loader):
            rollout = self.plan.rollout
            prompts = core.validation_prompts(prompts, rollout.per_request_seed, self.cfg.worker.rollout.seed, self.global_step, index)
            batch = self.rollout.generate(prompts, sampling)
            trajectories += batch.get(TRAJECTORY_KEY) or []
            inputs = self._reward_inputs(batch)
            result: RewardResult = ray.get(self.reward_actor.compute.remote(inputs))
            for key, values in result.scores.items():
                scores.setdefault(key, []).extend(values)
            samples.extend(zip([i.prompt for i in inputs], [i.response for i in inputs], [i.ground_truth for i in inputs], result.overall))
            if self.viewer is not None:
                captures.append(capture_rollouts(self.global_step, "val", batch, result.scores, result.overall))
        if self.viewer is not None:
            self.viewer.submit(captures)
        metrics = val_metrics(scores)
        metrics.update({f"val/{key}": value for key, value in trajectory_metrics(trajectories).items()})
        count = self.cfg.trainer.val_generations_to_log
        if count > 0 and self.tracker is not None:
            self.tracker.log_generations(self.global_step, [Generation(p, r, str(g), s) for p, r, g, s in samples[:count]])
        return metrics

    # ------------------------------------------------------------------ checkpoints
    def save_checkpoint(self, score: float | None) -> Path:
        path = self.ckpt.partial_dir(self.global_step)
        if self.cfg.trainer.save_model_only:  # the policy in HF format only; no resumable state
            self.hybrid.call_all("export_hf", str(path / HF_EXPORT_DIR))
            return self.ckpt.commit(self.global_step, score, model_only=True)
        self.hybrid.call_all("save_checkpoint", str(path), True)
        if self.critic is not None:
            self.critic.call_all("save_checkpoint", str(path))
        torch.save(  # plain values and tensors only: resume reads it with weights_only=True
            {
                "global_step": self.global_step,
                "dataloader": self.train_loader.state_dict(),
                "kl_ctrl": self.kl_ctrl.state_dict(),
                "rng": rng_state(),
                **({"reward_model_scores": self.reward_model_scores.state_dict()} if self.reward_model_scores else {}),
            },
            path / "trainer_state.pt",
        )
        return self.ckpt.commit(self.global_step, score)

    def _load_checkpoint(self) -> None:
        path = self.resume_from
        if path is None:
            return
        logger.warning("easyvlm: resuming from %s", path)
        state = load_state(path / "trainer_state.pt")
        self.hybrid.call_all("load_checkpoint", str(path))
        if self.critic is not None:
            self.critic.call_all("load_checkpoint", str(path))
        self.global_step = state["global_step"]
        self.train_loader.load_state_dict(state["dataloader"])
        self._policy_version += 1  # the separate rollout group needs the loaded weights
        self.kl_ctrl.load_state_dict(state["kl_ctrl"])
        if self.reward_model_scores is not None and "reward_model_scores" in state:
            self.reward_model_scores.load_state_dict(state["reward_model_scores"])
        set_rng_state(state["rng"])

    def export_hf(self, path: str) -> None:
        self.hybrid.call_all("export_hf", path)

    def shutdown(self) -> None:
        """Stop this run's Ray actors and free their resources. Ray itself stays up, so a process
        can run one trainer after another (the end-to-end tests do)."""
        if self._background is not None:  # a generation in flight fails against the killed actors
            self._background.shutdown(wait=False, cancel_futures=True)
        for group in (self.rollout_group, self.reward_model, self.critic, self.hybrid):
            if group is not None:
                group.shutdown()
        self.rollout_group = self.reward_model = self.critic = self.hybrid = None
        ray.kill(self.reward_actor)
        if self.judge is not None:
            self.judge.close()


def _model_inputs(batch: Batch) -> Batch:
    """What the workers' forward passes read (tensors and vision inputs), without the rest."""
    return batch.select(*[k for k in MODEL_INPUT_KEYS if k in batch], meta=False)


def _curve_row(step: int, metrics: dict[str, float]) -> dict:
    return {"step": step, **{k: v for k, v in metrics.items() if k.startswith(("reward/", "val/"))}}


def _rank0_metrics(per_rank: list[dict[str, float]]) -> dict[str, float]:
    """Workers all-reduce their metrics, so every rank holds the global values: take rank 0's."""
    return dict(per_rank[0])


def _select_result(result: RewardResult, rows: list[int]) -> RewardResult:
    return RewardResult({k: [v[i] for i in rows] for k, v in result.scores.items()}, {}, [])


def _concat_results(results: list[RewardResult]) -> RewardResult:
    """One result of several rounds' (or of one round's kept rows): scores in order, metrics
    recomputed over them (the error count summed)."""
    scores: dict[str, list[float]] = {}
    for r in results:
        for k, v in r.scores.items():
            scores.setdefault(k, []).extend(v)
    metrics = reward_metrics(scores)
    if any("reward/error_count" in r.metrics for r in results):
        metrics["reward/error_count"] = sum(r.metrics.get("reward/error_count", 0.0) for r in results)
    return RewardResult(scores, metrics, [e for r in results for e in r.errors])
