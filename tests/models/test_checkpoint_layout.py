"""Qwen3-VL-MoE's checkpoint layout (easyvlm/models/checkpoint_layout.py): the builtin's file and the
actor's HF export hold the fused experts as the released checkpoints do, (E, hidden, 2*I) and
(E, I, hidden), which vLLM loads (tests/rollout/test_engine_families.py runs vLLM on that file), and
transformers loads them back to its in-memory weights; other families pass through unchanged."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoConfig, AutoModelForImageTextToText, AutoProcessor

from easyvlm.models.checkpoint_layout import to_checkpoint_layout

GATE_UP = "model.language_model.layers.0.mlp.experts.gate_up_proj"
DOWN = "model.language_model.layers.0.mlp.experts.down_proj"


@pytest.fixture(scope="module")
def moe_dir(easyvlm_cache_dir) -> str:
    from easyvlm.builtin.models import materialize_model

    return str(materialize_model("tiny-qwen3-vl-moe", cache_dir=easyvlm_cache_dir))


@pytest.fixture(scope="module")
def moe_model(moe_dir):
    return AutoModelForImageTextToText.from_pretrained(moe_dir, dtype=torch.float32).eval()


def _assert_checkpoint_layout(file_state: dict, model) -> None:
    """``file_state`` is ``model``'s weights in the checkpoint layout, expert by expert."""
    text = model.config.text_config
    experts, hidden, width = text.num_experts, text.hidden_size, text.moe_intermediate_size
    memory = model.state_dict()
    assert file_state[GATE_UP].shape == (experts, hidden, 2 * width)
    assert file_state[DOWN].shape == (experts, width, hidden)
    for e in range(experts):  # expert e's gate and up rows (transformers' linear weight) are the file's columns
        torch.testing.assert_close(file_state[GATE_UP][e], memory[GATE_UP][e].T, rtol=0, atol=0)
        torch.testing.assert_close(file_state[DOWN][e], memory[DOWN][e].T, rtol=0, atol=0)
    assert file_state.keys() == memory.keys()
    expected = dict(to_checkpoint_layout(model.config, memory.items()))
    for name, tensor in file_state.items():
        assert torch.equal(tensor, expected[name]), name


def test_builtin_file_holds_the_checkpoint_layout(moe_dir, moe_model):
    """The file differs from transformers' in-memory layout exactly in the two fused expert tensors per
    layer, and transformers loads it back to the weights of a fresh build (same seed)."""
    import transformers

    from easyvlm.builtin.models import get_builtin_spec

    _assert_checkpoint_layout(load_file(f"{moe_dir}/model.safetensors"), moe_model)
    torch.manual_seed(get_builtin_spec("tiny-qwen3-vl-moe").seed)
    fresh = transformers.Qwen3VLMoeForConditionalGeneration(moe_model.config).to(torch.float32)
    for name, tensor in fresh.state_dict().items():
        assert torch.equal(moe_model.state_dict()[name], tensor), name


def test_hf_export_writes_the_checkpoint_layout(moe_dir, moe_model, tmp_path):
    """The actor's export (export_hf_model, after save_pretrained) writes what the builtin's file
    holds, and transformers loads it to the exported weights."""
    from easyvlm.workers.actor import export_hf_model

    torch.manual_seed(1)
    state = {k: v + 0.01 * torch.randn_like(v) for k, v in moe_model.state_dict().items()}  # "trained"
    processor = AutoProcessor.from_pretrained(moe_dir)
    files = SimpleNamespace(tokenizer=processor.tokenizer, processor=processor, generation_config=None)
    export_hf_model(state, AutoConfig.from_pretrained(moe_dir), files, tmp_path / "hf")
    exported = AutoModelForImageTextToText.from_pretrained(tmp_path / "hf", dtype=torch.float32)
    for name, tensor in exported.state_dict().items():
        assert torch.equal(tensor, state[name]), name
    _assert_checkpoint_layout(load_file(str(tmp_path / "hf" / "model.safetensors")), exported)


def test_other_families_and_tensors_pass_through(moe_model):
    dense = SimpleNamespace(model_type="qwen3_vl")
    tensor = torch.randn(4, 96, 128)
    [(name, out)] = to_checkpoint_layout(dense, [(GATE_UP, tensor)])
    assert name == GATE_UP and out is tensor
    moe_text = SimpleNamespace(model_type="qwen3_5_moe")  # transformers writes per-expert tensors for it
    assert next(to_checkpoint_layout(moe_text, [(GATE_UP, tensor)]))[1] is tensor
    # Qwen3-VL-MoE: only the fused experts move; the router and the rest stay
    router = "model.language_model.layers.0.mlp.gate.weight"
    memory = moe_model.state_dict()
    out = dict(to_checkpoint_layout(moe_model.config, [(router, memory[router]), (GATE_UP, memory[GATE_UP])]))
    assert out[router] is memory[router]
    assert out[GATE_UP].data_ptr() == memory[GATE_UP].data_ptr()  # a view: the weight sync copies nothing


def test_a_tensor_in_checkpoint_layout_already_is_refused(moe_model):
    already = moe_model.state_dict()[GATE_UP].transpose(-1, -2)
    with pytest.raises(ValueError, match="not transformers' in-memory layout"):
        list(to_checkpoint_layout(moe_model.config, [(GATE_UP, already)]))
