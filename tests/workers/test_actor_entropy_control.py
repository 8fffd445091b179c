"""The driver's adaptive entropy coefficient (worker.actor.use_adaptive_entropy) in a real actor
update on one process: it replaces worker.actor.entropy_coeff in the loss, the loss moves by exactly
-c x entropy, and the update reports the token-mean entropy the controller steps on."""

from __future__ import annotations

import pytest
import torch
from test_actor import make_actor, with_training_keys
from workers_testing import PROMPTS, RESPONSE_LENGTHS, make_rl_batch


@pytest.fixture(scope="module")
def batch(tiny_model_path):
    return make_rl_batch(tiny_model_path, PROMPTS[:4], RESPONSE_LENGTHS[:4])


def recording(actor, monkeypatch) -> list[tuple[torch.Tensor, float]]:
    """Every micro-batch loss of the actor's next updates, with its aggregated entropy (entropy_loss)."""
    seen, update = [], actor.trained.update

    def spy(batch, micro_loss):
        def recorded(micro, normalizer):
            out = micro_loss(micro, normalizer)
            seen.append((out.loss.detach().clone(), out.sums["entropy_loss"]))
            return out

        return update(batch, recorded)

    monkeypatch.setattr(actor.trained, "update", spy)
    return seen


def test_the_drivers_coefficient_enters_the_loss_as_minus_c_times_entropy(process_group, tiny_model_path, batch, monkeypatch):
    # the coefficient is what the driver's controller (use_adaptive_entropy) hands each update.
    # lr 0: the weights stay, so the three updates see the same forward passes. 2 mini-batches of 2
    # samples, micro-batches of 1 (4 micro-batch losses per update); loss_avg_mode seq, so that the
    # loss's aggregated entropy (seq-mean-token-mean) differs from the token mean the controller reads
    actor = make_actor(tiny_model_path, entropy_coeff=0.1, lr=0.0, loss_avg_mode="seq", global_batch_size=2,
                       micro_batch_size_per_device_for_update=1)
    data = with_training_keys(batch, actor.compute_logprobs(batch)["old_logprobs"])
    fresh = actor.compute_logprobs(data, with_entropy=True)
    seen = recording(actor, monkeypatch)
    no_bonus = actor.update_policy(data, entropy_coeff=0.0)  # what the controller hands out while gated off
    base = list(seen)
    seen.clear()
    adaptive = actor.update_policy(data, entropy_coeff=0.3)
    with_c = list(seen)
    seen.clear()
    fixed = actor.update_policy(data)  # no coefficient from the driver: the spec's entropy_coeff 0.1
    assert len(base) == len(with_c) == len(seen) == 4
    for (loss0, entropy0), (loss_c, entropy_c), (loss_fixed, _) in zip(base, with_c, seen):
        assert entropy_c == entropy0
        # L(c) = L_pg - c * H_agg, in the loss's own float32 arithmetic: exactly
        h = torch.tensor(entropy0, dtype=torch.float32)
        assert torch.equal(loss_c, loss0 - 0.3 * h), (loss_c, loss0, h)
        assert torch.equal(loss_fixed, loss0 - 0.1 * h)
        assert loss_c != loss0
    assert no_bonus["actor/pg_loss"] == adaptive["actor/pg_loss"] == fixed["actor/pg_loss"]
    # actor/entropy (with a driver's coefficient only): per mini-batch the mean over its valid
    # tokens of the exact entropy, then the mean over the 2 mini-batches
    mask = data["response_mask"]
    minis = (slice(0, 2), slice(2, 4))
    token_mean = sum(fresh["entropies"][rows][mask[rows]].mean().item() for rows in minis) / 2
    # the loss's seq-mean-token-mean: per mini-batch the mean over its 2 sequences of their token means
    seq_mean = sum(sum(fresh["entropies"][i][mask[i]].mean().item() for i in range(r.start, r.stop)) / 2 for r in minis) / 2
    assert abs(token_mean - seq_mean) > 1e-4 * token_mean  # the tiny model's entropies are near ln(vocab) everywhere
    assert adaptive["actor/entropy"] == pytest.approx(token_mean, rel=1e-6)
    assert adaptive["actor/entropy_loss"] == pytest.approx(seq_mean, rel=1e-6)
    assert no_bonus["actor/entropy"] == pytest.approx(token_mean, rel=1e-6)
    assert "actor/entropy" not in fixed
