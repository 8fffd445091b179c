"""The vision towers' windows batched (easyvlm/models/vision_attention.py) against transformers' own
per-window attention modules: Qwen2-VL, Qwen2.5-VL (windows of unequal lengths), Qwen3-VL; and the
window plans built once per ``cu_seqlens`` tensor of a tower forward, anew for a new or changed one."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from transformers import AutoModelForImageTextToText

from easyvlm.builtin.models import materialize_model
from easyvlm.models import vision_attention
from easyvlm.models.vision_attention import (
    WindowBatchedVisionAttention,
    WindowPlans,
    batch_vision_windows,
    window_plan,
    windowed_attention,
)

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tiny models on a shared 2-core machine (conftest)


def per_window_reference(query, key, value, bounds, scale):
    """One SDPA per window, as transformers' SDPA branch: (N, H, D) -> (N, H, D)."""
    outs = []
    for start, end in zip(bounds[:-1], bounds[1:]):
        q, k, v = (t[start:end].transpose(0, 1)[None] for t in (query, key, value))  # (1, H, L, D)
        outs.append(F.scaled_dot_product_attention(q, k, v, scale=scale)[0].transpose(0, 1))
    return torch.cat(outs)


@pytest.mark.parametrize("bounds", [[0, 4, 8, 12], [0, 3, 7, 10, 14, 14, 15]])
def test_windowed_attention_is_one_sdpa_per_window(bounds):
    # equal windows (the view path) and windows of lengths 3, 4, 3, 4, 0 and 1 (grouped by length:
    # 3s, 4s and the 1; the empty window is skipped, as transformers' split yields an empty chunk)
    torch.manual_seed(0)
    n = bounds[-1]
    query, key, value = (torch.randn(n, 2, 8, requires_grad=True) for _ in range(3))
    out = windowed_attention(query, key, value, torch.tensor(bounds), 0.3)
    expected = per_window_reference(query, key, value, bounds, 0.3)
    torch.testing.assert_close(out, expected, rtol=0, atol=1e-6)
    weights = torch.randn_like(out)
    grads = torch.autograd.grad((out * weights).sum(), (query, key, value))
    expected_grads = torch.autograd.grad((expected * weights).sum(), (query, key, value))
    for got, want in zip(grads, expected_grads):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-6)


def test_windows_that_do_not_cover_the_patches_are_an_error():
    x = torch.zeros(6, 1, 4)
    with pytest.raises(ValueError, match="cover rows 0 .. 4, the tower has 6 patches"):
        windowed_attention(x, x, x, torch.tensor([0, 2, 5]), 1.0)


@pytest.mark.parametrize("name", ["tiny-qwen2.5-vl", "tiny-qwen2-vl", "tiny-qwen3-vl"])
def test_the_batched_tower_is_transformers_tower(name, easyvlm_cache_dir):
    # three images of 12 x 20, 8 x 8 and (two frames of) 4 x 6 patches. Qwen2.5-VL's windows are
    # 8 x 8 patches (112 px), so the first image has windows of 64, 64, 32, 32, 32 and 16 patches
    # (one batch per length) in its windowed layer, and each image is one window in the full layer;
    # Qwen2-VL and Qwen3-VL attend per frame. Same parameter names; the same output and gradients.
    model = AutoModelForImageTextToText.from_pretrained(
        materialize_model(name, cache_dir=easyvlm_cache_dir), dtype=torch.float32, attn_implementation="sdpa")
    tower = model.model.visual
    batched = copy.deepcopy(tower)
    assert batch_vision_windows(batched) == len(tower.blocks) == 2
    assert all(isinstance(block.attn, WindowBatchedVisionAttention) for block in batched.blocks)
    assert list(batched.state_dict()) == list(tower.state_dict())
    config = tower.config
    grid = torch.tensor([[1, 12, 20], [1, 8, 8], [2, 4, 6]])
    torch.manual_seed(0)
    pixels = torch.randn(int(grid.prod(-1).sum()), config.in_channels * config.temporal_patch_size * config.patch_size**2)
    outputs = [module(pixels, grid_thw=grid).pooler_output for module in (tower, batched)]  # (88, hidden)
    torch.testing.assert_close(outputs[1], outputs[0], rtol=0, atol=0)  # bitwise on the CPU
    weights = torch.randn_like(outputs[0])
    for module, out in zip((tower, batched), outputs):
        (out * weights).sum().backward()
    for (name_a, a), (name_b, b) in zip(tower.named_parameters(), batched.named_parameters()):
        assert name_a == name_b
        torch.testing.assert_close(b.grad, a.grad, rtol=0, atol=0, msg=name_a)


