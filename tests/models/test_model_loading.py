"""Model loading from a ModelSpec: Auto classes per family and role, attention implementations,
overrides, frozen vision tower, gradient checkpointing, LoRA targets, meta-device builds,
tokenizer and processor."""

from __future__ import annotations

import dataclasses
import re
import shutil
from pathlib import Path

import pytest
import torch
from models_testing import build_tiny_text_model

from easyvlm.models.loading import (
    ValueHeadModel,
    get_vision_tower,
    load_hf_config,
    load_model,
    load_tokenizer_and_processor,
)
from easyvlm.models.padding_free import VARLEN_ATTENTION
from easyvlm.models.specs import LoraSpec, ModelSpec

# EasyR1's documented comma form (examples/config.yaml), split into a tuple by the plan builder
EASYR1_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@pytest.fixture(scope="module")
def text_model_path(tmp_path_factory) -> str:
    return build_tiny_text_model(tmp_path_factory.mktemp("qwen2"), "qwen2")


def _spec(path: str, override_config: dict | None = None, **kw) -> ModelSpec:
    """What the driver's plan builder makes: a local directory and the config with its overrides."""
    fields = dict(
        model_dir=path,
        hf_config=load_hf_config(path, override_config),
        trust_remote_code=False,
        attn_implementation="sdpa",
        lora=None,
        freeze_vision_tower=False,
        gradient_checkpointing=True,
    )
    fields.update(kw)
    return ModelSpec(**fields)


def _lora(target_modules, exclude_modules=None) -> LoraSpec:
    return LoraSpec(rank=4, alpha=8, target_modules=target_modules, exclude_modules=exclude_modules)


def _adapted_modules(model) -> set[str]:
    """Full names (without PEFT's prefix) of the modules that received a LoRA adapter."""
    names = {n.split(".lora_A.")[0] for n, _ in model.named_parameters() if ".lora_A." in n}
    return {n.removeprefix("base_model.model.") for n in names}


def _linear_modules(model) -> set[str]:
    return {n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)}


def test_vl_policy_defaults(tiny_model_path):
    loaded = load_model(_spec(tiny_model_path))
    model = loaded.model
    assert type(model).__name__ == "Qwen2_5_VLForConditionalGeneration"
    assert loaded.is_vision_language
    assert model.dtype == torch.float32
    assert model.config._attn_implementation == "sdpa"
    assert model.is_gradient_checkpointing
    assert all(p.requires_grad for p in model.parameters())


def test_the_weights_come_from_the_directory(tiny_model_path):
    from safetensors.torch import load_file

    model = load_model(_spec(tiny_model_path)).model
    on_disk = load_file(f"{tiny_model_path}/model.safetensors")
    # the file's names differ from transformers 5's in-memory ones; compare one tensor by value
    in_memory = model.state_dict()["model.language_model.layers.0.self_attn.q_proj.weight"]
    assert any(torch.equal(in_memory, t) for t in on_disk.values())


def test_the_spec_config_is_not_modified(tiny_model_path, text_model_path):
    # the driver's config is shared by the roles: padding-free attention and the critic's
    # num_labels=1 (token-classification models such as Qwen2) go to a copy
    for path in (tiny_model_path, text_model_path):
        spec = _spec(path)
        before = spec.hf_config.to_dict()
        load_model(spec, padding_free=True)
        load_model(spec, role="critic")
        assert spec.hf_config.to_dict() == before, path


def test_vl_policy_padding_free_uses_varlen_for_text_only(tiny_model_path):
    model = load_model(_spec(tiny_model_path, gradient_checkpointing=False), padding_free=True).model
    assert model.config.text_config._attn_implementation == VARLEN_ATTENTION
    assert model.config.vision_config._attn_implementation == "sdpa"
    assert not model.is_gradient_checkpointing


def test_freeze_vision_tower(tiny_model_path):
    model = load_model(_spec(tiny_model_path, freeze_vision_tower=True)).model
    tower = get_vision_tower(model)
    assert tower is model.model.visual
    frozen = {n for n, p in model.named_parameters() if not p.requires_grad}
    assert frozen == {n for n, _ in model.named_parameters() if n.startswith("model.visual.")}
    assert frozen  # the tower has parameters


def test_reference_model_is_fully_frozen(tiny_model_path):
    model = load_model(_spec(tiny_model_path), trainable=False).model
    assert not any(p.requires_grad for p in model.parameters())
    assert not model.is_gradient_checkpointing


