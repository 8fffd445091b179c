"""Policy losses: hand-derived values and gradients (B = 2 or 3), invariants over the registry, plug-ins."""

import math

import pytest
import torch
from algorithms_testing import lengths_to_mask, policy_loss_inputs
from torch.testing import assert_close

from easyvlm.algorithms import LOSS_AVG_MODES, PolicyLossInputs, get_policy_loss, policy_loss_names
from easyvlm.utils.plugins import PluginError

NAN = float("nan")


def make_inputs(ratios, advantages, lengths, logprobs=None, **kwargs):
    """Build inputs from target ratios r = exp(logprobs - old_logprobs). (B, T) lists, padded with NaN."""
    mask = lengths_to_mask(lengths, len(ratios[0]))
    ratios = torch.tensor(ratios)
    if logprobs is None:
        logprobs = torch.full(ratios.shape, -1.0)
    logprobs = torch.as_tensor(logprobs, dtype=torch.float32).clone().requires_grad_()
    old_logprobs = (logprobs.detach() - torch.log(ratios)).masked_fill(~mask, NAN)
    inputs = policy_loss_inputs(
        logprobs=logprobs,
        old_logprobs=old_logprobs,
        advantages=torch.tensor(advantages).masked_fill(~mask, NAN),
        response_mask=mask,
        **kwargs,
    )
    return inputs


# clip_ratio_low 0.2, clip_ratio_high 0.3 -> clip range [0.8, 1.3]; dual clip c = 3
PPO_CASE = dict(
    ratios=[[1.0, 1.5, 0.5], [0.5, 2.0, 4.0], [1.2, 1.0, 1.0]],
    advantages=[[1.0, 1.0, 1.0], [-1.0, -1.0, -1.0], [2.0, 2.0, 2.0]],
    lengths=[3, 3, 1],
    clip_ratio_low=0.2,
    clip_ratio_high=0.3,
    clip_ratio_dual=3.0,
)


def test_ppo_clip_hand_values_and_gradient():
    # token losses l = max(-A r, -A clip(r)), and for A < 0 min(l, -A c):
    # row 0 (A=+1): r=1 -> -1 | r=1.5 -> max(-1.5, -1.3) = -1.3 (clipped high) | r=0.5 -> max(-0.5, -0.8) = -0.5
    # row 1 (A=-1): r=0.5 -> max(0.5, 0.8) = 0.8 (clipped low) | r=2 -> max(2, 1.3) = 2, min(2, 3) = 2
    #               r=4 -> max(4, 1.3) = 4, min(4, 3) = 3 (dual clip)
    # row 2 (A=+2): r=1.2 -> -2.4; two padding tokens
    # token mean: (-1 - 1.3 - 0.5 + 0.8 + 2 + 3 - 2.4) / 7 = 0.6 / 7
    inputs = make_inputs(**PPO_CASE)
    loss, metrics = get_policy_loss("default")(inputs)
    assert_close(loss, torch.tensor(0.6 / 7))
    # d l / d logprob = -A r where unclipped, 0 where a clip is active; / 7 tokens
    expected_grad = torch.tensor([[-1.0, 0.0, -0.5], [0.0, 2.0, 0.0], [-2.4, 0.0, 0.0]]) / 7
    (grad,) = torch.autograd.grad(loss, inputs.logprobs)
    assert_close(grad, expected_grad)
    # one token each out of 7 is clipped high, low and dual
    assert metrics["pg_clipfrac_higher"] == pytest.approx(1 / 7)
    assert metrics["pg_clipfrac_lower"] == pytest.approx(1 / 7)
    assert metrics["pg_clipfrac_dual"] == pytest.approx(1 / 7)
    # ppo_kl = mean(old - new) = -mean(log r) = -1.280934 / 7; entropy_loss = mean(-logprobs) = 1
    mean_log_r = sum(math.log(r) for r in [1.0, 1.5, 0.5, 0.5, 2.0, 4.0, 1.2]) / 7
    assert metrics["ppo_kl"] == pytest.approx(-mean_log_r)
    assert metrics["entropy_loss"] == pytest.approx(1.0)


