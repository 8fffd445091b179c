"""The asynchronous producers (``worker.rollout.max_staleness: k >= 1``): a thread keeps the separate
engines generating while the trainer updates, never handing out a sample whose oldest token is more than
k updates older than the weights it trains on. `BatchesAhead` (default): whole batches, step d's on
version exactly d - 1 - k (k = 1: verl's one-step-off); `GroupStream` (``partial_rollout``): streamed
prompt groups, each token keeping its version. docs/rollout.md, "Separate placement and asynchronous rollout"."""

from __future__ import annotations

import itertools
import threading
from collections import Counter
import time
from dataclasses import dataclass
from typing import Any, Callable, Protocol

import ray
from ray.exceptions import RayActorError

from easyvlm.data.batch import Batch
from easyvlm.pipeline.scoring import Scorer
from easyvlm.plan.specs import RoundsSpec
from easyvlm.rollout.base import TRAIN_CALL
from easyvlm.rollout.versions import PolicyVersions
from easyvlm.service.rounds import StepSamples, concat_results, concat_rollouts, filter_error, kept_groups
from easyvlm.utils.timing import timed

# Decoding steps per stream_advance call: new weights and completed groups are seen this often.
STREAM_STEPS = 4
# How long closing the service waits for the producer's current engine call to return.
STOP_TIMEOUT_S = 60.0


class ServiceView(Protocol):
    """What a producer uses of the rollout service (``easyvlm.service.rollout_service``)."""

    versions: PolicyVersions
    spec: RoundsSpec
    total_steps: int
    scorer: Scorer
    pad_token_id: int
    engine_lock: Any  # held while the engines are used: one user at a time

    @property
    def engines(self) -> Any:
        """The separate rollout group (a WorkerGroup of RolloutHosts)."""

    def draw_limit(self, step: int) -> int: ...

    def next_prompts(self) -> Batch: ...

    def seeded(self, prompts: Batch, *call: int) -> Batch: ...

    def generate_step(self, prompts: Batch, step: int, version: int, metrics: dict[str, float]) -> tuple[Batch, Any]: ...

    def note_restart(self, rank: int) -> None: ...


class Producer:
    """The thread, its error, the trainer's wait and the engines' idle time. The service calls
    ``start``, ``take``, ``send_weights`` and ``stop``, and checks each batch against ``bound``."""

    def __init__(self, service: ServiceView):
        self.service, self.versions = service, service.versions
        self.cond = self.versions.cond  # the versions' lock guards the producer's state too: one wait for both
        # the bound's rules (easyvlm/rollout/staleness.py), which the service checks every batch against
        self.bound = service.spec.placement.staleness_bound(service.spec.prompt_groups)
        self.limit = 0  # the last step whose prompts may be drawn (the next checkpoint's)
        self.error: BaseException | None = None
        self.stopping = False
        self.idle = 0.0  # seconds the engines waited for the trainer since the last take
        self.thread: threading.Thread | None = None

    def start(self, first_step: int) -> None:
        self.limit = self.service.draw_limit(first_step)
        self.floor = self.versions.current  # no batch uses older weights than the run starts with
        self.thread = threading.Thread(target=self._guarded, args=(first_step,), name="easyvlm-rollout", daemon=True)
        self.thread.start()

    def _guarded(self, first_step: int) -> None:
        try:
            self.run(first_step)
        except BaseException as error:  # noqa: BLE001 - handed to the trainer's thread
            with self.cond:
                self.error = error
                self.cond.notify_all()

    def run(self, first_step: int) -> None:
        raise NotImplementedError

    def wait_until(self, ready: Any) -> bool:
        """Under the lock: wait (the engines idle) until ``ready()`` or stop; False on stop."""
        start = time.perf_counter()
        while not self.stopping and not ready():
            self.cond.wait()
        self.idle += time.perf_counter() - start
        return not self.stopping

    def await_batch(self, step: int, ready: Any) -> float:
        """Under the lock: let the producer draw up to the next checkpoint, then wait for
        ``ready()``; returns the seconds waited. Raises the producer's error."""
        limit = self.service.draw_limit(step)
        if limit > self.limit:  # past a checkpoint's pause: the next batch starts from the newest weights
            self.floor = self.versions.current
        self.limit = limit
        self.cond.notify_all()
        start = time.perf_counter()
        while self.error is None and not ready():
            self.cond.wait()
        if self.error is not None:
            raise RuntimeError("the rollout producer failed; its error is above") from self.error
        return time.perf_counter() - start

    def wait_metrics(self, metrics: dict[str, float], wait: float) -> None:
        """``timing_s/gen``: the trainer's wait for the batch (EasyR1's name), also
        ``timing_s/wait_rollout``; ``timing_s/wait_trainer``: the engines' idle time since the last batch."""
        metrics["timing_s/gen"] = metrics["timing_s/wait_rollout"] = wait
        metrics["timing_s/wait_trainer"], self.idle = self.idle, 0.0

    def send_weights(self, version: int | None = None) -> None:
        """Under the engine lock: published weights (``version``'s, else the newest) to every engine."""
        version, ref = self.versions.weights(version)
        self.service.engines.call_all("load_weights", ref)
        self.versions.engines_hold(version)

    def stop(self, timeout: float = STOP_TIMEOUT_S) -> None:
        """Stop drawing and join the thread (left running, it would call the engines of a dead run)."""
        with self.cond:
            self.stopping = True
            self.cond.notify_all()
        if self.thread is not None and self.thread is not threading.current_thread():
            self.thread.join(timeout)


