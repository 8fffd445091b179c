"""Worker paths that depend on the model's modules, on the builtin Qwen3.5, Qwen3.5-MoE and
Qwen3-VL-MoE (the paths every family shares, log-probs, the update, the HF export and the critic:
test_family_workers.py; the same paths on the tiny Qwen2.5-VL: test_actor.py, test_ref_critic.py;
router replay and the load-balancing loss: test_moe_actor.py):

- LoRA (target all-linear) with a frozen vision tower: Qwen3.5's gated-DeltaNet projections inside
  the segment-aware module (``SegmentedGatedDeltaNet``) get adapters, the MoE routers
  (``ReplayRouter``: a parameter, no Linear) and the fused experts do not; the merged weights handed
  to vLLM give the LoRA actor's log-probs; the tower stays bit-identical.
- the reference worker (frozen, padding-free with shared prompts) against transformers.
- gradient checkpointing: the recomputation in the backward pass sees the packed row's segments
  (Qwen3.5's linear attention) and the experts the forward replayed (MoE, router replay R2).
- a checkpoint round trip: gated-DeltaNet parameters, fused experts and routers through DCP.
"""

from __future__ import annotations

import functools

import pytest
import torch
from plan_testing import plan_for
from test_actor import weights, with_training_keys
from test_moe_actor import _drift_routers
from workers_testing import PROMPTS, RESPONSE_LENGTHS, actor_spec, make_rl_batch, reference_logprobs

from easyvlm.data.batch import ROUTED_EXPERTS_KEY
from easyvlm.workers.actor import ActorWorker

