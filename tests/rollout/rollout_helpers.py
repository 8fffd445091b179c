"""Helpers of the rollout tests: prompt batches built with the model's own processor (not the data
pipeline), and the actor-side log-prob recomputation, so that the engines are checked against
transformers alone."""

from __future__ import annotations

from typing import Any, Sequence

import torch
from PIL import Image

from easyvlm.data.batch import Batch
from easyvlm.models.position_ids import get_position_ids


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


def recompute_logprobs(model: Any, rollout: Batch, temperature: float, blocked_token_ids: Sequence[int]) -> torch.Tensor:
    """What the actor computes: log_softmax(logits / temperature) of the response tokens, blocked ids
    removed, from one transformers forward over prompt + response with the Batch's (mRoPE) position ids.

    Returns (B, T) float32.
    """
    from easyvlm.models.position_ids import to_model_layout
    from easyvlm.data.collate import concat_multi_modal_inputs

    mm = concat_multi_modal_inputs(rollout["multi_modal_inputs"])
    with torch.no_grad():
        logits = model(
            input_ids=rollout["input_ids"],
            attention_mask=rollout["attention_mask"].long(),
            position_ids=to_model_layout(rollout["position_ids"]),
            **mm,
        ).logits.float()
    prompt_len = rollout["prompts"].shape[1]
    logits = logits[:, prompt_len - 1 : -1] / (temperature or 1.0)  # (B, T, V): position t predicts token t
    logits[..., list(blocked_token_ids)] = float("-inf")
    return logits.log_softmax(-1).gather(-1, rollout["responses"].unsqueeze(-1)).squeeze(-1)


PROMPTS = [
    ("What shape is in the picture?", [(0, (56, 84))]),
    ("Count the objects in both images.", [(1, (56, 56)), (2, (84, 56))]),
    ("Say hi.", []),
]

