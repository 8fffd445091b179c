"""aggregate_loss / loss_normalizer: hand-derived values, and split invariance the way the actor runs it."""

import pytest
import torch
from algorithms_testing import lengths_to_mask, policy_loss_inputs
from torch.testing import assert_close

from easyvlm.algorithms import (
    LOSS_AVG_MODES,
    PolicyLossInputs,
    aggregate_loss,
    canonical_loss_avg_mode,
    entropy_bonus_loss,
    entropy_from_logits,
    get_policy_loss,
    kl_loss,
    loss_normalizer,
    policy_loss_names,
)

NAN = float("nan")
# B = 3, T = 3; row 0 has 3 valid tokens, row 1 has 1, row 2 has 2; NaN at padding must not matter
LOSSES = torch.tensor([[1.0, 2.0, 3.0], [4.0, NAN, NAN], [7.0, 8.0, NAN]])
MASK = lengths_to_mask([3, 1, 2], 3)
# token sums per row: 6, 4, 15 (total 25); lengths 3, 1, 2 (total 6)


@pytest.mark.parametrize(
    ("mode", "expected_loss", "expected_normalizer"),
    [
        ("token", 25 / 6, 6.0),  # 25 / 6 tokens
        ("seq", (6 / 3 + 4 / 1 + 15 / 2) / 3, 3.0),  # mean of row means (2, 4, 7.5) = 4.5
        ("seq-mean-token-sum", 25 / 3, 3.0),  # mean of row sums
        ("seq-mean-token-sum-norm", 25 / (3 * 3), 9.0),  # row sums / (3 seqs * norm_length T=3)
    ],
)
def test_aggregate_hand_values(mode, expected_loss, expected_normalizer):
    assert loss_normalizer(MASK, mode) == expected_normalizer
    assert_close(aggregate_loss(LOSSES, MASK, mode), torch.tensor(expected_loss))


def test_seq_mean_token_sum_norm_uses_given_constant_length():
    # 25 / (3 seqs * 4) = 25 / 12: the constant, not the padded width 3
    normalizer = loss_normalizer(MASK, "seq-mean-token-sum-norm", norm_length=4)
    assert normalizer == 12.0
    assert_close(aggregate_loss(LOSSES, MASK, "seq-mean-token-sum-norm", normalizer), torch.tensor(25 / 12))


@pytest.mark.parametrize("mode", LOSS_AVG_MODES)
def test_fully_masked_row_is_as_if_absent(mode):
    losses = torch.cat([LOSSES, torch.full((1, 3), NAN)])
    mask = torch.cat([MASK, torch.zeros(1, 3, dtype=torch.bool)])
    assert loss_normalizer(mask, mode) == loss_normalizer(MASK, mode)
    assert_close(aggregate_loss(losses, mask, mode), aggregate_loss(LOSSES, MASK, mode))


def test_no_valid_token_gives_zero_not_nan():
    mask = torch.zeros(3, 3, dtype=torch.bool)
    for mode in LOSS_AVG_MODES:
        assert_close(aggregate_loss(LOSSES, mask, mode), torch.tensor(0.0))


def test_aliases_and_unknown_mode():
    assert canonical_loss_avg_mode("token-mean") == "token"
    assert canonical_loss_avg_mode("seq-mean-token-mean") == "seq"
    assert_close(aggregate_loss(LOSSES, MASK, "seq-mean-token-mean"), torch.tensor(4.5))
    with pytest.raises(ValueError, match=r"loss_avg_mode 'mean'.*worker\.actor\.loss_avg_mode.*seq-mean-token-sum"):
        canonical_loss_avg_mode("mean")


def test_float_mask_is_rejected():
    with pytest.raises(TypeError, match="bool"):
        aggregate_loss(LOSSES, MASK.float(), "token")


# ----------------------------------------------------------------------------- split invariance

LENGTHS = [5, 1, 3, 4, 2, 5, 3, 1]  # B = 8, T = 5: very different lengths
KL_COEF, ENTROPY_COEFF = 0.1, 0.01
# (rank, rows of each micro-batch): uneven micro-batches, as dynamic batching makes them
RANK_MICRO_BATCHES = [[[0], [1, 2, 3]], [[4, 5], [6, 7]]]


def _inputs(policy):
    gen = torch.Generator().manual_seed(1)
    mask = lengths_to_mask(LENGTHS, 5)
    with torch.no_grad():
        base = policy.logprobs()
    # old log-probs 0.3 nats off on average, so that some ratios are clipped
    old_logprobs = base + 0.3 * torch.randn(base.shape, generator=gen)
    ref_logprobs = base + 0.3 * torch.randn(base.shape, generator=gen)
    advantages = torch.randn(base.shape, generator=gen)
    return mask, old_logprobs, ref_logprobs, advantages


def _actor_loss(policy, loss_type, mode, rows, mask, old, ref, adv, normalizer, weight=None):
    """The actor's total loss on the micro-batch ``rows``: policy + KL loss - entropy bonus."""
    width = int(mask[rows].sum(-1).max())  # drop padding columns, as dynamic batching does
    cols = slice(0, width)
    logits = policy.logits(rows, weight)[:, cols]
    logprobs = policy.logprobs(rows, weight)[:, cols]
    m = mask[rows][:, cols]
    inputs = policy_loss_inputs(
        logprobs=logprobs,
        old_logprobs=old[rows][:, cols],
        advantages=adv[rows][:, cols],
        response_mask=m,
        clip_ratio_low=0.2,
        clip_ratio_high=0.28,
        loss_avg_mode=mode,
        normalizer=normalizer,
    )
    pg_loss, _ = get_policy_loss(loss_type)(inputs)
    kl = kl_loss(logprobs, ref[rows][:, cols], m, "low_var_kl", mode, normalizer)
    entropy = entropy_bonus_loss(entropy_from_logits(logits), m, ENTROPY_COEFF, mode, normalizer)
    return pg_loss + KL_COEF * kl + entropy