def test_ppo_clip_seq_mode():
    # row means: (-1 - 1.3 - 0.5) / 3 = -0.933333, (0.8 + 2 + 3) / 3 = 1.933333, -2.4; mean = -1.4 / 3
    loss, _ = get_policy_loss("default")(make_inputs(**PPO_CASE, loss_avg_mode="seq"))
    assert_close(loss, torch.tensor(-1.4 / 3))


# GSPO: sequence ratio s_i = exp(mean_t log r_it) = geometric mean of the token ratios
GSPO_CASE = dict(
    ratios=[[2.0, 0.5], [2.0, 2.0], [1.69, 1.0]],  # s = 1, 2, 1.69
    advantages=[[1.0, 1.0], [-1.0, -1.0], [1.0, 1.0]],
    lengths=[2, 2, 1],
    clip_ratio_low=0.2,
    clip_ratio_high=0.3,
)


@pytest.mark.parametrize("name", ["gspo", "gspo_token"])
def test_gspo_hand_values_and_gradient(name):
    # row 0: s = 1 -> -1 per token | row 1 (A=-1): s = 2 -> max(2, 1.3) = 2 (no dual clip in GSPO)
    # row 2: s = 1.69 > 1.3 -> max(-1.69, -1.3) = -1.3 (clipped high); seq mode: (-1 + 2 - 1.3) / 3 = -0.1
    inputs = make_inputs(**GSPO_CASE, loss_avg_mode="seq")
    loss, metrics = get_policy_loss(name)(inputs)
    assert_close(loss, torch.tensor(-0.1))
    # gradient: row i's loss -A s_i, d s_i / d logprob_t = s_i / L_i (gspo) -- and gspo_token, with
    # per-token A equal across the row, gives the same: row 0: -1 * 1 / 2 / 3 = -1/6 per token;
    # row 1: +1 * 2 / 2 / 3 = 1/3 per token; row 2 clipped: 0
    (grad,) = torch.autograd.grad(loss, inputs.logprobs)
    assert_close(grad, torch.tensor([[-1 / 6, -1 / 6], [1 / 3, 1 / 3], [0.0, 0.0]]))
    assert metrics["pg_clipfrac_higher"] == pytest.approx(1 / 5)  # row 2's single token of 5
    assert metrics["pg_clipfrac_lower"] == 0.0


def test_gspo_token_mode():
    # per token: row 0: -1, -1; row 1: 2, 2; row 2: -1.3 -> (-2 + 4 - 1.3) / 5 = 0.14
    loss, _ = get_policy_loss("gspo")(make_inputs(**GSPO_CASE, loss_avg_mode="token"))
    assert_close(loss, torch.tensor(0.14))


def test_gspo_token_differs_from_gspo_with_per_token_advantages():
    # three identical rows, ratios (2, 0.5) -> s = 1, advantages (1, -1), seq mode (/ 3 rows):
    # gspo: row loss mean_t(-A_t s) = -s mean(A) = 0 for every s -> gradient 0
    # gspo_token: d/d logprob_t of mean_t'(-A_t' s_t') = -A_t s / L / 3 = (-1/2, +1/2) / 3
    case = dict(ratios=[[2.0, 0.5]] * 3, advantages=[[1.0, -1.0]] * 3, lengths=[2, 2, 2], loss_avg_mode="seq")
    seq_inputs, token_inputs = make_inputs(**case), make_inputs(**case)
    (g_seq,) = torch.autograd.grad(get_policy_loss("gspo")(seq_inputs)[0], seq_inputs.logprobs)
    (g_tok,) = torch.autograd.grad(get_policy_loss("gspo_token")(token_inputs)[0], token_inputs.logprobs)
    assert_close(g_seq, torch.zeros(3, 2))
    assert_close(g_tok, torch.tensor([[-0.5, 0.5]] * 3) / 3)


