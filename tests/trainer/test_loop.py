"""The driver loop (easyvlm/trainer/loop.py) with its worker groups, reward actor and Ray replaced by
fakes: what `Trainer` does with each of its own settings (``trainer.*``, ``algorithm.*``,
``worker.reward.*`` that the loop reads), checked on values, without a model or a Ray session.

The fakes: the hybrid group "generates" ``n`` responses ``ab<eos>`` per prompt and records every
call; the reward actor scores sample j of prompt i with ``accuracy = ACCURACY[i % 4][j]`` and
``overall = 1 - accuracy / 2``; the loader hands out prompts p0, p1, ... in order. The plan is the
real one (tests/plan_testing.py), so every setting arrives as in a run.
"""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch
from plan_testing import plan_for

from easyvlm.data.batch import Batch
from easyvlm.rewards.types import RewardResult
from easyvlm.pipeline import model_scorers
from easyvlm.pipeline import scoring as pipeline_scoring
from easyvlm.service import producers, rollout_service, rounds
from easyvlm.trainer import loop, topology
from easyvlm.trainer.loop import Trainer
from easyvlm.service.rounds import OnlineFilterError

N = 4  # samples per prompt
# accuracy of sample j of prompt i: ACCURACY[i % 4][j]. Group means: 1, 0.25, 0.75, 0; of
# overall = 1 - accuracy / 2: 0.5, 0.875, 0.625, 1
ACCURACY = [[1.0, 1.0, 1.0, 1.0], [1.0, 0.0, 0.0, 0.0], [1.0, 1.0, 1.0, 0.0], [0.0, 0.0, 0.0, 0.0]]
ROLLOUT_SHIFT = 1.0986122886681098  # ln 3
# a valid GRPO run around the tiny model: 2 prompts x 4 samples per step, 1 rank
LOOP_OVERRIDES = (
    "algorithm.adv_estimator=grpo",
    f"worker.rollout.n={N}",
    "data.rollout_batch_size=2",
    "worker.actor.global_batch_size=2",
    "worker.critic.global_batch_size=2",
    "trainer.max_steps=3",
)


class FakeLoader:
    """``rows`` prompts p0, p1, ... in order, ``size`` per batch (the last partial batch dropped);
    like the real loader, a new iteration continues where the last one stopped."""

    def __init__(self, rows: int, size: int, prefix: str = "p"):
        self.dataset = list(range(rows))
        self.size, self.prefix, self.epoch, self.position = size, prefix, 0, 0

    def __iter__(self):
        while (self.position + 1) * self.size <= len(self.dataset):
            rows = range(self.position * self.size, (self.position + 1) * self.size)
            self.position += 1
            yield Batch(
                {"input_ids": torch.zeros(self.size, 2, dtype=torch.long)},
                {"uid": [f"{self.prefix}{i}" for i in rows], "ground_truth": [str(i) for i in rows]},
            )
        self.epoch, self.position = self.epoch + 1, 0

    def state_dict(self) -> dict:
        return {"epoch": self.epoch}


GiB = 2**30
RANK_PEAKS = (2 * GiB, 3 * GiB)  # the fake ranks' peak resident memory, bytes
REWARD_PEAK = GiB // 4


class FakeRank:
    """A rank's actor handle, as far as the loop uses one directly: ``peak_rss.remote()``."""

    def __init__(self, peak: int):
        self.peak_rss = SimpleNamespace(remote=lambda: peak)


