"""RefWorker (frozen policy) and CriticWorker (value model) on one process, against independent
transformers computations."""

from __future__ import annotations

import pytest
import torch
from plan_testing import plan_for
from workers_testing import PROMPTS, RESPONSE_LENGTHS, actor_spec, critic_spec, make_rl_batch, reference_logprobs

from easyvlm.algorithms.value_losses import value_loss
from easyvlm.workers.critic import CriticWorker
from easyvlm.workers.fsdp import gather_full_state_dict
from easyvlm.workers.ref import RefWorker


@pytest.fixture(scope="module")
def batch(tiny_model_path):
    return make_rl_batch(tiny_model_path, PROMPTS[2:6], RESPONSE_LENGTHS[2:6], seed=1)


@pytest.mark.parametrize("padding_free", [False, True])
def test_ref_logprobs_match_transformers(process_group, tiny_model_path, batch, padding_free):
    from transformers import AutoModelForImageTextToText

    # LoRA on the actor: the reference is the base model without adapters
    spec = plan_for(tiny_model_path, f"worker.actor.padding_free={str(padding_free).lower()}", "worker.actor.model.lora.rank=4",
                    "worker.rollout.temperature=0.5", "algorithm.disable_kl=false").ref
    ref = RefWorker(spec, rank=0, world_size=1)
    assert not any(p.requires_grad for p in ref.model.parameters())
    out = ref.compute_ref_logprobs(batch)
    model = AutoModelForImageTextToText.from_pretrained(tiny_model_path, attn_implementation="sdpa").eval()
    expected, _ = reference_logprobs(model, batch, 0.5)
    mask = batch["response_mask"]
    torch.testing.assert_close(out["ref_logprobs"][mask], expected[mask])
    assert out.keys() == ["ref_logprobs"]


def critic_config(model_path: str, total_steps: int = 5, **overrides):
    defaults = dict(global_batch_size=4, micro_batch_size_per_device_for_update=1,
                    micro_batch_size_per_device_for_experience=2, dynamic_batching=False, cliprange_value=0.2)
    defaults.update(overrides)
    return critic_spec(model_path, total_steps=total_steps, **defaults)


def reference_values(model_dir: str, head: dict[str, torch.Tensor], batch) -> torch.Tensor:
    """(B, T): the backbone's last hidden state at position p_b - 1 + t of each unpadded sample,
    through the value head; 0 where response_mask is False."""
    from transformers import AutoModel

    from easyvlm.data.collate import concat_multi_modal_inputs

    backbone = AutoModel.from_pretrained(model_dir, attn_implementation="sdpa").eval()
    B, T = batch["responses"].shape
    P = batch["input_ids"].shape[1] - T
    values = torch.zeros(B, T)
    for b in range(B):
        keep = batch["attention_mask"][b].bool()
        mm = concat_multi_modal_inputs([batch["multi_modal_inputs"][b]])
        with torch.no_grad():
            hidden = backbone(input_ids=batch["input_ids"][b][keep][None],
                              position_ids=batch["position_ids"][b][1:, keep][:, None], **mm).last_hidden_state[0]
        p_b = int(batch["attention_mask"][b, :P].sum())
        for t in range(T):
            if batch["response_mask"][b, t]:
                values[b, t] = hidden[p_b - 1 + t] @ head["score.weight"][0] + head["score.bias"][0]
    return values


@pytest.mark.parametrize("padding_free", [False, True])
def test_critic_values_and_update(process_group, tiny_model_path, batch, padding_free):
    config = critic_config(tiny_model_path, padding_free=padding_free)
    critic = CriticWorker(config, rank=0, world_size=1)
    head = {k: v for k, v in gather_full_state_dict(critic.model).items() if k.startswith("score.")}
    values = critic.compute_values(batch)["values"]
    expected = reference_values(tiny_model_path, head, batch)
    mask = batch["response_mask"]
    torch.testing.assert_close(values[mask], expected[mask])
    assert torch.all(values[~mask] == 0)

    data = batch.copy()
    data["values"] = values
    data["returns"] = torch.where(mask, values + 1.0, 0.0)  # every value 1 too low: clipped at 0.2
    metrics = critic.update_critic(data)
    # one mini-batch of 4 samples in 4 micro-batches: the metric is the mini-batch loss at the
    # initial weights, 0.5 * max((v - R)^2, (v_clip - R)^2) = 0.5 * max(1, 0.64) = 0.5 per token
    loss, _ = value_loss(values, values, data["returns"], mask, 0.2)
    assert metrics["critic/vf_loss"] == pytest.approx(loss.item(), rel=1e-5) == pytest.approx(0.5, rel=1e-5)
    assert metrics["critic/vf_clipfrac"] == 0.0 and metrics["critic/lr"] == 1e-3
    assert metrics["critic/skipped_steps"] == 0 and metrics["critic/grad_norm"] > 0
    moved = critic.compute_values(batch)["values"]
    assert (moved - values)[mask].mean() > 0  # values moved towards the returns


