"""Test batches: real prompts from the tiny model's processor (with and without images), random
responses of given lengths, laid out as the trainer lays them out (prompt left padded, response
right padded, position ids extended over the response)."""

from __future__ import annotations

import dataclasses

import numpy as np
import torch
from PIL import Image

from easyvlm.data.batch import Batch
from easyvlm.data.collate import left_pad
from easyvlm.models.position_ids import extend_position_ids, get_position_ids


def make_rl_batch(
    model_dir: str,
    prompts: list[tuple[str, tuple[int, int] | None]],
    response_lengths: list[int],
    seed: int = 0,
    n: int = 1,
) -> Batch:
    """prompts: (question, media) per sample, media = an image's (width, height), ``("video", (width,
    height))`` for a video of 4 noise frames (sampled at 2 fps), or None; response_lengths: tokens
    per sample. ``n``: each prompt (with its media) is repeated n times in a row, as the rollout's
    groups are; ``response_lengths`` then has len(prompts) * n entries.

    Returns tensors input_ids, attention_mask (B, P+T), position_ids (B, 4, P+T), responses,
    response_mask (B, T), and objects multi_modal_inputs.
    """
    from transformers import AutoConfig, AutoProcessor

    processor = AutoProcessor.from_pretrained(model_dir)
    hf_config = AutoConfig.from_pretrained(model_dir)
    tokenizer = processor.tokenizer
    rng = np.random.default_rng(seed)
    ids, positions, mm_inputs = [], [], []
    for question, media in prompts:
        kind, size = (media if isinstance(media[0], str) else ("image", media)) if media else (None, None)
        content = ([{"type": kind}] if kind else []) + [{"type": "text", "text": question}]
        messages = [{"role": "user", "content": content}]
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        kwargs = {}
        if kind == "image":
            kwargs["images"] = [Image.fromarray(rng.integers(0, 256, (size[1], size[0], 3), dtype=np.uint8))]
        elif kind == "video":
            from transformers.video_utils import VideoMetadata

            kwargs["videos"] = [rng.integers(0, 256, (4, size[1], size[0], 3), dtype=np.uint8)]
            kwargs["video_metadata"] = [VideoMetadata(fps=2.0, total_num_frames=4, frames_indices=[0, 1, 2, 3])]
            kwargs["do_sample_frames"] = False
        enc = processor(text=[text], return_tensors="pt", **kwargs)
        mm = {k: enc[k] for k in ("pixel_values", "image_grid_thw", "pixel_values_videos", "video_grid_thw") if k in enc}
        if enc.get("second_per_grid_ts") is not None:  # Qwen2.5-VL videos
            mm["second_per_grid_ts"] = torch.as_tensor(enc["second_per_grid_ts"], dtype=torch.float32)
        pos = get_position_ids(enc["input_ids"], enc["attention_mask"], mm.get("image_grid_thw"), mm.get("video_grid_thw"),
                               model_config=hf_config, second_per_grid_ts=mm.get("second_per_grid_ts"))
        ids.append(enc["input_ids"][0])
        positions.append(pos[0])
        mm_inputs.append(mm)
    ids, positions, mm_inputs = ([x for x in xs for _ in range(n)] for xs in (ids, positions, mm_inputs))
    pad = tokenizer.pad_token_id
    prompt_ids = left_pad(ids, pad)  # (B, P)
    P = prompt_ids.shape[1]
    prompt_mask = torch.arange(P)[None, :] >= torch.tensor([P - len(x) for x in ids])[:, None]
    prompt_pos = left_pad(positions, 0)
    T = max(response_lengths)
    gen = torch.Generator().manual_seed(seed)
    responses = torch.randint(0, 256, (len(ids), T), generator=gen)
    response_mask = torch.arange(T)[None, :] < torch.tensor(response_lengths)[:, None]  # (B, T)
    responses = responses.masked_fill(~response_mask, pad)
    return Batch(
        tensors={
            "input_ids": torch.cat([prompt_ids, responses], dim=1),
            "attention_mask": torch.cat([prompt_mask, response_mask], dim=1),
            "position_ids": extend_position_ids(prompt_pos, T),
            "responses": responses,
            "response_mask": response_mask,
        },
        objects={"multi_modal_inputs": mm_inputs},
    )


