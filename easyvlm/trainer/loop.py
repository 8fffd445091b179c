"""The single-controller RL loop. `Trainer.fit` reads top to bottom as the data flow of one step:

    generate -> reward (async) -> old log-probs -> ref log-probs -> values -> [online filtering]
    -> KL in reward -> advantages -> critic update -> actor update -> validation -> checkpoint

The driver holds no model: every heavy call goes to a worker group through a `Batch`. The math in
between is pure functions (`easyvlm.algorithms`, `easyvlm.trainer.core`).
"""

from __future__ import annotations

import json
import logging
import random
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import ray
import torch

from easyvlm.algorithms import AdvantageInputs, apply_kl_penalty, build_kl_controller, get_advantage, kl_penalty
from easyvlm.config.derived import Derived
from easyvlm.data.batch import Batch
from easyvlm.distributed.worker_group import Resources, WorkerGroup
from easyvlm.rewards.actor import build_reward_inputs, create_reward_actor
from easyvlm.rewards.types import RewardResult
from easyvlm.rollout.base import SEED_KEY, prompt_seeds
from easyvlm.trainer import core
from easyvlm.trainer.checkpoint import (
    HF_EXPORT_DIR,
    CheckpointManager,
    check_resumable,
    latest_checkpoint,
    resolve_checkpoint,
)
from easyvlm.trainer.metrics import reward_metrics, response_metrics, throughput_metrics, timed, val_metrics
from easyvlm.trainer.tracking import Tracker, data_order_log
from easyvlm.workers.actor import update_is_on_policy
from easyvlm.workers.hybrid import CriticHost, HybridWorker

logger = logging.getLogger("easyvlm")

# the kinds of generation calls, part of their sampling seeds (Trainer._seeded)
TRAIN_CALL, VAL_CALL = 0, 1
# keys the actor / critic updates read; everything else stays in the driver
MODEL_INPUT_KEYS = ("input_ids", "attention_mask", "position_ids", "responses", "response_mask", "multi_modal_inputs")


class OnlineFilterError(RuntimeError):
    pass