# Clip-Cov and KL-Cov centre the covariance and count their tokens per micro-batch (as verl does;
# policy_losses.py): their selection, hence their gradient, depends on the split by design.
SPLIT_INVARIANT_LOSSES = [name for name in policy_loss_names() if name not in ("clip_cov", "kl_cov")]


@pytest.mark.parametrize("loss_type", SPLIT_INVARIANT_LOSSES)
@pytest.mark.parametrize("mode", LOSS_AVG_MODES)
def test_gradient_of_mini_batch_equals_sum_over_micro_batches_and_ranks(tiny_policy, mode, loss_type):
    mask, old, ref, adv = _inputs(tiny_policy)
    everything = torch.arange(len(LENGTHS))
    norm_length = 5  # data.max_response_length; micro-batches are narrower after trimming

    # reference: the whole mini-batch in one piece
    full_normalizer = loss_normalizer(mask, mode, norm_length)
    full_loss = _actor_loss(tiny_policy, loss_type, mode, everything, mask, old, ref, adv, full_normalizer)
    (full_grad,) = torch.autograd.grad(full_loss, tiny_policy.weight)

    # the actor: each rank computes its local normaliser; all-reduce(SUM) gives N
    world_size = len(RANK_MICRO_BATCHES)
    local = [loss_normalizer(mask[sum(mbs, [])], mode, norm_length) for mbs in RANK_MICRO_BATCHES]
    normalizer = sum(local)
    assert normalizer == full_normalizer
    rank_grads, micro_losses = [], []
    for micro_batches in RANK_MICRO_BATCHES:
        weight = tiny_policy.weight.detach().clone().requires_grad_()  # this rank's replica
        for rows in micro_batches:
            rows = torch.tensor(rows)
            loss = _actor_loss(tiny_policy, loss_type, mode, rows, mask, old, ref, adv, normalizer, weight)
            micro_losses.append(loss.detach())
            (loss * world_size).backward()  # accumulate; x world_size undoes FSDP's average
        rank_grads.append(weight.grad)
    fsdp_grad = sum(rank_grads) / world_size  # what FSDP's all-reduce (average) hands back

    assert_close(torch.stack(micro_losses).sum(), full_loss.detach())
    assert_close(fsdp_grad, full_grad)
    assert full_grad.abs().sum() > 0


# Micro-batches of the LOSSES / MASK mini-batch as the actor cuts them: rows 0-1 (widths kept: 3)
# and row 2 trimmed to its own width 2. Row sums 6, 4 | 15; lengths 3, 1 | 2. With norm_length 3
# (data.max_response_length), each piece is divided by the N of the whole mini-batch.
MICRO_ROWS, MICRO_WIDTHS, NORM_LENGTH = [[0, 1], [2]], [3, 2], 3


@pytest.mark.parametrize(
    ("mode", "expected_local_normalizers", "expected_piece_losses"),
    [
        # N = 4 + 2 tokens = 6: pieces 10/6 + 15/6 = 25/6. Local normalisation would give 10/4 and
        # 15/2, summing to 10 (or averaging to 5), not 25/6.
        ("token", [4.0, 2.0], [10 / 6, 15 / 6]),
        # N = 2 + 1 sequences = 3: (6/3 + 4/1) / 3 = 2 and (15/2) / 3 = 2.5, sum 4.5. Local: 3 and 7.5.
        ("seq", [2.0, 1.0], [2.0, 2.5]),
        # N = 3: 10/3 + 15/3 = 25/3. Local: 5 and 15.
        ("seq-mean-token-sum", [2.0, 1.0], [10 / 3, 5.0]),
        # N = 2 * 3 + 1 * 3 = 9: 10/9 + 15/9 = 25/9. Using the trimmed width 2 of the second piece
        # instead of norm_length would give N = 6 + 2 = 8.
        ("seq-mean-token-sum-norm", [6.0, 3.0], [10 / 9, 15 / 9]),
    ],
    ids=["token", "seq", "seq-mean-token-sum", "seq-mean-token-sum-norm"],
)
def test_micro_batches_divided_by_the_mini_batch_normalizer_add_up(
    mode, expected_local_normalizers, expected_piece_losses
):
    pieces = [(LOSSES[rows, :width], MASK[rows, :width]) for rows, width in zip(MICRO_ROWS, MICRO_WIDTHS)]
    local = [loss_normalizer(mask, mode, NORM_LENGTH) for _, mask in pieces]
    assert local == expected_local_normalizers
    normalizer = sum(local)  # what the all-reduce (SUM) over ranks / micro-batches gives
    piece_losses = [aggregate_loss(losses, mask, mode, normalizer) for losses, mask in pieces]
    assert_close(torch.stack(piece_losses), torch.tensor(expected_piece_losses))
    # and together they are the one-piece loss of test_aggregate_hand_values (25/6, 4.5, 25/3, 25/9)
    assert_close(sum(piece_losses), aggregate_loss(LOSSES, MASK, mode, loss_normalizer(MASK, mode, NORM_LENGTH)))