def test_cispo_hand_values_and_gradient():
    # l = -w A logprob with w = clip(r, 0.8, 1.3), detached
    # row 0 (A=1): logprobs -1, -2, -0.5; r 1, 2, 0.5 -> w 1, 1.3, 0.8 -> l = 1, 2.6, 0.4
    # row 1 (A=-2): logprobs -1, -3; r 1.1, 0.9 -> w 1.1, 0.9 -> l = 2 w logprob = -2.2, -5.4
    # row 2 (A=0.5): logprob -2, r 1 -> l = 1.0; token mean: (1 + 2.6 + 0.4 - 2.2 - 5.4 + 1) / 6 = -2.6 / 6
    inputs = make_inputs(
        ratios=[[1.0, 2.0, 0.5], [1.1, 0.9, 1.0], [1.0, 1.0, 1.0]],
        advantages=[[1.0] * 3, [-2.0] * 3, [0.5] * 3],
        lengths=[3, 2, 1],
        logprobs=[[-1.0, -2.0, -0.5], [-1.0, -3.0, 0.0], [-2.0, 0.0, 0.0]],
        clip_ratio_low=0.2,
        clip_ratio_high=0.3,
    )
    loss, metrics = get_policy_loss("cispo")(inputs)
    assert_close(loss, torch.tensor(-2.6 / 6))
    # d l / d logprob = -w A / 6: every token keeps a gradient, even the clipped ones
    (grad,) = torch.autograd.grad(loss, inputs.logprobs)
    assert_close(grad, torch.tensor([[-1.0, -1.3, -0.8], [2.2, 1.8, 0.0], [-0.5, 0.0, 0.0]]) / 6)
    assert metrics["pg_clipfrac_higher"] == pytest.approx(1 / 6)  # r = 2
    assert metrics["pg_clipfrac_lower"] == pytest.approx(1 / 6)  # r = 0.5


# ----------------------------------------------------------------------------- every loss


def random_inputs(seed=0, **overrides):
    gen = torch.Generator().manual_seed(seed)
    mask = lengths_to_mask([4, 1, 3, 2], 4)
    logprobs = (-torch.rand(4, 4, generator=gen) * 3).requires_grad_()
    kwargs = dict(
        logprobs=logprobs,
        old_logprobs=logprobs.detach() + 0.4 * torch.randn(4, 4, generator=gen),
        advantages=torch.randn(4, 4, generator=gen),
        response_mask=mask,
    )
    kwargs.update(overrides)
    return policy_loss_inputs(**kwargs)


@pytest.mark.parametrize("mode", LOSS_AVG_MODES)
@pytest.mark.parametrize("name", policy_loss_names())
def test_values_at_masked_positions_change_no_output_or_gradient(name, mode):
    clean = random_inputs(loss_avg_mode=mode)
    pad = ~clean.response_mask
    dirty_logprobs = clean.logprobs.detach().masked_fill(pad, 50.0).requires_grad_()
    dirty = random_inputs(
        logprobs=dirty_logprobs,
        old_logprobs=clean.old_logprobs.masked_fill(pad, NAN),
        advantages=clean.advantages.masked_fill(pad, NAN),
        loss_avg_mode=mode,
    )
    loss_a, metrics_a = get_policy_loss(name)(clean)
    loss_b, metrics_b = get_policy_loss(name)(dirty)
    assert_close(loss_a, loss_b)
    assert metrics_a == pytest.approx(metrics_b)
    (grad_a,) = torch.autograd.grad(loss_a, clean.logprobs)
    (grad_b,) = torch.autograd.grad(loss_b, dirty.logprobs)
    assert_close(grad_a, grad_b)
    assert (grad_b[pad] == 0).all() and grad_b.abs().sum() > 0