class Trainer:
    def __init__(self, cfg: Any, derived: Derived, resources: Resources, device: str):
        from transformers import AutoProcessor, AutoTokenizer, AutoConfig

        from easyvlm.data.dataloader import create_dataloaders
        from easyvlm.models.builtin import resolve_model_path

        self.cfg, self.derived = cfg, derived
        model_path = resolve_model_path(cfg.worker.actor.model.model_path)
        tokenizer_path = resolve_model_path(derived.tokenizer_path)
        self.tokenizer = AutoTokenizer.from_pretrained(tokenizer_path)
        try:
            processor = AutoProcessor.from_pretrained(tokenizer_path)
        except (OSError, ValueError):  # a text-only model has no processor
            processor = None
        model_config = AutoConfig.from_pretrained(model_path)
        self.train_loader, self.val_loader = create_dataloaders(cfg.data, self.tokenizer, processor, model_config)
        self.total_steps = derived.total_steps(len(self.train_loader.dataset))

        self.kl_ctrl = build_kl_controller(
            cfg.algorithm.kl_type, cfg.algorithm.kl_coef, cfg.algorithm.kl_target, cfg.algorithm.kl_horizon
        )
        self.advantage_fn = get_advantage(cfg.algorithm.adv_estimator)
        self.ckpt = CheckpointManager(derived.save_checkpoint_path, cfg.trainer.save_limit)
        self.global_step = 0

        # workers: the reward actor first (it validates the reward files before anything heavy)
        self.reward_actor = create_reward_actor(cfg.worker.reward)
        self.hybrid: WorkerGroup | None = None
        self.critic: WorkerGroup | None = None
        # the critic's rank r shares rank r's device (and CPUs) with the hybrid worker
        share = 0.5 if derived.use_critic else 1.0
        try:
            self.hybrid = WorkerGroup(
                "hybrid", resources, partial(HybridWorker, cfg, self.total_steps, derived.use_reference, device), share=share
            )
            if derived.use_critic:
                critic = partial(CriticHost, cfg, self.total_steps)
                self.critic = WorkerGroup("critic", resources, critic, pg=self.hybrid.pg, share=share)
        except BaseException:
            self.shutdown()
            raise

    # ------------------------------------------------------------------ the loop
    def fit(self) -> dict[str, float]:
        cfg = self.cfg.trainer
        self._load_checkpoint()
        tracker = Tracker(
            cfg.logger,
            Path(self.derived.save_checkpoint_path),
            cfg.project_name,
            cfg.experiment_name,
            {"config": str(self.cfg)},
            self.total_steps,
            self.global_step,
        )
        order_log = data_order_log(Path(self.derived.save_checkpoint_path), self.global_step)
        last_metrics: dict[str, float] = {}
        try:
            if self.global_step == 0 and (cfg.val_before_train or cfg.val_only):
                last_metrics = self.validate()
                tracker.log(0, last_metrics)
            if cfg.val_only:
                return last_metrics
            for prompts in self._prompt_batches():
                self.global_step += 1
                if order_log is not None:
                    order_log.log(self.global_step, {"uids": list(prompts["uid"])})
                metrics = self.train_step(prompts)
                is_last = self.global_step >= self.total_steps
                if cfg.val_freq > 0 and (self.global_step % cfg.val_freq == 0 or is_last):
                    with timed("testing", metrics):
                        metrics.update(self.validate())
                if cfg.save_freq > 0 and (self.global_step % cfg.save_freq == 0 or is_last):
                    with timed("save_checkpoint", metrics):
                        self.save_checkpoint(metrics.get("val/reward_score"))
                tracker.log(self.global_step, metrics)
                last_metrics = metrics
                if is_last:
                    break
        finally:
            tracker.close()
            if order_log is not None:
                order_log.close()
        return last_metrics

    def _prompt_batches(self):
        """Prompt batches until total_steps, across epochs (the loader resumes mid-epoch)."""
        while self.global_step < self.total_steps:
            yielded = False
            for prompts in self.train_loader:
                yielded = True
                yield prompts
            if not yielded:
                raise RuntimeError("the training dataloader produced no batch; check data.train_files and rollout_batch_size")

    def train_step(self, prompts: Batch) -> dict[str, float]:
        metrics: dict[str, float] = {}
        algo = self.cfg.algorithm
        with timed("step", metrics):
            # 1. generate (+ rewards; with online filtering, until enough groups carry signal)
            with timed("gen", metrics):
                batch, reward_ref = self._generate(prompts, metrics)
            batch["group_ids"] = core.group_ids_from_uids(batch["uid"])
            if algo.adv_estimator == "remax":
                with timed("gen_baseline", metrics):
                    batch["baseline_rewards"] = self._greedy_baseline(prompts, batch)

            # 2. old log-probs, ref log-probs, values: the reward actor works meanwhile. An on-policy
            # update (one PPO epoch, one mini-batch, no KL in the reward) needs no old log-probs: the
            # actor uses its update's own forward pass, detached (then no timing_s/old is logged)
            model_inputs = batch.select(*[k for k in MODEL_INPUT_KEYS if k in batch], meta=False)
            if not update_is_on_policy(self.derived.actor.optimizer_steps_per_step, self.derived.kl_in_reward):
                with timed("old", metrics):
                    batch = batch.union(self.hybrid.dispatch("compute_logprobs", model_inputs))
            if self.derived.use_reference:
                with timed("ref", metrics):
                    batch = batch.union(self.hybrid.dispatch("compute_ref_logprobs", model_inputs))
            if self.critic is not None:
                with timed("values", metrics):
                    batch = batch.union(self.critic.dispatch("compute_values", model_inputs))
            with timed("reward", metrics):
                result: RewardResult = reward_ref if isinstance(reward_ref, RewardResult) else ray.get(reward_ref)
            metrics.update(result.metrics)
            seq_rewards = torch.tensor(result.overall, dtype=torch.float32)

            # 3. rewards per token, KL in the reward, advantages (pure functions)
            with timed("adv", metrics):
                token_rewards = core.place_seq_rewards(seq_rewards, batch["response_mask"].bool())
                if self.derived.kl_in_reward:
                    kl = kl_penalty(batch["old_logprobs"], batch["ref_logprobs"], algo.kl_penalty)
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
            update_keys = [k for k in (*MODEL_INPUT_KEYS, "old_logprobs", "ref_logprobs", "advantages", "returns", "values") if k in batch]
            update_batch = batch.select(*update_keys, meta=False)
            if self.critic is not None:
                with timed("update_critic", metrics):
                    metrics.update(_rank0_metrics(self.critic.dispatch_collect("update_critic", update_batch)))
            if self.global_step > self.cfg.trainer.critic_warmup:
                with timed("update_actor", metrics):
                    metrics.update(_rank0_metrics(self.hybrid.dispatch_collect("update_actor", update_batch)))

        prompt_mask = batch["attention_mask"][:, : batch["prompts"].shape[1]].bool()
        metrics.update(response_metrics(batch["response_mask"].bool(), prompt_mask, self.cfg.data.max_response_length))
        metrics.update(throughput_metrics(core.count_tokens(batch["attention_mask"]), metrics["timing_s/step"], self.derived.world_size))
        metrics["training/global_step"] = float(self.global_step)
        metrics["training/epoch"] = float(self.train_loader.epoch)
        return metrics

    # ------------------------------------------------------------------ generation and rewards
    def _generate(self, prompts: Batch, metrics: dict[str, float]) -> tuple[Batch, Any]:
        """Rollout batch and its reward (a Ray ref, or the result itself when filtering needed it)."""
        algo = self.cfg.algorithm
        if not algo.online_filtering:
            batch = self.hybrid.dispatch("generate", self._seeded(prompts, TRAIN_CALL, self.global_step, 0))
            inputs = build_reward_inputs(batch, self.tokenizer, self.cfg.worker.reward.skip_special_tokens)
            return batch, self.reward_actor.compute.remote(inputs)

        # DAPO dynamic sampling: keep groups whose mean filter_key is inside (low, high)
        wanted = self.cfg.data.rollout_batch_size
        kept: list[Batch] = []
        kept_results: list[RewardResult] = []
        n_kept, tries = 0, 0
        iterator = iter(self._refill(prompts))
        while n_kept < wanted:
            tries += 1
            limit = self.cfg.trainer.max_try_make_batch
            if limit > 0 and tries > limit:
                raise OnlineFilterError(
                    f"online filtering kept {n_kept} of {wanted} prompt groups after {limit} generation rounds "
                    f"(trainer.max_try_make_batch): almost every group scores all-right or all-wrong on "
                    f"'{algo.filter_key}'. Widen algorithm.filter_low/filter_high, raise max_try_make_batch "
                    f"(-1 = no limit), or turn algorithm.online_filtering off"
                )
            batch = self.hybrid.dispatch("generate", self._seeded(next(iterator), TRAIN_CALL, self.global_step, tries))
            result = ray.get(self.reward_actor.compute.remote(build_reward_inputs(batch, self.tokenizer, self.cfg.worker.reward.skip_special_tokens)))
            if algo.filter_key not in result.scores:
                raise OnlineFilterError(
                    f"algorithm.filter_key={algo.filter_key!r} is not a key the reward returns; keys: {sorted(result.scores)}"
                )
            keep = core.groups_in_range(batch["uid"], result.scores[algo.filter_key], algo.filter_low, algo.filter_high)
            keep = keep[: wanted - n_kept]
            rows = core.rows_of_groups(batch["uid"], keep)
            if rows:
                kept.append(batch.index(rows))
                kept_results.append(_select_result(result, rows))
            n_kept += len(keep)
        metrics["online_filtering/rounds"] = float(tries)
        merged = _concat_results(kept_results)
        return core.concat_rollouts(kept, self.train_loader.dataset.pad_token_id), merged

    def _seeded(self, prompts: Batch, *call: int) -> Batch:
        """``prompts`` with a sampling seed per prompt, derived from worker.rollout.seed and the
        generation call (kind, step, round or batch), when worker.rollout.per_request_seed is on:
        a resumed run then samples exactly what an uninterrupted run did. Off: the engine's stream."""
        rollout = self.cfg.worker.rollout
        if not rollout.per_request_seed:
            return prompts
        prompts = prompts.copy()
        prompts[SEED_KEY] = prompt_seeds(rollout.seed, call, len(prompts))
        return prompts

    def _refill(self, first: Batch):
        """The step's prompts, then more prompts from the loader for further filtering rounds."""
        yield first
        while True:
            for prompts in self.train_loader:
                yield prompts

    def _greedy_baseline(self, prompts: Batch, batch: Batch) -> torch.Tensor:
        """ReMax (arXiv:2310.10505): the reward of one greedy response per prompt, per sample."""
        greedy = self.hybrid.dispatch("generate", prompts, n=1, temperature=0.0)
        result = ray.get(self.reward_actor.compute.remote(build_reward_inputs(greedy, self.tokenizer, self.cfg.worker.reward.skip_special_tokens)))
        by_uid = dict(zip(greedy["uid"], result.overall))
        return torch.tensor([by_uid[uid] for uid in batch["uid"]], dtype=torch.float32)

    # ------------------------------------------------------------------ validation
    def validate(self) -> dict[str, float]:
        if self.val_loader is None:
            return {}
        overrides = dict(self.cfg.worker.rollout.val_override_config)
        scores: dict[str, list[float]] = {}
        samples = []
        for index, prompts in enumerate(self.val_loader):
            batch = self.hybrid.dispatch("generate", self._seeded(prompts, VAL_CALL, self.global_step, index), **overrides)
            inputs = build_reward_inputs(batch, self.tokenizer, self.cfg.worker.reward.skip_special_tokens)
            result: RewardResult = ray.get(self.reward_actor.compute.remote(inputs))
            for key, values in result.scores.items():
                scores.setdefault(key, []).extend(values)
            samples.extend(zip([i.prompt for i in inputs], [i.response for i in inputs], [i.ground_truth for i in inputs], result.overall))
        metrics = val_metrics(scores)
        self._log_generations(samples)
        return metrics

    def _log_generations(self, samples: list) -> None:
        count = self.cfg.trainer.val_generations_to_log
        if count <= 0 or not samples:
            return
        path = Path(self.derived.save_checkpoint_path) / "val_generations.jsonl"
        path.parent.mkdir(parents=True, exist_ok=True)
        with path.open("a") as f:
            for prompt, response, truth, score in samples[:count]:
                f.write(json.dumps({"step": self.global_step, "prompt": prompt, "response": response, "ground_truth": str(truth), "score": score}) + "\n")

    # ------------------------------------------------------------------ checkpoints
    def save_checkpoint(self, score: float | None) -> Path:
        path = self.ckpt.partial_dir(self.global_step)
        if self.cfg.trainer.save_model_only:  # the policy in HF format only; no resumable state
            self.hybrid.call_all("export_hf", str(path / HF_EXPORT_DIR))
            return self.ckpt.commit(self.global_step, score, model_only=True)
        self.hybrid.call_all("save_checkpoint", str(path), True)
        if self.critic is not None:
            self.critic.call_all("save_checkpoint", str(path))
        torch.save(
            {
                "global_step": self.global_step,
                "dataloader": self.train_loader.state_dict(),
                "kl_ctrl": self.kl_ctrl.state_dict(),
                "rng": {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()},
            },
            path / "trainer_state.pt",
        )
        return self.ckpt.commit(self.global_step, score)

    def _load_checkpoint(self) -> None:
        cfg = self.cfg.trainer
        if cfg.load_checkpoint_path:
            path = resolve_checkpoint(cfg.load_checkpoint_path)
        elif cfg.find_last_checkpoint:
            path = latest_checkpoint(Path(self.derived.save_checkpoint_path))
        else:
            path = None
        if path is None:
            return
        check_resumable(path)
        logger.warning("easyvlm: resuming from %s", path)
        state = torch.load(path / "trainer_state.pt", weights_only=False)
        self.hybrid.call_all("load_checkpoint", str(path))
        if self.critic is not None:
            self.critic.call_all("load_checkpoint", str(path))
        self.global_step = state["global_step"]
        self.train_loader.load_state_dict(state["dataloader"])
        self.kl_ctrl.load_state_dict(state["kl_ctrl"])
        random.setstate(state["rng"]["python"])
        np.random.set_state(state["rng"]["numpy"])
        torch.set_rng_state(state["rng"]["torch"])

    def export_hf(self, path: str) -> None:
        self.hybrid.call_all("export_hf", path)

    def shutdown(self) -> None:
        """Stop this run's Ray actors and free their resources. Ray itself stays up, so a process
        can run one trainer after another (the end-to-end tests do)."""
        for group in (self.critic, self.hybrid):
            if group is not None:
                group.shutdown()
        self.critic = self.hybrid = None
        ray.kill(self.reward_actor)


def _rank0_metrics(per_rank: list[dict[str, float]]) -> dict[str, float]:
    """Workers all-reduce their metrics, so every rank holds the global values: take rank 0's."""
    return dict(per_rank[0])


def _select_result(result: RewardResult, rows: list[int]) -> RewardResult:
    return RewardResult({k: [v[i] for i in rows] for k, v in result.scores.items()}, {}, [])


def _concat_results(results: list[RewardResult]) -> RewardResult:
    scores: dict[str, list[float]] = {}
    for r in results:
        for k, v in r.scores.items():
            scores.setdefault(k, []).extend(v)
    return RewardResult(scores, reward_metrics(scores), [])
