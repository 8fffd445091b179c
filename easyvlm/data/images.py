"""Images: load them from what a data row holds, and fit them into [min_pixels, max_pixels].

:func:`fit_image` is the only place that resizes. Its output is a fixed point of Qwen-VL's
``smart_resize`` with the same bounds: both sides are multiples of ``factor`` (= patch_size *
merge_size) and the pixel count lies in [min_pixels, max_pixels]. So a processor or vLLM that runs
``smart_resize`` again with the same bounds leaves the image alone, and the number of image tokens
counted for the prompt, the pixels the rollout sees and the pixels the training forward sees are
the same. easyvlm also calls the Hugging Face processor with ``do_resize=False`` on fitted images,
and the rollout gives vLLM ``vllm_mm_processor_kwargs(min_pixels, max_pixels)``.
"""

from __future__ import annotations

import io
import math
import os
from pathlib import Path
from typing import Any

from PIL import Image

MAX_ASPECT_RATIO = 200  # Qwen-VL's smart_resize refuses longer/shorter > 200


class ImageLoadError(ValueError):
    """An image in a data row that cannot be used; the message says which and why."""


def smart_resize(height: int, width: int, factor: int, min_pixels: int, max_pixels: int) -> tuple[int, int]:
    """Qwen-VL's target size: sides multiples of ``factor``, pixels in range, aspect ratio kept.

    Same rule as transformers' ``qwen2_vl.image_processing_qwen2_vl.smart_resize`` and
    qwen-vl-utils (tests compare them): round each side to the nearest multiple of ``factor``;
    if that is above ``max_pixels`` scale down (floor), if below ``min_pixels`` scale up (ceil).
    """
    if min(height, width) <= 0:
        raise ImageLoadError(f"image has size {width}x{height}; both sides must be positive")
    if max(height, width) / min(height, width) > MAX_ASPECT_RATIO:
        raise ImageLoadError(
            f"image of {width}x{height} has an aspect ratio above {MAX_ASPECT_RATIO}, which Qwen-VL models refuse"
        )
    h = round(height / factor) * factor
    w = round(width / factor) * factor
    if h * w > max_pixels:
        scale = math.sqrt(height * width / max_pixels)
        h = max(factor, math.floor(height / scale / factor) * factor)
        w = max(factor, math.floor(width / scale / factor) * factor)
    elif h * w < min_pixels:
        scale = math.sqrt(min_pixels / (height * width))
        h = math.ceil(height * scale / factor) * factor
        w = math.ceil(width * scale / factor) * factor
    return h, w


def fitted_size(height: int, width: int, min_pixels: int, max_pixels: int, factor: int) -> tuple[int, int]:
    """(height, width) that :func:`fit_image` produces: ``smart_resize`` applied until it is a no-op.

    One pass is enough for ordinary images. For extreme aspect ratios or a tight range, one pass
    can land outside [min_pixels, max_pixels] (the sides are floored/ceiled separately), and a
    second ``smart_resize`` in the processor would then change the image again; iterating makes
    the result a fixed point, which is what keeps tokens and pixels consistent downstream.
    """
    h, w = height, width
    for _ in range(32):  # thin images shrink by a factor > 1 per pass: a handful of passes
        nh, nw = smart_resize(h, w, factor, min_pixels, max_pixels)
        if (nh, nw) == (h, w):
            return h, w
        h, w = nh, nw
    raise ImageLoadError(
        f"cannot fit an image of {width}x{height} into [min_pixels={min_pixels}, max_pixels={max_pixels}] "
        f"with sides that are multiples of {factor}; widen the pixel range (data.min_pixels / data.max_pixels)"
    )


def check_pixel_limits(min_pixels: int, max_pixels: int, factor: int) -> None:
    """Raise a ValueError naming the config keys if the limits cannot hold even one patch block."""
    if min_pixels <= 0 or max_pixels < min_pixels:
        raise ValueError(f"need 0 < data.min_pixels <= data.max_pixels, got {min_pixels} and {max_pixels}")
    if max_pixels < factor * factor:
        raise ValueError(
            f"data.max_pixels={max_pixels} is below one {factor}x{factor} block ({factor * factor} pixels), "
            f"the smallest image this model accepts; raise data.max_pixels"
        )