@pytest.mark.parametrize("mode", LOSS_AVG_MODES)
@pytest.mark.parametrize("name", policy_loss_names())
@pytest.mark.parametrize("sign", [1.0, -1.0])
def test_one_gradient_step_moves_logprob_with_the_advantage(tiny_policy, name, mode, sign):
    """A positive advantage raises the log-prob of the sampled tokens after one SGD step; negative lowers it."""
    mask = lengths_to_mask([5, 3, 4, 2, 5, 1, 2, 3], 5)
    advantages = torch.zeros(8, 5)
    advantages[0] = sign  # only sequence 0 carries a signal
    before = tiny_policy.logprobs()
    inputs = policy_loss_inputs(
        logprobs=before,
        old_logprobs=before.detach(),  # on-policy: ratio 1
        advantages=advantages,
        response_mask=mask,
        loss_avg_mode=mode,
    )
    loss, _ = get_policy_loss(name)(inputs)
    loss.backward()
    with torch.no_grad():
        tiny_policy.weight -= 0.05 * tiny_policy.weight.grad
        after = tiny_policy.logprobs()
    change = (after[0] - before[0].detach()).sum()
    assert sign * change > 0


def test_dual_clip_constant_must_exceed_one():
    with pytest.raises(ValueError, match="clip_ratio_dual must be > 1"):
        random_inputs(clip_ratio_dual=1.0)


def test_mismatched_shapes_are_rejected():
    with pytest.raises(ValueError, match=r"advantages has shape \(4, 3\)"):
        random_inputs(advantages=torch.zeros(4, 3))


def test_given_normalizer_replaces_the_local_one():
    # the same micro-batch with N = 2 x its own token count has half the loss
    own = random_inputs()
    n_tokens = float(own.response_mask.sum())
    for name in policy_loss_names():
        halved = random_inputs(normalizer=2 * n_tokens)
        assert_close(get_policy_loss(name)(halved)[0], get_policy_loss(name)(own)[0] / 2)


# ----------------------------------------------------------------------------- sapo

# SAPO: l = -A g, g = 4/tau sigmoid(tau (r - 1)); tau = tau_positive (1 here) for A >= 0, tau_negative
# (2 here, far from 1 so that a swap shows) for A < 0. The ratios put tau (r - 1) at +-ln 2 or
# +-ln 3, where sigmoid(ln k) = k / (k + 1) is exact: s = 3/4, 1/4, 2/3, 1/3.
LN2, LN3 = math.log(2.0), math.log(3.0)
SAPO_CASE = dict(
    ratios=[[1 + LN3, 1 - LN3 / 2, 1 + LN2], [1 + LN2 / 2, 1 - LN2, 1.0]],
    advantages=[[1.0, -1.0, 2.0], [-3.0, 0.5, 0.0]],
    lengths=[3, 2],
    tau_positive=1.0,
    tau_negative=2.0,
)


