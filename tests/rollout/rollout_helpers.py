"""Helpers of the rollout tests: prompt batches built with the model's own processor (not the data
pipeline), and the actor-side log-prob recomputation, so that the engines are checked against
transformers alone."""

from __future__ import annotations

import dataclasses
from typing import Any, Sequence

import torch
from PIL import Image

from easyvlm.data.batch import Batch
from easyvlm.models.position_ids import get_position_ids
from easyvlm.rollout.base import RolloutEngine
from easyvlm.rollout.specs import Sampling

# The rollout tests' run: the tiny model's plan (tests/plan_testing.py) with these rollout settings.
# n = 2 (grpo needs at least 2 samples per prompt), seed 3, prompts of at most 128 tokens.
ROLLOUT_OVERRIDES = (
    "worker.rollout.n=2",
    "worker.rollout.temperature=1.0",
    "worker.rollout.seed=3",
    "data.max_prompt_length=128",
)


def rollout_plan(model_path: str, response_length: int, *overrides: str) -> Any:
    """The `RunPlan` of the tiny test run with :data:`ROLLOUT_OVERRIDES`, ``response_length``
    (data.max_response_length) and ``overrides``, made by the real plan builder."""
    from plan_testing import plan_for

    return plan_for(model_path, *ROLLOUT_OVERRIDES, f"data.max_response_length={response_length}", *overrides)


def with_sampling(engine: RolloutEngine, **changes: Any) -> Sampling:
    """The engine's sampling with ``changes`` (fields of `Sampling`), for one generate() call."""
    return dataclasses.replace(engine.sampling, **changes)


def make_prompt_batch(processor: Any, model_config: Any, prompts: Sequence[tuple[str, Sequence[Image.Image]]]) -> Batch:
    """A prompt Batch as the data pipeline's contract describes it, from (question, images) pairs.

    ``raw_prompt_ids``: the chat-template ids with one ``<|image_pad|>`` per image (vLLM expands
    them); ``input_ids``: the processor's expanded ids, left padded.
    """
    tokenizer = processor.tokenizer
    texts, raw_prompt_ids, multi_modal_inputs = [], [], []
    for question, images in prompts:
        content = [{"type": "image"} for _ in images] + [{"type": "text", "text": question}]
        messages = [{"role": "user", "content": content}]
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        texts.append(text)
        raw_prompt_ids.append(tokenizer(text, add_special_tokens=False)["input_ids"])
        if images:
            enc = processor(text=[text], images=list(images), return_tensors="pt")
            multi_modal_inputs.append({"pixel_values": enc["pixel_values"], "image_grid_thw": enc["image_grid_thw"]})
        else:
            multi_modal_inputs.append({})
    tokenizer.padding_side = "left"
    all_images = [image for _, images in prompts for image in images]
    enc = processor(text=texts, images=all_images or None, return_tensors="pt", padding=True)
    attention_mask = enc["attention_mask"].bool()
    position_ids = get_position_ids(enc["input_ids"], attention_mask, enc.get("image_grid_thw"), model_config=model_config)
    return Batch(
        {"input_ids": enc["input_ids"], "attention_mask": attention_mask, "position_ids": position_ids},
        {
            "raw_prompt_ids": raw_prompt_ids,
            "images": [list(images) for _, images in prompts],
            "multi_modal_inputs": multi_modal_inputs,
            "uid": [f"p{i}" for i in range(len(prompts))],
        },
    )


def noise_image(seed: int, size: tuple[int, int] = (56, 84)) -> Image.Image:
    """A deterministic noise image (its pixels steer the tiny model's outputs)."""
    g = torch.Generator().manual_seed(seed)
    pixels = torch.randint(0, 256, (size[1], size[0], 3), generator=g, dtype=torch.uint8)
    return Image.fromarray(pixels.numpy())


def response_logits(model: Any, rollout: Batch, attend_whole_response: bool = False) -> torch.Tensor:
    """(B, T, V) float32 logits that predicted each response token: one transformers forward over
    prompt + response with the Batch's (mRoPE) position ids.

    attend_whole_response: attend to the tokens after the first EOS too (what the sampler did with
    ignore_eos) instead of using the Batch's attention mask.
    """
    from easyvlm.data.collate import concat_multi_modal_inputs
    from easyvlm.models.position_ids import to_model_layout

    prompt_len = rollout["prompts"].shape[1]
    attention_mask = rollout["attention_mask"].clone()
    if attend_whole_response:
        attention_mask[:, prompt_len:] = True
    with torch.no_grad():
        logits = model(
            input_ids=rollout["input_ids"],
            attention_mask=attention_mask.long(),
            position_ids=to_model_layout(rollout["position_ids"]),
            **concat_multi_modal_inputs(rollout["multi_modal_inputs"]),
        ).logits.float()
    return logits[:, prompt_len - 1 : -1]  # position t predicts response token t