def test_override_config_in_the_spec_reaches_the_model(tiny_model_path):
    spec = _spec(tiny_model_path, override_config={"text_config": {"rms_norm_eps": 1e-3}})
    loaded = load_model(spec)
    assert loaded.hf_config.text_config.rms_norm_eps == 1e-3
    assert loaded.model.model.language_model.norm.variance_epsilon == 1e-3


def test_flash_attention_falls_back_to_sdpa_without_cuda(tiny_model_path, caplog):
    with caplog.at_level("WARNING", logger="easyvlm.models.loading"):
        spec = _spec(tiny_model_path, attn_implementation="flash_attention_2")
        model = load_model(spec, padding_free=True).model
    assert "model.attn_implementation='flash_attention_2' but no CUDA device; using 'sdpa'" in caplog.text
    assert model.config.vision_config._attn_implementation == "sdpa"
    assert model.config.text_config._attn_implementation == VARLEN_ATTENTION


def test_lora_all_linear_excluding_the_vision_tower(tiny_model_path):
    model = load_model(_spec(tiny_model_path, lora=_lora("all-linear", ".*visual.*"))).model
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert trainable and all(".lora_A." in n or ".lora_B." in n for n in trainable)
    # all-linear: every linear layer of the decoder, not the output head (peft's rule)
    base = load_model(_spec(tiny_model_path)).model
    decoder = {n for n in _linear_modules(base) if n.startswith("model.language_model.")}
    assert len(decoder) == 14  # 2 layers x (q, k, v, o, gate, up, down)
    assert _adapted_modules(model) == decoder


def test_lora_comma_form_targets_exactly_those_modules(tiny_model_path):
    model = load_model(_spec(tiny_model_path, lora=_lora(EASYR1_TARGETS))).model
    base = load_model(_spec(tiny_model_path)).model
    # a name in the list matches every module whose name ends with it: the 7 projections of both
    # decoder layers and the vision blocks' gate/up/down MLP (Qwen2.5-VL's vision MLP is gated);
    # the vision attention (qkv, proj), the merger and lm_head get none
    expected = {n for n in _linear_modules(base) if n.rsplit(".", 1)[-1] in EASYR1_TARGETS}
    assert _adapted_modules(model) == expected
    assert len(expected) == 2 * 7 + 2 * 3
    assert not any(n.endswith((".qkv", ".proj", "lm_head")) for n in _adapted_modules(model))
    # the same list with the vision tower excluded: the decoder's 14 projections only
    no_vision = load_model(_spec(tiny_model_path, lora=_lora(EASYR1_TARGETS, ".*visual.*"))).model
    assert _adapted_modules(no_vision) == {n for n in expected if n.startswith("model.language_model.")}


def test_lora_regex_string_matches_full_names(tiny_model_path):
    regex = r".*language_model\.layers\.1\.self_attn\.(q_proj|v_proj)"
    model = load_model(_spec(tiny_model_path, lora=_lora(regex))).model
    assert _adapted_modules(model) == {
        "model.language_model.layers.1.self_attn.q_proj",
        "model.language_model.layers.1.self_attn.v_proj",
    }
    assert all(re.fullmatch(regex, n) for n in _adapted_modules(model))


@pytest.mark.parametrize("role", ["policy", "critic"])
def test_on_meta_builds_the_same_model_without_reading_the_directory(tiny_model_path, tmp_path, role):
    lora = _lora(EASYR1_TARGETS) if role == "policy" else None
    real = load_model(_spec(tiny_model_path, lora=lora, freeze_vision_tower=True), role=role).model
    # the meta build gets an empty directory: it must not need a file
    spec = _spec(tiny_model_path, lora=lora, freeze_vision_tower=True)
    meta = load_model(dataclasses.replace(spec, model_dir=str(tmp_path)), role=role, on_meta=True).model
    assert all(t.is_meta for t in [*meta.parameters(), *meta.buffers()])
    assert type(meta) is type(real)
    real_params = {n: (p.shape, p.dtype, p.requires_grad) for n, p in real.named_parameters()}
    assert {n: (p.shape, p.dtype, p.requires_grad) for n, p in meta.named_parameters()} == real_params
    assert {n: (b.shape, b.dtype) for n, b in meta.named_buffers()} == {
        n: (b.shape, b.dtype) for n, b in real.named_buffers()
    }


def test_vl_critic_is_backbone_plus_value_head(tiny_model_path):
    model = load_model(_spec(tiny_model_path, gradient_checkpointing=False), role="critic").model
    assert isinstance(model, ValueHeadModel)
    assert type(model.backbone).__name__ == "Qwen2_5_VLModel"
    assert model.score.weight.shape == (1, 128) and torch.equal(model.score.bias, torch.zeros(1))
    ids = torch.tensor([[1, 2, 3]])
    out = model(input_ids=ids).logits  # (1, 3, 1)
    hidden = model.backbone(input_ids=ids).last_hidden_state
    torch.testing.assert_close(out, hidden @ model.score.weight.T + model.score.bias)


