"""The rollout service (``easyvlm.service.rollout_service``) and its asynchronous producers on the
real plan, with the engines faked in this process: `FakeRolloutEngine`'s generation stream samples
one token per step per request, a token's log-prob is -1 - 0.1 x the version that sampled it, so
where new weights landed can be read off every token. A test "trainer" asks for batches and
publishes weights, slowly or quickly, and checks what the service hands out.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from types import SimpleNamespace

import pytest
import torch
from plan_testing import plan_for
from ray.exceptions import RayActorError
from test_loop import LOOP_OVERRIDES

from easyvlm.data.batch import Batch
from easyvlm.rewards.types import RewardResult
from rollout_testing import FakeRolloutEngine
from easyvlm.service import producers, rollout_service
from easyvlm.service.rollout_service import TRANSFER_GROUP_TRIES, RolloutService
from easyvlm.workers.hosts import RolloutHost

B, N = 2, 4  # prompt groups per step, samples per prompt (LOOP_OVERRIDES)
RESPONSE = [5, 6, 7, 8, 9, 10]  # 6 tokens, no EOS: a sample takes 6 stream steps (4 per advance)


def respond(prompt_ids, j):
    """A long tail: prompts 0, 3, 6, ... answer in 6 tokens, the others in 1, so that young groups
    complete before old ones (the case a staleness bound must hold in)."""
    return RESPONSE if prompt_ids[0] % 3 == 0 else RESPONSE[:1]
ASYNC = ("worker.rollout.placement=separate", "worker.rollout.name=vllm", "algorithm.rollout_correction.rollout_is=token",
         "trainer.val_before_train=false", "data.max_response_length=6")


class PromptLoader:
    """Prompts p0, p1, ... ``size`` per batch, as the real loader continues where it stopped."""

    def __init__(self, rows: int, size: int):
        self.rows, self.size, self.position, self.epoch, self.drawn = rows, size, 0, 0, []

    def __iter__(self):
        while (self.position + 1) * self.size <= self.rows:
            ids = list(range(self.position * self.size, (self.position + 1) * self.size))
            self.position += 1
            self.drawn += [f"p{i}" for i in ids]
            yield Batch(
                {"input_ids": torch.tensor([[i, i] for i in ids]),
                 "attention_mask": torch.ones(self.size, 2, dtype=torch.bool),
                 "position_ids": torch.arange(2).repeat(self.size, 1)},
                {"raw_prompt_ids": [[i, i] for i in ids], "uid": [f"p{i}" for i in ids],
                 "ground_truth": [str(i) for i in ids]},
            )
        self.epoch, self.position = self.epoch + 1, 0

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "position": self.position}


class FakeHost(RolloutHost):
    """The real RolloutHost around a fake engine (the real one builds the plan's engine)."""

    def __init__(self, engine: FakeRolloutEngine):
        self.rollout = engine


class LocalActor:
    """A Ray actor's handle on a RolloutHost in this process: ``call.remote`` runs the method now;
    ``die()`` makes every later call raise as a killed actor's would."""

    def __init__(self, host: RolloutHost):
        self.host, self.dead = host, False
        self.call = SimpleNamespace(remote=self._call)
        self.node = SimpleNamespace(remote=self._node)

    def _call(self, method, *args, **kwargs):
        if self.dead:
            raise RayActorError()
        return getattr(self.host, method)(*args, **kwargs)

    def _node(self):
        if self.dead:
            raise RayActorError()
        return {}


class LocalGroup:
    """The separate rollout group: ``hosts`` fake engines; ``restart`` makes a fresh one."""

    def __init__(self, plan, hosts: int, step_seconds: float):
        self.plan, self.step_seconds, self.restarts = plan, step_seconds, []
        self.workers = [LocalActor(self._host()) for _ in range(hosts)]

    def _host(self) -> RolloutHost:
        engine = FakeRolloutEngine(respond, self.plan.rollout.sampling, len(RESPONSE), 0, [2])
        engine.step_seconds = self.step_seconds
        return FakeHost(engine)

    def dispatch(self, method, batch, replicas=1, **kwargs):
        chunks = batch.chunk(len(self.workers))
        return Batch.concat([w._call(method, chunk, **kwargs) for w, chunk in zip(self.workers, chunks)])

    def call_all(self, method, *args, **kwargs):
        return [w._call(method, *args, **kwargs) for w in self.workers]

    def answers(self, calls):  # the calls ran already: their answers
        return [answer for _, answer in calls]

    def responds(self, rank: int) -> bool:
        return not self.workers[rank].dead

    def restart(self, rank: int) -> None:
        self.restarts.append(rank)
        self.workers[rank] = LocalActor(self._host())


class FakeHybrid:
    """The actor's ranks: ``weights_for_sync`` gives a tensor holding the number of updates so far."""

    def __init__(self):
        self.gathers = 0

    def call_all_async(self, method, *args):
        assert method == "weights_for_sync"
        self.gathers += 1
        return [{"w": torch.tensor(float(self.gathers))}]


class FakeScorer:
    def inputs(self, batch, training=False):
        return list(batch["uid"])

    def submit(self, inputs):
        return RewardResult({"overall": [1.0] * len(inputs), "accuracy": [1.0] * len(inputs)}, {})


def make_service(monkeypatch, tiny_model_path, *overrides, hosts=1, step_seconds=0.0, steps=8, actor=None):
    plan = plan_for(tiny_model_path, *LOOP_OVERRIDES, *ASYNC, f"trainer.max_steps={steps}", *overrides)
    fake_ray = SimpleNamespace(get=lambda refs, timeout=None: refs)
    for module in (rollout_service, producers):
        monkeypatch.setattr(module, "ray", fake_ray)
    loader = PromptLoader(rows=200, size=B)
    service = RolloutService(plan, actor or FakeHybrid(), LocalGroup(plan, hosts, step_seconds), FakeScorer(), loader,
                             steps, encoder=None)
    return service, loader


def train(service: RolloutService, steps: int, seconds_per_step: float = 0.0, during=None) -> list[tuple[Batch, dict]]:
    """The trainer's side of ``steps`` steps: take the batch, 'train' for ``seconds_per_step``, publish.
    Fails after 60 s (a lost group would make the trainer wait forever)."""
    done: list = []
    thread = threading.Thread(target=lambda: done.append(_train(service, steps, seconds_per_step, during)), daemon=True)
    thread.start()
    thread.join(60)
    if thread.is_alive():
        service.close()
        raise AssertionError("the trainer is still waiting for its batch after 60 s")
    assert done, "the trainer failed (its error is printed above)"
    # closed means stopped: a producer thread left running would call the real Ray once this test's
    # fakes are undone (it started a Ray cluster inside pytest, whose loss later ended the process)
    producer = service.producer
    assert producer is None or producer.thread is None or not producer.thread.is_alive(), "close() left the producer running"
    return done[0]


def _train(service: RolloutService, steps: int, seconds_per_step: float, during) -> list[tuple[Batch, dict]]:
    out = []
    service.begin(0)
    try:
        for step in range(1, steps + 1):
            metrics: dict[str, float] = {}
            samples = service.next_batch(step, metrics)
            if during is not None:
                during(step)
            time.sleep(seconds_per_step)
            service.step_done(metrics)
            out.append((samples.batch, metrics))
    finally:
        service.close()
    return out


def check_delivered_once(batches: list[tuple[Batch, dict]], steps: int) -> None:
    """Every step has B groups of N samples; no prompt is trained on twice."""
    uids = [uid for batch, _ in batches for uid in dict.fromkeys(batch["uid"])]
    assert len(uids) == steps * B and len(set(uids)) == len(uids), uids
    for batch, _ in batches:
        assert len(batch) == B * N


@pytest.mark.parametrize("k", [1, 2, 3])
@pytest.mark.parametrize("trainer_seconds,engine_seconds", [(0.05, 0.0), (0.0, 0.01), (0.01, 0.003)])
def test_streamed_samples_never_exceed_the_staleness_bound(monkeypatch, tiny_model_path, k, trainer_seconds,
                                                            engine_seconds):
    service, _ = make_service(monkeypatch, tiny_model_path, f"worker.rollout.max_staleness={k}",
                              "worker.rollout.partial_rollout=true", step_seconds=engine_seconds, steps=12)
    batches = train(service, 12, trainer_seconds)
    check_delivered_once(batches, 12)
    staleness = [m["rollout/staleness_max"] for _, m in batches]
    assert max(staleness) <= k, staleness
    for batch, metrics in batches:  # the metric is the batch's own: version at training - oldest token's
        oldest = batch["rollout_token_versions"].masked_fill(~batch["response_mask"].bool(), 10**6).amin(dim=1)
        assert torch.equal(batch["rollout_version"], oldest)
    if trainer_seconds > engine_seconds * 20:  # a slow trainer: the engines keep about one step ahead, not k
        assert staleness.count(1.0) >= 8, staleness


def test_streamed_tokens_keep_the_version_and_log_prob_that_sampled_them(monkeypatch, tiny_model_path):
    # a slow engine (10 ms a token, 60 ms a long sample) and a quicker trainer (20 ms a step): new
    # weights land while samples are half done
    service, _ = make_service(monkeypatch, tiny_model_path, "worker.rollout.max_staleness=2",
                              "worker.rollout.partial_rollout=true", step_seconds=0.01)
    batches = train(service, 8, 0.02)
    assert any(m["rollout/partial_fraction"] > 0 for _, m in batches), [m["rollout/partial_fraction"] for _, m in batches]
    for batch, metrics in batches:
        versions, mask = batch["rollout_token_versions"], batch["response_mask"].bool()
        assert (versions[mask] >= 0).all() and (versions[~mask] == -1).all()
        # the behaviour log-prob of each token is its own version's: -1 - 0.1 v
        torch.testing.assert_close(batch["rollout_logprobs"][mask], -1.0 - 0.1 * versions[mask].float())
        spans = (versions.masked_fill(~mask, -1).amax(1) > versions.masked_fill(~mask, 10**6).amin(1)).float().mean()
        assert metrics["rollout/partial_fraction"] == pytest.approx(float(spans))


@pytest.mark.parametrize("k", [1, 2])
@pytest.mark.parametrize("trainer_seconds", [0.0, 0.03])
def test_whole_batches_use_the_weights_of_exactly_k_steps_before(monkeypatch, tiny_model_path, k, trainer_seconds):
    # BatchesAhead: step d's batch is sampled with version d - 1 - k (at least 0) whatever the timing,
    # so a seeded run is reproducible: staleness 0, 1, ..., k, k, k
    service, loader = make_service(monkeypatch, tiny_model_path, f"worker.rollout.max_staleness={k}")
    batches = train(service, 6, trainer_seconds)
    check_delivered_once(batches, 6)
    assert [m["rollout/staleness_max"] for _, m in batches] == [min(d, k) for d in range(6)]
    assert [m["rollout/staleness_mean"] for _, m in batches] == [min(d, k) for d in range(6)]
    # in step order: the synchronous loop's data order
    assert [list(dict.fromkeys(b["uid"])) for b, _ in batches] == [[f"p{2 * d}", f"p{2 * d + 1}"] for d in range(6)]


def test_one_step_off_is_max_staleness_one(tiny_model_path):
    shorthand = plan_for(tiny_model_path, *LOOP_OVERRIDES, *ASYNC, "worker.rollout.one_step_off=true")
    explicit = plan_for(tiny_model_path, *LOOP_OVERRIDES, *ASYNC, "worker.rollout.max_staleness=1")
    # the same bound and everything else the driver reads the same: the raw keys differ, nothing they decide
    a, b = shorthand.driver, explicit.driver
    assert a.rounds.placement.staleness == b.rounds.placement.staleness == 1
    assert dataclasses.replace(a.rounds, placement=None) == dataclasses.replace(b.rounds, placement=None)
    assert a.advantage == b.advantage


def test_the_producer_draws_no_prompt_past_a_checkpoint_until_it_is_saved(monkeypatch, tiny_model_path):
    # save_freq 3: after step 3 the loader state must hold exactly steps 1-3's prompts
    service, loader = make_service(monkeypatch, tiny_model_path, "worker.rollout.max_staleness=2",
                                   "worker.rollout.partial_rollout=true", "trainer.save_freq=3")
    states = {}

    def during(step):
        if step == 3:
            time.sleep(0.2)  # give the producer every chance to run ahead
            states[step] = (service.loader_state(), list(loader.drawn))

    train(service, 6, during=during)
    state, drawn = states[3]
    assert state == {"epoch": 0, "position": 3} and drawn == [f"p{i}" for i in range(6)]


@pytest.mark.parametrize("partial", [True, False])
def test_a_dead_engine_is_restarted_and_nothing_is_lost_or_trained_twice(monkeypatch, tiny_model_path, partial):
    service, _ = make_service(monkeypatch, tiny_model_path, "worker.rollout.max_staleness=1", "worker.rollout.num_devices=2",
                              f"worker.rollout.partial_rollout={str(partial).lower()}", hosts=2, step_seconds=0.02)
    group = service.engines
    killed = threading.Event()

    def during(step):
        if step == 3:  # the engines are the slower side (20 ms a token): engine 1 has groups in flight
            group.workers[1].dead = True  # its process is gone: every call raises RayActorError
            killed.set()

    batches = train(service, 6, 0.02, during=during)
    assert killed.is_set() and group.restarts == [1]
    check_delivered_once(batches, 6)
    assert max(m["rollout/staleness_max"] for _, m in batches) <= 1


def test_a_step_takes_old_groups_early_enough_for_later_steps_to_keep_the_bound(monkeypatch, tiny_model_path):
    # k = 2, B = 2, the trainer at version 3, complete groups in completion order: two admitted at
    # version 3, then four at version 2. Groups of version 2 must all be trained by the step at
    # version 4 (2 + k), i.e. this step and the next, which take 2 each: this step must take
    # 4 - 2 = 2 of them. The first completed (the two young ones) would leave 4 due next step.
    from easyvlm.service.producers import Group

    service, _ = make_service(monkeypatch, tiny_model_path, "worker.rollout.max_staleness=2",
                              "worker.rollout.partial_rollout=true")
    stream = service.producer

    def complete(*admitted):
        stream.groups = {(d, 0): Group(None, v, 0, batch="done") for d, v in enumerate(admitted)}
        stream.completed = list(stream.groups)

    complete(3, 3, 2, 2, 2, 2)
    assert stream._choose(3) == [(2, 0), (3, 0)]
    # a group of version 1 cannot wait longer: it goes now; then (3 - 2 - 1 = 0 more of version
    # <= 2 are due) the first completed fills the batch
    complete(1, 2, 2, 3, 3)
    assert stream._choose(3) == [(0, 0), (1, 0)]
    complete(3, 3, 1)
    assert stream._choose(3) == [(2, 0), (0, 0)]
    # ... and while it is still generating, the step waits
    stream.groups[(2, 0)].batch = None
    stream.completed.remove((2, 0))
    assert stream._choose(3) is None


def test_each_tokens_behaviour_log_prob_weights_its_correction(monkeypatch, tiny_model_path):
    # partial samples: tokens of versions v and v + 1 in one response, each with log-prob -1 - 0.1 v.
    # With pi_old = -1 on every token, token TIS weights each token by exp(-1 - (-1 - 0.1 v)) = e^(0.1 v),
    # truncated at rollout_is_threshold 2: its own version's, not the sample's first
    from easyvlm.algorithms.rollout_correction import parse_rollout_correction, rollout_correction

    service, _ = make_service(monkeypatch, tiny_model_path, "worker.rollout.max_staleness=2",
                              "worker.rollout.partial_rollout=true", step_seconds=0.01)
    batches = train(service, 8, 0.02)
    batch = next(b for b, m in batches if m["rollout/partial_fraction"] > 0)
    mask, versions = batch["response_mask"].bool(), batch["rollout_token_versions"]
    corr = parse_rollout_correction(service_plan_correction(tiny_model_path))
    weights, keep, _ = rollout_correction(torch.full(mask.shape, -1.0), batch["rollout_logprobs"], mask, corr)
    torch.testing.assert_close(weights[mask], torch.exp(0.1 * versions[mask].float()).clamp(max=2.0))
    spanning = (versions.masked_fill(~mask, -1).amax(1) > versions.masked_fill(~mask, 10**6).amin(1))
    row = int(spanning.nonzero()[0])  # a sample whose weights differ along its tokens
    assert weights[row][mask[row]].unique().numel() == 2


def service_plan_correction(tiny_model_path):
    return plan_for(tiny_model_path, *LOOP_OVERRIDES, *ASYNC, "worker.rollout.max_staleness=2").driver.advantage.rollout_correction


class GrouplessHybrid(FakeHybrid):
    """The actor's ranks, whose rank 0 counts the attempts to form the weight-transfer group (the
    first thing forming it asks: rank 0's address) and refuses each, as a node without a free port would."""

    def __init__(self):
        super().__init__()
        self.group_attempts = 0
        self.workers = [SimpleNamespace(node_address=SimpleNamespace(remote=self._node_address))]

    def _node_address(self):
        self.group_attempts += 1
        raise ConnectionError("no transfer group in this test")


@pytest.mark.parametrize("weight_transfer,attempts", [("auto", 2), ("object_store", 0)])
def test_weight_transfer_object_store_sends_ray_objects_without_forming_the_group(monkeypatch, tiny_model_path,
                                                                                  weight_transfer, attempts):
    # synchronous separate engines: auto tries the collective at each sync (and falls back to Ray objects
    # for that sync when the group does not form); object_store never tries it. Either way the engine loads the actor's state
    # dict, {"w": a float32 scalar} = 4 bytes, once per step
    service, _ = make_service(monkeypatch, tiny_model_path, f"worker.rollout.weight_transfer={weight_transfer}",
                              actor=GrouplessHybrid())
    assert service.collective == (weight_transfer == "auto")
    batches = train(service, 2)
    engine = service.engines.workers[0].host.rollout
    assert service.actor.group_attempts == attempts
    assert service.actor.gathers == 2 and engine.weight_updates == 2  # versions 0 and 1
    assert [m["perf/weight_sync_bytes"] for _, m in batches] == [4.0, 4.0]
    assert all(m["timing_s/weight_sync"] > 0 for _, m in batches)


def test_auto_tries_the_group_at_three_syncs_then_keeps_the_ray_objects(monkeypatch, tiny_model_path, caplog):
    service, _ = make_service(monkeypatch, tiny_model_path, actor=GrouplessHybrid())
    with caplog.at_level(logging.WARNING, logger="easyvlm"):
        batches = train(service, 5)
    assert service.actor.group_attempts == TRANSFER_GROUP_TRIES == 3  # syncs 1-3 tried, 4 and 5 did not
    assert not service.collective and service.actor.gathers == 5
    assert [m["perf/weight_sync_bytes"] for _, m in batches] == [4.0] * 5  # every sync served by the Ray objects
    tries = [r.getMessage() for r in caplog.records if "did not form" in r.getMessage()]
    assert [t.endswith("(tried again at the next)") for t in tries] == [True, True, False]
    assert "3 of 3 tries" in tries[-1] and tries[-1].endswith("from now on")


def test_weight_transfer_collective_stops_when_the_group_does_not_form(monkeypatch, tiny_model_path):
    service, _ = make_service(monkeypatch, tiny_model_path, "worker.rollout.weight_transfer=collective",
                              actor=GrouplessHybrid())
    service.begin(0)
    with pytest.raises(RuntimeError, match=r"worker\.rollout\.weight_transfer=collective: the weight-transfer group .* "
                       r"did not form \(ConnectionError"):
        service.next_batch(1, {})
    assert service.actor.group_attempts == 1 and service.actor.gathers == 0


class AdapterHybrid(GrouplessHybrid):
    """The actor's ranks serving LoRA adapters unmerged: ``adapter_for_sync`` gives (the base if asked, the
    adapters), each a 4-byte scalar, and records whether the base was asked for."""

    def __init__(self):
        super().__init__()
        self.with_base: list[bool] = []

    def call_all_async(self, method, *args):
        assert method == "adapter_for_sync", method
        self.with_base.append(args[0])
        self.gathers += 1
        base = {"base.w": torch.zeros(())} if args[0] else None
        return [(base, {"lora_A": torch.zeros(())})]


class AdapterHost(FakeHost):
    """An engine that records what each adapter sync loaded: "base+adapter" or "adapter"."""

    def __init__(self, engine):
        super().__init__(engine)
        self.loads: list[str] = []

    def load_adapter(self, payload):
        base, adapter = payload
        self.loads.append("base+adapter" if base is not None else "adapter")
        return 4 * (len(adapter) + len(base or {}))


def test_separate_engines_serving_adapters_get_the_base_once_and_again_after_a_restart(monkeypatch, tiny_model_path):
    # synchronous separate engines, LoRA unmerged, the group never forms (Ray objects): syncs at steps 1-4;
    # engine 1 dies after step 2's batch, so step 3's sync restarts it and must send the base again
    # (bytes: base 4 + adapter 4, then adapter 4)
    monkeypatch.setattr(LocalGroup, "_host", lambda self: AdapterHost(
        FakeRolloutEngine(respond, self.plan.rollout.sampling, len(RESPONSE), 0, [2])))
    service, _ = make_service(monkeypatch, tiny_model_path, "worker.rollout.num_devices=2", "worker.rollout.name=hf",
                              "worker.actor.model.lora.rank=8", "worker.actor.model.lora.merge_for_rollout=false",
                              hosts=2, actor=AdapterHybrid())
    assert service.serves_adapter
    group = service.engines

    def during(step):
        if step == 2:
            group.workers[1].dead = True

    batches = train(service, 4, during=during)
    assert group.restarts == [1]
    # step 3's sync first sends the adapters alone (the death is not known yet), engine 1 raises, it is
    # restarted and the sync sent again with the base
    assert service.actor.with_base == [True, False, False, True, False]
    assert group.workers[0].host.loads == ["base+adapter", "adapter", "adapter", "base+adapter", "adapter"]
    assert group.workers[1].host.loads == ["base+adapter", "adapter"]  # the restarted engine: base first
    assert [m["perf/weight_sync_bytes"] for _, m in batches] == [8.0, 4.0, 8.0, 4.0]  # one engine's bytes
