"""Advantage estimators: hand-derived values at B >= 3, invariants over the whole registry, plug-ins."""

import math

import pytest
import torch
from algorithms_testing import lengths_to_mask
from torch.testing import assert_close

from easyvlm.algorithms import AdvantageInputs, AdvantageOutputs, advantage_names, get_advantage
from easyvlm.algorithms.advantages import group_stats
from easyvlm.utils.plugins import PluginError

NAN = float("nan")
EPS = 1e-6

# --- a GRPO-style batch: B = 6, T = 3, groups {0: rows 0-2, 1: rows 3-4, 2: row 5 (alone)}
GROUP_IDS = torch.tensor([0, 0, 0, 1, 1, 2])
GROUP_MASK = lengths_to_mask([3, 1, 2, 3, 2, 1], 3)
# sequence rewards (sum over valid tokens): 1 (0.5 + 0.5, as with per-token terms), 0, 0 | 2, 4 | 5
GROUP_REWARDS = torch.tensor(
    [
        [0.5, 0.0, 0.5],
        [0.0, NAN, NAN],
        [0.0, 0.0, NAN],
        [0.0, 0.0, 2.0],
        [0.0, 4.0, NAN],
        [5.0, NAN, NAN],
    ]
)
# group 0 {1, 0, 0}: mean 1/3, unbiased std sqrt(((2/3)^2 + 2 (1/3)^2) / 2) = sqrt(1/3) = 0.577350
# group 1 {2, 4}: mean 3, unbiased std sqrt((1 + 1) / 1) = sqrt(2)
# group 2 {5}: mean 5, std 0
STD = torch.tensor([math.sqrt(1 / 3)] * 3 + [math.sqrt(2)] * 2 + [0.0])


def group_inputs(**kwargs) -> AdvantageInputs:
    return AdvantageInputs(token_rewards=GROUP_REWARDS, response_mask=GROUP_MASK, group_ids=GROUP_IDS, **kwargs)


def on_tokens(seq_values, mask=GROUP_MASK):
    """(B,) per-sequence values -> (B, T) on valid tokens, 0 elsewhere."""
    return torch.where(mask, torch.as_tensor(seq_values, dtype=torch.float32).unsqueeze(-1), 0.0)


def test_grpo_hand_values():
    # (r - mean) / (std + eps): group 0: 2/3, -1/3, -1/3 over (0.577350 + eps) -> 1.154699, -0.577349, ...
    # group 1: -1, +1 over (1.414214 + eps); the lone sample: 0 / eps = 0
    expected = torch.tensor([2 / 3, -1 / 3, -1 / 3, -1.0, 1.0, 0.0]) / (STD + EPS)
    out = get_advantage("grpo")(group_inputs(eps=EPS))
    assert_close(out.advantages, on_tokens(expected))
    assert_close(out.returns, out.advantages)


def test_dr_grpo_does_not_divide_by_std():
    out = get_advantage("grpo")(group_inputs(norm_by_std=False))
    assert_close(out.advantages, on_tokens([2 / 3, -1 / 3, -1 / 3, -1.0, 1.0, 0.0]))


def test_grpo_matches_slow_loop_reference_on_shuffled_groups():
    gen = torch.Generator().manual_seed(0)
    group_ids = torch.tensor([5, 9, 5, 2, 9, 2, 5, 2, 9, 7])  # unordered ids, one singleton (7)
    seq_rewards = torch.randn(10, generator=gen)
    mask = torch.ones(10, 1, dtype=torch.bool)
    out = get_advantage("grpo")(AdvantageInputs(seq_rewards.unsqueeze(-1), mask, group_ids, eps=EPS))
    expected = torch.zeros(10)
    for i in range(10):  # the obvious loop, one sample at a time
        group = seq_rewards[group_ids == group_ids[i]]
        std = group.std() if len(group) > 1 else torch.tensor(0.0)
        expected[i] = (seq_rewards[i] - group.mean()) / (std + EPS)
    assert_close(out.advantages.squeeze(-1), expected)


