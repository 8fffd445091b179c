"""The checks that need the model's config (easyvlm.plan.checks): which vision-language families pass."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from easyvlm.config.schema import PPOConfig
from easyvlm.models.position_ids import MROPE_MODEL_TYPES
from easyvlm.plan.checks import model_problems


def _hf_config(model_type: str, vision: bool = True) -> SimpleNamespace:
    return SimpleNamespace(model_type=model_type, vision_config=object() if vision else None,
                           num_attention_heads=4, num_key_value_heads=2)


@pytest.mark.parametrize("model_type", sorted(MROPE_MODEL_TYPES))
def test_every_family_with_mrope_position_ids_is_accepted(model_type):
    # qwen3_vl_moe included: position_ids lays out its videos as qwen3_vl's
    assert model_problems(PPOConfig(), _hf_config(model_type), "cuda") == []


def test_other_vision_language_models_are_refused_and_text_models_pass():
    [problem] = model_problems(PPOConfig(), _hf_config("llava"), "cuda")
    assert problem.key == "worker.actor.model.model_path"
    assert problem.message == ("is a 'llava' vision-language model; easyvlm supports qwen2_vl, qwen2_5_vl, qwen3_vl, "
                               "qwen3_vl_moe and text-only causal LMs")
    assert model_problems(PPOConfig(), _hf_config("llama", vision=False), "cuda") == []
