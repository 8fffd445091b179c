"""The rollout service: the one owner of generation and of the policy's version (`PolicyVersions`: training
steps done), whatever the placement; docs/rollout.md, "Separate placement and asynchronous rollout"."""

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
from easyvlm.distributed.worker_group import WorkerGroup
from easyvlm.pipeline.scoring import Scorer
from easyvlm.plan.build import RunPlan
from easyvlm.rollout.specs import Sampling
from easyvlm.rollout.staleness import staleness_metrics
from easyvlm.rollout.versions import PolicyVersions
from easyvlm.service.producers import BatchesAhead, GroupStream, Producer
from easyvlm.service.rounds import GenerationRounds, StepSamples, prompt_batches
from easyvlm.utils.timing import timed
from easyvlm.workers.hybrid import WEIGHT_SYNC_BYTES
from easyvlm.workers.weight_transfer import BUCKET_BYTES, Rendezvous

logger = logging.getLogger("easyvlm")
# how often a generation call is retried after its engine process died (and was restarted)
ENGINE_RESTARTS = 3
TRANSFER_GROUP_TRIES = 3  # syncs that try to form the weight-transfer group (auto) before the Ray objects serve for good


class RolloutService:
    """Generation for the trainer, validation and ReMax's baseline, in the plan's placement."""

    def __init__(self, plan: RunPlan, actor: WorkerGroup, engines: WorkerGroup | None, scorer: Scorer,
                 loader: PromptDataLoader, total_steps: int, encoder: Any):
        """``actor``: the hybrid group (the actor's ranks, colocated engines); ``engines``: the separate group, or None."""
        self.spec = spec = plan.driver.rounds
        self.actor, self.engines = actor, engines
        self.scorer, self.loader, self.total_steps = scorer, loader, total_steps
        self.save_freq = plan.driver.save_freq
        self.sampling: Sampling = plan.rollout.sampling
        self.pad_token_id = plan.bundle.tokens.pad
        self.rounds = GenerationRounds(spec, scorer, loader, self.pad_token_id)
        self.rollout = DriverRollout(plan, encoder, self._engine_call)  # one call, or the multi-turn loop
        self.versions = PolicyVersions()
        self.engine_lock = threading.RLock()  # one user of the engines at a time
        self.engine_restarts = 0  # engine processes that died and were restarted, so far
        self.producer: Producer | None = None
        # partial rollouts: single-turn groups stream through the engines' interruptible generation;
        # multi-turn batches take the newest weights at each turn (a turn in flight ends on its own)
        self.turn_refresh = spec.placement.partial_rollout and self.rollout.multi_turn is not None
        if spec.placement.staleness > 0:
            streamed = spec.placement.partial_rollout and not self.turn_refresh
            self.producer = (GroupStream if streamed else BatchesAhead)(self)
        self._prompt_iter: Iterator[Batch] | None = None
        self._refreshing = False  # in the producer's multi-turn generation (turn_refresh)
        self._calls = 0  # engine calls of that generation so far
        self._sync_bytes = 0.0  # bytes one engine took since the last step's metrics
        # worker.rollout.weight_transfer: separate synchronous engines take the weights by a collective from the
        # actor's rank 0 (unless object_store), in a group formed at the first sync and again after an engine
        # restart; asynchronous ones, published Ray objects
        self.weight_transfer = spec.placement.weight_transfer
        self.collective = engines is not None and spec.placement.by_collective
        self._transfer: Rendezvous | None = None
        self._group_failures = 0  # syncs whose group did not form (auto: tried again, TRANSFER_GROUP_TRIES in all)
        # LoRA served unmerged by separate engines: the base weights once (again after an engine restart), then
        # the adapters at every sync
        self.serves_adapter = engines is not None and plan.rollout.engine.lora is not None
        self._base_sent = False
        if engines is not None:
            how = ("by a collective broadcast from the actor's rank 0" if self.collective else
                   "as Ray objects (asynchronous: published per version)" if self.producer is not None else
                   "as Ray objects")
            logger.info("easyvlm: separate rollout engines take the weights %s (worker.rollout.weight_transfer=%s)",
                        how, self.weight_transfer)

    @property
    def asynchronous(self) -> bool:
        return self.producer is not None

    # ------------------------------------------------------------------ the trainer's side
    def begin(self, version: int) -> None:
        """Start at ``version`` (a loaded checkpoint's step, else 0); a producer starts on step version + 1."""
        self.versions.start(version)
        if self.producer is not None:
            self.publish_weights({})
            self.producer.start(version + 1)

    def next_batch(self, step: int, metrics: dict[str, float], prompts: Batch | None = None) -> StepSamples:
        """Step ``step``'s samples: generated now (synchronous placements; ``prompts``, else the
        loader's next), or the producer's (checked against the staleness bound)."""
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
        """The step's update is done: the version counts it (warm-up steps too) and a producer gets the weights."""
        if self.producer is None or self.versions.current + 1 >= self.total_steps:  # no later batch needs them
            self.versions.advance()
        else:
            self.publish_weights(metrics, self.versions.current + 1)

    def publish_weights(self, metrics: dict[str, float], version: int | None = None) -> None:
        """Asynchronous: gather the actor's weights (a collective: the main thread's only) and
        publish them with their version together, so the producer never sees one without the other."""
        with timed("weight_gather", metrics):
            refs = self.actor.call_all_async("weights_for_sync")  # full weights on rank 0, None elsewhere
            ray.get(refs[1:])
        self.versions.publish(self.versions.current if version is None else version, refs[0])

    def loader_state(self) -> dict:
        """The data loader's state for a checkpoint: the prompts of the steps trained so far."""
        return self.loader.state_dict()

    def draw_limit(self, step: int) -> int:
        """The last step whose prompts may be drawn while step ``step`` runs: the next checkpoint's
        step (its loader state must not include later prompts), else the last step."""
        if self.save_freq <= 0:
            return self.total_steps
        return min(self.total_steps, -(-step // self.save_freq) * self.save_freq)

    # ------------------------------------------------------------------ generation on current weights
    def generate(self, prompts: Batch, sampling: Sampling | None = None) -> Batch:
        """Samples of the current weights (validation, ReMax's baseline), under the engine lock."""
        with self.engine_lock:
            self.versions.generating = self.versions.current
            self._sync_weights(None)
            return self.rollout.generate(prompts, sampling)

    def generate_step(self, prompts: Batch, step: int, version: int, metrics: dict[str, float]) -> tuple[Batch, Any]:
        """Step ``step``'s generation rounds on ``version``'s weights, separate engines' samples tagged
        ``rollout_version``. Multi-turn partial rollouts: later turns on the newest published weights,
        ``rollout_token_versions`` per model token, ``rollout_version`` the sample's oldest."""
        with self.engine_lock:
            self.versions.generating = version
            self._sync_weights(metrics, version)
            # the step's first call runs on ``version``'s weights; its later turns on the newest published
            self._refreshing = self.turn_refresh and threading.current_thread() is getattr(self.producer, "thread", None)
            self._calls = 0
            try:
                batch, reward = self.rounds.generate(prompts, metrics, step, self.rollout.generate)
            finally:
                self._refreshing = False
            if self._sync_bytes:  # colocated engines: the bytes of this step's weight sync, per engine
                metrics[WEIGHT_SYNC_BYTES], self._sync_bytes = self._sync_bytes, 0.0
        if "rollout_token_versions" in batch:  # multi-turn partial rollouts: the version of each model token
            batch["rollout_version"] = oldest_token_version(batch["rollout_token_versions"], batch["response_mask"], version)
        elif self.engines is not None:
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
        """One generation call: the colocated engines or the separate ones, whose dead processes
        are restarted and the call retried (``ENGINE_RESTARTS`` times)."""
        if self.engines is None:
            version = self.versions.generating
            out = self.actor.dispatch("generate", batch, sampling=sampling,
                                      sync_weights=self.versions.engines_need(version))
            self.versions.engines_hold(version)
            self._sync_bytes += out.meta.pop(WEIGHT_SYNC_BYTES, 0.0)  # what a synced call's engine took
            return out
        if self._refreshing and self._calls > 0:  # a later turn of a multi-turn partial rollout: the newest weights
            self.versions.generating = max(self.versions.generating, self.versions.weights()[0])
            self._sync_weights(None, self.versions.generating)
        self._calls += 1
        for attempt in range(ENGINE_RESTARTS + 1):
            try:
                out = self.engines.dispatch("generate", batch, sampling=sampling)
                if self.turn_refresh:  # the multi-turn loop tags each turn's tokens with it
                    out["rollout_version"] = torch.full((len(out),), self.versions.generating, dtype=torch.long)
                return out
            except RayActorError:
                if attempt == ENGINE_RESTARTS:
                    raise
                self.restart_dead_engines()
                self._sync_weights(None, self.versions.generating)
        raise AssertionError("unreachable")

    def restart_dead_engines(self) -> list[int]:
        """Restart the rollout ranks that died or stopped answering; returns their ranks (on file weights until a sync)."""
        group = self.engines
        dead = [rank for rank in range(len(group.workers)) if not group.responds(rank)]
        for rank in dead:
            self.note_restart(rank)
            group.restart(rank)
        if dead:
            self.versions.engines_lost()
            self._transfer = None  # the group lost a member: formed again, with the new one, at the next sync
            self._base_sent = False  # a new engine holds the file's weights: adapters need their base again
        return dead

    def note_restart(self, rank: int) -> None:
        self.engine_restarts += 1
        logger.warning("easyvlm: rollout engine rank %d died; restarting it (its unfinished samples are generated "
                       "again)", rank)

    def _sync_weights(self, metrics: dict[str, float] | None, version: int | None = None) -> None:
        """Separate engines, under the engine lock: send them ``version``'s weights (default: the
        current) if they hold others. Colocated engines load theirs in `_engine_call`."""
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
        if self.collective and (self._transfer is not None or self._form_transfer_group()):
            self._broadcast_weights()
            self.versions.engines_hold(version)
        elif self.producer is None:
            method, args, load = ("adapter_for_sync", (not self._base_sent,), "load_adapter") if self.serves_adapter \
                else ("weights_for_sync", (), "load_weights")
            refs = self.actor.call_all_async(method, *args)
            self._sync_bytes += float(self.engines.call_all(load, refs[0])[0] or 0)  # bytes per engine
            ray.get(refs[1:])
            self._base_sent = True
            self.versions.engines_hold(version)
        else:
            if not self.versions.published(version):  # the last step's weights, for validation (the main thread)
                self.publish_weights({})
            self.producer.send_weights(version)

    def _form_transfer_group(self) -> bool:
        """Form the weight-transfer group of the actor's rank 0 (the sender, on a free port of its node) and every
        engine; False, with the reason logged, where it cannot form (the Ray-object path then serves the run)."""
        meet = None
        try:
            sender = self.actor.workers[0]
            host, port = ray.get(sender.node_address.remote())
            backend = ray.get(sender.call.remote("transfer_backend"))
            meet = Rendezvous(host, port, 1 + len(self.engines.workers), backend)
            joined = sender.call.remote("join_weight_transfer", meet)
            joins = [(rank, worker.call.remote("join_weight_transfer", meet, rank + 1))
                     for rank, worker in enumerate(self.engines.workers)]
            self._settled([joined], joins)
        except RayActorError:
            raise  # a dead engine: restarted by the caller, and the group formed again
        except Exception as error:  # noqa: BLE001 - the object store still works
            if self.weight_transfer == "collective":
                raise RuntimeError(f"worker.rollout.weight_transfer=collective: the weight-transfer group ({meet}) did "
                                   f"not form ({type(error).__name__}: {error}); set weight_transfer=auto to fall back "
                                   "to Ray objects, or object_store") from error
            self._group_failures += 1
            self.collective = self._group_failures < TRANSFER_GROUP_TRIES  # e.g. a port taken between choice and bind
            logger.warning("easyvlm: the weight-transfer group (%s) did not form (%s: %s, %d of %d tries); the separate "
                           "engines take the weights as Ray objects %s", meet, type(error).__name__, error,
                           self._group_failures, TRANSFER_GROUP_TRIES,
                           "this sync (tried again at the next)" if self.collective else "from now on")
            return False
        self._transfer = meet
        return True

    def _broadcast_weights(self) -> None:
        """The actor's weights to every engine through the transfer group, in buckets (BUCKET_BYTES)."""
        if self.serves_adapter:
            sends = self.actor.call_all_async("send_adapter", BUCKET_BYTES, not self._base_sent)
            receives = list(enumerate(self.engines.call_all_async("receive_adapter", not self._base_sent)))
        else:
            sends = self.actor.call_all_async("send_weights", BUCKET_BYTES)
            receives = list(enumerate(self.engines.call_all_async("receive_weights")))
        try:
            self._sync_bytes += float(self._settled(sends, receives)[0])
            self._base_sent = True
        except Exception:
            self._transfer = None  # broken for all: formed again at the next sync
            raise

    def _settled(self, actor_calls: list, engine_calls: list[tuple[int, Any]]) -> list:
        """The actor's answers once every call of a collective over both groups ended. A member that died
        fails the others at once (gloo); then every call is let end, and a dead engine raises
        ``RayActorError`` (the caller restarts it) rather than its peers' errors."""
        try:
            self.engines.answers(engine_calls)
            return ray.get(actor_calls)
        except Exception:
            refs = actor_calls + [ref for _, ref in engine_calls]
            ray.wait(refs, num_returns=len(refs), timeout=Rendezvous.timeout_s)
            if not all(self.engines.responds(rank) for rank in range(len(self.engines.workers))):
                raise RayActorError() from None
            raise

    def close(self) -> None:
        if self.producer is not None:
            self.producer.stop()


def oldest_token_version(token_versions: torch.Tensor, response_mask: torch.Tensor, default: int) -> torch.Tensor:
    """(B,) int64: per sample, the oldest version among its model tokens (``token_versions`` (B, T),
    -1 off the model's tokens), ``default`` for a sample without one; the staleness bound's version."""
    valid = response_mask.bool() & (token_versions >= 0)
    oldest = torch.where(valid, token_versions, torch.full_like(token_versions, 2**62)).amin(dim=1)
    return torch.where(valid.any(dim=1), oldest, torch.full_like(oldest, default))