def recompute_logprobs(model: Any, rollout: Batch, temperature: float, blocked_token_ids: Sequence[int]) -> torch.Tensor:
    """What the actor computes: log_softmax(logits / temperature) of the response tokens with the
    blocked ids removed. Returns (B, T) float32."""
    logits = response_logits(model, rollout) / (temperature or 1.0)
    logits[..., list(blocked_token_ids)] = float("-inf")
    return logits.log_softmax(-1).gather(-1, rollout["responses"].unsqueeze(-1)).squeeze(-1)


def reference_experts(model: Any, rollout: Batch) -> tuple[torch.Tensor, torch.Tensor]:
    """What transformers' own unmodified routers choose over the finished rows (prompt + response),
    one forward with the rows' own positions and images: (B, L, layers, k) top-k experts, and (B, L,
    layers) the gap between the k-th and (k+1)-th router probability (a choice is only comparable
    across kernels where it is not a near-tie)."""
    k = model.config.get_text_config().num_experts_per_tok
    items = rollout["multi_modal_inputs"]
    images = [i for i in items if i and "pixel_values" in i]
    extra = {}
    if images:
        extra = {"pixel_values": torch.cat([i["pixel_values"] for i in images]),
                 "image_grid_thw": torch.cat([i["image_grid_thw"] for i in images])}
    with torch.no_grad():
        logits = model(input_ids=rollout["input_ids"], attention_mask=rollout["attention_mask"].long(),
                       position_ids=rollout["position_ids"].transpose(0, 1), output_router_logits=True,
                       **extra).router_logits
    B, L = rollout["input_ids"].shape
    probs = torch.stack([layer.float().softmax(-1) for layer in logits], dim=1)  # (B * L, layers, E)
    top = probs.topk(k + 1, dim=-1)
    gap = top.values[..., k - 1] - top.values[..., k]
    return top.indices[..., :k].reshape(B, L, len(logits), k), gap.reshape(B, L, len(logits))


PROMPTS = [
    ("What shape is in the picture?", [(0, (56, 84))]),
    ("Count the objects in both images.", [(1, (56, 56)), (2, (84, 56))]),
    ("Say hi.", []),
]


def default_prompts(processor: Any, model_config: Any) -> Batch:
    """The PROMPTS above: one image (portrait), two images, text only."""
    batch = [(text, [noise_image(seed, size) for seed, size in images]) for text, images in PROMPTS]
    return make_prompt_batch(processor, model_config, batch)


def eos_inside(rollout: Batch, eos_token_ids: Sequence[int]) -> int:
    """Rows with an EOS before the last position and a non-pad token after it (sampling went on)."""
    responses = rollout["responses"]
    count = 0
    for row in responses.tolist():
        ends = [k for k, token in enumerate(row[:-1]) if token in eos_token_ids]
        count += bool(ends) and any(token not in eos_token_ids for token in row[ends[0] + 1 :])
    return count


def video_prompt_batch(processor: Any, model_config: Any, root: Any) -> Batch:
    """Three prompts through the data pipeline: a video file (8 noise frames at 4 fps, 56x56, sampled
    at 2 fps to 4 frames), a frame list next to an image, and text only."""
    import json

    import numpy as np

    from easyvlm.config.schema import DataConfig
    from easyvlm.data.collate import collate_prompts
    from easyvlm.data.dataset import RLDataset
    from easyvlm.data.videos import write_video

    rng = np.random.default_rng(0)
    frames = [rng.integers(0, 256, (56, 56, 3), dtype=np.uint8) for _ in range(8)]
    write_video(root / "clip.mp4", frames, fps=4)
    for k in range(3):
        Image.fromarray(frames[k]).save(root / f"f{k}.png")
    rows = [
        {"problem": "<video>What happens?", "answer": "a", "videos": ["clip.mp4"]},
        {"problem": "<image>Is it in <video>?", "answer": "b", "images": ["f0.png"], "videos": [["f0.png", "f1.png", "f2.png"]]},
        {"problem": "Say hi.", "answer": "c"},
    ]
    path = root / "rows.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    config = dataclasses.replace(
        DataConfig(), train_files=str(path), prompt_key="problem", min_pixels=3136, max_pixels=50176,
        max_prompt_length=128, filter_overlong_prompts_workers=1,
    )
    dataset = RLDataset(str(path), config, processor.tokenizer, processor, model_config)
    return collate_prompts([dataset[i] for i in range(len(dataset))], dataset.pad_token_id)
