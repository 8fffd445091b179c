"""Skipping old log-probs on an on-policy update: the actor's update without ``old_logprobs`` (it
takes its own forward pass, detached) must equal the update with explicitly computed ones, and the
trainer may skip them only when the update is provably on-policy."""

from __future__ import annotations

import pytest
import torch
from workers_testing import PROMPTS, RESPONSE_LENGTHS, actor_spec, make_rl_batch

from easyvlm.config.derived import derive
from easyvlm.config.loader import load_config
from easyvlm.workers.actor import ActorWorker, update_is_on_policy

TEMPERATURE = 0.7


@pytest.fixture(scope="module")
def batch(tiny_model_path):
    data = make_rl_batch(tiny_model_path, PROMPTS[:4], RESPONSE_LENGTHS[:4])
    gen = torch.Generator().manual_seed(0)
    data["advantages"] = torch.where(data["response_mask"], torch.randn(data["responses"].shape, generator=gen), 0.0)
    return data


def make_actor(model_path: str, **overrides) -> ActorWorker:
    # one mini-batch of all 4 samples (rollout_n 1), accumulated over 2 micro-batches of 2;
    # max_grad_norm 0.5 < the gradient norm, so clipping (which sees the gradient's scale) is active
    config = dict(global_batch_size=4, micro_batch_size_per_device_for_update=2, max_grad_norm=0.5, lr=1e-2)
    config.update(overrides)
    return ActorWorker(actor_spec(model_path, temperature=TEMPERATURE, **config), rank=0, world_size=1)


def weights(worker: ActorWorker) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in worker.state_dict_for_sync().items()}


def test_update_without_old_logprobs_equals_update_with_them(process_group, tiny_model_path, batch):
    explicit = make_actor(tiny_model_path)
    data = batch.copy()
    data["old_logprobs"] = explicit.compute_logprobs(batch)["old_logprobs"]  # exactly on-policy, no noise
    before = weights(explicit)
    explicit_metrics = explicit.update_policy(data)
    expected = weights(explicit)

    skipped = make_actor(tiny_model_path)  # same seed and model: the same starting weights
    skipped_metrics = skipped.update_policy(batch.copy())  # no old_logprobs
    after = weights(skipped)

    assert after.keys() == expected.keys()
    for name in expected:
        torch.testing.assert_close(after[name], expected[name], msg=name)
    assert any(not torch.equal(before[k], expected[k]) for k in before)  # the update did move the weights
    # the weights alone cannot see a wrongly scaled gradient (AdamW's first step is ~ lr * sign(g));
    # the pre-clip norm and the loss can. On-policy: every ratio is 1, so nothing is clipped and the
    # loss is -mean(advantages) over the response tokens
    assert explicit_metrics["actor/grad_norm"] > 0.5
    for key in ("actor/grad_norm", "actor/pg_loss", "actor/ppo_kl", "actor/pg_clipfrac_higher", "actor/pg_clipfrac_lower"):
        assert skipped_metrics[key] == pytest.approx(explicit_metrics[key], rel=1e-5, abs=1e-7), key
    mask = batch["response_mask"]
    assert skipped_metrics["actor/pg_loss"] == pytest.approx(-batch["advantages"][mask].mean().item(), rel=1e-5)
    assert skipped_metrics["actor/pg_clipfrac_higher"] == 0 and skipped_metrics["actor/pg_clipfrac_lower"] == 0


@pytest.mark.parametrize("overrides", [dict(ppo_epochs=2), dict(global_batch_size=2)])
def test_off_policy_update_requires_old_logprobs(process_group, tiny_model_path, batch, overrides):
    actor = make_actor(tiny_model_path, **overrides)
    with pytest.raises(AssertionError, match="without old_logprobs is only valid for an on-policy update"):
        actor.update_policy(batch.copy())


BASE = [
    "data.train_files=builtin:synthetic@train",
    "data.val_files=builtin:synthetic@val",
    "worker.actor.model.model_path=builtin:tiny-qwen2.5-vl",
    "worker.reward.reward_function=r.py:f",
    "data.rollout_batch_size=16",
    "worker.rollout.n=8",
    "worker.actor.global_batch_size=16",
    "worker.actor.micro_batch_size_per_device_for_update=8",
    "worker.actor.ppo_epochs=1",
    "algorithm.disable_kl=false",
    "algorithm.use_kl_loss=true",
]


