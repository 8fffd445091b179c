"""The single-controller RL loop. One step: generate [online filtering] -> reward (async) -> the
plan's batch stages (``easyvlm.trainer.stages``) -> validation -> checkpoint. The driver holds no
model: every heavy call goes to a worker group through a `Batch`.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import ray
import torch

from easyvlm.agents.loop import TRAJECTORY_KEY, trajectory_metrics
from easyvlm.algorithms import build_kl_controller
from easyvlm.algorithms.entropy import AdaptiveEntropyController
from easyvlm.data.batch import Batch
from easyvlm.data.dataloader import PromptDataLoader
from easyvlm.distributed.worker_group import Resources
from easyvlm.pipeline.scoring import ActorRewards, Scorer
from easyvlm.plan.build import RunPlan
from easyvlm.run.checkpoint import HF_EXPORT_DIR, CheckpointManager
from easyvlm.run.plot import write_learning_curve
from easyvlm.run.tracking import Tracker, data_order_log
from easyvlm.service.rollout_service import RolloutService
from easyvlm.trainer import core
from easyvlm.trainer.metrics import data_metrics, response_metrics, throughput_metrics, timing_per_token_metrics
from easyvlm.trainer.stages import StageContext, StepState, build_stages
from easyvlm.trainer.topology import Workers
from easyvlm.trainer.validation import validate
from easyvlm.utils.safe_state import load_state, rng_state, set_rng_state
from easyvlm.utils.timing import timed
from easyvlm.viewer.records import capture_rollouts
from easyvlm.viewer.writer import RolloutWriter

logger = logging.getLogger("easyvlm")


class Trainer:
    """The driver's loop over a `RunPlan`, driving its `Workers`, `RolloutService` and `Scorer`.
    ``train_loader`` hands out one generation round of prompts per batch; ``resume_from``: a
    checkpoint already checked."""

    def __init__(
        self,
        plan: RunPlan,
        train_loader: PromptDataLoader,
        val_loader: PromptDataLoader | None,
        resources: Resources,
        resume_from: Path | None = None,
        tracker: Tracker | None = None,
    ):
        self.plan, self.spec = plan, plan.driver
        self.train_loader, self.val_loader = train_loader, val_loader
        self.total_steps = self.spec.length.total_steps(len(train_loader.dataset))
        self.resume_from = resume_from
        adv = self.spec.advantage
        self.kl_ctrl = build_kl_controller(adv.kl.kl_type, adv.kl.kl_coef, adv.kl.kl_target, adv.kl.kl_horizon)
        ent = self.spec.entropy_control  # worker.actor.use_adaptive_entropy: the actor's coefficient, per step
        self.entropy_ctrl = (AdaptiveEntropyController(ent.entropy_coeff, ent.entropy_target, ent.entropy_coeff_delta,
                                                       ent.entropy_coeff_min, ent.entropy_coeff_max)
                             if ent is not None else None)
        records = self.spec.records
        self.ckpt = CheckpointManager(records.run_dir, records.save_limit)
        self.global_step = 0
        self._step_uids: list[str] = []  # prompts of the current step, for the data-order log
        self.tracker: Tracker | None = tracker  # opened by the driver before Ray started, else by fit()
        self.viewer: RolloutWriter | None = None  # made by fit() when trainer.rollout_log_freq > 0
        # ranks of a Ulysses group share their samples in the model passes (generation is not split)
        self.actor_sp = plan.actor.forward.settings.ulysses_size
        self.critic_sp = plan.critic.forward.settings.ulysses_size if plan.critic is not None else 1
        # the reward actor starts first (it loads the reward files before anything heavy)
        self.workers = Workers(plan, resources, self.total_steps)
        self.scorer = Scorer(ActorRewards(self.workers.reward_actor), plan.bundle.tokenizer, records.skip_special_tokens,
                             self.workers.reward_model_scores, self.workers.judge)
        # generation and the policy's version, in the plan's placement
        self.service = RolloutService(plan, self.workers.hybrid, self.workers.rollout_group, self.scorer, train_loader,
                                      self.total_steps, getattr(train_loader.dataset, "encoder", None))
        context = StageContext(advantage=self.spec.advantage, workers=self.workers, service=self.service,
                               scorer=self.scorer, actor_sp=self.actor_sp, critic_sp=self.critic_sp,
                               kl_ctrl=self.kl_ctrl, entropy_ctrl=self.entropy_ctrl)
        self.stages = build_stages(self.spec.stages, context)  # what the step does to its batch, in order

    def placement(self) -> list[str]:
        """Where the ranks and the reward actor run, when the run spans nodes (nothing on one node)."""
        return self.workers.placement(self.spec.nnodes)

    # ------------------------------------------------------------------ the loop
    def fit(self) -> dict[str, float]:
        spec, records = self.spec, self.spec.records
        run_dir = Path(records.run_dir)
        self._load_checkpoint()
        if self.tracker is None:
            self.tracker = open_tracker(self.plan, self.total_steps, self.global_step)
        tracker = self.tracker
        order_log = data_order_log(run_dir, self.global_step)
        if records.rollout_log_freq > 0:
            self.viewer = RolloutWriter(run_dir / "rollouts", self.plan.bundle.tokenizer, records.skip_special_tokens,
                                        on_page=tracker.log_rollouts)
        last_metrics: dict[str, float] = {}
        curve_rows: list[dict] = []  # this launch's reward and validation values, for the learning curve
        try:
            if self.global_step == 0 and (spec.val_before_train or spec.val_only):
                last_metrics = self.validate()
                tracker.log(0, last_metrics)
                curve_rows.append(_curve_row(0, last_metrics))
            if spec.val_only:
                return last_metrics
            self.service.begin(self.global_step)  # asynchronous: the producer starts generating
            while True:
                self.global_step += 1
                metrics = self.train_step()
                if order_log is not None:  # the prompts of every generation round of the step
                    order_log.log(self.global_step, {"uids": self._step_uids})
                is_last = self.global_step >= self.total_steps
                self._validate_and_save(metrics, is_last)
                metrics.update(self.workers.peak_memory(self.service.asynchronous))
                tracker.log(self.global_step, metrics)
                curve_rows.append(_curve_row(self.global_step, metrics))
                last_metrics = metrics
                if is_last:
                    break
        finally:
            self._close_records(order_log, curve_rows)
        return last_metrics

    def _validate_and_save(self, metrics: dict[str, float], is_last: bool) -> None:
        """Validation and a checkpoint at their frequencies, and after the last step."""
        spec = self.spec
        if spec.val_freq > 0 and (self.global_step % spec.val_freq == 0 or is_last):
            with timed("validation", metrics):  # EasyR1's name
                metrics.update(self.validate())
        if spec.save_freq > 0 and (self.global_step % spec.save_freq == 0 or is_last):
            with timed("save_checkpoint", metrics):
                self.save_checkpoint(metrics.get("val/reward_score"))

    def _close_records(self, order_log: Any, curve_rows: list[dict]) -> None:
        if self.viewer is not None:  # before the tracker: it hands pages to the trackers
            self.viewer.close()
            self.viewer = None
        self.tracker.close()
        self._write_learning_curve(curve_rows)
        if order_log is not None:
            order_log.close()
        if self.spec.records.ray_timeline:  # before shutdown: killed actors lose the events they have not flushed
            ray.timeline(filename=self.spec.records.ray_timeline)

    def _write_learning_curve(self, rows: list[dict]) -> None:
        """<run dir>/learning_curve.png, from the file logger's whole history when it is on, else
        from this launch's rows. A failed plot is logged, never raised."""
        try:
            history = None if "file" in self.spec.records.loggers else rows
            write_learning_curve(Path(self.spec.records.run_dir), history)
        except Exception as e:  # noqa: BLE001
            logger.warning("easyvlm: could not draw the learning curve: %r", e)

    # ------------------------------------------------------------------ one step
    def train_step(self, prompts: Batch | None = None) -> dict[str, float]:
        """One step: the rollout service's batch (``prompts``: generate these now instead), then
        the plan's batch stages; returns the step's metrics."""
        metrics: dict[str, float] = {}
        with timed("step", metrics):
            samples = self.service.next_batch(self.global_step, metrics, prompts)
            batch = samples.batch
            self._step_uids = list(dict.fromkeys(batch["uid"]))
            batch["group_ids"] = core.group_ids_from_uids(batch["uid"])
            state = StepState(self.global_step, samples.prompts, batch, samples.reward, metrics)
            for _, stage in self.stages:
                stage(state)
            self.service.step_done(metrics)  # the policy's version counts the step
        metrics.update(self._step_metrics(state.batch, state.scores, metrics))
        if self.viewer is not None and self.global_step % self.spec.records.rollout_log_freq == 0:
            # plain lists and references here; the page is written in the viewer's thread
            self.viewer.submit([capture_rollouts(self.global_step, "train", state.batch, state.result.scores,
                                                 state.result.overall)])
        return metrics

    def _step_metrics(self, batch: Batch, seq_rewards: torch.Tensor, metrics: dict[str, float]) -> dict[str, float]:
        """The step's data, length, timing-per-token and throughput metrics (EasyR1's names)."""
        records = self.spec.records
        prompt_mask = batch["attention_mask"][:, : batch["prompts"].shape[1]].bool()
        mask = batch["response_mask"].bool()
        out = data_metrics(seq_rewards, batch["token_rewards"], batch["advantages"], batch["returns"], mask, batch.get("values"))
        out.update(response_metrics(mask, prompt_mask, records.max_response_length, records.max_prompt_length))
        if TRAJECTORY_KEY in batch:
            out.update(trajectory_metrics(batch[TRAJECTORY_KEY]))
        num_tokens = core.count_tokens(batch["attention_mask"])
        out.update(timing_per_token_metrics(metrics, int(mask.sum()), num_tokens))
        out.update(throughput_metrics(num_tokens, metrics["timing_s/step"], self.plan.launch.world_size))
        out["training/global_step"] = float(self.global_step)
        out["training/epoch"] = float(self.train_loader.epoch)
        return out

    # ------------------------------------------------------------------ validation and checkpoints
    def validate(self) -> dict[str, float]:
        return validate(self.global_step, self.val_loader, self.service, self.plan.rollout.val_sampling,
                        self.spec.records.val_generations_to_log, self.viewer, self.tracker)

    def save_checkpoint(self, score: float | None) -> Path:
        path = self.ckpt.partial_dir(self.global_step)
        workers = self.workers
        if self.spec.records.save_model_only:  # the policy in HF format only; no resumable state
            workers.hybrid.call_all("export_hf", str(path / HF_EXPORT_DIR))
            return self.ckpt.commit(self.global_step, score, model_only=True)
        workers.hybrid.call_all("save_checkpoint", str(path), True)
        if workers.critic is not None:
            workers.critic.call_all("save_checkpoint", str(path))
        torch.save(  # plain values and tensors only: resume reads it with weights_only=True
            {
                "global_step": self.global_step,
                "dataloader": self.service.loader_state(),
                **{name: component.state_dict() for name, component in self._stateful().items()},
                "rng": rng_state(),
            },
            path / "trainer_state.pt",
        )
        return self.ckpt.commit(self.global_step, score)

    def _stateful(self) -> dict[str, Any]:
        """The driver's stateful components (state_dict / load_state_dict) that are on, by their
        key in trainer_state.pt."""
        named = {"kl_ctrl": self.kl_ctrl, "entropy_ctrl": self.entropy_ctrl,
                 "reward_model_scores": self.workers.reward_model_scores}
        return {name: component for name, component in named.items() if component is not None}

    def _load_checkpoint(self) -> None:
        path = self.resume_from
        if path is None:
            return
        logger.warning("easyvlm: resuming from %s", path)
        state = load_state(path / "trainer_state.pt")
        workers = self.workers
        workers.hybrid.call_all("load_checkpoint", str(path))
        if workers.critic is not None:
            workers.critic.call_all("load_checkpoint", str(path))
        self.global_step = state["global_step"]
        self.train_loader.load_state_dict(state["dataloader"])
        for name, component in self._stateful().items():
            if name in state:  # a component this run has and the checkpoint's run did not starts fresh
                component.load_state_dict(state[name])
        set_rng_state(state["rng"])

    def export_hf(self, path: str) -> None:
        self.workers.hybrid.call_all("export_hf", path)

    def shutdown(self) -> None:
        """Stop this run's Ray actors; Ray stays up (a process may run one trainer after another)."""
        self.service.close()
        self.workers.shutdown()


def open_tracker(plan: RunPlan, total_steps: int, start_step: int) -> Tracker:
    """The run's trackers (``trainer.logger``), opened: a tracker that cannot start raises here."""
    records = plan.driver.records
    config = {**records.config_record, "batch_stages": list(plan.driver.stages)}  # the recipe's stages, readable
    return Tracker(list(records.loggers), Path(records.run_dir), records.project_name, records.experiment_name,
                   config, total_steps, start_step)


def _curve_row(step: int, metrics: dict[str, float]) -> dict:
    return {"step": step, **{k: v for k, v in metrics.items() if k.startswith(("reward/", "val/"))}}