def test_sapo_hand_values_and_gradient():
    # row 0: A=+1, tau 1, x = ln 3  -> s = 3/4, g = 4 * 3/4 = 3       -> l = -3
    #        A=-1, tau 2, x = -ln 3 -> s = 1/4, g = 4/2 * 1/4 = 1/2   -> l = +1/2
    #        A=+2, tau 1, x = ln 2  -> s = 2/3, g = 8/3               -> l = -16/3
    # row 1: A=-3, tau 2, x = ln 2  -> s = 2/3, g = 4/2 * 2/3 = 4/3   -> l = +4
    #        A=.5, tau 1, x = -ln 2 -> s = 1/3, g = 4/3               -> l = -2/3; one padding token
    # token mean: (-3 + 1/2 - 16/3 + 4 - 2/3) / 5 = -4.5 / 5 = -0.9
    inputs = make_inputs(**SAPO_CASE)
    loss, metrics = get_policy_loss("sapo")(inputs)
    assert_close(loss, torch.tensor(-0.9))
    # d l / d logprob = -A dg/dr dr/dlogprob = -A (4/tau * tau s (1 - s)) r = -A * 4 s (1 - s) * r;
    # 4 s (1 - s) = 3/4 for s = 3/4 or 1/4, 8/9 for s = 2/3 or 1/3; / 5 tokens
    expected_grad = torch.tensor(
        [
            [-1 * 3 / 4 * (1 + LN3), 1 * 3 / 4 * (1 - LN3 / 2), -2 * 8 / 9 * (1 + LN2)],
            [3 * 8 / 9 * (1 + LN2 / 2), -0.5 * 8 / 9 * (1 - LN2), 0.0],
        ]
    )
    (grad,) = torch.autograd.grad(loss, inputs.logprobs)
    assert_close(grad, expected_grad / 5)
    # sapo_grad_scale = mean of 4 s (1 - s) = (3/4 + 3/4 + 8/9 + 8/9 + 8/9) / 5 = (25/6) / 5 = 5/6
    assert metrics["sapo_grad_scale"] == pytest.approx(5 / 6)
    assert not any(key.startswith("pg_clipfrac") for key in metrics)  # nothing is clipped
    mean_log_r = sum(math.log(r) for r in [1 + LN3, 1 - LN3 / 2, 1 + LN2, 1 + LN2 / 2, 1 - LN2]) / 5
    assert metrics["ppo_kl"] == pytest.approx(-mean_log_r)
    assert metrics["entropy_loss"] == pytest.approx(1.0)


def test_sapo_seq_mode():
    # row means: (-3 + 1/2 - 16/3) / 3 = -47/18 and (4 - 2/3) / 2 = 5/3 = 30/18 -> mean -17/36
    loss, _ = get_policy_loss("sapo")(make_inputs(**SAPO_CASE, loss_avg_mode="seq"))
    assert_close(loss, torch.tensor(-17 / 36))


@pytest.mark.parametrize(("tau_positive", "tau_negative"), [(1.0, 1.05), (0.25, 4.0), (3.0, 0.5)])
def test_sapo_on_policy_gradient_is_the_plain_policy_gradient(tau_positive, tau_negative):
    # at r = 1: s = 1/2, so l = -A * 2 / tau and d l / d logprob = -A * 4 * 1/4 * 1 = -A for every tau
    clean = random_inputs()
    inputs = random_inputs(
        old_logprobs=clean.logprobs.detach(), tau_positive=tau_positive, tau_negative=tau_negative
    )
    mask, adv = inputs.response_mask, inputs.advantages
    n_tokens = mask.sum()
    loss, metrics = get_policy_loss("sapo")(inputs)
    tau = torch.where(adv >= 0, tau_positive, tau_negative)
    assert_close(loss, (torch.where(mask, -adv * 2 / tau, 0.0)).sum() / n_tokens)
    (grad,) = torch.autograd.grad(loss, inputs.logprobs)
    assert_close(grad, torch.where(mask, -adv, 0.0) / n_tokens)
    assert metrics["sapo_grad_scale"] == pytest.approx(1.0)


def test_sapo_gradient_matches_the_closed_form_off_policy():
    # random ratios plus one token at log r = +40: clamped to 20 (no gradient through the clamp, and
    # s = 1 in float32 anyway), so its gradient is 0, not NaN
    base = random_inputs()
    old_logprobs = base.old_logprobs.clone()
    old_logprobs[0, 0] = base.logprobs[0, 0].detach() - 40.0
    inputs = random_inputs(old_logprobs=old_logprobs)  # default temperatures 1.0 / 1.05
    loss, _ = get_policy_loss("sapo")(inputs)
    (grad,) = torch.autograd.grad(loss, inputs.logprobs)
    mask, adv = inputs.response_mask, inputs.advantages
    ratio = torch.exp((inputs.logprobs.detach() - old_logprobs).clamp(-20, 20))
    s = torch.sigmoid(torch.where(adv >= 0, 1.0, 1.05) * (ratio - 1))
    expected = torch.where(mask, -adv * 4 * s * (1 - s) * ratio, 0.0) / mask.sum()
    assert_close(grad, expected)
    assert grad[0, 0] == 0 and torch.isfinite(grad).all()


