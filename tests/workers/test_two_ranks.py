"""FSDP2 over 2 gloo processes gives the log-probs, values, metrics and weights of 1 process.

The 2-rank run cuts the data differently (other micro-batches, dummy passes on the rank with
fewer of them or without images), so this checks the global normalisation across ranks, the
world-size factor on the loss, and that every rank makes the same FSDP collectives.
"""

from __future__ import annotations

import pytest
import torch
import torch.multiprocessing as mp
from workers_testing import (
    LAYOUTS,
    ONE_RANK_ORDER,
    RESPONSE_LENGTHS,
    make_rl_batch,
    run_actor_and_critic,
    training_keys,
    two_rank_main,
)

from easyvlm.workers.dist import find_free_port


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["default", "mixed"])
def test_two_ranks_equal_one_rank(process_group, tiny_model_path, tmp_path, layout):
    """default: images and text on both ranks; mixed: rank 0 text only, rank 1 images and videos."""
    assert_two_ranks_equal_one_rank(tiny_model_path, layout, tmp_path)


@pytest.mark.slow
def test_two_ranks_with_the_vision_cache(process_group, tiny_model_path, tmp_path):
    """The mixed layout with a frozen tower behind the vision cache: rank 0 (text only) encodes its
    dummies once, rank 1 its images and videos, so the ranks run the tower unequally often; the
    tower's blocks then sit in the root's FSDP unit (no collective of their own), or this hangs."""
    assert_two_ranks_equal_one_rank(tiny_model_path, "mixed", tmp_path, {"freeze_vision_tower": True, "vision_cache_mb": 64})


@pytest.mark.slow
def test_two_ranks_equal_one_rank_on_qwen3_5_moe(process_group, easyvlm_cache_dir, tmp_path):
    """The tiny Qwen3.5-MoE: gated-DeltaNet layers (segment-aware, under gradient checkpointing) and
    sparse experts with their routers, sharded by FSDP2 and built on the meta device on rank 1
    (rank-0 init), with rank 1's dummy passes through the routers. Without the load-balancing loss:
    it is a nonlinear function of each micro-batch's routing (not split-invariant), and the ranks cut
    other micro-batches than one process does."""
    from easyvlm.builtin.models import materialize_model

    model_path = str(materialize_model("tiny-qwen3.5-moe", cache_dir=easyvlm_cache_dir))
    assert_two_ranks_equal_one_rank(model_path, "default", tmp_path, {"router_aux_loss_coef": 0.0})


def assert_two_ranks_equal_one_rank(model_path: str, layout: str, tmp_path, actor_overrides: dict | None = None):
    out_file = str(tmp_path / "two_ranks.pt")
    mp.spawn(two_rank_main, args=(2, find_free_port(), model_path, out_file, layout, actor_overrides), nprocs=2,
             join=True)
    two = torch.load(out_file, weights_only=False)

    full = make_rl_batch(model_path, LAYOUTS[layout], RESPONSE_LENGTHS)
    noise, advantages = training_keys(full)
    order = torch.tensor(ONE_RANK_ORDER)
    one = run_actor_and_critic(
        model_path, full.index(order), noise[order], advantages[order], rank=0, world_size=1,
        actor_overrides=actor_overrides,
    )

    mask = full["response_mask"][order]
    torch.testing.assert_close(one["logprobs"][mask], two["logprobs"][order][mask])
    torch.testing.assert_close(one["values"][mask], two["values"][order][mask])
    # rel 1e-5: float32 sums over micro-batches and ranks in a different order
    for role, keys in (("actor", ("pg_loss", "entropy_loss", "grad_norm", "ppo_kl")), ("critic", ("vf_loss", "grad_norm"))):
        for key in keys:
            name = f"{role}/{key}"
            expected = two[f"{role}_metrics"][name]
            assert one[f"{role}_metrics"][name] == pytest.approx(expected, rel=1e-5, abs=1e-7), name
    assert one["actor_metrics"]["actor/skipped_steps"] == two["actor_metrics"]["actor/skipped_steps"] == 0
    for which in ("actor_weights", "critic_weights"):
        assert one[which].keys() == two[which].keys()
        for name, value in one[which].items():
            # atol lr/20: AdamW's 1/(sqrt(v) + 1e-8) turns float32 summation-order differences of
            # near-zero gradient entries into a fraction of one lr-sized step
            torch.testing.assert_close(value, two[which][name], rtol=1.3e-6, atol=5e-5, msg=f"{which} {name}")