# Prompts of the test batches: (question, image (width, height) or None). Images of two sizes,
# text-only prompts, ragged prompt and response lengths.
PROMPTS = [
    ("what is it?", (56, 56)),
    ("count the dots, please", (84, 56)),
    ("hi", None),
    ("a longer text-only question", None),
    ("x", (56, 84)),
    ("colour?", None),
    ("how many?", (56, 56)),
    ("why", None),
]
RESPONSE_LENGTHS = [5, 9, 3, 7, 1, 8, 4, 6]
# Mixed media across ranks (EasyR1 #468): rank 0 gets only text (no visual input: it must still run
# the vision tower, or FSDP's collectives go out of step), rank 1 images and videos of two sizes.
MIXED_PROMPTS = [
    ("hi", None),
    ("a longer text-only question", None),
    ("why", None),
    ("colour?", None),
    ("what is it?", (56, 56)),
    ("which colour comes first?", ("video", (56, 56))),
    ("x", ("video", (84, 56))),
    ("how many?", (56, 84)),
]
LAYOUTS = {"default": PROMPTS, "mixed": MIXED_PROMPTS}


def _value(v) -> str:
    import json

    if isinstance(v, bool):
        return str(v).lower()
    if v is None:
        return "null"
    if isinstance(v, (list, tuple, dict)):
        return json.dumps(list(v) if isinstance(v, tuple) else v)
    return str(v)


def role_overrides(role: str = "actor", **kwargs) -> list[str]:
    """Dotted overrides from keyword arguments: ``lr``, ``optim={...}``, model keys
    (``enable_gradient_checkpointing``, ``freeze_vision_tower``, ``lora={...}``), ``algorithm={...}``,
    ``temperature`` and ``n`` (rollout) by name; everything else is a key of ``worker.<role>``."""
    p = f"worker.{role}"
    out = []
    for key, value in kwargs.items():
        if key == "lr":
            out.append(f"{p}.optim.lr={_value(value)}")
        elif key in ("optim", "algorithm"):
            prefix = f"{p}.optim" if key == "optim" else "algorithm"
            out += [f"{prefix}.{k}={_value(v)}" for k, v in value.items()]
        elif key in ("enable_gradient_checkpointing", "freeze_vision_tower"):
            out.append(f"{p}.model.{key}={_value(value)}")
        elif key == "lora":
            out += [f"{p}.model.lora.{k}={_value(v)}" for k, v in value.items()]
        elif key in ("temperature", "n"):
            out.append(f"worker.rollout.{key}={_value(value)}")
        else:
            out.append(f"{p}.{key}={_value(value)}")
    return out


def actor_spec(model_path: str, total_steps: int = 10, world_size: int = 1, extra: tuple[str, ...] = (), **kwargs):
    """The `ActorSpec` the plan builder makes for the tiny test run with ``kwargs`` (see
    :func:`role_overrides`, ``extra``: more dotted overrides); fixed micro-batches, no gradient
    checkpointing, lr 1e-3 by default."""
    from plan_testing import plan_for

    frozen = kwargs.get("lr") == 0  # the config check wants lr > 0; tests that keep weights fixed set 0 after
    if frozen:
        kwargs["lr"] = 1e-3
    overrides = role_overrides("actor", **kwargs) + [f"trainer.n_gpus_per_node={world_size}", *extra]
    spec = plan_for(model_path, *overrides, total_steps=total_steps).actor
    if frozen:
        optim = dataclasses.replace(spec.update.optim, lr=0.0)
        spec = dataclasses.replace(spec, update=dataclasses.replace(spec.update, optim=optim))
    return spec


def critic_spec(model_path: str, total_steps: int = 10, world_size: int = 1, **kwargs):
    """The `CriticSpec` of the tiny test run (a gae run) with ``kwargs`` for ``worker.critic``."""
    from plan_testing import plan_for

    overrides = ["algorithm.adv_estimator=gae", f"trainer.n_gpus_per_node={world_size}"]
    return plan_for(model_path, *overrides, *role_overrides("critic", **kwargs), total_steps=total_steps).critic