def test_sapo_temperatures_apply_to_the_right_advantage_sign():
    # two one-token rows with the same ratio 1.5: row 0 has A = +1, row 1 has A = -1. Raising
    # tau_positive must change row 0's gradient only, raising tau_negative row 1's only.
    def grad(tau_positive, tau_negative):
        inputs = make_inputs(
            ratios=[[1.5], [1.5]],
            advantages=[[1.0], [-1.0]],
            lengths=[1, 1],
            tau_positive=tau_positive,
            tau_negative=tau_negative,
        )
        return torch.autograd.grad(get_policy_loss("sapo")(inputs)[0], inputs.logprobs)[0][:, 0]

    def closed_form(advantage, tau):  # -A * 4 s (1 - s) * r / 2 tokens, s = sigmoid(tau * 0.5)
        s = 1 / (1 + math.exp(-tau * 0.5))
        return -advantage * 4 * s * (1 - s) * 1.5 / 2

    base, hot_positive, hot_negative = grad(1.0, 1.0), grad(3.0, 1.0), grad(1.0, 3.0)
    assert_close(base, torch.tensor([closed_form(1.0, 1.0), closed_form(-1.0, 1.0)]))
    assert_close(hot_positive, torch.tensor([closed_form(1.0, 3.0), closed_form(-1.0, 1.0)]))
    assert_close(hot_negative, torch.tensor([closed_form(1.0, 1.0), closed_form(-1.0, 3.0)]))
    # a hotter gate attenuates more off-policy: 4 s (1 - s) drops from 0.94 (tau 1) to 0.60 (tau 3)
    assert hot_positive[0].abs() < base[0].abs() and hot_negative[1].abs() < base[1].abs()


@pytest.mark.parametrize("key", ["tau_positive", "tau_negative"])
@pytest.mark.parametrize("value", [0.0, -1.0, math.inf, NAN])
def test_sapo_temperature_must_be_positive_and_finite(key, value):
    with pytest.raises(ValueError, match=rf"worker\.actor\.{key} must be a finite number > 0"):
        random_inputs(**{key: value})


# ----------------------------------------------------------------------------- plug-ins

PLUGIN = """
import torch

def reinforce(inputs):
    # plain REINFORCE: -A * logprob, token mean over valid tokens
    m = inputs.response_mask
    token_losses = torch.where(m, -inputs.advantages * inputs.logprobs, 0.0)
    return token_losses.sum() / m.sum(), {"my_metric": 1.0}

def not_a_pair(inputs):
    return inputs.logprobs.sum()
"""


def test_plugin_policy_loss_from_file(tmp_path):
    path = tmp_path / "my_loss.py"
    path.write_text(PLUGIN)
    # row 0: -1 * (-1 - 2 - 0.5) = 3.5, row 1: -(-2) * (-1) = -2, row 2: -0.5 * (-2) = 1 -> 2.5 / 5 tokens
    inputs = make_inputs(
        ratios=[[1.0] * 3] * 3,
        advantages=[[1.0] * 3, [-2.0] * 3, [0.5] * 3],
        lengths=[3, 1, 1],
        logprobs=[[-1.0, -2.0, -0.5], [-1.0, 0.0, 0.0], [-2.0, 0.0, 0.0]],
    )
    loss, metrics = get_policy_loss(f"{path}:reinforce")(inputs)
    assert_close(loss, torch.tensor(0.5))
    assert metrics == {"my_metric": 1.0}


def test_bad_specs_give_clear_errors(tmp_path):
    with pytest.raises(ValueError, match=r"unknown policy loss 'ppo'.*worker\.actor\.loss_type.*'default'.*file\.py"):
        get_policy_loss("ppo")
    with pytest.raises(PluginError, match="not found"):
        get_policy_loss(str(tmp_path / "nowhere.py:reinforce"))
    path = tmp_path / "my_loss.py"
    path.write_text(PLUGIN)
    with pytest.raises(PluginError, match=r"no function 'main'.*reinforce"):
        get_policy_loss(str(path))  # no :func -> looks for main
    with pytest.raises(TypeError, match=r"my_loss\.py:not_a_pair must return \(loss"):
        get_policy_loss(f"{path}:not_a_pair")(random_inputs())