def test_rloo_hand_values():
    # r_i - mean of the others: group 0: 1 - 0 = 1, 0 - 0.5 = -0.5 (x2); group 1: 2 - 4, 4 - 2; alone: 0
    out = get_advantage("rloo")(group_inputs())
    assert_close(out.advantages, on_tokens([1.0, -0.5, -0.5, -2.0, 2.0, 0.0]))


def test_grpo_passk_hand_values():
    # A_i = max(group) - max(group without i): group 0 {1, 0, 0}: the best gets 1 - 0 = 1, others 0;
    # group 1 {2, 4}: 4 - 2 = 2 for the best, 0 for the other; alone: 0
    raw = torch.tensor([1.0, 0.0, 0.0, 0.0, 2.0, 0.0])
    assert_close(get_advantage("grpo_passk")(group_inputs(norm_by_std=False)).advantages, on_tokens(raw))
    # divided by (group std + eps): 1 / 0.577351, 2 / 1.414215
    assert_close(get_advantage("grpo_passk")(group_inputs(eps=EPS)).advantages, on_tokens(raw / (STD + EPS)))


def test_grpo_passk_tie_for_best_gives_zero():
    # {1, 1, 0}: removing either best leaves max 1 -> 0 for everyone
    mask = torch.ones(3, 1, dtype=torch.bool)
    rewards = torch.tensor([[1.0], [1.0], [0.0]])
    out = get_advantage("grpo_passk")(AdvantageInputs(rewards, mask, torch.zeros(3, dtype=torch.long)))
    assert_close(out.advantages, torch.zeros(3, 1))


# --- a token-level batch: B = 3, T = 3, lengths 3, 2, 1; gamma = 0.5
TOKEN_MASK = lengths_to_mask([3, 2, 1], 3)
TOKEN_REWARDS = torch.tensor([[0.0, 0.0, 1.0], [0.2, 0.8, NAN], [-1.0, NAN, NAN]])
VALUES = torch.tensor([[1.0, 2.0, 3.0], [0.5, 1.0, NAN], [2.0, NAN, NAN]])


def token_inputs(**kwargs) -> AdvantageInputs:
    kwargs.setdefault("group_ids", torch.tensor([0, 0, 0]))
    return AdvantageInputs(token_rewards=TOKEN_REWARDS, response_mask=TOKEN_MASK, **kwargs)


def whiten(valid_values: list[float]) -> torch.Tensor:
    """Independent whitening of a flat list (population std), for expected values."""
    x = torch.tensor(valid_values)
    return (x - x.mean()) / torch.sqrt(x.var(unbiased=False) + 1e-8)


def scatter(valid_values, mask=TOKEN_MASK):
    """Put a flat list of values (row-major) at the valid positions of ``mask``."""
    out = torch.zeros(mask.shape)
    out[mask] = torch.as_tensor(valid_values, dtype=torch.float32)
    return out


def test_gae_hand_values_at_b3_with_different_lengths():
    # gamma = 0.5, lam = 0.5 (gamma * lam = 0.25); V = 0 after the last valid token
    # row 0: t2: d = 1 - 3 = -2, A = -2 | t1: d = 0 + 0.5*3 - 2 = -0.5, A = -0.5 + 0.25*-2 = -1
    #        t0: d = 0 + 0.5*2 - 1 = 0, A = 0.25*-1 = -0.25;   returns A + V = 0.75, 1, 1
    # row 1: t1: d = 0.8 - 1 = -0.2, A = -0.2 | t0: d = 0.2 + 0.5*1 - 0.5 = 0.2, A = 0.2 - 0.05 = 0.15
    #        returns 0.65, 0.8
    # row 2: t0: d = -1 - 2 = -3, A = -3; returns -1
    raw = [-0.25, -1.0, -2.0, 0.15, -0.2, -3.0]
    out = get_advantage("gae")(token_inputs(values=VALUES, gamma=0.5, lam=0.5))
    assert_close(out.returns, scatter([0.75, 1.0, 1.0, 0.65, 0.8, -1.0]))
    assert_close(out.advantages, scatter(whiten(raw)))


