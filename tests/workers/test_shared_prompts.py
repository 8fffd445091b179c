"""Shared prompts (``worker.actor.share_prompts``): GRPO groups run their prompt and image once.

The log-probs must equal an independent transformers forward per sample, the update must equal the
unshared update, and the packed row must really be shorter (else the other two tests prove nothing).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from workers_testing import PROMPTS, actor_spec, assert_logprobs_match_reference, make_rl_batch

from easyvlm.workers.actor import ActorWorker

TEMPERATURE = 0.7
# 3 prompts x 3 samples: an image prompt, another image size, a text-only prompt; ragged responses
GROUP_PROMPTS = [PROMPTS[0], PROMPTS[1], PROMPTS[2]]
GROUP_RESPONSES = [5, 9, 3, 7, 1, 8, 4, 6, 2]


@pytest.fixture(scope="module")
def group_batch(tiny_model_path):
    return make_rl_batch(tiny_model_path, GROUP_PROMPTS, GROUP_RESPONSES, n=3)


def make_actor(model_path: str, update_micro: int | None = None, **overrides) -> ActorWorker:
    spec = actor_spec(model_path, temperature=TEMPERATURE, **overrides)
    if update_micro is not None:
        micro = dataclasses.replace(spec.update.micro, micro_batch_size=update_micro)
        spec = dataclasses.replace(spec, update=dataclasses.replace(spec.update, micro=micro))
    return ActorWorker(spec, rank=0, world_size=1)


def packed_lengths(actor: ActorWorker, batch) -> list[int]:
    """Tokens of each packed row the text decoder ran on, in compute_logprobs."""
    lengths = []
    model = actor.model.model.language_model
    handle = model.register_forward_pre_hook(lambda _m, _a, kw: lengths.append(kw["inputs_embeds"].shape[1]), with_kwargs=True)
    try:
        actor.compute_logprobs(batch)
    finally:
        handle.remove()
    return lengths


@pytest.mark.parametrize("micro", [9, 4])
def test_shared_logprobs_match_transformers(process_group, tiny_model_path, group_batch, micro):
    # micro 9: every group shared whole; micro 4: groups cut across micro-batches ([3 + 1], [2 + 2], [1])
    from transformers import AutoModelForImageTextToText

    actor = make_actor(tiny_model_path, share_prompts=True, micro_batch_size_per_device_for_experience=micro)
    out = actor.compute_logprobs(group_batch, with_entropy=True)
    reference = AutoModelForImageTextToText.from_pretrained(tiny_model_path, attn_implementation="sdpa").eval()
    assert_logprobs_match_reference(out, reference, group_batch, TEMPERATURE)


def test_shared_prompts_shorten_the_packed_row(process_group, tiny_model_path, group_batch):
    # unshared: every sample's prompt + response; shared: each prompt once + every response
    prompt_tokens = group_batch["attention_mask"][:, : -group_batch["responses"].shape[1]].sum(-1).tolist()
    unshared = sum(prompt_tokens) + sum(GROUP_RESPONSES)
    shared = sum(prompt_tokens[::3]) + sum(GROUP_RESPONSES)
    assert shared < unshared * 0.6  # the prompts (~20-40 tokens) dominate these short responses
    one_micro = dict(micro_batch_size_per_device_for_experience=9)
    # + 1: the batch has images but no video, so the forward adds a one-token dummy video row (every
    # micro-batch runs the vision tower for images and for videos: vision_dummy.with_dummy_image)
    assert packed_lengths(make_actor(tiny_model_path, share_prompts=False, **one_micro), group_batch) == [unshared + 1]
    assert packed_lengths(make_actor(tiny_model_path, share_prompts=True, **one_micro), group_batch) == [shared + 1]


def test_shared_update_equals_unshared(process_group, tiny_model_path, group_batch):
    # one mini-batch of 9 in micro-batches of 5 (a group cut in two); max_grad_norm 0.5 so clipping
    # is active and the gradient norm (which AdamW's scale-free step would hide) is compared too
    # (the config check wants micro-batches that divide the mini-batch: the spec gets 5 after the check)
    settings = dict(global_batch_size=9, micro_batch_size_per_device_for_update=3, max_grad_norm=0.5,
                    extra=("data.rollout_batch_size=9",), update_micro=5)
    gen = torch.Generator().manual_seed(0)
    mask = group_batch["response_mask"]
    data = group_batch.copy()
    unshared = make_actor(tiny_model_path, share_prompts=False, **settings)
    old = unshared.compute_logprobs(group_batch)["old_logprobs"]
    data["old_logprobs"] = torch.where(mask, old + 0.3 * torch.randn(old.shape, generator=gen), 0.0)
    data["advantages"] = torch.where(mask, torch.randn(old.shape, generator=gen), 0.0)
    shared = make_actor(tiny_model_path, share_prompts=True, **settings)
    metrics_unshared = unshared.update_policy(data)
    metrics_shared = shared.update_policy(data)
    assert metrics_unshared["actor/grad_norm"] > 0.5
    assert metrics_shared["actor/grad_norm"] == pytest.approx(metrics_unshared["actor/grad_norm"], rel=1e-5)
    assert metrics_shared["actor/pg_loss"] == pytest.approx(metrics_unshared["actor/pg_loss"], rel=1e-5)
    after_unshared, after_shared = unshared.state_dict_for_sync(), shared.state_dict_for_sync()
    for name, value in after_unshared.items():
        # atol lr/20, as in test_actor: AdamW's 1/sqrt(v) amplifies float32 summation-order noise
        # on gradient entries near 1e-8
        torch.testing.assert_close(after_shared[name], value, rtol=1.3e-6, atol=5e-5, msg=name)


def test_samples_share_a_prompt_only_with_the_same_tokens_and_image(tiny_model_path):
    from easyvlm.workers.forward import shared_prompt_sources

    # the same question twice, each with its own random image, 2 samples each: 2 groups, not 1
    batch = make_rl_batch(tiny_model_path, [PROMPTS[0], PROMPTS[0]], [2, 3, 4, 5], n=2)
    prompt_length = batch["input_ids"].shape[1] - batch["responses"].shape[1]
    assert shared_prompt_sources(batch, prompt_length).tolist() == [0, 0, 2, 2]
    # text-only prompts with equal tokens are one prompt, however they were listed; a different one is not
    text = make_rl_batch(tiny_model_path, [PROMPTS[2], PROMPTS[2], PROMPTS[3]], [2, 3, 4])
    assert shared_prompt_sources(text, text["input_ids"].shape[1] - 4).tolist() == [0, 0, 2]
