"""Multi-turn rollouts on the real engines: after a tool returned an image mid-sequence, the log-probs
the engine reports for the model's next turn equal transformers' forward over the whole trajectory
(positions from transformers' own rope index), and the actor's (padding-free, shared prompts).

The random tiny model never writes a tool call itself, so its first turn is scripted (a zoom call);
every later turn is sampled by the engine, which sees the tool's image in its context.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from agent_helpers import encoder_of, end_of_turn, multi_turn_of, prompt_batch, tool_plan, two_colour_image
from transformers import AutoModelForImageTextToText

from easyvlm.data.collate import concat_multi_modal_inputs
from easyvlm.rollout.factory import build_rollout
from easyvlm.rollout.hf import mm_token_type_ids
from easyvlm.rollout.postprocess import build_rollout_batch

T = 240
# the two samples of a prompt zoom into different boxes: their prompts are shared in the actor's
# packed forward, their tool images are not
ZOOM_CALLS = ['<tool_call>{"name": "image_zoom", "arguments": {"box": [0, 0, 120, 120]}}</tool_call>',
              '<tool_call>{"name": "image_zoom", "arguments": {"box": [60, 100, 200, 224]}}</tool_call>']
ROWS = [
    {"prompt": "<image>Which colour is on top?", "answer": "red", "images": ["a.png"]},
    {"prompt": "<image>Which colour is at the bottom?", "answer": "blue", "images": ["a.png"]},
]
TEMPERATURE = 0.8


@pytest.fixture(scope="module")
def model(tiny_model_path):
    return AutoModelForImageTextToText.from_pretrained(tiny_model_path, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def image_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("images")
    two_colour_image(root / "a.png")
    return root


def rollout(plan, image_dir, engine):
    """Two prompts x 2 samples: turn 1 scripted (zoom), turn 2 sampled by ``engine`` (what is left of T)."""
    encoder = encoder_of(plan)
    prompts = prompt_batch(encoder, ROWS, image_dir)
    eos, pad = end_of_turn(plan), plan.rollout.tokens.pad
    calls = []

    def generate(batch, sampling):
        calls.append(len(batch))
        if len(calls) > 1:
            return engine.generate(batch, sampling)
        # turn 1, scripted: row k (sample k % 2 of its prompt) zooms into box k % 2
        turns = [encoder.tokenizer(ZOOM_CALLS[k % 2], add_special_tokens=False)["input_ids"] + [eos] for k in range(len(batch))]
        return build_rollout_batch(batch, turns, [[0.0] * len(t) for t in turns], T, pad, [eos])

    sampling = dataclasses.replace(plan.rollout.sampling, n=2, temperature=TEMPERATURE)
    out = multi_turn_of(plan, encoder).generate(prompts, sampling, generate)
    assert all(t["tool_calls"][0]["ok"] and t["num_turns"] >= 2 for t in out["trajectory"])
    first, second = out["multi_modal_inputs"][:2]  # the two samples of prompt 0: different tool images
    assert not torch.equal(first["image_grid_thw"], second["image_grid_thw"])
    return out


def transformers_logprobs(model, out, blocked):
    """log_softmax(logits / T) with the blocked ids removed, from one forward over each whole
    trajectory whose positions transformers computes itself (get_rope_index)."""
    ids, attention = out["input_ids"], out["attention_mask"].long()
    mm = concat_multi_modal_inputs(out["multi_modal_inputs"])
    position_ids, _ = model.model.get_rope_index(ids, mm_token_type_ids(ids, model.config), image_grid_thw=mm["image_grid_thw"], attention_mask=attention)
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=attention, position_ids=position_ids, **mm).logits.float()
    P = out["prompts"].shape[1]
    logits = logits[:, P - 1 : -1] / TEMPERATURE
    logits[..., list(blocked)] = float("-inf")
    return logits.log_softmax(-1).gather(-1, out["responses"].unsqueeze(-1)).squeeze(-1)


def sampled_after_the_tool(out):
    """(B, T) bool: the model's tokens after the first tool result (what the engine sampled)."""
    mask = out["response_mask"].bool()
    tool = ~mask & out["attention_mask"][:, out["prompts"].shape[1]:].bool()
    after_tool = tool.long().cumsum(-1) > 0
    return mask & after_tool


def check_parity(out, model, plan, atol):
    expected = transformers_logprobs(model, out, plan.rollout.tokens.blocked)
    sampled = sampled_after_the_tool(out)
    assert sampled.sum() >= 8 * len(out)  # every sample wrote a turn after seeing the zoomed image
    torch.testing.assert_close(out["rollout_logprobs"][sampled], expected[sampled], atol=atol, rtol=0)


def test_transformers_engine_matches_the_forward_over_the_whole_trajectory(tiny_model_path, model, image_dir):
    plan = tool_plan(tiny_model_path, T, "worker.rollout.name=hf", "worker.rollout.tools=[image_zoom]",
                     "worker.rollout.max_tokens_per_turn=96", "worker.rollout.max_turns=2",
                     f"worker.rollout.temperature={TEMPERATURE}")
    out = rollout(plan, image_dir, build_rollout(plan.rollout))
    # float32 on both sides, the same kernels: equal up to summation order
    check_parity(out, model, plan, atol=1e-4)


@pytest.mark.slow
def test_vllm_engine_matches_the_forward_and_the_actor(tiny_model_path, model, image_dir, request):
    import gc

    import torch.distributed as dist

    from easyvlm.workers.actor import ActorWorker
    from easyvlm.workers.dist import init_distributed
    from easyvlm.workers.forward import shared_prompt_sources

    plan = tool_plan(tiny_model_path, T, "worker.rollout.name=vllm", "worker.rollout.tools=[image_zoom]",
                     "worker.rollout.max_tokens_per_turn=96", "worker.rollout.max_turns=2",
                     f"worker.rollout.temperature={TEMPERATURE}", "worker.actor.padding_free=true",
                     "worker.rollout.max_num_seqs=8")
    engine = build_rollout(plan.rollout)
    # vLLM checks every turn's context: its expansion of the raw ids (one pad per image, the tool's
    # image included) must equal the batch's input_ids (easyvlm.rollout.vllm._check_prompts)
    out = rollout(plan, image_dir, engine)
    check_parity(out, model, plan, atol=1e-3)
    # vLLM's teardown destroys the default process group: close it before the actor needs one,
    # and leave one initialised for the worker tests that share the session's group
    del engine
    gc.collect()
    request.getfixturevalue("process_group")
    if not dist.is_initialized():
        init_distributed("gloo")
    # each prompt runs once for its two samples in the packed forward, their different tool images do not
    P = out["prompts"].shape[1]
    assert shared_prompt_sources(out, P, model.config.image_token_id).tolist() == [0, 0, 2, 2]
    actor = ActorWorker(plan.actor, rank=0, world_size=1)
    actor_logprobs = actor.compute_logprobs(out)["old_logprobs"]
    mask = out["response_mask"].bool()  # every model token, the scripted turn included
    expected = transformers_logprobs(model, out, plan.rollout.tokens.blocked)
    torch.testing.assert_close(actor_logprobs[mask], expected[mask], atol=1e-4, rtol=0)
