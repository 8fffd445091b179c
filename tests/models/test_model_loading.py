"""Model loading from a ModelConfig: Auto classes per family and role, attention implementations,
overrides, frozen vision tower, gradient checkpointing, LoRA, tokenizer and processor."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from models_testing import build_tiny_text_model

from easyvlm.config.schema import LoraConfig, ModelConfig
from easyvlm.models.loading import (
    ValueHeadModel,
    get_vision_tower,
    load_model,
    load_tokenizer_and_processor,
)
from easyvlm.models.padding_free import VARLEN_ATTENTION


@pytest.fixture(scope="module")
def text_model_path(tmp_path_factory) -> str:
    return build_tiny_text_model(tmp_path_factory.mktemp("qwen2"), "qwen2")


def _cfg(path: str, **kw) -> ModelConfig:
    return ModelConfig(model_path=path, **kw)


def test_vl_policy_defaults(tiny_model_path):
    loaded = load_model(_cfg(tiny_model_path))
    model = loaded.model
    assert type(model).__name__ == "Qwen2_5_VLForConditionalGeneration"
    assert loaded.is_vision_language
    assert model.dtype == torch.float32
    assert model.config._attn_implementation == "sdpa"
    assert model.is_gradient_checkpointing  # ModelConfig default: on
    assert all(p.requires_grad for p in model.parameters())


def test_vl_policy_padding_free_uses_varlen_for_text_only(tiny_model_path):
    model = load_model(_cfg(tiny_model_path, enable_gradient_checkpointing=False), padding_free=True).model
    assert model.config.text_config._attn_implementation == VARLEN_ATTENTION
    assert model.config.vision_config._attn_implementation == "sdpa"
    assert not model.is_gradient_checkpointing


def test_freeze_vision_tower(tiny_model_path):
    model = load_model(_cfg(tiny_model_path, freeze_vision_tower=True)).model
    tower = get_vision_tower(model)
    assert tower is model.model.visual
    frozen = {n for n, p in model.named_parameters() if not p.requires_grad}
    assert frozen == {n for n, _ in model.named_parameters() if n.startswith("model.visual.")}
    assert frozen  # the tower has parameters


def test_reference_model_is_fully_frozen(tiny_model_path):
    model = load_model(_cfg(tiny_model_path), trainable=False).model
    assert not any(p.requires_grad for p in model.parameters())
    assert not model.is_gradient_checkpointing


def test_override_config_reaches_sub_config(tiny_model_path):
    cfg = _cfg(tiny_model_path, override_config={"text_config": {"rms_norm_eps": 1e-3}})
    loaded = load_model(cfg)
    assert loaded.hf_config.text_config.rms_norm_eps == 1e-3
    assert loaded.model.model.language_model.norm.variance_epsilon == 1e-3


def test_flash_attention_falls_back_to_sdpa_without_cuda(tiny_model_path, caplog):
    with caplog.at_level("WARNING", logger="easyvlm.models.loading"):
        model = load_model(_cfg(tiny_model_path, attn_implementation="flash_attention_2"), padding_free=True).model
    assert "model.attn_implementation='flash_attention_2' but no CUDA device; using 'sdpa'" in caplog.text
    assert model.config.vision_config._attn_implementation == "sdpa"
    assert model.config.text_config._attn_implementation == VARLEN_ATTENTION


def test_lora_excluding_the_vision_tower(tiny_model_path):
    cfg = _cfg(tiny_model_path, lora=LoraConfig(rank=4, alpha=8, exclude_modules=".*visual.*"))
    model = load_model(cfg).model
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert trainable and all(".lora_A." in n or ".lora_B." in n for n in trainable)
    assert not any("visual" in n for n in trainable)
    # all-linear: every projection of the decoder gets an adapter (q, k, v, o, gate, up, down)
    layer0 = {n.split("layers.0.")[1].split(".lora_")[0] for n in trainable if "layers.0." in n}
    assert layer0 == {"self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
                      "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"}


def test_vl_critic_is_backbone_plus_value_head(tiny_model_path):
    model = load_model(_cfg(tiny_model_path, enable_gradient_checkpointing=False), role="critic").model
    assert isinstance(model, ValueHeadModel)
    assert type(model.backbone).__name__ == "Qwen2_5_VLModel"
    assert model.score.weight.shape == (1, 128) and torch.equal(model.score.bias, torch.zeros(1))
    ids = torch.tensor([[1, 2, 3]])
    out = model(input_ids=ids).logits  # (1, 3, 1)
    hidden = model.backbone(input_ids=ids).last_hidden_state
    torch.testing.assert_close(out, hidden @ model.score.weight.T + model.score.bias)


def test_text_only_policy_and_critic(text_model_path):
    policy = load_model(_cfg(text_model_path)).model
    assert type(policy).__name__ == "Qwen2ForCausalLM"
    critic = load_model(_cfg(text_model_path), role="critic").model
    assert type(critic).__name__ == "Qwen2ForTokenClassification"
    assert critic.config.num_labels == 1
    assert get_vision_tower(policy) is None
    # freeze_vision_tower on a text-only model is ignored (with a warning), nothing gets frozen
    frozen = load_model(_cfg(text_model_path, freeze_vision_tower=True)).model
    assert all(p.requires_grad for p in frozen.parameters())


def test_tokenizer_and_processor(tiny_model_path, text_model_path):
    tokenizer, processor = load_tokenizer_and_processor(_cfg(tiny_model_path))
    assert type(processor).__name__ == "Qwen2_5_VLProcessor"
    assert tokenizer.convert_tokens_to_ids("<|im_end|>") == tokenizer.eos_token_id
    tokenizer, processor = load_tokenizer_and_processor(_cfg(text_model_path))
    assert processor is None and tokenizer.pad_token == "<|endoftext|>"
    # tokenizer_path wins over model_path
    cfg = dataclasses.replace(_cfg(tiny_model_path), tokenizer_path=text_model_path)
    assert load_tokenizer_and_processor(cfg)[1] is None


def test_missing_model_path_says_which_key():
    with pytest.raises(ValueError, match="model_path is empty"):
        load_model(ModelConfig())


def test_trust_remote_code_is_off_by_default(tmp_path):
    # a checkpoint that ships its own Python code: refused unless the user opts in
    (tmp_path / "config.json").write_text(
        '{"model_type": "shipped_code", "auto_map": {"AutoConfig": "configuration_shipped.ShippedConfig"}}'
    )
    with pytest.raises(ValueError, match="trust_remote_code"):
        load_model(_cfg(str(tmp_path)))