class BatchesAhead(Producer):
    """Whole batches, in step order, up to k steps ahead of the trainer."""

    def __init__(self, service: ServiceView):
        super().__init__(service)
        self.ready: dict[int, tuple[Any, dict[str, float]]] = {}
        self.taken = 0  # the last step whose batch the trainer took

    def start(self, first_step: int) -> None:
        self.taken = first_step - 1
        super().start(first_step)

    def run(self, step: int) -> None:
        service, versions = self.service, self.versions
        while step <= service.total_steps:
            with self.cond:
                # one batch ahead of the trainer's requests, so that the engine's calls (and a
                # validation between them) come in the same order whatever the timing
                if not self.wait_until(lambda: self.bound.batch_may_start(step, versions.current, self.taken, self.limit)):
                    return
                version = self.bound.batch_version(step, self.floor)
                versions.release_before(version)  # no later batch needs them
            prompts = service.next_prompts()
            metrics: dict[str, float] = {}
            with timed("gen_async", metrics):
                batch, reward = service.generate_step(prompts, step, version, metrics)
            with self.cond:
                self.ready[step] = (StepSamples(prompts, batch, reward), metrics)
                self.cond.notify_all()
            step += 1

    def take(self, step: int, metrics: dict[str, float]) -> StepSamples:
        with self.cond:
            wait = self.await_batch(step, lambda: step in self.ready)
            samples, gen_metrics = self.ready.pop(step)
            self.taken = step
            self.cond.notify_all()  # the producer may start the next batch
        metrics.update(gen_metrics)
        self.wait_metrics(metrics, wait)
        return samples


@dataclass
class Group:
    """A prompt group in play: its prompt row (seeded), the version its first tokens were sampled
    with, its engine, and once complete its rollout rows and reward."""

    prompt: Batch
    admitted: int
    host: int
    batch: Batch | None = None
    reward: Any = None