class FakeGroup:
    """A worker group: records every call, answers with fixed tensors."""

    def __init__(self, name, resources, factory, share=1.0, pg=None, watched=False):
        self.name, self.pg, self.calls = name, "pg", []
        self.workers = [FakeRank(peak) for peak in RANK_PEAKS]
        self.loaded: list[int] = []  # a separate rollout group: the weights sent to it (updates they hold)
        self.plan: SimpleNamespace | None = None  # set by make_trainer: tokenizer, eos, n

    def dispatch(self, method: str, batch: Batch, replicas: int = 1, **kwargs):
        self.calls.append((method, batch, kwargs))
        B, T = len(batch), batch["responses"].shape[1] if "responses" in batch else 0
        if method == "generate":
            return self._generate(batch, kwargs.get("sampling"))
        if method == "compute_logprobs":
            return Batch({"old_logprobs": torch.zeros(B, T)})
        if method == "compute_ref_logprobs":
            return Batch({"ref_logprobs": torch.full((B, T), -0.1)})  # k1 KL = 0 - (-0.1) = 0.1 per token
        if method == "compute_values":
            return Batch({"values": torch.zeros(B, T)})
        raise AssertionError(method)

    def _generate(self, prompts: Batch, sampling) -> Batch:
        n = sampling.n if sampling is not None else self.plan.n
        response = self.plan.tokenizer("ab", add_special_tokens=False)["input_ids"] + [self.plan.eos]
        rows = [(i, j) for i in range(len(prompts)) for j in range(n)]  # interleaved: the n samples of a prompt
        B, T, P = len(rows), len(response), 2
        return Batch(
            {
                "prompts": torch.zeros(B, P, dtype=torch.long),
                "input_ids": torch.zeros(B, P + T, dtype=torch.long),
                "attention_mask": torch.ones(B, P + T, dtype=torch.bool),
                "responses": torch.tensor([response] * B),
                "response_mask": torch.ones(B, T, dtype=torch.bool),
                # the sampler's log-probs: 0 (the fake trainer's too) but ln(1/3) on the first token
                # of every prompt's sample 0, so there r = pi_old / pi_rollout = 3
                "rollout_logprobs": torch.tensor([[-ROLLOUT_SHIFT if (j == 0 and t == 0) else 0.0 for t in range(T)]
                                                  for _, j in rows]),
            },
            {
                "uid": [prompts["uid"][i] for i, _ in rows],
                "ground_truth": [prompts["ground_truth"][i] for i, _ in rows],
                "extra": [{"sample": j} for _, j in rows],
            },
        )

    def dispatch_collect(self, method: str, batch: Batch, replicas: int = 1, **kwargs):
        self.calls.append((method, batch, kwargs))
        return [{f"{self.name}/loss": 0.0}]

    def call_all(self, method: str, *args, **kwargs):
        self.calls.append((method, args, kwargs))
        if method == "load_weights":
            self.loaded.append(args[0])
        if method == "weights_for_sync":  # rank 0's weights: the number of updates they hold
            return [self.methods().count("update_actor")]
        return [None]

    def call_all_async(self, method: str, *args, **kwargs):
        return self.call_all(method, *args, **kwargs)

    def methods(self) -> list[str]:
        return [c[0] for c in self.calls]

    def shutdown(self) -> None:
        pass


class FakeRewardActor:
    """``compute.remote(inputs)``: the RewardResult itself (the fake ``ray.get`` returns it)."""

    def __init__(self):
        self.inputs = []
        self.compute = SimpleNamespace(remote=self._compute)
        self.peak_rss = SimpleNamespace(remote=lambda: REWARD_PEAK)

    def _compute(self, inputs):
        self.inputs.append(inputs)
        accuracy = [ACCURACY[int(x.ground_truth) % 4][x.extra["sample"]] for x in inputs]
        return RewardResult({"overall": [1 - a / 2 for a in accuracy], "accuracy": accuracy}, {})


def make_trainer(monkeypatch, tiny_model_path, tmp_path, *overrides, rows=16, val_rows=2):
    """A Trainer on the real plan of LOOP_OVERRIDES + ``overrides`` with the fakes above; returns
    (trainer, fakes) with fakes.hybrid, .critic, .reward, .ray (what the fake Ray module recorded)."""
    plan = plan_for(tiny_model_path, *LOOP_OVERRIDES, f"trainer.save_checkpoint_path={tmp_path}", *overrides)
    fakes = SimpleNamespace(groups={}, reward=FakeRewardActor(), ray=SimpleNamespace(timelines=[], reward_cpus=[]))
    info = SimpleNamespace(tokenizer=plan.bundle.tokenizer, eos=plan.bundle.tokenizer.eos_token_id, n=plan.rollout.sampling.n)

    def group(name, *args, **kwargs):
        made = FakeGroup(name, *args, **kwargs)
        made.plan = info
        fakes.groups[name] = made
        return made

    def reward_actor(settings, num_cpus):
        fakes.ray.reward_cpus.append(num_cpus)
        return fakes.reward

    fake_ray = SimpleNamespace(
        get=lambda ref: ref, kill=lambda actor: None, timeline=lambda filename: fakes.ray.timelines.append(filename),
        wait=lambda refs, num_returns, timeout: (list(refs), []),  # every answer is there at once
    )
    monkeypatch.setattr(topology, "WorkerGroup", group)
    monkeypatch.setattr(model_scorers, "WorkerGroup", group)
    monkeypatch.setattr(topology, "create_reward_actor", reward_actor)
    # every driver module that calls Ray
    for module in (loop, rounds, topology, pipeline_scoring, rollout_service, producers):
        monkeypatch.setattr(module, "ray", fake_ray)
    size = plan.driver.rounds.prompts_per_round
    val = FakeLoader(val_rows, val_rows, prefix="v") if val_rows else None
    trainer = Trainer(plan, FakeLoader(rows, size), val, resources=None)
    fakes.hybrid, fakes.critic = fakes.groups["hybrid"], fakes.groups.get("critic")
    return trainer, fakes