def test_gae_skips_holes_in_the_mask():
    # a masked hole in the middle is bridged: same result as the sequence with the hole removed
    rewards = torch.tensor([[0.3, 99.0, 1.0], [0.5, 2.0, 0.0]])
    values = torch.tensor([[0.4, 99.0, 0.7], [0.1, 0.2, 0.0]])
    holed = torch.tensor([[True, False, True], [True, True, False]])
    compact = torch.tensor([[True, True, False], [True, True, False]])
    kwargs = dict(group_ids=torch.tensor([0, 1]), gamma=0.9, lam=0.8)
    out = get_advantage("gae")(AdvantageInputs(rewards, holed, values=values, **kwargs))
    rewards_c = torch.tensor([[0.3, 1.0, 0.0], [0.5, 2.0, 0.0]])
    values_c = torch.tensor([[0.4, 0.7, 0.0], [0.1, 0.2, 0.0]])
    ref = get_advantage("gae")(AdvantageInputs(rewards_c, compact, values=values_c, **kwargs))
    assert_close(out.advantages[holed], ref.advantages[compact])
    assert_close(out.returns[holed], ref.returns[compact])


def test_gae_without_values_says_what_is_missing():
    with pytest.raises(ValueError, match="gae.*values.*critic"):
        get_advantage("gae")(token_inputs())


def test_reinforce_plus_plus_hand_values():
    # discounted returns with gamma = 0.5, ending at each row's last valid token (EOS):
    # row 0: [0 + 0.5*(0 + 0.5*1), 0 + 0.5*1, 1] = [0.25, 0.5, 1]; row 1: [0.2 + 0.5*0.8, 0.8] = [0.6, 0.8]
    # row 2: [-1]; advantages = these six values whitened over the batch
    returns = [0.25, 0.5, 1.0, 0.6, 0.8, -1.0]
    out = get_advantage("reinforce_plus_plus")(token_inputs(gamma=0.5))
    assert_close(out.returns, scatter(returns))
    assert_close(out.advantages, scatter(whiten(returns)))


def test_reinforce_plus_plus_skips_holes_in_the_mask():
    # a masked hole is bridged without a discount step: G = [1 + 0.5 * 2, (hole), 2] = [2, 0, 2]
    rewards = torch.tensor([[1.0, 99.0, 2.0], [0.0, 0.0, 1.0], [3.0, 0.0, 0.0]])
    mask = torch.tensor([[True, False, True], [True, True, True], [True, False, False]])
    out = get_advantage("reinforce_plus_plus")(AdvantageInputs(rewards, mask, torch.tensor([0, 1, 2]), gamma=0.5))
    assert_close(out.returns, torch.tensor([[2.0, 0.0, 2.0], [0.25, 0.5, 1.0], [3.0, 0.0, 0.0]]))


def test_reinforce_plus_plus_baseline_hand_values():
    # groups {0: rows 0, 1}, {1: rows 2, 3}; sequence rewards 1, 0 | 3, 3; lengths 2, 1, 1, 1
    # minus the group mean: 0.5, -0.5 | 0, 0 -> tokens 0.5, 0.5, -0.5, 0, 0
    # mean 0.1; deviations 0.4, 0.4, -0.6, -0.1, -0.1; population var (2 * 0.16 + 0.36 + 2 * 0.01) / 5 = 0.14
    # whitened: 0.4 / sqrt(0.14) = 1.069045, -0.6 / sqrt(0.14) = -1.603567, -0.1 / sqrt(0.14) = -0.267261
    rewards = torch.tensor([[0.0, 1.0], [0.0, NAN], [3.0, NAN], [3.0, NAN]])
    mask = lengths_to_mask([2, 1, 1, 1], 2)
    out = get_advantage("reinforce_plus_plus_baseline")(AdvantageInputs(rewards, mask, torch.tensor([0, 0, 1, 1])))
    std = math.sqrt(0.14 + 1e-8)
    assert_close(out.advantages, scatter([0.4 / std, 0.4 / std, -0.6 / std, -0.1 / std, -0.1 / std], mask))
    assert_close(out.returns, out.advantages)


