"""The actor on the builtin tiny Qwen2-VL, Qwen3-VL, Qwen3.5, Qwen3.5-MoE and Qwen3-VL-MoE (the tiny
Qwen2.5-VL: test_actor.py, test_shared_prompts.py): log-probs (padded, padding-free, shared prompts)
equal an independent transformers forward per sample, an update equals a hand-written PPO step, the HF export loads
with transformers' Auto classes as the same family and gives the actor's log-probs, and the critic
(the family's backbone plus a value head) gives the backbone's values.

Qwen3-VL differs where the forward could go wrong: a ViT with learned position embeddings and patch
16, DeepStack features added to the first decoder layers at the image tokens (the padding-free and
shared-prompt rows must keep them aligned), interleaved mRoPE, and q/k norms. Qwen3.5 (and its MoE)
adds gated-DeltaNet linear-attention layers, whose convolution and recurrent state must restart per
packed sequence and fork per shared prompt (easyvlm/models/linear_attention.py); the MoE families add
sparse experts behind replayable routers, and Qwen3-VL-MoE's export rewrites its fused experts into
the checkpoint layout. Paths that depend on these modules (LoRA, reference, gradient checkpointing,
checkpoints): test_family_paths.py.
"""

from __future__ import annotations

import pytest
import torch
from test_actor import _reference_update, weights, with_training_keys
from test_ref_critic import critic_config, reference_values
from workers_testing import (
    PROMPTS,
    RESPONSE_LENGTHS,
    actor_spec,
    assert_logprobs_match_reference,
    make_rl_batch,
    reference_logprobs,
)

from easyvlm.workers.actor import ActorWorker

TEMPERATURE = 0.7
FAMILIES = {
    "tiny-qwen2-vl": "Qwen2VLForConditionalGeneration",
    "tiny-qwen3-vl": "Qwen3VLForConditionalGeneration",
    "tiny-qwen3.5": "Qwen3_5ForConditionalGeneration",
    "tiny-qwen3.5-moe": "Qwen3_5MoeForConditionalGeneration",
    "tiny-qwen3-vl-moe": "Qwen3VLMoeForConditionalGeneration",
}


@pytest.fixture(scope="module", params=list(FAMILIES))
def model_name(request) -> str:
    return request.param


@pytest.fixture(scope="module")
def model_dir(model_name, easyvlm_cache_dir) -> str:
    from easyvlm.builtin.models import materialize_model

    return str(materialize_model(model_name, cache_dir=easyvlm_cache_dir))


@pytest.fixture(scope="module")
def batch(model_dir):
    # samples 0, 1 with images of two sizes, 2, 3 text-only (a micro-batch of 2 without images runs
    # the vision tower on the dummy image)
    return make_rl_batch(model_dir, PROMPTS[:4], RESPONSE_LENGTHS[:4])


@pytest.fixture(scope="module")
def group_batch(model_dir):
    # GRPO-like groups: an image prompt and a text-only prompt, 2 samples each
    return make_rl_batch(model_dir, [PROMPTS[1], PROMPTS[2]], [5, 9, 3, 7], n=2)


@pytest.fixture(scope="module")
def reference_model(model_dir):
    from transformers import AutoModelForImageTextToText

    return AutoModelForImageTextToText.from_pretrained(model_dir, attn_implementation="sdpa").eval()


def make_actor(model_dir: str, **overrides) -> ActorWorker:
    return ActorWorker(actor_spec(model_dir, temperature=TEMPERATURE, **overrides), rank=0, world_size=1)


def test_reference_is_the_family(model_name, reference_model):
    assert type(reference_model).__name__ == FAMILIES[model_name]


@pytest.mark.parametrize("mode", ["padded", "padding_free", "shared_prompts"])
def test_logprobs_match_transformers(process_group, model_dir, batch, group_batch, reference_model, mode):
    if mode == "shared_prompts":
        actor = make_actor(
            model_dir, padding_free=True, share_prompts=True, micro_batch_size_per_device_for_experience=4
        )
        data = group_batch
    else:
        actor = make_actor(model_dir, padding_free=mode == "padding_free")
        data = batch
    out = actor.compute_logprobs(data, with_entropy=True)
    assert_logprobs_match_reference(out, reference_model, data, TEMPERATURE)