@pytest.mark.parametrize("padding_free", [False, True])
def test_text_only_model_through_the_workers(process_group, tmp_path, padding_free):
    # Qwen2 (1-D position ids, no vision tower, AutoModelForTokenClassification critic)
    from transformers import AutoModelForCausalLM, AutoModelForTokenClassification, AutoTokenizer
    from workers_testing import build_tiny_qwen2, make_text_batch

    from easyvlm.rollout.tokens import blocked_token_ids

    from easyvlm.workers.actor import ActorWorker

    model_dir = build_tiny_qwen2(tmp_path)
    batch = make_text_batch([5, 2, 7], [3, 6, 1], pad_id=256)
    actor = ActorWorker(actor_spec(model_dir, total_steps=1, padding_free=padding_free, global_batch_size=3,
                                   micro_batch_size_per_device_for_update=1, temperature=0.9), rank=0, world_size=1)
    logprobs = actor.compute_logprobs(batch)["old_logprobs"]
    model = AutoModelForCausalLM.from_pretrained(model_dir, attn_implementation="sdpa").eval()
    mask, T = batch["response_mask"], batch["responses"].shape[1]
    with torch.no_grad():  # padded reference: logits at P-1 .. P+T-2
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                       position_ids=batch["position_ids"]).logits[:, -T - 1 : -1] / 0.9
    # without the ids the rollout never samples (here: LM-head rows beyond the tokenizer's vocabulary)
    blocked = blocked_token_ids(AutoTokenizer.from_pretrained(model_dir), model.config)
    assert blocked  # else the masking is not exercised
    logits[..., blocked] = float("-inf")
    expected = torch.log_softmax(logits, -1).gather(-1, batch["responses"][..., None])[..., 0]
    torch.testing.assert_close(logprobs[mask], expected[mask])

    critic = CriticWorker(critic_config(model_dir, total_steps=1, padding_free=padding_free, global_batch_size=3),
                          rank=0, world_size=1)
    values = critic.compute_values(batch)["values"]
    head = gather_full_state_dict(critic.model)
    reference = AutoModelForTokenClassification.from_pretrained(model_dir, num_labels=1, attn_implementation="sdpa")
    reference.load_state_dict(head)
    with torch.no_grad():
        expected = reference(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                             position_ids=batch["position_ids"]).logits[:, -T - 1 : -1, 0]
    torch.testing.assert_close(values[mask], expected[mask])


@pytest.mark.parametrize("offload_params", [False, True])
def test_ref_offload_params_moves_the_weights_while_idle(process_group, tiny_model_path, batch, monkeypatch, offload_params):
    """worker.ref.offload.offload_params: the weights go to the host after a pass and come back before
    the next one (GPU memory; on the CPU the helpers are no-ops, so their calls are recorded here)."""
    from easyvlm.workers import ref as ref_module

    moves = []
    monkeypatch.setattr(ref_module, "offload_model", lambda model: moves.append("host"))
    monkeypatch.setattr(ref_module, "load_model_to", lambda model, device: moves.append(device.type))
    spec = plan_for(tiny_model_path, f"worker.ref.offload.offload_params={str(offload_params).lower()}").ref
    ref = RefWorker(spec, rank=0, world_size=1)
    ref.offload()
    ref.compute_ref_logprobs(batch.index([0]))
    assert moves == (["host", "cpu"] if offload_params else [])
