"""What the model reads between its turns: tool results and observations as chat-template tokens,
images fitted and expanded as a prompt's (docs/agents.md, "What the model sees")."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from easyvlm.data.dataset import PromptEncoder
from easyvlm.data.images import fit_image

_ASSISTANT_MARK = "EASYVLM_ASSISTANT_TURN"
IMAGE_PLACEHOLDER = "[image removed]"
"""What the model reads instead of an image the image budget removed (``max_images_in_context``)."""


class RenderError(ValueError):
    """The chat template cannot render what a tool returned (e.g. it drops images)."""


@dataclass
class Segment:
    """Tokens the model did not write: a tool result or an observation, with its images."""

    input_ids: list[int]  # vision placeholders expanded (what the training forward sees)
    raw_ids: list[int]  # one placeholder per image (what vLLM gets, with the images)
    images: list = field(default_factory=list)  # fitted to the pixel limits
    multi_modal_inputs: dict[str, Tensor] = field(default_factory=dict)
    text: str = ""


def content_of(text: str, images: list) -> str | list[dict]:
    """A chat message's content: the images first, then the text (as a prompt's ``<image>``-less row)."""
    if not images:
        return text
    return [{"type": "image"} for _ in images] + ([{"type": "text", "text": text}] if text else [])


def without_images(messages: list[dict], removed: int) -> list[dict]:
    """A copy of ``messages`` with their first ``removed`` images replaced by :data:`IMAGE_PLACEHOLDER`."""
    out = []
    for message in messages:
        content = message["content"]
        if isinstance(content, list):
            new_content = []
            for item in content:
                if item.get("type") == "image" and removed > 0:
                    item, removed = {"type": "text", "text": IMAGE_PLACEHOLDER}, removed - 1
                new_content.append(item)
            message = {**message, "content": new_content}
        out.append(message)
    return out


class TurnRenderer:
    """Renders tool results and observations with the run's PromptEncoder (template, pixel limits)."""

    def __init__(self, encoder: PromptEncoder):
        self.encoder = encoder
        self.tokenizer = encoder.tokenizer
        self.processor = encoder.processor
        self._templater = self.processor if self.processor is not None else self.tokenizer

    @property
    def chat_template(self) -> str | None:
        """The template in use: data.override_chat_template, else the processor's or tokenizer's own."""
        return self.encoder.chat_template or getattr(self._templater, "chat_template", None)

    def _apply(self, messages: list[dict], generation_prompt: bool, tools: list | None = None) -> str:
        return self._templater.apply_chat_template(
            messages, add_generation_prompt=generation_prompt, tokenize=False,
            chat_template=self.encoder.chat_template, tools=tools,
        )

    def segment_text(self, messages: list[dict], eos_text: str | None) -> str:
        """The text between the model's EOS (``eos_text``; None: the turn had none) and its next turn."""
        base = [{"role": "user", "content": "?"}, {"role": "assistant", "content": _ASSISTANT_MARK}]
        before = self._apply(base, generation_prompt=False)
        after = self._apply(base + messages, generation_prompt=True)
        if not after.startswith(before):
            raise RenderError(
                "the chat template renders the conversation's start differently once a tool or user message follows; "
                "easyvlm cannot tell which tokens the new message adds"
            )
        tail = before[before.rindex(_ASSISTANT_MARK) + len(_ASSISTANT_MARK):]  # e.g. "<|im_end|>\n"
        if eos_text and tail.startswith(eos_text):
            tail = tail[len(eos_text):]  # the model wrote its EOS; the rest of the template's ending is ours
        return tail + after[len(before):]

    def render(self, messages: list[dict], images: list, eos_text: str | None) -> Segment:
        """The segment of ``messages`` (one ``{"type": "image"}`` per image of ``images``, in order)."""
        text = self.segment_text(messages, eos_text)
        raw_ids = list(self.tokenizer(text, add_special_tokens=False)["input_ids"])
        if not images:
            return Segment(raw_ids, raw_ids, [], {}, text)
        if self.processor is None:
            raise RenderError("a tool returned an image, but the model is text-only (no image processor)")
        enc = self.encoder
        fitted = [
            fit_image(image, enc.min_pixels, enc.max_pixels, enc.factor,
                      processor_min_pixels=enc.processor_min_pixels, processor_max_pixels=enc.processor_max_pixels)
            for image in images
        ]
        placeholders = raw_ids.count(enc.image_token_id)
        if placeholders != len(images):
            raise RenderError(
                f"the chat template rendered {placeholders} image placeholder(s) for {len(images)} image(s) in a "
                f"{messages[0]['role']} message; use a template that renders images in that role (Qwen2.5-VL's does)"
            )
        out = self.processor(text=[text], images=fitted, do_resize=False, add_special_tokens=False, return_tensors="pt")
        mm = {"pixel_values": out["pixel_values"], "image_grid_thw": out["image_grid_thw"].to(torch.long)}
        return Segment(out["input_ids"][0].tolist(), raw_ids, fitted, mm, text)
