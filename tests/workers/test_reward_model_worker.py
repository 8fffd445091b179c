"""The reward model worker against transformers' own forward of the exported reward model."""

from __future__ import annotations

import pytest
import torch
from plan_testing import plan_for
from workers_testing import PROMPTS, RESPONSE_LENGTHS, make_rl_batch

from easyvlm.config.errors import ConfigError
from easyvlm.data.collate import concat_multi_modal_inputs
from easyvlm.workers.reward_model import RewardModelWorker

RM_REWARD = "worker.reward.reward_function=reward_functions/reward_model.py:compute_score"


def rm_plan(model_path: str, rm_path: str, *overrides: str):
    return plan_for(model_path, "worker.reward_model.enable=true", f"worker.reward_model.model.model_path={rm_path}",
                    RM_REWARD, *overrides)


def transformers_scores(export_dir: str, batch) -> torch.Tensor:
    """(B,): each row alone, unpadded, through AutoModelForSequenceClassification, which pools the
    last token; no position ids given, so transformers computes the mRoPE index itself."""
    from transformers import AutoModelForSequenceClassification

    from easyvlm.models.reward_model import register_sequence_classification

    register_sequence_classification()
    model = AutoModelForSequenceClassification.from_pretrained(export_dir, attn_implementation="sdpa").eval()
    scores = []
    for b in range(len(batch)):
        keep = batch["attention_mask"][b].bool()
        ids = batch["input_ids"][b][keep]
        assert int(ids[-1]) != model.config.get_text_config().pad_token_id  # else transformers would pool an earlier token
        with torch.no_grad():
            out = model(input_ids=ids[None], **concat_multi_modal_inputs([batch["multi_modal_inputs"][b]]))
        scores.append(out.logits[0, 0])
    return torch.stack(scores)


@pytest.mark.parametrize("padding_free", [False, True])
def test_worker_scores_equal_transformers_forward(process_group, tiny_model_path, exported_reward_model, padding_free):
    # four samples of two prompts (shared prompts when padding-free), responses of 3..9 tokens
    batch = make_rl_batch(tiny_model_path, [PROMPTS[2], PROMPTS[2], PROMPTS[3], PROMPTS[3]], RESPONSE_LENGTHS[:4], seed=1)
    spec = rm_plan(tiny_model_path, exported_reward_model, f"worker.reward_model.padding_free={str(padding_free).lower()}",
                   "worker.reward_model.micro_batch_size_per_device=3").reward_model
    worker = RewardModelWorker(spec, rank=0, world_size=1)
    assert not any(p.requires_grad for p in worker.model.parameters())
    scores = worker.compute_scores(batch)["rm_scores"]
    expected = transformers_scores(exported_reward_model, batch)
    assert scores.shape == (4,) and expected.abs().max() > 1e-3  # a trained head: scores are not all ~0
    torch.testing.assert_close(scores, expected, rtol=1e-5, atol=1e-5)


def test_a_policy_checkpoint_is_refused(tiny_model_path):
    with pytest.raises(ConfigError, match=r"is not a reward model: its config.json names architectures "
                                          r"\['Qwen2_5_VLForConditionalGeneration'\]"):
        rm_plan(tiny_model_path, tiny_model_path)


def test_a_classification_head_that_is_not_scalar_is_refused(tiny_model_path, exported_reward_model, tmp_path):
    import json
    import shutil

    copy = tmp_path / "two_labels"
    shutil.copytree(exported_reward_model, copy)
    config = json.loads((copy / "config.json").read_text())
    config["id2label"] = {"0": "bad", "1": "good"}  # num_labels follows id2label
    (copy / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError, match="has a 2-way classification head"):
        rm_plan(tiny_model_path, str(copy))


def test_keys_reach_the_reward_model_spec(tiny_model_path, exported_reward_model):
    spec = rm_plan(
        tiny_model_path, exported_reward_model,
        "worker.reward_model.micro_batch_size_per_device=5", "worker.reward_model.padding_free=false",
        "worker.reward_model.normalize=running", "worker.reward_model.model.attn_implementation=eager",
        "worker.reward_model.model.trust_remote_code=true",
        "worker.reward_model.model.override_config={text_config: {rms_norm_eps: 0.001}}",
        "worker.reward_model.fsdp.enable_full_shard=false", "worker.reward_model.fsdp.enable_cpu_offload=true",
        "worker.reward_model.fsdp.enable_rank0_init=false", "worker.reward_model.fsdp.use_orig_params=true",
        "worker.reward_model.fsdp.torch_dtype=bf16", "worker.reward_model.fsdp.fsdp_size=1",
        "worker.reward_model.fsdp.mp_param_dtype=fp32", "worker.reward_model.fsdp.mp_reduce_dtype=bf16",
        "worker.reward_model.fsdp.mp_buffer_dtype=bf16",
    ).reward_model
    assert spec.model.model_dir == exported_reward_model
    assert spec.forward.experience.micro_batch_size == 5 and not spec.forward.settings.padding_free
    assert spec.normalize == "running"
    assert spec.model.attn_implementation == "eager" and spec.model.trust_remote_code
    assert spec.model.hf_config.get_text_config().rms_norm_eps == 0.001
    assert (spec.fsdp.enable_full_shard, spec.fsdp.enable_cpu_offload, spec.fsdp.enable_rank0_init, spec.fsdp.use_orig_params,
            spec.fsdp.torch_dtype, spec.fsdp.fsdp_size) == (False, True, False, True, "bf16", 1)
    assert (spec.fsdp.mp_param_dtype, spec.fsdp.mp_reduce_dtype, spec.fsdp.mp_buffer_dtype) == ("fp32", "bf16", "bf16")
    default = rm_plan(tiny_model_path, exported_reward_model).reward_model
    assert default.forward.experience.micro_batch_size == 16 and default.forward.settings.padding_free
    assert default.normalize == "none"
    assert plan_for(tiny_model_path).reward_model is None  # off by default


@pytest.mark.parametrize("overrides, key, message", [
    (["worker.reward_model.normalize=running"], "worker.reward_model.normalize", "enable is false, so no reward model runs"),
    (["worker.reward_model.model.model_path=x"], "worker.reward_model.model.model_path", "enable is false"),
    ([RM_REWARD], "worker.reward_model.enable", "returns the reward model's score"),
    (["worker.reward_model.enable=true", RM_REWARD], "worker.reward_model.model.model_path", "is unset"),
    (["worker.reward_model.enable=true", "worker.reward_model.model.model_path=x", RM_REWARD,
      "worker.reward_model.micro_batch_size_per_device=0"], "worker.reward_model.micro_batch_size_per_device", "must be > 0"),
])
def test_reward_model_keys_are_checked(overrides, key, message):
    from easyvlm.config.loader import load_config
    from easyvlm.config.validate import find_problems

    problems = find_problems(load_config(["config=examples/config.yaml", *overrides]))
    assert any(p.key == key and message in p.message for p in problems), problems