TEMPERATURE = 0.7
MODELS = ["tiny-qwen3.5", "tiny-qwen3.5-moe", "tiny-qwen3-vl-moe"]
MOE = ["tiny-qwen3.5-moe", "tiny-qwen3-vl-moe"]
# Qwen3.5's gated-DeltaNet (linear-attention) projections: nn.Linear layers of its own names
LINEAR_ATTENTION_PROJECTIONS = {"in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "out_proj"}


@functools.cache
def model_dir(name: str) -> str:
    from easyvlm.builtin.models import materialize_model

    return str(materialize_model(name))  # $EASYVLM_CACHE, as the easyvlm_cache_dir fixture


@functools.cache
def mixed_batch(name: str):
    # samples 0, 1 with images of two sizes, 2, 3 text-only
    return make_rl_batch(model_dir(name), PROMPTS[:4], RESPONSE_LENGTHS[:4])


@functools.cache
def group_batch(name: str):
    # GRPO-like groups of 2 (an image prompt, a text-only prompt): shared prompts, trunks and branches
    return make_rl_batch(model_dir(name), [PROMPTS[1], PROMPTS[2]], [5, 9, 3, 7], n=2)


def make_actor(name: str, **overrides) -> ActorWorker:
    return ActorWorker(actor_spec(model_dir(name), temperature=TEMPERATURE, **overrides), rank=0, world_size=1)


def transformers_model(name: str):
    from transformers import AutoModelForImageTextToText

    return AutoModelForImageTextToText.from_pretrained(model_dir(name), attn_implementation="sdpa").eval()


@pytest.mark.parametrize("name", MODELS)
def test_lora_all_linear_with_a_frozen_tower(process_group, name):
    batch = mixed_batch(name)
    actor = make_actor(name, lora=dict(rank=4, alpha=8, target_modules="all-linear"), freeze_vision_tower=True,
                       lr=1e-2, global_batch_size=4)
    adapted = {n.split(".lora_A.")[0].removeprefix("base_model.model.") for n, _ in actor.model.named_parameters()
               if ".lora_A." in n}
    kinds = {n.rsplit(".", 1)[-1] for n in adapted}
    if "qwen3.5" in name:
        assert LINEAR_ATTENTION_PROJECTIONS <= kinds, kinds
    assert {"q_proj", "o_proj", "qkv"} <= kinds, kinds  # full attention and the tower's
    # routers and fused experts are parameters of their own (no Linear), the LM head is left out
    assert not any(n.endswith((".mlp.gate", "lm_head")) or ".experts" in n for n in adapted), sorted(adapted)
    trainable = [n for n, p in actor.model.named_parameters() if p.requires_grad]
    assert trainable and all(".lora_" in n and ".visual." not in n for n in trainable)

    base = transformers_model(name).state_dict()
    before = weights(actor)
    assert before.keys() == base.keys()
    assert all(torch.equal(before[k], base[k]) for k in base)  # LoRA's B starts at 0
    actor.update_policy(with_training_keys(batch, actor.compute_logprobs(batch)["old_logprobs"]))
    after = weights(actor)
    changed = {k for k in after if not torch.equal(after[k], before[k])}
    assert changed == {f"{n}.weight" for n in adapted if not n.startswith("model.visual.")}, sorted(changed)
    # the merged weights (what vLLM receives and export_hf writes) are the LoRA actor's policy
    merged = transformers_model(name)
    merged.load_state_dict(after)
    expected, _ = reference_logprobs(merged, batch, TEMPERATURE)
    mask = batch["response_mask"]
    torch.testing.assert_close(actor.compute_logprobs(batch)["old_logprobs"][mask], expected[mask])


@pytest.mark.parametrize("name", MODELS)
def test_ref_logprobs_match_transformers(process_group, name):
    from easyvlm.workers.ref import RefWorker

    # padding-free with shared prompts (the actor's forward settings); LoRA on the actor: the
    # reference is the base model without adapters
    spec = plan_for(model_dir(name), "worker.actor.padding_free=true", "worker.actor.share_prompts=true",
                    "worker.actor.micro_batch_size_per_device_for_experience=4", "worker.actor.model.lora.rank=4",
                    f"worker.rollout.temperature={TEMPERATURE}", "algorithm.disable_kl=false").ref
    ref = RefWorker(spec, rank=0, world_size=1)
    assert not any(p.requires_grad for p in ref.model.parameters())
    batch = group_batch(name)
    out = ref.compute_ref_logprobs(batch)
    expected, _ = reference_logprobs(transformers_model(name), batch, TEMPERATURE)
    mask = batch["response_mask"]
    torch.testing.assert_close(out["ref_logprobs"][mask], expected[mask])


@pytest.mark.parametrize("name", MODELS)
def test_gradient_checkpointing_recomputes_the_same_forward(process_group, name):
    """One update with transformers' (non-reentrant) gradient checkpointing equals one without: the
    recomputation in the backward pass runs the checkpointed decoder layers again, outside the forward
    call, and must see what the forward saw: the packed row's segments (Qwen3.5's linear attention,
    shared prompts on: branches continue their trunk's state) and, for MoE models replaying the
    recorded experts (R2, routers drifted so that free routing would choose others), the same experts."""
    batch = group_batch(name)
    data = with_training_keys(batch, make_actor(name).compute_logprobs(batch)["old_logprobs"])
    common = dict(global_batch_size=4, micro_batch_size_per_device_for_update=4, lr=1e-2)
    if name in MOE:
        data[ROUTED_EXPERTS_KEY] = make_actor(name, router_replay="R2").compute_logprobs(batch)[ROUTED_EXPERTS_KEY]
        common["router_replay"] = "R2"
    results = []
    for checkpointing in (False, True):
        actor = make_actor(name, enable_gradient_checkpointing=checkpointing, **common)
        if name in MOE:
            _drift_routers(actor)
        results.append((actor.update_policy(data), weights(actor)))
    (plain, plain_weights), (recomputed, recomputed_weights) = results
    assert recomputed.keys() == plain.keys()
    for key in {"actor/pg_loss", "actor/grad_norm", "actor/moe/aux_loss"} & plain.keys():
        assert recomputed[key] == pytest.approx(plain[key], rel=1e-6), key
    for key, value in plain_weights.items():
        torch.testing.assert_close(recomputed_weights[key], value, msg=key)


@pytest.mark.parametrize("name", MOE)
def test_checkpoint_round_trip(process_group, name, tmp_path):
    # Qwen3.5-MoE: gated-DeltaNet parameters, fused experts, shared expert and routers;
    # Qwen3-VL-MoE: fused experts (transformers' in-memory layout) and DeepStack mergers
    batch = mixed_batch(name)
    actor = make_actor(name)
    data = with_training_keys(batch, actor.compute_logprobs(batch)["old_logprobs"])
    actor.update_policy(data)
    actor.save_checkpoint(tmp_path / "ckpt")
    saved = weights(actor)
    saved_optim = {i: {k: v.full_tensor().clone() for k, v in state.items() if k != "step"}
                   for i, state in actor.optimizer.state_dict()["state"].items()}
    after_save = actor.update_policy(data)  # moves weights, optimizer and scheduler on
    expected_next = weights(actor)

    restored = make_actor(name)
    restored.load_checkpoint(tmp_path / "ckpt")
    assert all(torch.equal(saved[k], v) for k, v in weights(restored).items())
    restored_optim = restored.optimizer.state_dict()["state"]
    assert restored_optim.keys() == saved_optim.keys()
    for i, state in saved_optim.items():
        for key, value in state.items():
            assert torch.equal(restored_optim[i][key].full_tensor(), value), (i, key)
    assert restored.trained.scheduler.last_epoch == 1
    # the restored worker continues exactly as the original did
    assert restored.update_policy(data) == after_save
    assert all(torch.equal(expected_next[k], v) for k, v in weights(restored).items())
