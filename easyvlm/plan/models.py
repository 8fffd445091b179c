"""The model files of a run, resolved and loaded once in the driver (the `ModelBundle`), and the
`ModelSpec` a worker builds its model from."""

from __future__ import annotations

import easyvlm.builtin
from easyvlm.config.checks import lora_module_names
from easyvlm.config.errors import ConfigError, Problem
from easyvlm.models.settings import ModelConfig
from easyvlm.models.specs import LoraSpec, ModelBundle, ModelSpec, TokenIds
from easyvlm.utils.compose import settings_of


def load_bundle(model: ModelConfig, key: str = "worker.actor.model") -> ModelBundle:
    """Resolve the model and tokenizer paths and load config, tokenizer, processor and token ids.
    Raises ConfigError naming ``key`` when the files do not fit together."""
    from transformers import GenerationConfig

    from easyvlm.models.paths import resolve_model_path
    from easyvlm.models.loading import load_tokenizer_and_processor
    from easyvlm.rollout.tokens import blocked_token_ids, eos_token_ids, pad_token_id

    assert model.model_path, "validate() requires worker.actor.model.model_path"
    easyvlm.builtin.register()  # builtin: model paths and data sets resolve from here on (rm calls this alone)
    spec = model_spec(model, resolve_model_path(model.model_path), trainable_lora=True)
    same_tokenizer = model.tokenizer_path in (None, model.model_path)
    tokenizer_dir = spec.model_dir if same_tokenizer else resolve_model_path(model.tokenizer_path)
    tokenizer_path = model.model_path if same_tokenizer else model.tokenizer_path
    tokenizer, processor = load_tokenizer_and_processor(tokenizer_dir, model.trust_remote_code)
    try:
        generation_config = GenerationConfig.from_pretrained(spec.model_dir)
    except OSError:  # no generation_config.json: the tokenizer's EOS alone ends responses
        generation_config = None
    try:
        tokens = TokenIds(
            pad=pad_token_id(tokenizer),
            eos=tuple(eos_token_ids(tokenizer, generation_config)),
            blocked=tuple(blocked_token_ids(tokenizer, spec.hf_config)),
        )
    except ValueError as err:
        raise ConfigError([Problem(f"{key}.tokenizer_path", str(err))]) from err
    return ModelBundle(spec, tokenizer, processor, generation_config, tokens, tokenizer_dir, tokenizer_path)


def model_spec(model: ModelConfig, model_dir: str, trainable_lora: bool, key: str = "worker.actor.model") -> ModelSpec:
    """The `ModelSpec` of ``model`` whose files are in ``model_dir`` (loads its config; an unknown
    ``override_config`` key is a ConfigError naming it)."""
    from easyvlm.models.loading import UnknownOverrideError, load_hf_config

    lora = model.lora
    lora_spec = None
    if trainable_lora and lora.rank > 0:
        names = lora_module_names(lora.target_modules)
        lora_spec = LoraSpec(lora.rank, lora.alpha, names if names is not None else lora.target_modules, lora.exclude_modules)
    try:
        hf_config = load_hf_config(model_dir, dict(model.override_config), model.trust_remote_code)
    except UnknownOverrideError as err:
        raise ConfigError([Problem(err.key.replace("model.override_config", f"{key}.override_config", 1), str(err))]) from err
    # trust_remote_code, attn_implementation and freeze_vision_tower: the model section's keys
    return settings_of(
        ModelSpec, model,
        model_dir=model_dir,
        hf_config=hf_config,
        lora=lora_spec,
        gradient_checkpointing=model.enable_gradient_checkpointing,
        model_path=model.model_path or "",
    )