def test_only_sdpa_towers_are_replaced(easyvlm_cache_dir):
    # eager is the reference one asks for on purpose; flash attention already takes the windows whole
    model = AutoModelForImageTextToText.from_pretrained(
        materialize_model("tiny-qwen2.5-vl", cache_dir=easyvlm_cache_dir), dtype=torch.float32,
        attn_implementation="eager")
    assert batch_vision_windows(model) == 0


@pytest.fixture
def plan_builds(monkeypatch):
    """The cu_seqlens tensors whose window plan was built (each build is one host sync)."""
    built = []

    def counting(cu_seqlens, device):
        built.append(cu_seqlens)
        return window_plan(cu_seqlens, device)

    monkeypatch.setattr(vision_attention, "window_plan", counting)
    return built


@pytest.mark.parametrize("name", ["tiny-qwen2.5-vl", "tiny-qwen2-vl", "tiny-qwen3-vl"])
def test_a_tower_forward_builds_one_plan_per_cu_seqlens(name, easyvlm_cache_dir, plan_builds):
    # four blocks; Qwen2.5-VL's alternate windowed and full attention (cu_window_seqlens, cu_seqlens,
    # cu_window_seqlens, cu_seqlens): two plans per forward, each reused by the later block of its
    # kind (and by the recomputation of gradient checkpointing); Qwen2-VL and Qwen3-VL: one plan.
    # A second forward passes new tensors: new plans. Output and gradients stay transformers'.
    model = AutoModelForImageTextToText.from_pretrained(
        materialize_model(name, cache_dir=easyvlm_cache_dir), dtype=torch.float32, attn_implementation="sdpa")
    tower = model.model.visual
    tower.blocks.extend(copy.deepcopy(list(tower.blocks)))
    if hasattr(tower, "fullatt_block_indexes"):
        tower.fullatt_block_indexes = [1, 3]
    tower.gradient_checkpointing_enable()
    tower.train()
    batched = copy.deepcopy(tower)
    assert batch_vision_windows(batched) == 4
    copied = copy.deepcopy(batched)  # one memo per model, a copy's its own
    for module in (batched, copied):
        assert len({id(block.attn.plans) for block in module.blocks}) == 1
    assert copied.blocks[0].attn.plans is not batched.blocks[0].attn.plans
    grid = torch.tensor([[1, 12, 20], [1, 8, 8]])
    config = tower.config
    torch.manual_seed(0)
    pixels = torch.randn(int(grid.prod(-1).sum()), config.in_channels * config.temporal_patch_size * config.patch_size**2)
    per_forward = 2 if name == "tiny-qwen2.5-vl" else 1
    for forward in (1, 2):
        outputs = [module(pixels, grid_thw=grid).pooler_output for module in (tower, batched)]
        torch.testing.assert_close(outputs[1], outputs[0], rtol=0, atol=0)
        weights = torch.randn_like(outputs[0])
        for out in outputs:
            (out * weights).sum().backward()
        assert len(plan_builds) == forward * per_forward
        assert len({id(t) for t in plan_builds[-per_forward:]}) == per_forward
    for (param_name, a), b in zip(tower.named_parameters(), batched.parameters()):
        torch.testing.assert_close(b.grad, a.grad, rtol=0, atol=0, msg=param_name)


def test_a_plan_is_served_only_for_its_tensor_unchanged(plan_builds):
    plans = WindowPlans()
    torch.manual_seed(0)
    query, key, value = (torch.randn(14, 2, 8) for _ in range(3))

    def attend(cu_seqlens, bounds):  # through the memo, checked against the per-window reference
        out = windowed_attention(query, key, value, plans.get(cu_seqlens, query.device), 0.3)
        torch.testing.assert_close(out, per_window_reference(query, key, value, bounds, 0.3), rtol=0, atol=1e-6)

    cu_seqlens = torch.tensor([0, 3, 7, 10, 14])
    attend(cu_seqlens, [0, 3, 7, 10, 14])
    attend(cu_seqlens, [0, 3, 7, 10, 14])
    assert len(plan_builds) == 1  # the same tensor, unchanged: the same plan
    cu_seqlens[1:4] = torch.tensor([7, 9, 12])  # changed in place
    attend(cu_seqlens, [0, 7, 9, 12, 14])
    assert len(plan_builds) == 2
    cu_seqlens = torch.tensor([0, 7, 9, 12, 14])  # a new tensor with the same values
    attend(cu_seqlens, [0, 7, 9, 12, 14])
    assert len(plan_builds) == 3
    for bounds in ([0, 2, 14], [0, 7, 14], [0, 2, 14]):  # new tensors, perhaps where a dead one was
        attend(torch.tensor(bounds), bounds)
    assert len(plan_builds) == 6
    with torch.inference_mode():  # no version counter: no memo
        cu_seqlens = torch.tensor([0, 7, 14])
        attend(cu_seqlens, [0, 7, 14])
        attend(cu_seqlens, [0, 7, 14])
    assert len(plan_builds) == 8