# The gated-DeltaNet's per-head decay parameters (Qwen3.5's linear-attention layers): their float32
# gradients are sums through the chunked delta rule's cumulative decays, accurate to ~1e-6 absolute
# only (measured on tiny-qwen3.5 against a float64 run: 1.1e-6 for the padded reference, 3.8e-7 per
# sample, on entries up to 5.8e-3; every other weight's gradient is within ~1e-6 relative). Several
# of their entries have gradients of ~1e-7, so AdamW's normalised step there goes in a direction set
# by rounding: after the two steps the actor's and the reference's differ by up to 1.1e-4 = lr / 9
# (tiny-qwen3.5; 5.3e-5 on tiny-qwen3.5-moe). lr / 4 still catches a wrong gradient on any entry
# with a real one (a flipped sign moves the weight ~2 lr over the two steps).
DECAY_PARAMETERS = ("linear_attn.A_log", "linear_attn.dt_bias")


def test_update_equals_a_hand_written_ppo_step(process_group, model_name, model_dir, batch):
    # as test_actor.py: 2 mini-batches of 2, micro-batches of 1, clipping active. MoE: without the
    # load-balancing loss (the hand-written step has none; tests/workers/test_moe_actor.py checks it)
    moe = {"router_aux_loss_coef": 0.0} if "moe" in model_name else {}
    actor = make_actor(model_dir, global_batch_size=2, micro_batch_size_per_device_for_update=1, max_grad_norm=0.5,
                       **moe)
    data = with_training_keys(batch, actor.compute_logprobs(batch)["old_logprobs"])
    before = weights(actor)
    metrics = actor.update_policy(data)
    after = weights(actor)
    expected, grad_norms = _reference_update(model_dir, data, 2, 1e-3, 0.5, "token")
    assert metrics["actor/grad_norm"] == pytest.approx(sum(grad_norms) / 2, rel=1e-5)
    assert min(grad_norms) > 0.5
    assert after.keys() == expected.keys()
    for name in expected:
        atol = 2.5e-4 if name.endswith(DECAY_PARAMETERS) else 5e-5
        torch.testing.assert_close(after[name], expected[name], rtol=1.3e-6, atol=atol, msg=name)
        assert not torch.equal(after[name], before[name]) or "embed_tokens" in name, name


def test_export_hf_loads_with_auto_classes(process_group, model_name, model_dir, batch, tmp_path):
    from transformers import AutoConfig, AutoModelForImageTextToText, AutoProcessor

    actor = make_actor(model_dir, lr=1e-2)
    data = with_training_keys(batch, actor.compute_logprobs(batch)["old_logprobs"])
    actor.update_policy(data)
    actor.export_hf(tmp_path / "hf")
    exported = AutoModelForImageTextToText.from_pretrained(tmp_path / "hf").eval()
    assert type(exported).__name__ == FAMILIES[model_name]
    processor = AutoProcessor.from_pretrained(tmp_path / "hf")
    assert type(processor) is type(AutoProcessor.from_pretrained(model_dir))
    assert type(processor.video_processor) is type(AutoProcessor.from_pretrained(model_dir).video_processor)
    assert AutoConfig.from_pretrained(tmp_path / "hf").to_dict() == exported.config.to_dict()
    trained = weights(actor)
    assert all(torch.equal(trained[k], v) for k, v in exported.state_dict().items())
    expected, _ = reference_logprobs(exported, batch, TEMPERATURE)
    mask = batch["response_mask"]
    torch.testing.assert_close(actor.compute_logprobs(batch)["old_logprobs"][mask], expected[mask])


@pytest.mark.parametrize("padding_free", [False, True])
def test_critic_values_match_the_backbone(process_group, model_dir, batch, padding_free):
    from easyvlm.workers.critic import CriticWorker
    from easyvlm.workers.fsdp import gather_full_state_dict

    critic = CriticWorker(critic_config(model_dir, padding_free=padding_free), rank=0, world_size=1)
    head = {k: v for k, v in gather_full_state_dict(critic.model).items() if k.startswith("score.")}
    values = critic.compute_values(batch)["values"]
    mask = batch["response_mask"]
    torch.testing.assert_close(values[mask], reference_values(model_dir, head, batch)[mask])