@pytest.mark.parametrize(
    "overrides, on_policy",
    [
        ([], True),  # the demo's settings: 1 epoch, 1 mini-batch, KL as a loss term
        (["algorithm.disable_kl=true", "algorithm.use_kl_loss=false"], True),  # no KL at all
        (["worker.actor.ppo_epochs=2"], False),  # the second epoch's ratios need the old log-probs
        (["worker.actor.global_batch_size=8"], False),  # the second mini-batch runs on updated weights
        (["algorithm.use_kl_loss=false"], False),  # the KL in the reward reads old_logprobs
    ],
)
def test_on_policy_predicate(overrides, on_policy):
    # the rule itself; tests/trainer/test_e2e.py checks that the trainer's steps follow it (timing_s/old)
    derived = derive(load_config([*BASE, *overrides]))
    assert update_is_on_policy(derived.actor.optimizer_steps_per_step, derived.kl_in_reward) is on_policy


def test_the_update_reports_the_samplers_mismatch(process_group, tiny_model_path, batch):
    """An injected perturbation between sampler and trainer: the sampler's log-probs are the actor's
    own minus ln 3 on one token per sample and plus ln 2 on another (hand-derived metrics below);
    the on-policy update (no old_logprobs) measures them against its own forward pass."""
    import math

    actor = make_actor(tiny_model_path)
    exact = actor.compute_logprobs(batch)["old_logprobs"]
    mask = batch["response_mask"]
    shift = torch.zeros_like(exact)
    shift[:, 0] = math.log(3)  # every sample's first token: r = 3 (outside [1/2, 2])
    shift[:, 1] = -math.log(2)  # its second token (every response here has >= 2): r = 1/2
    data = batch.copy()
    data["rollout_logprobs"] = torch.where(mask, exact - shift, 0.0)
    metrics = actor.update_policy(data)
    n = int(mask.sum())  # the other tokens have r = 1
    samples = mask.shape[0]
    assert metrics["actor/rollout_mismatch/k1"] == pytest.approx(samples * (-math.log(3) + math.log(2)) / n, abs=1e-5)
    assert metrics["actor/rollout_mismatch/k3"] == pytest.approx(samples * ((2 - math.log(3)) + (math.log(2) - 0.5)) / n,
                                                                 abs=1e-5)
    assert metrics["actor/rollout_mismatch/ratio_mean"] == pytest.approx((samples * (3 + 0.5) + n - 2 * samples) / n, abs=1e-5)
    assert metrics["actor/rollout_mismatch/ratio_outside"] == pytest.approx(samples / n, abs=1e-6)


@pytest.mark.parametrize("setting", ["tis", "rejection"])
def test_the_correction_acts_through_the_update(process_group, tiny_model_path, batch, setting):
    """The driver's rollout correction on an injected perturbation, then the real update: on-policy
    every PPO ratio is 1, so the pg loss is -sum(A w) / N over the kept tokens, by hand."""
    import math

    from easyvlm.algorithms.rollout_correction import RolloutCorrectionConfig, parse_rollout_correction, rollout_correction

    actor = make_actor(tiny_model_path)
    exact = actor.compute_logprobs(batch)["old_logprobs"]
    mask = batch["response_mask"]
    shift = torch.zeros_like(exact)
    shift[:, 0] = math.log(3)  # first token of every sample: r = pi_old / pi_rollout = 3
    data = batch.copy()
    data["old_logprobs"] = exact
    data["rollout_logprobs"] = torch.where(mask, exact - shift, 0.0)
    if setting == "tis":  # token TIS at 2: the first tokens weigh 2, the others 1
        corr = parse_rollout_correction(RolloutCorrectionConfig(rollout_is="token"))
        expected_w = torch.where(mask, 1.0, 0.0)
        expected_w[:, 0] = 2.0
        kept = mask
    else:  # token_k1 with band [1/2, 2] drops the first tokens
        corr = parse_rollout_correction(RolloutCorrectionConfig(rollout_rs="token_k1", rollout_rs_threshold="2.0"))
        expected_w = torch.where(mask, 1.0, 0.0)
        kept = mask.clone()
        kept[:, 0] = False
    weights, keep, _ = rollout_correction(data["old_logprobs"], data["rollout_logprobs"], mask, corr)
    assert torch.equal(keep, kept)
    if weights is not None:
        torch.testing.assert_close(weights, expected_w)
        data["rollout_is_weights"] = weights
    data["response_mask"] = keep
    metrics = actor.update_policy(data)
    advantages = batch["advantages"]
    expected = -(advantages * expected_w)[kept].sum().item() / int(kept.sum())
    assert metrics["actor/pg_loss"] == pytest.approx(expected, rel=1e-5)
    # and it differs from the uncorrected loss -mean(A) over all tokens (the correction acted)
    assert abs(expected + advantages[mask].mean().item()) > 1e-3
