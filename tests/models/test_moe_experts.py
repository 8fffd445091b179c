"""How the MoE experts compute (``model.experts_implementation``) and where expert parallelism puts
them (``easyvlm.models.expert_parallel``'s layout; its numbers on 2 ranks: tests/workers/test_expert_parallel.py).

Reference: transformers' eager loop over experts (one product per expert hit), the same weights."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from easyvlm.models.expert_parallel import expert_parallel_layout

MODELS = ["tiny-qwen3.5-moe", "tiny-qwen3-vl-moe"]


@pytest.fixture(scope="module", params=MODELS)
def moe_spec(request, easyvlm_cache_dir):
    from easyvlm.builtin.models import materialize_model
    from easyvlm.models.loading import load_hf_config
    from easyvlm.models.specs import ModelSpec

    model_dir = str(materialize_model(request.param, cache_dir=easyvlm_cache_dir))
    return ModelSpec(model_dir=model_dir, hf_config=load_hf_config(model_dir), trust_remote_code=False,
                     attn_implementation="sdpa", lora=None, freeze_vision_tower=False, gradient_checkpointing=False)


def _experts_forward_backward(spec, implementation):
    """(logits, {name: gradient}) of a left-padded text batch through ``load_model`` with
    ``experts_implementation``; the sum of squared logits is the loss."""
    from easyvlm.models.loading import load_model

    model = load_model(dataclasses.replace(spec, experts_implementation=implementation), padding_free=False).model
    experts = [m for m in model.modules() if type(m).__name__.endswith("Experts")]
    assert experts and {m.config._experts_implementation for m in experts} == {implementation or "grouped_mm"}
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 256, (2, 24), generator=g)
    mask = torch.ones(2, 24, dtype=torch.long)
    mask[1, :5] = 0
    logits = model(input_ids=ids, attention_mask=mask).logits
    logits.square().sum().backward()
    return logits.detach(), {n: p.grad for n, p in model.named_parameters() if p.grad is not None}


def test_grouped_experts_equal_the_eager_loop(moe_spec):
    """One grouped product per projection and layer gives the eager loop's logits and every gradient
    (the experts', the routers' and the rest) within float32 rounding: the same products, summed in
    another order. Gradients within 1e-6 of each tensor's largest entry, and never less than 1e-6
    absolute (float32's 1.2e-7 over sums of a few hundred O(1) terms: a gradient that is a small
    difference of large terms, e.g. Qwen3.5's dt_bias at 1.1e-3, keeps the terms' absolute rounding;
    seen: at most 3.9e-7 absolute there, 3e-7 of the largest entry elsewhere)."""
    eager_logits, eager_grads = _experts_forward_backward(moe_spec, "eager")
    for implementation in ("grouped_mm", None):  # None: the default, transformers' grouped products
        logits, grads = _experts_forward_backward(moe_spec, implementation)
        torch.testing.assert_close(logits, eager_logits, rtol=1e-5, atol=1e-5)
        assert grads.keys() == eager_grads.keys()
        assert any("experts" in name for name in grads) and any("gate" in name for name in grads)
        for name, grad in grads.items():
            reference = eager_grads[name]
            assert (grad - reference).abs().max() <= 1e-6 * max(reference.abs().max(), 1.0), name


def test_expert_parallel_layout_by_hand():
    # 8 ranks in groups of 4: {0..3} and {4..7}; rank 6 holds the third quarter of the experts and
    # shares them with rank 2 (its expert-data-parallel group)
    layout = expert_parallel_layout(6, 8, 4)
    assert layout.group_ranks == (4, 5, 6, 7) and layout.index == 2 and layout.replica_ranks == (2, 6)
    assert layout.local_experts(128) == range(64, 96)
    # 2 ranks in one group: each holds half, nobody else holds the same half
    assert [expert_parallel_layout(r, 2, 2).local_experts(4) for r in (0, 1)] == [range(0, 2), range(2, 4)]
    assert expert_parallel_layout(1, 2, 2).replica_ranks == (1,)
    # size 1: every rank holds every expert
    assert expert_parallel_layout(3, 4, 1).local_experts(8) == range(0, 8)
    with pytest.raises(ValueError, match="must be >= 1 and divide the 6 ranks"):
        expert_parallel_layout(0, 6, 4)