def fit_image(image: Image.Image, min_pixels: int, max_pixels: int, factor: int) -> Image.Image:
    """An RGB copy of ``image`` resized into [min_pixels, max_pixels] (sides multiples of ``factor``).

    The aspect ratio is kept as closely as multiples of ``factor`` allow; bicubic resampling as in
    the Qwen-VL image processor. Returns the same object if it is already RGB and fitted.
    """
    if image.mode != "RGB":
        image = image.convert("RGB")
    h, w = fitted_size(image.height, image.width, min_pixels, max_pixels, factor)
    if (h, w) != (image.height, image.width):
        image = image.resize((w, h), resample=Image.Resampling.BICUBIC)
    return image


def resolve_image_path(path: str, base_dir: str | os.PathLike | None) -> Path:
    """``path`` as is when absolute, else relative to ``base_dir`` (image_dir or the data file's dir)."""
    p = Path(os.path.expanduser(path))
    if not p.is_absolute() and base_dir is not None:
        p = Path(base_dir) / p
    return p


def load_image(value: Any, base_dir: str | os.PathLike | None = None) -> Image.Image:
    """A PIL image (fully decoded) from a path, bytes, ``{"bytes": ...}``, ``{"path": ...}`` or PIL.

    Raises ImageLoadError saying what was given and why it failed.
    """
    if isinstance(value, Image.Image):
        value.load()
        return value
    if isinstance(value, dict):
        if value.get("bytes") is not None:
            value = value["bytes"]
        elif value.get("path"):
            value = value["path"]
        else:
            raise ImageLoadError(f"image dict {_short(value)} has neither 'bytes' nor 'path'")
    if isinstance(value, (bytes, bytearray, memoryview)):
        try:
            image = Image.open(io.BytesIO(bytes(value)))
            image.load()
            return image
        except Exception as err:
            raise ImageLoadError(f"image bytes ({len(value)} bytes) cannot be decoded: {err}") from err
    if isinstance(value, (str, os.PathLike)):
        path = resolve_image_path(str(value), base_dir)
        if not path.is_file():
            raise ImageLoadError(f"image file {str(path)!r} does not exist (given as {str(value)!r})")
        try:
            image = Image.open(path)
            image.load()  # decode now, so a truncated file fails here (and PIL closes the file)
            return image
        except Exception as err:
            raise ImageLoadError(f"image file {str(path)!r} cannot be read: {err}") from err
    raise ImageLoadError(
        f"image of type {type(value).__name__} ({_short(value)}); expected a path, bytes, "
        f"{{'bytes': ...}}, {{'path': ...}} or a PIL image"
    )


def _short(value: Any, limit: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def image_factor(processor: Any) -> int:
    """patch_size * merge_size of the processor's image processor (28 for Qwen2/2.5-VL, 32 for Qwen3-VL)."""
    image_processor = getattr(processor, "image_processor", None)
    if image_processor is None:
        raise ValueError(f"{type(processor).__name__} has no image_processor; this model cannot take images")
    return int(image_processor.patch_size) * int(image_processor.merge_size)


def vllm_mm_processor_kwargs(min_pixels: int, max_pixels: int) -> dict[str, dict[str, int]]:
    """``mm_processor_kwargs`` that make vLLM's Qwen-VL processor leave fitted images unchanged.

    vLLM resizes with the model's processor limits unless told otherwise; with the data config's
    limits, images from :func:`fit_image` are a fixed point and keep their token counts. The limits
    go in transformers 5's form, ``size={"shortest_edge": min_pixels, "longest_edge": max_pixels}``
    (pixel counts, despite the names); ``min_pixels=`` / ``max_pixels=`` are deprecated.
    """
    return {"size": {"shortest_edge": int(min_pixels), "longest_edge": int(max_pixels)}}