def assert_logprobs_match_reference(out: Batch, reference, batch: Batch, temperature: float) -> None:
    """``out`` (compute_logprobs with entropies) equals :func:`reference_logprobs` on the response
    tokens (default tolerances of float32) and is 0 at padding."""
    expected_logprobs, expected_entropies = reference_logprobs(reference, batch, temperature)
    mask = batch["response_mask"]
    torch.testing.assert_close(out["old_logprobs"][mask], expected_logprobs[mask])
    torch.testing.assert_close(out["entropies"][mask], expected_entropies[mask])
    assert torch.all(out["old_logprobs"][~mask] == 0)


def reference_logprobs(model, batch: Batch, temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Independent (B, T) log-probs and entropies: one unpadded transformers forward per sample.

    Response token t of sample b is predicted by the logits at position p_b - 1 + t of the
    unpadded sequence (p_b = its prompt tokens). The ids the rollout never samples
    (``easyvlm.rollout.tokens.blocked_token_ids`` of the model's tokenizer and config) are removed
    from the distribution, as in the rollout. 0 where response_mask is False.
    """
    from transformers import AutoTokenizer

    from easyvlm.data.collate import concat_multi_modal_inputs
    from easyvlm.rollout.tokens import blocked_token_ids

    blocked = blocked_token_ids(AutoTokenizer.from_pretrained(model.name_or_path), model.config)

    B, T = batch["responses"].shape
    P = batch["input_ids"].shape[1] - T
    logprobs = torch.zeros(B, T)
    entropies = torch.zeros(B, T)
    for b in range(B):
        keep = batch["attention_mask"][b].bool()
        ids = batch["input_ids"][b][keep].unsqueeze(0)
        pos = batch["position_ids"][b][..., keep]  # (4, n): rows 1..3 are the mRoPE rows
        mm = concat_multi_modal_inputs([batch["multi_modal_inputs"][b]])
        with torch.no_grad():
            logits = model(input_ids=ids, position_ids=pos[1:].unsqueeze(1), **mm).logits[0] / temperature
        logits[:, blocked] = float("-inf")
        logp = torch.log_softmax(logits.double(), -1)
        p_b = int(batch["attention_mask"][b, :P].sum())
        for t in range(T):
            if batch["response_mask"][b, t]:
                logprobs[b, t] = logp[p_b - 1 + t, batch["responses"][b, t]]
                allowed = torch.isfinite(logp[p_b - 1 + t])  # blocked ids: p = 0, no entropy
                entropies[b, t] = -(logp[p_b - 1 + t][allowed].exp() * logp[p_b - 1 + t][allowed]).sum()
    return logprobs, entropies


# ------------------------------------------------------------------------------------------------
# Two-rank runs (FSDP over 2 gloo processes vs 1 process)

TWO_RANK_ACTOR = dict(
    global_batch_size=4,  # 2 mini-batches of 4 samples: 2 per rank on 2 ranks
    micro_batch_size_per_device_for_update=2,
    micro_batch_size_per_device_for_experience=4,
    dynamic_batching=True,
    # attended lengths are [41 58 24 53 | 29 34 38 28]: rank 0 cuts more micro-batches than rank 1,
    # so rank 1 runs dummy forward/backward passes to match FSDP's collectives
    max_token_len_per_device=70,  # with data.max_prompt_length + max_response_length <= 70 (TWO_RANK_EXTRA)
    enable_gradient_checkpointing=True,
    max_grad_norm=0.5,
    lr=1e-3,
    temperature=0.8,
)
TWO_RANK_EXTRA = ("data.max_prompt_length=54", "data.max_response_length=16")
ONE_RANK_ORDER = [0, 1, 4, 5, 2, 3, 6, 7]  # the mini-batches of 1 rank = those of 2 ranks, joined


def training_keys(batch: Batch, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """(old_logprobs noise, advantages) for the whole batch, fixed by ``seed``."""
    gen = torch.Generator().manual_seed(seed)
    shape = batch["responses"].shape
    mask = batch["response_mask"]
    noise = torch.where(mask, 0.3 * torch.randn(shape, generator=gen), 0.0)
    advantages = torch.where(mask, torch.randn(shape, generator=gen), 0.0)
    return noise, advantages


def run_actor_and_critic(
    model_path: str, batch: Batch, noise: torch.Tensor, advantages: torch.Tensor, rank: int, world_size: int,
    actor_overrides: dict | None = None,
) -> dict:
    """compute_logprobs, update_policy, compute_values, update_critic on this rank's ``batch``
    (``actor_overrides``: more keys for the actor, over TWO_RANK_ACTOR); returns what the comparison
    needs (weights gathered to every rank)."""
    from easyvlm.workers.actor import ActorWorker
    from easyvlm.workers.critic import CriticWorker

    spec = actor_spec(model_path, total_steps=3, world_size=world_size, extra=TWO_RANK_EXTRA,
                      **{**TWO_RANK_ACTOR, **(actor_overrides or {})})
    actor = ActorWorker(spec, rank=rank, world_size=world_size)
    logprobs = actor.compute_logprobs(batch)["old_logprobs"]
    data = batch.copy()
    data["old_logprobs"] = logprobs + noise
    data["advantages"] = advantages
    actor_metrics = actor.update_policy(data)
    actor_weights = actor.state_dict_for_sync()

    critic_cfg = critic_spec(model_path, total_steps=3, world_size=world_size, global_batch_size=4,
                             micro_batch_size_per_device_for_update=1, dynamic_batching=False, lr=1e-3)
    critic = CriticWorker(critic_cfg, rank=rank, world_size=world_size)
    values = critic.compute_values(batch)["values"]
    data["values"] = values
    data["returns"] = values + advantages
    critic_metrics = critic.update_critic(data)
    from easyvlm.workers.fsdp import gather_full_state_dict

    return dict(logprobs=logprobs, values=values, actor_metrics=actor_metrics, critic_metrics=critic_metrics,
                actor_weights=actor_weights, critic_weights=gather_full_state_dict(critic.model))


def two_rank_main(rank: int, world_size: int, port: int, model_path: str, out_file: str, layout: str = "default",
                  actor_overrides: dict | None = None) -> None:
    """Entry point of each spawned rank: run on rows [4 r, 4 r + 4) of ``LAYOUTS[layout]`` and save
    rank 0's view."""
    import os

    import torch.distributed as dist

    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    from easyvlm.workers.dist import init_distributed

    init_distributed("gloo")
    full = make_rl_batch(model_path, LAYOUTS[layout], RESPONSE_LENGTHS)
    noise, advantages = training_keys(full)
    rows = slice(4 * rank, 4 * rank + 4)
    out = run_actor_and_critic(model_path, full.index(rows), noise[rows], advantages[rows], rank, world_size,
                               actor_overrides)
    per_rank = [None] * world_size
    dist.all_gather_object(per_rank, {"logprobs": out["logprobs"], "values": out["values"]})
    if rank == 0:
        out["logprobs"] = torch.cat([r["logprobs"] for r in per_rank])
        out["values"] = torch.cat([r["values"] for r in per_rank])
        torch.save(out, out_file)
    dist.barrier()
    dist.destroy_process_group()


# ------------------------------------------------------------------------------------------------
# Text-only models (Qwen2 family)


def build_tiny_qwen2(out_dir) -> str:
    """A random 2-layer Qwen2 causal LM (hidden 64) with the built-in byte tokenizer."""
    from transformers import AutoModelForCausalLM, Qwen2Config

    from easyvlm.builtin.models import build_tokenizer

    tokenizer = build_tokenizer()
    config = Qwen2Config(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id, tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    return str(out_dir)


def make_text_batch(prompt_lengths: list[int], response_lengths: list[int], pad_id: int, seed: int = 0) -> Batch:
    """Random byte-token prompts and responses, (B, L) position ids = cumsum(attention_mask) - 1."""
    gen = torch.Generator().manual_seed(seed)
    P, T = max(prompt_lengths), max(response_lengths)
    prompt_mask = torch.arange(P)[None, :] >= torch.tensor([P - n for n in prompt_lengths])[:, None]
    response_mask = torch.arange(T)[None, :] < torch.tensor(response_lengths)[:, None]
    mask = torch.cat([prompt_mask, response_mask], 1)
    input_ids = torch.randint(0, 256, mask.shape, generator=gen).masked_fill(~mask, pad_id)
    return Batch({
        "input_ids": input_ids,
        "attention_mask": mask,
        "position_ids": (mask.long().cumsum(-1) - 1).clamp(min=0),
        "responses": input_ids[:, P:],
        "response_mask": response_mask,
    })