def test_remax_hand_values():
    # sequence rewards 1, 1, -1 minus greedy baselines 0.5, 1, 0 -> 0.5, 0, -1 on every valid token
    # returns: undiscounted rewards-to-go: [1, 1, 1], [1.0, 0.8], [-1]
    out = get_advantage("remax")(token_inputs(baseline_rewards=torch.tensor([0.5, 1.0, 0.0])))
    assert_close(out.advantages, scatter([0.5, 0.5, 0.5, 0.0, 0.0, -1.0]))
    assert_close(out.returns, scatter([1.0, 1.0, 1.0, 1.0, 0.8, -1.0]))


def test_remax_without_baseline_says_what_is_missing():
    with pytest.raises(ValueError, match="remax.*baseline_rewards"):
        get_advantage("remax")(token_inputs())


# ----------------------------------------------------------------------------- every estimator


def random_inputs(seed: int = 0, **overrides) -> AdvantageInputs:
    """B = 6, T = 4, three groups of two, varied lengths; values and baselines for gae / remax, two
    steps of two tokens with random rewards and anchors for gigpo."""
    gen = torch.Generator().manual_seed(seed)
    mask = lengths_to_mask([4, 1, 3, 2, 4, 3], 4)
    kwargs = dict(
        turn_index=torch.where(mask, torch.arange(4) // 2, -1),
        step_rewards=torch.randn(6, 2, generator=gen),
        step_anchors=torch.randint(0, 2, (6, 2), generator=gen),
        token_rewards=torch.randn(6, 4, generator=gen),
        response_mask=mask,
        group_ids=torch.tensor([3, 3, 1, 1, 8, 8]),
        values=torch.randn(6, 4, generator=gen),
        baseline_rewards=torch.randn(6, generator=gen),
        gamma=0.9,
        lam=0.95,
    )
    kwargs.update(overrides)
    return AdvantageInputs(**kwargs)


@pytest.mark.parametrize("name", advantage_names())
def test_every_estimator_runs_at_b6_and_zeroes_padding(name):
    out = get_advantage(name)(random_inputs())
    mask = random_inputs().response_mask
    for tensor in (out.advantages, out.returns):
        assert tensor.shape == (6, 4)
        assert torch.isfinite(tensor).all()
        assert (tensor[~mask] == 0).all()
    assert out.advantages[mask].abs().sum() > 0


@pytest.mark.parametrize("name", advantage_names())
def test_values_at_masked_positions_change_no_output(name):
    clean = random_inputs()
    pad = ~clean.response_mask
    dirty = random_inputs(
        token_rewards=clean.token_rewards.masked_fill(pad, NAN),
        values=clean.values.masked_fill(pad, 1e6),
    )
    a, b = get_advantage(name)(clean), get_advantage(name)(dirty)
    assert_close(a.advantages, b.advantages)
    assert_close(a.returns, b.returns)


@pytest.mark.parametrize("name", advantage_names())
def test_permuting_the_batch_permutes_the_output(name):
    inputs = random_inputs()
    perm = torch.tensor([5, 2, 0, 4, 1, 3])
    permuted = AdvantageInputs(
        token_rewards=inputs.token_rewards[perm],
        response_mask=inputs.response_mask[perm],
        group_ids=inputs.group_ids[perm],
        values=inputs.values[perm],
        baseline_rewards=inputs.baseline_rewards[perm],
        turn_index=inputs.turn_index[perm],
        step_rewards=inputs.step_rewards[perm],
        step_anchors=inputs.step_anchors[perm],
        gamma=inputs.gamma,
        lam=inputs.lam,
    )
    assert_close(get_advantage(name)(permuted).advantages, get_advantage(name)(inputs).advantages[perm])


@pytest.mark.parametrize(("name", "norm_by_std"), [("grpo", True), ("grpo", False), ("rloo", True)])
def test_group_advantages_have_zero_mean_per_group(name, norm_by_std):
    inputs = random_inputs(seed=3, norm_by_std=norm_by_std)
    seq_advantages = get_advantage(name)(inputs).advantages[:, 0]  # every row has a first valid token
    for gid in inputs.group_ids.unique():
        assert_close(seq_advantages[inputs.group_ids == gid].mean(), torch.tensor(0.0))


@pytest.mark.parametrize("name", ["grpo", "rloo", "grpo_passk"])
def test_group_of_one_sample_gets_zero(name):
    out = get_advantage(name)(group_inputs())
    assert (out.advantages[5] == 0).all()  # row 5 is alone in group 2


def test_group_stats_per_sample():
    mean, std, count = group_stats(torch.tensor([1.0, 2.0, 10.0, 4.0]), torch.tensor([4, 1, 9, 4]))
    # groups: 4 -> {1, 4} mean 2.5 std sqrt(4.5); 1 -> {2}; 9 -> {10}
    assert_close(mean, torch.tensor([2.5, 2.0, 10.0, 2.5]))
    assert_close(std, torch.tensor([math.sqrt(4.5), 0.0, 0.0, math.sqrt(4.5)]))
    assert_close(count, torch.tensor([2.0, 1.0, 1.0, 2.0]))


def test_inputs_are_validated():
    with pytest.raises(TypeError, match="response_mask must be a bool"):
        AdvantageInputs(TOKEN_REWARDS, TOKEN_MASK.float(), torch.tensor([0, 0, 0]))
    with pytest.raises(ValueError, match=r"group_ids must be an integer tensor of shape \(3,\)"):
        AdvantageInputs(TOKEN_REWARDS, TOKEN_MASK, torch.tensor([0, 0]))


# ----------------------------------------------------------------------------- plug-ins

PLUGIN = """
import torch
from easyvlm.algorithms import AdvantageOutputs

def centred(inputs):
    # sequence reward minus the batch mean, on every valid token
    seq = torch.where(inputs.response_mask, inputs.token_rewards, 0.0).sum(-1)
    adv = torch.where(inputs.response_mask, (seq - seq.mean()).unsqueeze(-1), 0.0)
    return AdvantageOutputs(advantages=adv, returns=adv)

def main(inputs):
    return centred(inputs)

def broken(inputs):
    return inputs.token_rewards
"""


def test_plugin_estimator_from_file(tmp_path):
    path = tmp_path / "my_adv.py"
    path.write_text(PLUGIN)
    # sequence rewards 1, 1, -1: mean 1/3 -> 2/3, 2/3, -4/3
    for spec in (f"{path}:centred", str(path)):  # without :func the function is main
        out = get_advantage(spec)(token_inputs())
        assert_close(out.advantages, scatter([2 / 3] * 5 + [-4 / 3]))


def test_plugin_with_wrong_return_type_names_the_file(tmp_path):
    path = tmp_path / "my_adv.py"
    path.write_text(PLUGIN)
    with pytest.raises(TypeError, match=r"my_adv\.py:broken returned Tensor.*AdvantageOutputs"):
        get_advantage(f"{path}:broken")(token_inputs())


def test_bad_specs_give_clear_errors(tmp_path):
    message = r"unknown advantage estimator 'grpoo'.*algorithm\.adv_estimator.*'grpo'.*file\.py"
    with pytest.raises(ValueError, match=message):
        get_advantage("grpoo")
    with pytest.raises(PluginError, match="not found"):
        get_advantage(str(tmp_path / "missing.py") + ":f")
    path = tmp_path / "my_adv.py"
    path.write_text(PLUGIN)
    with pytest.raises(PluginError, match=r"no function 'nope'.*centred"):
        get_advantage(f"{path}:nope")


def test_registered_names_match_the_documented_list():
    assert set(advantage_names()) == {
        "gae", "grpo", "grpo_passk", "rloo", "reinforce_plus_plus", "reinforce_plus_plus_baseline", "remax", "gpg",
        "gigpo",
    }
    assert isinstance(get_advantage("grpo")(group_inputs()), AdvantageOutputs)
