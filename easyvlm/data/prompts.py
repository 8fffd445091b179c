"""From a row's question to chat messages (docs/data.md, "How a row becomes a prompt")."""

from __future__ import annotations

import re
from functools import lru_cache
from pathlib import Path
from typing import Any

IMAGE_PLACEHOLDER = "<image>"
VIDEO_PLACEHOLDER = "<video>"
_PLACEHOLDER_RE = re.compile(f"({re.escape(IMAGE_PLACEHOLDER)}|{re.escape(VIDEO_PLACEHOLDER)})")


class PromptError(ValueError):
    """A row whose prompt cannot be built; the message says why."""


@lru_cache(maxsize=8)
def load_format_prompt(path: str):
    """The compiled Jinja template in file ``path`` (data.format_prompt)."""
    import jinja2

    file = Path(path).expanduser()
    if not file.is_file():
        raise FileNotFoundError(f"data.format_prompt: file {str(file)!r} does not exist")
    try:
        env = jinja2.Environment(undefined=jinja2.StrictUndefined, keep_trailing_newline=False)
        return env.from_string(file.read_text(encoding="utf-8"))
    except jinja2.TemplateSyntaxError as err:
        raise ValueError(f"data.format_prompt: {str(file)!r} line {err.lineno}: {err.message}") from err


def render_prompt(content: str, row: dict, format_prompt: str | None) -> str:
    """``content`` through the format prompt (if any), with the row's columns as variables."""
    if not format_prompt:
        return content
    import jinja2

    template = load_format_prompt(format_prompt)
    try:
        return template.render({**row, "content": content})
    except jinja2.UndefinedError as err:
        raise PromptError(
            f"format prompt {format_prompt!r} uses a name this row does not have ({err.message}); "
            f"available: content, {', '.join(sorted(row))}"
        ) from err


def count_placeholders(text: str) -> tuple[int, int]:
    """(number of ``<image>``, number of ``<video>``) in ``text``."""
    return text.count(IMAGE_PLACEHOLDER), text.count(VIDEO_PLACEHOLDER)


def build_content(text: str, num_images: int, num_videos: int = 0) -> list[dict[str, Any]]:
    """The chat content list for ``text``: ``"a <image> b"`` -> text "a ", image, text " b". A kind without
    placeholders goes before the text; with them it needs one per item, else PromptError."""
    n_image_tags, n_video_tags = count_placeholders(text)
    for kind, placeholder, tags, count in (
        ("image", IMAGE_PLACEHOLDER, n_image_tags, num_images),
        ("video", VIDEO_PLACEHOLDER, n_video_tags, num_videos),
    ):
        if tags and tags != count:
            raise PromptError(
                f"the prompt has {tags} {placeholder} placeholder(s) but the row has {count} {kind}(s); "
                f"use one placeholder per {kind}, or none (then all {kind}s go before the text)"
            )
    items: list[dict[str, Any]] = []
    if not n_image_tags:
        items += [{"type": "image"} for _ in range(num_images)]
    if not n_video_tags:
        items += [{"type": "video"} for _ in range(num_videos)]
    for piece in _PLACEHOLDER_RE.split(text):
        if piece == IMAGE_PLACEHOLDER:
            items.append({"type": "image"})
        elif piece == VIDEO_PLACEHOLDER:
            items.append({"type": "video"})
        elif piece:
            items.append({"type": "text", "text": piece})
    return items


def build_messages(
    text: str, num_images: int, system_prompt: str | None = None, multimodal: bool = True, num_videos: int = 0
) -> list[dict[str, Any]]:
    """Chat messages for one prompt. ``multimodal=False`` (a tokenizer without a processor) gives
    plain-string content and refuses images and videos."""
    messages: list[dict[str, Any]] = []
    if system_prompt:
        messages.append({"role": "system", "content": system_prompt})
    if multimodal:
        messages.append({"role": "user", "content": build_content(text, num_images, num_videos)})
    else:
        if num_images or num_videos or count_placeholders(text) != (0, 0):
            raise PromptError(
                f"the model has no image processor (text-only), but the row has {num_images} image(s), {num_videos} video(s) or "
                f"<image>/<video> placeholders; use a vision-language model or text-only rows"
            )
        messages.append({"role": "user", "content": text})
    return messages


def resolve_chat_template(override: str | None) -> str | None:
    """``data.override_chat_template``: a Jinja string, or the path of a file that holds one."""
    if not override:
        return None
    candidate = Path(override).expanduser()
    if "{" not in override and candidate.is_file():
        return candidate.read_text(encoding="utf-8")
    if "{" not in override:
        raise FileNotFoundError(
            f"data.override_chat_template={override!r} is neither a Jinja template string nor an existing file"
        )
    return override
