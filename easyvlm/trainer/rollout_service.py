"""The rollout service: the one owner of generation and of the policy's version.

The trainer asks it for each step's batch (``next_batch``) and tells it when a step is done
(``step_done``: the weights may have changed); how the samples are made is the service's business.
Three placements behind that interface (docs/rollout.md, "Asynchronous rollout"):

- **colocated** (the hybrid engine, the default): the step's batch is generated on the spot by the
  engines in the actor's processes, which take the weights in memory when their version changed;
- **separate, synchronous** (``worker.rollout.max_staleness: 0``): generated on the spot by the
  rollout group, which is sent the weights over Ray when their version changed;
- **separate, asynchronous** (``max_staleness: k >= 1``; ``one_step_off`` is k = 1): a producer
  thread keeps generating while the trainer updates (``easyvlm.trainer.async_rollout``): whole
  batches in order (`BatchesAhead`), or, with ``partial_rollout``, prompt groups streamed to the
  trainer as they complete, new weights reaching the engines between two decoding steps
  (`GroupStream`).

The version (`PolicyVersions`, easyvlm/rollout/versions.py, its one holder): the number of
training steps done (a loaded checkpoint's step). A sample's staleness is the version it is trained
at minus the version of the weights that sampled its oldest token; the asynchronous producers never
let it exceed k (`StalenessBound`, easyvlm/rollout/staleness.py), and `next_batch` checks it.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any, Iterator

import ray
import torch
from ray.exceptions import RayActorError

from easyvlm.agents.setup import DriverRollout
from easyvlm.data.batch import Batch
from easyvlm.data.dataloader import PromptDataLoader
from easyvlm.pipeline.scoring import Scorer
from easyvlm.plan.build import RunPlan
from easyvlm.rollout.specs import Sampling
from easyvlm.rollout.staleness import staleness_metrics
from easyvlm.rollout.versions import PolicyVersions
from easyvlm.trainer.async_rollout import BatchesAhead, GroupStream, Producer
from easyvlm.trainer.metrics import timed
from easyvlm.trainer.sampling import GenerationRounds, StepSamples, prompt_batches
from easyvlm.trainer.topology import Workers

logger = logging.getLogger("easyvlm")
# how often a generation call is retried after its engine process died (and was restarted)
ENGINE_RESTARTS = 3


class RolloutService:
    """Generation for the trainer, validation and ReMax's baseline, in the plan's placement."""

    def __init__(self, plan: RunPlan, workers: Workers, scorer: Scorer, loader: PromptDataLoader, total_steps: int,
                 encoder: Any):
        self.spec = spec = plan.driver.rounds
        self.workers, self.scorer, self.loader, self.total_steps = workers, scorer, loader, total_steps
        self.save_freq = plan.driver.save_freq
        self.sampling: Sampling = plan.rollout.sampling
        self.pad_token_id = plan.bundle.tokens.pad
        self.rounds = GenerationRounds(spec, scorer, loader, self.pad_token_id)
        self.rollout = DriverRollout(plan, encoder, self._engine_call)  # one call, or the multi-turn loop
        self.versions = PolicyVersions()
        self.engine_lock = threading.RLock()  # one user of the engines at a time
        self.engine_restarts = 0  # engine processes that died and were restarted, so far
        self.producer: Producer | None = None
        if spec.max_staleness > 0:
            self.producer = (GroupStream if spec.partial_rollout else BatchesAhead)(self)
        self._prompt_iter: Iterator[Batch] | None = None

    @property
    def asynchronous(self) -> bool:
        return self.producer is not None

    @property
    def engines(self) -> Any:
        """The separate rollout group (None: the engines are colocated with the actor)."""
        return self.workers.rollout_group

    # ------------------------------------------------------------------ the trainer's side
    def begin(self, version: int) -> None:
        """Start at ``version`` (the steps a loaded checkpoint had done; 0 on a fresh run): the
        asynchronous producer starts generating step ``version + 1``'s samples."""
        self.versions.start(version)
        if self.producer is not None:
            self.publish_weights({})
            self.producer.start(version + 1)

    def next_batch(self, step: int, metrics: dict[str, float], prompts: Batch | None = None) -> StepSamples:
        """Step ``step``'s samples: generated now (synchronous placements; ``prompts``, else the
        loader's next), or the producer's. Logs the staleness (separate engines) and, streamed,
        the share of samples whose tokens span more than one version."""
        if self.producer is not None and prompts is None:
            samples = self.producer.take(step, metrics)
            if "rollout_version" in samples.batch:  # the bound, checked before the batch is trained
                self.producer.bound.check(self.versions.current, samples.batch["rollout_version"].tolist(), step)
        else:
            prompts = prompts if prompts is not None else self.next_prompts()
            start = time.perf_counter()
            with timed("gen", metrics):
                batch, reward = self.generate_step(prompts, step, self.versions.current, metrics)
            if self.engines is not None:  # the trainer idles while the separate engines work
                metrics["timing_s/wait_rollout"] = time.perf_counter() - start
            samples = StepSamples(prompts, batch, reward)
        metrics.update(staleness_metrics(samples.batch, self.versions.current))
        if self.engines is not None:
            metrics["rollout/engine_restarts"] = float(self.engine_restarts)
        return samples

    def step_done(self, metrics: dict[str, float]) -> None:
        """The step's update is done: the policy's version counts it (critic warm-up steps too, so
        that versions and steps agree), and an asynchronous producer gets the new weights."""
        if self.producer is None or self.versions.current + 1 >= self.total_steps:  # no later batch needs them
            self.versions.advance()
        else:
            self.publish_weights(metrics, self.versions.current + 1)

    def publish_weights(self, metrics: dict[str, float], version: int | None = None) -> None:
        """Asynchronous: gather the actor's weights (a collective on the hybrid ranks: the main
        thread's) into the object store, then make them and their version current together, so
        that the producer never sees a version without its weights."""
        with timed("weight_gather", metrics):
            refs = self.workers.hybrid.call_all_async("weights_for_sync")  # full weights on rank 0, None elsewhere
            ray.get(refs[1:])
        self.versions.publish(self.versions.current if version is None else version, refs[0])

    def loader_state(self) -> dict:
        """The data loader's state for a checkpoint: the prompts of the steps trained so far (the
        asynchronous producer draws no prompt beyond a checkpoint's step until it is saved)."""
        return self.loader.state_dict()

    def draw_limit(self, step: int) -> int:
        """The last step whose prompts may be drawn while step ``step`` runs: the next checkpoint's
        step (its loader state must not include later prompts), else the last step."""
        if self.save_freq <= 0:
            return self.total_steps
        return min(self.total_steps, -(-step // self.save_freq) * self.save_freq)

    # ------------------------------------------------------------------ generation on current weights
    def generate(self, prompts: Batch, sampling: Sampling | None = None) -> Batch:
        """Samples of the current weights (validation, ReMax's greedy baseline), whatever the
        producer is doing: it waits for the engines (a streamed generation goes on afterwards, on
        the weights loaded here)."""
        with self.engine_lock:
            self.versions.generating = self.versions.current
            self._sync_weights(None)
            return self.rollout.generate(prompts, sampling)

    def generate_step(self, prompts: Batch, step: int, version: int, metrics: dict[str, float]) -> tuple[Batch, Any]:
        """Step ``step``'s generation rounds (online filtering, multi-turn included) on ``version``'s
        weights, the separate engines' samples tagged with it (``rollout_version``)."""
        with self.engine_lock:
            self.versions.generating = version
            self._sync_weights(metrics, version)
            batch, reward = self.rounds.generate(prompts, metrics, step, self.rollout.generate)
        if self.engines is not None:
            batch["rollout_version"] = torch.full((len(batch),), version, dtype=torch.long)
        return batch, reward

    def next_prompts(self) -> Batch:
        """The loader's next prompt batch (the data order of the synchronous loop)."""
        if self._prompt_iter is None:
            self._prompt_iter = prompt_batches(self.loader)
        return next(self._prompt_iter)

    def seeded(self, prompts: Batch, *call: int) -> Batch:
        return self.rounds.seeded(prompts, *call)

    # ------------------------------------------------------------------ the engines
    def _engine_call(self, batch: Batch, sampling: Sampling | None) -> Batch:
        """One generation call: the colocated engines (told to load the actor's weights first when
        they hold another version) or the separate ones, whose dead processes are restarted and the
        call retried."""
        if self.engines is None:
            version = self.versions.generating
            out = self.workers.hybrid.dispatch("generate", batch, sampling=sampling,
                                               sync_weights=self.versions.engines_need(version))
            self.versions.engines_hold(version)
            return out
        for attempt in range(ENGINE_RESTARTS + 1):
            try:
                return self.engines.dispatch("generate", batch, sampling=sampling)
            except RayActorError:
                if attempt == ENGINE_RESTARTS:
                    raise
                self.restart_dead_engines()
                self._sync_weights(None, self.versions.generating)
        raise AssertionError("unreachable")

    def restart_dead_engines(self) -> list[int]:
        """Restart the rollout group's ranks whose process died or stopped answering (killed by
        the group's watch); returns their ranks. Their weights are the model files' until the next sync."""
        group = self.engines
        dead = [rank for rank in range(len(group.workers)) if not group.responds(rank)]
        for rank in dead:
            self.note_restart(rank)
            group.restart(rank)
        if dead:
            self.versions.engines_lost()
        return dead

    def note_restart(self, rank: int) -> None:
        self.engine_restarts += 1
        logger.warning("easyvlm: rollout engine rank %d died; restarting it (its unfinished samples are generated "
                       "again)", rank)

    def _sync_weights(self, metrics: dict[str, float] | None, version: int | None = None) -> None:
        """Separate engines: send them ``version``'s weights (default: the current) if they hold
        others (under the engine lock). Synchronous placements gather them now (the main thread's
        call); asynchronous ones send published ones. Colocated engines load the actor's weights
        in their own processes (`_engine_call`)."""
        version = self.versions.current if version is None else version
        if self.engines is None or not self.versions.engines_need(version):
            return
        start = time.perf_counter()
        for attempt in range(ENGINE_RESTARTS + 1):
            try:
                self._send_weights(version)
                break
            except RayActorError:
                if attempt == ENGINE_RESTARTS:
                    raise
                self.restart_dead_engines()
        if metrics is not None:
            metrics["timing_s/weight_sync"] = metrics.get("timing_s/weight_sync", 0.0) + time.perf_counter() - start

    def _send_weights(self, version: int) -> None:
        if self.producer is None:
            refs = self.workers.hybrid.call_all_async("weights_for_sync")
            self.engines.call_all("load_weights", refs[0])
            ray.get(refs[1:])
            self.versions.engines_hold(version)
        else:
            if not self.versions.published(version):  # the last step's weights, for validation (the main thread)
                self.publish_weights({})
            self.producer.send_weights(version)

    def close(self) -> None:
        if self.producer is not None:
            self.producer.stop()