class GroupStream(Producer):
    """Prompt groups streamed through the engines' interruptible generation (partial rollouts)."""

    def __init__(self, service: ServiceView):
        super().__init__(service)
        self.groups: dict[tuple[int, int], Group] = {}  # admitted, not dropped, not yet trained on
        self.completed: list[tuple[int, int]] = []  # of those, the complete ones, in completion order
        self.in_play = 0  # groups admitted, minus those dropped by online filtering
        self.draws = 0
        self.dropped = 0  # by online filtering, since the last batch
        self.submissions: dict[tuple[int, int], tuple[int, int]] = {}  # (tag, row) -> group key
        self.tags = itertools.count()

    @property
    def prompt_groups(self) -> int:
        return self.service.spec.prompt_groups

    def _may_admit(self, version: int) -> bool:
        """Another prompt batch goes into play (``StalenessBound.may_admit``: on demand, within the bound)."""
        generating = sum(1 for g in self.groups.values() if g.batch is None)
        return self.bound.may_admit(version, self.limit, self.in_play, generating, len(self.completed))

    def _in_flight(self) -> bool:
        return any(g.batch is None for g in self.groups.values())

    def run(self, first_step: int) -> None:
        service, versions = self.service, self.versions
        while True:
            with self.cond:
                if not self.wait_until(lambda: self._may_admit(versions.current) or self._in_flight()):
                    return
                version, _ = versions.weights()
                versions.release_before(version)  # only the newest is sent
                admit = self._may_admit(version)
            with service.engine_lock:
                if versions.engines_need(version):
                    self.send_weights()
                if admit:
                    self._admit(version)
                finished = self._advance()
            self._complete(finished)

    def send_weights(self, version: int | None = None) -> None:
        """Under the engine lock: the newest weights to every engine; unfinished samples go on."""
        version, ref = self.versions.weights()
        workers = self.service.engines.workers
        self._on_each(range(len(workers)), lambda host: workers[host].call.remote("stream_set_weights", ref, version))
        self.versions.engines_hold(version)

    def _on_each(self, hosts: Any, call: Callable[[int], Any]) -> list[tuple[int, Any]]:
        """``call(host)`` (a Ray call) on each engine, their answers; an engine that died or stopped answering is
        restarted, given its unfinished groups again (`_recover`), and answers nothing."""
        refs = []
        for host in hosts:
            try:
                refs.append((host, call(host)))
            except RayActorError:
                self._recover(host)
        answers = []
        for host, ref in refs:
            try:
                answers.append((host, self.service.engines.answers([(host, ref)])[0]))  # a hung engine is killed
            except RayActorError:
                self._recover(host)
        return answers

    def _admit(self, version: int) -> None:
        """One prompt batch into play, its groups spread over the engines in contiguous slices."""
        service = self.service
        prompts = service.next_prompts()
        draw = self.draws
        self.draws += 1
        prompts = service.seeded(prompts, TRAIN_CALL, draw + 1, 0)  # as step draw + 1's first round
        hosts = len(service.engines.workers)
        slices = [list(range(len(prompts)))[h::hosts] for h in range(hosts)]
        with self.cond:
            for host, rows in enumerate(slices):
                for r in rows:
                    self.groups[(draw, r)] = Group(prompts.index([r]), version, host)
            self.in_play += len(prompts)
        submissions = {host: self._submission(prompts, rows, [(draw, r) for r in rows])
                       for host, rows in enumerate(slices) if rows}
        workers = service.engines.workers
        self._on_each(submissions, lambda host: workers[host].call.remote("stream_submit", *submissions[host]))

    def _submission(self, prompts: Batch, rows: list[int], keys: list[tuple[int, int]]) -> tuple[Batch, int]:
        tag = next(self.tags)
        for i, key in enumerate(keys):
            self.submissions[(tag, i)] = key
        return prompts.index(rows), tag

    def _advance(self) -> list[tuple[tuple[int, int], Batch]]:
        workers = self.service.engines.workers
        with self.cond:
            busy = sorted({g.host for g in self.groups.values() if g.batch is None})
        answers = self._on_each(busy, lambda host: workers[host].call.remote("stream_advance", STREAM_STEPS))
        return [(self.submissions.pop(sub), batch) for _, done in answers for sub, batch in done]

    def _recover(self, host: int) -> None:
        """Restart engine ``host``, give it the published weights and its unfinished groups (their
        tokens so far are lost with the process: they start again, on the newest weights)."""
        service = self.service
        group = service.engines
        service.note_restart(host)
        group.restart(host)
        version, ref = self.versions.weights()
        with self.cond:
            lost = sorted(key for key, g in self.groups.items() if g.host == host and g.batch is None)
        worker = group.workers[host]
        ray.get(worker.call.remote("stream_set_weights", ref, version))
        gone = set(lost)
        self.submissions = {sub: key for sub, key in self.submissions.items() if key not in gone}
        for draw in sorted({d for d, _ in lost}):
            keys = [key for key in lost if key[0] == draw]
            prompts = Batch.concat([self.groups[key].prompt for key in keys])
            ray.get(worker.call.remote("stream_submit", *self._submission(prompts, list(range(len(keys))), keys)))

    def _complete(self, finished: list[tuple[tuple[int, int], Batch]]) -> None:
        """Score each completed group; with online filtering, drop those outside the range."""
        service = self.service
        filtering = service.spec.filtering
        for key, batch in finished:
            reward = service.scorer.submit(service.scorer.inputs(batch, training=True))
            if filtering.online_filtering:
                reward = ray.get(reward)
                keep = bool(kept_groups(batch, reward, filtering))
            else:
                keep = True
            with self.cond:
                if keep:
                    self.groups[key].batch, self.groups[key].reward = batch, reward
                    self.completed.append(key)
                else:
                    del self.groups[key]
                    self.in_play -= 1
                    self.dropped += 1
                self.cond.notify_all()

    def _choose(self, version: int) -> list[tuple[int, int]] | None:
        """The B complete groups the step at ``version`` trains on, or None (``StalenessBound.choose``)."""
        untrained = Counter(g.admitted for g in self.groups.values())
        return self.bound.choose(version, untrained, [(key, self.groups[key].admitted) for key in self.completed])

    def take(self, step: int, metrics: dict[str, float]) -> StepSamples:
        """Step ``step``'s B groups (`_choose`), in admission order."""
        service, wanted = self.service, self.prompt_groups
        chosen: list[tuple[int, int]] = []

        def ready() -> bool:
            spec = service.spec
            if spec.filtering.online_filtering and spec.max_rounds > 0 and self.dropped > spec.max_rounds * wanted:
                self.error = filter_error(len(self.completed), wanted, f"{self.dropped} groups dropped",
                                          spec.filtering.filter_key)
                return False
            batch = self._choose(self.versions.current)
            chosen[:] = batch or []
            return batch is not None

        with self.cond:
            wait = self.await_batch(step, ready)
            taken = [self.groups.pop(key) for key in sorted(chosen)]
            picked = set(chosen)
            self.completed = [key for key in self.completed if key not in picked]
            self.cond.notify_all()  # the producer may admit the next prompts now
            if service.spec.filtering.online_filtering:
                metrics["online_filtering/dropped_groups"] = float(self.dropped)
            self.dropped = 0
        batch = concat_rollouts([g.batch for g in taken], service.pad_token_id)
        rewards = [g.reward for g in taken]
        reward = concat_results(rewards) if service.spec.filtering.online_filtering else rewards
        self.wait_metrics(metrics, wait)
        return StepSamples(None, batch, reward)