def one_step(trainer: Trainer) -> dict[str, float]:
    """Training step 1 on the loader's next prompts, as ``fit`` runs it."""
    trainer.global_step = 1
    return trainer.train_step(next(iter(trainer.train_loader)))


def generate_calls(group: FakeGroup) -> list[str]:
    """'train' or 'val' per generation call (validation passes the plan's validation sampling)."""
    return ["val" if kw.get("sampling") is not None else "train" for method, _, kw in group.calls if method == "generate"]


def read_jsonl(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


# ------------------------------------------------------------------------------------ the loop's flow
def test_validation_and_checkpoint_schedule(monkeypatch, tiny_model_path, tmp_path):
    # 3 steps, validation before training and every 2 steps (and at the last), checkpoints every 2
    # steps (and at the last), the Ray timeline written at the end
    timeline = tmp_path / "timeline.json"
    trainer, fakes = make_trainer(
        monkeypatch, tiny_model_path, tmp_path, "trainer.val_before_train=true", "trainer.val_freq=2",
        "trainer.save_freq=2", f"trainer.ray_timeline={timeline}", "data.val_files=builtin:synthetic@val",
    )
    trainer.fit()
    # val at 0, step 1, step 2 + val, step 3 + val (the last step)
    assert generate_calls(fakes.hybrid) == ["val", "train", "train", "val", "train", "val"]
    assert sorted(p.name for p in tmp_path.glob("global_step_*")) == ["global_step_2", "global_step_3"]
    assert [r["step"] for r in read_jsonl(tmp_path / "experiment_log.jsonl")] == [0, 1, 2, 3]
    assert fakes.ray.timelines == [str(timeline)]


def test_every_step_logs_each_process_peak_memory(monkeypatch, tiny_model_path, tmp_path):
    from easyvlm.utils.memory import peak_rss_bytes

    trainer, _ = make_trainer(monkeypatch, tiny_model_path, tmp_path, "trainer.val_before_train=false",
                              "algorithm.adv_estimator=gae", "worker.critic.model.model_path=" + tiny_model_path)
    trainer.fit()
    rows = read_jsonl(tmp_path / "experiment_log.jsonl")
    assert [r["step"] for r in rows] == [1, 2, 3]
    for row in rows:
        peaks = {k: v for k, v in row.items() if k.startswith("perf/peak_rss_gb/")}
        # each group logs its largest rank's peak in GiB (ranks at 2 and 3 GiB: 3.0), the reward actor
        # its own (1/4 GiB); the driver is this process: its own peak so far, of at least 0.1 GiB
        driver = peaks.pop("perf/peak_rss_gb/driver")
        assert peaks == {"perf/peak_rss_gb/hybrid": 3.0, "perf/peak_rss_gb/critic": 3.0, "perf/peak_rss_gb/reward": 0.25}
        assert 0.1 < driver <= peak_rss_bytes() / GiB


def test_no_validation_no_checkpoint_no_timeline(monkeypatch, tiny_model_path, tmp_path):
    # the control of the test above: val_before_train=false, val_freq=-1, save_freq=-1, no timeline
    trainer, fakes = make_trainer(monkeypatch, tiny_model_path, tmp_path, "trainer.val_before_train=false")
    trainer.fit()
    assert generate_calls(fakes.hybrid) == ["train"] * 3
    assert not list(tmp_path.glob("global_step_*")) and fakes.ray.timelines == []


def test_val_only_validates_once_and_stops(monkeypatch, tiny_model_path, tmp_path):
    trainer, fakes = make_trainer(monkeypatch, tiny_model_path, tmp_path, "trainer.val_only=true",
                                  "trainer.val_before_train=false", "data.val_files=builtin:synthetic@val")
    metrics = trainer.fit()
    assert generate_calls(fakes.hybrid) == ["val"]
    assert "update_actor" not in fakes.hybrid.methods()
    # v0, v1: accuracy (1 + 0.25) / 2 = 0.625, overall (0.5 + 0.875) / 2 = 0.6875
    assert metrics == {"val/reward_score": pytest.approx(0.6875), "val/accuracy_reward": pytest.approx(0.625)}


def test_val_generations_to_log(monkeypatch, tiny_model_path, tmp_path):
    # 2 validation prompts x 4 samples = 8 samples; the first 3 are logged, in order
    trainer, fakes = make_trainer(monkeypatch, tiny_model_path, tmp_path, "trainer.val_generations_to_log=3",
                                  "trainer.val_only=true", "data.val_files=builtin:synthetic@val")
    trainer.fit()
    logged = read_jsonl(tmp_path / "val_generations.jsonl")
    assert [(r["step"], r["ground_truth"], r["response"], r["score"]) for r in logged] == [(0, "0", "ab", 0.5)] * 3
    # the default, 0: nothing logged
    trainer, _ = make_trainer(monkeypatch, tiny_model_path, tmp_path / "none", "trainer.val_only=true",
                              "data.val_files=builtin:synthetic@val")
    trainer.fit()
    assert not (tmp_path / "none" / "val_generations.jsonl").exists()


def test_save_limit_prunes_the_loops_checkpoints(monkeypatch, tiny_model_path, tmp_path):
    trainer, _ = make_trainer(monkeypatch, tiny_model_path, tmp_path, "trainer.val_before_train=false",
                              "trainer.save_freq=1", "trainer.save_limit=1")
    trainer.fit()
    # steps 1, 2, 3 saved; no validation score, so only the latest survives
    assert [p.name for p in tmp_path.glob("global_step_*")] == ["global_step_3"]


@pytest.mark.parametrize("model_only", [False, True])
def test_save_model_only_exports_the_policy_alone(monkeypatch, tiny_model_path, tmp_path, model_only):
    trainer, fakes = make_trainer(monkeypatch, tiny_model_path, tmp_path, f"trainer.save_model_only={str(model_only).lower()}")
    path = trainer.save_checkpoint(None)
    calls = [(c[0], c[1]) for c in fakes.hybrid.calls]
    if model_only:
        assert calls == [("export_hf", (str(tmp_path / ".global_step_0.partial" / "actor" / "huggingface"),))]
        assert not (path / "trainer_state.pt").exists()
    else:
        assert calls == [("save_checkpoint", (str(tmp_path / ".global_step_0.partial"), True))]
        assert (path / "trainer_state.pt").exists()
    assert json.loads((path / "COMPLETE").read_text())["model_only"] is model_only


def test_critic_warmup_holds_the_actor_back(monkeypatch, tiny_model_path, tmp_path):
    # gae: the critic updates from step 1; with critic_warmup=2 the actor only at step 3
    trainer, fakes = make_trainer(monkeypatch, tiny_model_path, tmp_path, "algorithm.adv_estimator=gae",
                                  "trainer.critic_warmup=2", "trainer.val_before_train=false")
    trainer.fit()
    assert fakes.critic.methods().count("update_critic") == 3
    assert fakes.hybrid.methods().count("update_actor") == 1
    # the actor's single update came after the third generation
    assert fakes.hybrid.methods()[-1] == "update_actor" and generate_calls(fakes.hybrid) == ["train"] * 3
    trainer, fakes = make_trainer(monkeypatch, tiny_model_path, tmp_path / "no_warmup", "algorithm.adv_estimator=gae",
                                  "trainer.val_before_train=false")
    trainer.fit()
    assert fakes.hybrid.methods().count("update_actor") == 3


# ------------------------------------------------------------------------------ rewards and advantages
def test_reward_settings_the_loop_reads(monkeypatch, tiny_model_path, tmp_path):
    trainer, fakes = make_trainer(monkeypatch, tiny_model_path, tmp_path, "worker.reward.num_cpus=3",
                                  "worker.reward.skip_special_tokens=false")
    one_step(trainer)
    assert fakes.ray.reward_cpus == [3]  # the reward actor reserves worker.reward.num_cpus
    assert {x.response for x in fakes.reward.inputs[0]} == {"ab<|im_end|>"}  # EOS kept
    trainer, fakes = make_trainer(monkeypatch, tiny_model_path, tmp_path / "default")
    one_step(trainer)
    assert fakes.ray.reward_cpus == [1] and {x.response for x in fakes.reward.inputs[0]} == {"ab"}


def test_advantage_settings_reach_the_estimator(monkeypatch, tiny_model_path, tmp_path):
    trainer, _ = make_trainer(monkeypatch, tiny_model_path, tmp_path, "algorithm.adv_estimator=reinforce_plus_plus",
                              "algorithm.gamma=0.5", "algorithm.lam=0.7")
    from easyvlm.algorithms import get_advantage

    stage = dict(trainer.stages)["advantages"]
    assert stage.estimate is get_advantage("reinforce_plus_plus")
    seen = []
    estimator = stage.estimate

    def spy(inputs):
        seen.append(inputs)
        return estimator(inputs)

    stage.estimate = spy
    one_step(trainer)
    # norm_by_std is grpo's (its own test below); the check refuses norm_adv_by_std_in_grpo=false here
    assert (seen[0].gamma, seen[0].lam, seen[0].norm_by_std) == (0.5, 0.7, True)


@pytest.mark.parametrize("norm", [False, True])
def test_grpo_advantages_with_and_without_std_normalisation(monkeypatch, tiny_model_path, tmp_path, norm):
    trainer, fakes = make_trainer(monkeypatch, tiny_model_path, tmp_path, f"algorithm.norm_adv_by_std_in_grpo={str(norm).lower()}",
                                  "algorithm.disable_kl=true")
    one_step(trainer)
    update = [b for m, b, _ in fakes.hybrid.calls if m == "update_actor"][0]
    # p0 scores 0.5 x 4: advantage 0. p1 scores 0.5, 1, 1, 1: mean 0.875, r - mean = -0.375, 0.125 x 3;
    # the unbiased std is sqrt((0.375^2 + 3 x 0.125^2) / 3) = 0.25, so with the division: -1.5, 0.5 x 3
    centred = torch.tensor([0.0] * 4 + [-0.375, 0.125, 0.125, 0.125])
    expected = centred / (0.25 + 1e-6) if norm else centred
    # every response token carries its sample's advantage
    torch.testing.assert_close(update["advantages"][:, 0], expected)
    torch.testing.assert_close(update["advantages"][:, -1], expected)


def test_adaptive_kl_controller_follows_the_step_kl(monkeypatch, tiny_model_path, tmp_path):
    trainer, _ = make_trainer(monkeypatch, tiny_model_path, tmp_path, "algorithm.kl_type=adaptive", "algorithm.kl_coef=0.2",
                              "algorithm.kl_target=0.05", "algorithm.kl_horizon=100")
    metrics = one_step(trainer)
    # the fake reference is 0.1 nats below the old log-probs on every token: KL (k1) 0.1, twice the
    # target: error clip(0.1 / 0.05 - 1, -0.2, 0.2) = 0.2; 8 samples: 0.2 x (1 + 0.2 x 8 / 100) = 0.2032
    assert metrics["critic/kl"] == pytest.approx(0.1) and metrics["critic/kl_coef"] == 0.2
    assert trainer.kl_ctrl.value == pytest.approx(0.2032)
    # the default fixed controller keeps algorithm.kl_coef
    trainer, _ = make_trainer(monkeypatch, tiny_model_path, tmp_path / "fixed", "algorithm.kl_coef=0.2")
    one_step(trainer)
    assert trainer.kl_ctrl.value == 0.2


# ------------------------------------------------------------------------------------- online filtering
FILTERING = ("algorithm.online_filtering=true", "data.mini_rollout_batch_size=4", "algorithm.disable_kl=true")


@pytest.mark.parametrize(
    ("overrides", "kept", "rounds"),
    [
        # accuracy means per round of 4 prompts: 1, 0.25, 0.75, 0 -> (0.01, 0.99) keeps p1, p2
        (["algorithm.filter_key=accuracy"], ["p1", "p2"], 1),
        # the default filter_key, overall (means 0.5, 0.875, 0.625, 1): p0, p1 (p2 too, but 2 are enough)
        ([], ["p0", "p1"], 1),
        # filter_low 0.5: only p2 in round 1, then p6 (same pattern) in round 2
        (["algorithm.filter_key=accuracy", "algorithm.filter_low=0.5"], ["p2", "p6"], 2),
        # filter_high 0.5: p1, then p5
        (["algorithm.filter_key=accuracy", "algorithm.filter_high=0.5"], ["p1", "p5"], 2),
    ],
)
def test_online_filtering_keeps_the_groups_in_range(monkeypatch, tiny_model_path, tmp_path, overrides, kept, rounds):
    trainer, _ = make_trainer(monkeypatch, tiny_model_path, tmp_path, *FILTERING, *overrides)
    metrics = one_step(trainer)
    assert trainer._step_uids == kept
    assert metrics["online_filtering/rounds"] == rounds


def test_online_filtering_gives_up_after_max_try_make_batch(monkeypatch, tiny_model_path, tmp_path):
    # filter_low 0.8: no group qualifies (means 1, 0.25, 0.75, 0): 3 rounds, then the error
    trainer, fakes = make_trainer(monkeypatch, tiny_model_path, tmp_path, *FILTERING, "algorithm.filter_key=accuracy",
                                  "algorithm.filter_low=0.8", "trainer.max_try_make_batch=3")
    with pytest.raises(OnlineFilterError, match=r"kept 0 of 2 prompt groups after 3 generation rounds"):
        one_step(trainer)
    assert generate_calls(fakes.hybrid) == ["train"] * 3


def test_without_online_filtering_every_group_is_kept(monkeypatch, tiny_model_path, tmp_path):
    # the control: the same data and filter bounds with online_filtering off keep p0, p1
    trainer, _ = make_trainer(monkeypatch, tiny_model_path, tmp_path, "algorithm.filter_key=accuracy",
                              "algorithm.filter_low=0.8", "algorithm.disable_kl=true")
    one_step(trainer)
    assert trainer._step_uids == ["p0", "p1"]


@pytest.mark.parametrize("per_request_seed", [False, True])
def test_per_request_seed_seeds_each_generation_call(monkeypatch, tiny_model_path, tmp_path, per_request_seed):
    from easyvlm.rollout.base import SEED_KEY, mix_seeds
    from easyvlm.service.rounds import TRAIN_CALL

    trainer, fakes = make_trainer(monkeypatch, tiny_model_path, tmp_path, "worker.rollout.seed=9",
                                  f"worker.rollout.per_request_seed={str(per_request_seed).lower()}")
    one_step(trainer)
    [prompts] = [b for m, b, _ in fakes.hybrid.calls if m == "generate"]
    if per_request_seed:  # prompt i of (train call, step 1, round 0) from worker.rollout.seed 9
        assert prompts[SEED_KEY] == [mix_seeds(9, TRAIN_CALL, 1, 0, i) for i in range(2)]
    else:
        assert SEED_KEY not in prompts


# ------------------------------------------------------------------------------ rollout correction
CORRECTION = "algorithm.rollout_correction"


def actor_update(fakes) -> Batch:
    return [b for m, b, _ in fakes.hybrid.calls if m == "update_actor"][0]


@pytest.mark.parametrize(
    "overrides",
    [
        [f"{CORRECTION}.rollout_is=token"],  # truncated at the default rollout_is_threshold 2
        [f"{CORRECTION}.rollout_is=token", f"{CORRECTION}.rollout_is_threshold=4"],
        [f"{CORRECTION}.rollout_is=token", f"{CORRECTION}.rollout_is_batch_normalize=true"],
        [f"{CORRECTION}.rollout_rs=token_k1", f"{CORRECTION}.rollout_rs_threshold=2.0"],
        [f"{CORRECTION}.bypass_mode=true"],
        [],
    ],
)
def test_rollout_correction_settings_the_loop_applies(monkeypatch, tiny_model_path, tmp_path, overrides):
    # on-policy (disable_kl, 1 epoch, 1 mini-batch): no old log-probs unless the correction needs them
    trainer, fakes = make_trainer(monkeypatch, tiny_model_path, tmp_path, "algorithm.disable_kl=true", *overrides)
    metrics = one_step(trainer)
    update = actor_update(fakes)
    settings = dict(o.removeprefix(f"{CORRECTION}.").split("=") for o in overrides)
    first = torch.zeros(8, 3, dtype=torch.bool)
    first[[0, 4], 0] = True  # sample 0 of both prompts, first token: r = 3; every other token r = 1
    asked_old = "compute_logprobs" in fakes.hybrid.methods()
    if "rollout_is" in settings:
        assert asked_old  # the weights need pi_old even on-policy
        cap = float(settings.get("rollout_is_threshold", 2.0))
        mean = (22 + 2 * min(3.0, cap)) / 24  # 24 tokens: 22 with r = 1, 2 with r = 3 (truncated at cap)
        norm = mean if settings.get("rollout_is_batch_normalize") == "true" else 1.0
        torch.testing.assert_close(update["rollout_is_weights"], torch.where(first, min(3.0, cap), 1.0) / norm)
        assert metrics[f"rollout_corr/rollout_is_mean"] == pytest.approx(mean)
        assert metrics["rollout_corr/rollout_is_ratio_fraction_high"] == pytest.approx(2 / 24 if cap < 3 else 0.0)
        assert update["response_mask"].all()
    elif "rollout_rs" in settings:
        assert asked_old
        # r = 3 is outside [1/2, 2]: those two tokens leave the actor's loss (and its normaliser)
        assert torch.equal(update["response_mask"], ~first) and "rollout_is_weights" not in update
        assert metrics["rollout_corr/rollout_rs_masked_fraction"] == pytest.approx(2 / 24)
        assert metrics["rollout_corr/rollout_rs_seq_masked_fraction"] == pytest.approx(2 / 8)
    elif settings.get("bypass_mode") == "true":
        # the sampler's log-probs are pi_old: no forward pass for them, the PPO ratio is pi / pi_rollout
        assert not asked_old
        torch.testing.assert_close(update["old_logprobs"], torch.where(first, -ROLLOUT_SHIFT, 0.0))
    else:  # nothing set: only the actor's mismatch metrics (not faked here)
        assert not asked_old and "old_logprobs" not in update and "rollout_is_weights" not in update
        assert update["response_mask"].all() and not any(k.startswith("rollout_corr/") for k in metrics)


# ------------------------------------------------------------------------ separate rollout, one step off
@pytest.mark.parametrize("save_freq", [-1, 2])
def test_one_step_off_generates_the_next_batch_with_the_weights_of_the_last_step(monkeypatch, tiny_model_path, tmp_path,
                                                                                  save_freq):
    trainer, fakes = make_trainer(monkeypatch, tiny_model_path, tmp_path, "worker.rollout.placement=separate",
                                  "worker.rollout.one_step_off=true", "algorithm.rollout_correction.rollout_is=token",
                                  "trainer.val_before_train=false", f"trainer.save_freq={save_freq}")
    rollout = fakes.groups["rollout"]
    trainer.fit()
    rows = read_jsonl(tmp_path / "experiment_log.jsonl")
    # the engines sit in their own group: the hybrid ranks never generate
    assert "generate" not in fakes.hybrid.methods() and rollout.methods().count("generate") == 3
    # published before step 1 and after steps 1 and 2 (the last step's weights no batch needs)
    assert fakes.hybrid.methods().count("weights_for_sync") == 3
    if save_freq == -1:
        # step 1 samples with v0 (synced first) and starts step 2's generation with v0 before training;
        # step 2 sends v1 and starts step 3's; step 3 is the last and starts nothing: 2 loads
        assert rollout.loaded == [0, 1]
        assert [r["rollout/staleness_mean"] for r in rows] == [0.0, 1.0, 1.0]
    else:
        # step 2 saves a checkpoint, so it starts no generation (its loader state must not hold step
        # 3's prompts): step 3 syncs v2 and generates on the spot
        assert rollout.loaded == [0, 2]
        assert [r["rollout/staleness_mean"] for r in rows] == [0.0, 1.0, 0.0]
    assert all("timing_s/gen_async" in r for r in rows[1:2])
    # the data order is the synchronous loop's: prompts p0 p1, p2 p3, p4 p5
    steps = [[x.ground_truth for x in inputs] for inputs in fakes.reward.inputs]
    assert [sorted(set(s)) for s in steps] == [["0", "1"], ["2", "3"], ["4", "5"]]


def test_separate_placement_without_one_step_off_syncs_before_each_generation(monkeypatch, tiny_model_path, tmp_path):
    trainer, fakes = make_trainer(monkeypatch, tiny_model_path, tmp_path, "worker.rollout.placement=separate",
                                  "trainer.val_before_train=false")
    trainer.fit()
    rows = read_jsonl(tmp_path / "experiment_log.jsonl")
    assert fakes.groups["rollout"].loaded == [0, 1, 2]  # v0 before step 1, then after each update
    assert [r["rollout/staleness_mean"] for r in rows] == [0.0, 0.0, 0.0]
