"""The run's processes: which worker groups exist for a `RunPlan`, where their ranks run, how much
memory they hold, and stopping them."""

from __future__ import annotations

import dataclasses
from functools import partial
from typing import Any

import ray
from ray.exceptions import RayActorError

from easyvlm.distributed.worker_group import Resources, WorkerGroup, placement_report
from easyvlm.pipeline.model_scorers import start_reward_model
from easyvlm.plan.build import RunPlan
from easyvlm.plan.roles import with_total_steps
from easyvlm.rewards.actor import create_reward_actor
from easyvlm.rewards.judge import Judge
from easyvlm.rewards.model_scores import RewardModelScores
from easyvlm.utils.memory import cuda_peak_metrics, peak_rss_bytes, peak_rss_metrics
from easyvlm.workers.hosts import CriticHost, RolloutHost
from easyvlm.workers.hybrid import HybridWorker


class Workers:
    """The Ray actors and worker groups of one run."""

    def __init__(self, plan: RunPlan, resources: Resources | None, total_steps: int):
        self.reward_actor = create_reward_actor(plan.reward, plan.driver.reward_num_cpus)
        self.hybrid: WorkerGroup | None = None
        self.critic: WorkerGroup | None = None
        self.reward_model: WorkerGroup | None = None
        self.reward_model_scores: RewardModelScores | None = None
        self.judge: Judge | None = None
        self.rollout_group: WorkerGroup | None = None  # worker.rollout.placement=separate
        # perf/peak_rss_gb and (GPU ranks) perf/max_memory_*_gb, by ("rss" | "cuda", process name):
        self._peak_asks: dict[tuple[str, str], list] = {}  # questions not answered yet (a busy group's)
        self._peaks: dict[tuple[str, str], list] = {}  # each process's last answers (a group's by rank)
        self._use_gpu = resources is not None and resources.use_gpu  # CPU ranks hold no GPU memory: not asked
        try:
            self._start(plan, resources, total_steps)
        except BaseException:
            self.shutdown()
            raise

    def _start(self, plan: RunPlan, resources: Resources | None, total_steps: int) -> None:
        # the critic's and the reward model's rank r share rank r's device (and CPUs) with the hybrid worker
        share = 1.0 / (1 + (plan.critic is not None) + (plan.reward_model is not None))
        actor = with_total_steps(plan.actor, total_steps)
        rounds = plan.driver.rounds
        if plan.judge is not None:
            self.judge = Judge(plan.judge)
        engines = None if rounds.placement.separate else plan.rollout  # colocated: each hybrid rank holds an engine
        self.hybrid = WorkerGroup("hybrid", resources, partial(HybridWorker, actor, plan.ref, engines, teacher=plan.teacher), share=share)
        if rounds.placement.separate:  # the engines on their own devices: as many ranks as worker.rollout.num_devices
            rollout_resources = dataclasses.replace(resources, world_size=rounds.placement.num_devices) \
                if resources is not None else None
            self.rollout_group = WorkerGroup("rollout", rollout_resources, partial(RolloutHost, plan.rollout),
                                             watched=True)  # a hung engine is restarted
        if plan.critic is not None:
            critic = partial(CriticHost, with_total_steps(plan.critic, total_steps))
            self.critic = WorkerGroup("critic", resources, critic, pg=self.hybrid.pg, share=share)
        if plan.reward_model is not None:
            self.reward_model, self.reward_model_scores = start_reward_model(plan.reward_model, resources,
                                                                             pg=self.hybrid.pg, share=share)

    def placement(self, nnodes: int) -> list[str]:
        """Where the ranks and the reward actor run, when the run spans nodes (`placement_report`)."""
        groups = {name: group.nodes for name, group in (("hybrid", self.hybrid), ("rollout", self.rollout_group))
                  if group is not None}
        return placement_report(groups, {"reward actor": ray.get(self.reward_actor.node.remote())}, nnodes)

    def peak_memory(self, generating_ahead: bool) -> dict[str, float]:
        """``perf/peak_rss_gb/<process>`` and, on GPUs, ``perf/max_memory_*_gb/<group>``. With
        ``generating_ahead`` the busy rollout group and reward actor log their last answer."""
        groups = {"hybrid": self.hybrid, "critic": self.critic, "reward_model": self.reward_model,
                  "rollout": self.rollout_group}
        asked = {("rss", "reward"): ([self.reward_actor], "peak_rss")}  # (kind, process): (actors, their method)
        for name, group in groups.items():
            if group is not None:
                asked["rss", name] = (group.workers, "peak_rss")
                if self._use_gpu:
                    asked["cuda", name] = (group.workers, "peak_cuda_memory")
        for key, (actors, method) in asked.items():
            if key not in self._peak_asks:
                self._peak_asks[key] = [getattr(actor, method).remote() for actor in actors]
        for key, refs in list(self._peak_asks.items()):
            busy = key[1] in ("rollout", "reward") and generating_ahead
            ready, _ = ray.wait(refs, num_returns=len(refs), timeout=0 if busy else None)
            if len(ready) == len(refs):
                try:
                    self._peaks[key] = ray.get(refs)
                except RayActorError:  # a rollout engine died (and was restarted): ask the new one next step
                    pass
                del self._peak_asks[key]
        rss = {name: peaks for (kind, name), peaks in self._peaks.items() if kind == "rss"}
        cuda = {name: peaks for (kind, name), peaks in self._peaks.items() if kind == "cuda"}
        return {**peak_rss_metrics({"driver": peak_rss_bytes(), **rss}), **cuda_peak_metrics(cuda)}

    def shutdown(self) -> None:
        """Stop this run's Ray actors and free their resources; Ray itself stays up."""
        for group in (self.rollout_group, self.reward_model, self.critic, self.hybrid):
            if group is not None:
                group.shutdown()
        self.rollout_group = self.reward_model = self.critic = self.hybrid = None
        ray.kill(self.reward_actor)
        if self.judge is not None:
            self.judge.close()