def test_registered_names_match_the_documented_list():
    assert set(policy_loss_names()) == {
        "default", "gspo", "gspo_token", "cispo", "sapo", "geo_mean", "clip_cov", "kl_cov", "gpg"
    }


# GMPO (geo_mean): log-ratios d (r = e^d); eps_low 0.2, eps_high 0.3 (the defaults). The pessimistic
# choice keeps a log-ratio past the bound on the side that lowers the objective unclipped:
# row 0, A = +1, d = [-0.5, 0.5] (+ padding): d' = min(d, clip(d)) = [-0.5, 0.3] -> rho = e^-0.1
# row 1, A = -1, d = [-0.5, 0.5, 0.0]:       d' = max(d, clip(d)) = [-0.2, 0.5, 0.0] -> rho = e^0.1
# loss_i = -Abar_i rho_i: row 0 -e^-0.1, row 1 +e^0.1
GMPO_CASE = dict(
    ratios=[[math.exp(-0.5), math.exp(0.5), 1.0], [math.exp(-0.5), math.exp(0.5), 1.0]],
    advantages=[[1.0, 1.0, 0.0], [-1.0, -1.0, -1.0]],
    lengths=[2, 3],
)


def test_gmpo_hand_values_and_gradient():
    inputs = make_inputs(**GMPO_CASE, loss_avg_mode="seq")
    loss, metrics = get_policy_loss("geo_mean")(inputs)
    # seq (the paper's and verl's mean over sequences): (-e^-0.1 + e^0.1) / 2
    assert_close(loss, torch.tensor((math.exp(0.1) - math.exp(-0.1)) / 2))
    # d loss / d logprob_t = -Abar_i rho_i / |o_i| / B where d'_t is the unclipped d_t, 0 where the
    # clip was chosen: row 0 token 0 -e^-0.1 / 2 / 2, token 1 clipped; row 1 token 0 clipped, tokens
    # 1 and 2 +e^0.1 / 3 / 2
    (grad,) = torch.autograd.grad(loss, inputs.logprobs)
    assert_close(grad, torch.tensor([[-math.exp(-0.1) / 4, 0.0, 0.0], [0.0, math.exp(0.1) / 6, math.exp(0.1) / 6]]))
    # tokens whose log-ratio lies outside [-0.2, 0.3] (verl's count): 2 with A > 0, 2 with A < 0, of 5
    assert metrics["pg_clipfrac_higher"] == pytest.approx(0.4) and metrics["pg_clipfrac_lower"] == pytest.approx(0.4)


def test_gmpo_token_mode_weighs_each_sequence_by_its_length():
    # every token carries its sequence's loss: (2 (-e^-0.1) + 3 e^0.1) / 5 valid tokens
    loss, _ = get_policy_loss("geo_mean")(make_inputs(**GMPO_CASE, loss_avg_mode="token"))
    assert_close(loss, torch.tensor((3 * math.exp(0.1) - 2 * math.exp(-0.1)) / 5))


def test_gmpo_rollout_weights_enter_as_their_geometric_mean_per_sequence():
    # weights [4, 1] on row 0 -> geometric mean 2; [1, 1, 8] on row 1 -> 2: both rows' losses double
    weights = torch.tensor([[4.0, 1.0, NAN], [1.0, 1.0, 8.0]])
    plain, _ = get_policy_loss("geo_mean")(make_inputs(**GMPO_CASE, loss_avg_mode="seq"))
    loss, _ = get_policy_loss("geo_mean")(make_inputs(**GMPO_CASE, loss_avg_mode="seq", rollout_is_weights=weights))
    assert_close(loss, 2 * plain)