def test_text_only_policy_and_critic(text_model_path):
    policy = load_model(_spec(text_model_path)).model
    assert type(policy).__name__ == "Qwen2ForCausalLM"
    critic = load_model(_spec(text_model_path), role="critic").model
    assert type(critic).__name__ == "Qwen2ForTokenClassification"
    assert critic.config.num_labels == 1
    assert get_vision_tower(policy) is None
    # freeze_vision_tower on a text-only model is ignored (with a warning), nothing gets frozen
    frozen = load_model(_spec(text_model_path, freeze_vision_tower=True)).model
    assert all(p.requires_grad for p in frozen.parameters())


def test_tokenizer_and_processor(tiny_model_path, text_model_path):
    tokenizer, processor = load_tokenizer_and_processor(tiny_model_path, trust_remote_code=False)
    assert type(processor).__name__ == "Qwen2_5_VLProcessor"
    assert tokenizer.convert_tokens_to_ids("<|im_end|>") == tokenizer.eos_token_id
    tokenizer, processor = load_tokenizer_and_processor(text_model_path, trust_remote_code=False)
    assert processor is None and tokenizer.pad_token == "<|endoftext|>"


def test_trust_remote_code_is_honoured_for_the_config(tmp_path):
    # a checkpoint that ships its own Python code: refused unless the user opts in
    from transformers.utils import HF_MODULES_CACHE

    (tmp_path / "config.json").write_text(
        '{"model_type": "shipped_code", "auto_map": {"AutoConfig": "configuration_shipped.ShippedConfig"}}'
    )
    (tmp_path / "configuration_shipped.py").write_text(
        "from transformers import PretrainedConfig\n"
        "class ShippedConfig(PretrainedConfig):\n"
        "    model_type = 'shipped_code'\n"
    )
    with pytest.raises(ValueError, match="trust_remote_code"):
        load_hf_config(str(tmp_path))
    try:
        assert type(load_hf_config(str(tmp_path), trust_remote_code=True)).__name__ == "ShippedConfig"
    finally:  # transformers copied the code into its modules cache under the directory's name
        shutil.rmtree(Path(HF_MODULES_CACHE) / "transformers_modules" / tmp_path.name, ignore_errors=True)


@pytest.mark.parametrize("trust", [False, True])
def test_trust_remote_code_reaches_tokenizer_and_processor(tiny_model_path, monkeypatch, trust):
    import transformers

    seen = {}
    for cls in ("AutoTokenizer", "AutoProcessor"):
        auto = getattr(transformers, cls)
        original = auto.from_pretrained

        def spy(path, *, _cls=cls, _original=original, **kwargs):
            seen[_cls] = kwargs.get("trust_remote_code")
            return _original(path, **kwargs)

        monkeypatch.setattr(auto, "from_pretrained", spy)
    load_tokenizer_and_processor(tiny_model_path, trust_remote_code=trust)
    assert seen == {"AutoTokenizer": trust, "AutoProcessor": trust}


def test_override_config_sets_known_keys_and_refuses_unknown_ones(tiny_model_path):
    from transformers import AutoConfig

    from easyvlm.models.loading import UnknownOverrideError, apply_config_overrides

    config = AutoConfig.from_pretrained(tiny_model_path)
    apply_config_overrides(config, {"text_config": {"rms_norm_eps": 1e-5}, "image_token_id": config.image_token_id})
    assert config.text_config.rms_norm_eps == 1e-5
    # a misspelled key would be stored and ignored by the model (transformers configs take any attribute)
    with pytest.raises(UnknownOverrideError, match="is not an attribute of Qwen2_5_VLTextConfig") as info:
        apply_config_overrides(config, {"text_config": {"rms_norm_epsilon": 1e-5}})
    assert info.value.key == "model.override_config.text_config.rms_norm_epsilon"


def test_an_unknown_override_is_a_config_error_naming_the_key(tiny_model_path):
    from plan_testing import plan_for

    from easyvlm.config.errors import ConfigError

    with pytest.raises(ConfigError) as info:
        plan_for(tiny_model_path, "worker.actor.model.override_config={text_config: {rms_norm_epsilon: 1e-5}}")
    assert info.value.problems[0].key == "worker.actor.model.override_config.text_config.rms_norm_epsilon"
