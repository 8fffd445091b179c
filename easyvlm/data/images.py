"""Images: load them from what a data row holds, and size them as EasyR1's two stages do, in one
bicubic resize to a fixed point of ``smart_resize`` (so the processor and vLLM leave it alone);
docs/data.md, "Images: EasyR1's sizes, one resize"."""

from __future__ import annotations

import io
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

from PIL import Image

MAX_ASPECT_RATIO = 200  # Qwen-VL's smart_resize refuses longer/shorter > 200


class ImageLoadError(ValueError):
    """An image in a data row that cannot be used; the message says which and why."""


def check_aspect_ratio(height: int, width: int) -> None:
    """Raise ImageLoadError unless both sides are positive and longer / shorter <= 200 (Qwen-VL's limit)."""
    if min(height, width) <= 0:
        raise ImageLoadError(f"image has size {width}x{height}; both sides must be positive")
    if max(height, width) / min(height, width) > MAX_ASPECT_RATIO:
        raise ImageLoadError(
            f"image of {width}x{height} has an aspect ratio above {MAX_ASPECT_RATIO}, which Qwen-VL models refuse"
        )


def smart_resize(height: int, width: int, factor: int, min_pixels: int, max_pixels: int) -> tuple[int, int]:
    """transformers' ``qwen2_vl`` ``smart_resize``: sides multiples of ``factor``, pixels in range. Thin
    images can end outside the range, so the result is not always a fixed point of itself."""
    check_aspect_ratio(height, width)
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


def prescale_size(height: int, width: int, min_pixels: int | None, max_pixels: int | None) -> tuple[int, int]:
    """Stage 1 (``data.min_pixels`` / ``max_pixels``, None = no limit): EasyR1's ``process_image`` size,
    its float operations in its order (bitwise the same sides). A side can reach 0 (caller refuses)."""
    if max_pixels is not None and height * width > max_pixels:
        scale = math.sqrt(max_pixels / (width * height))
        width, height = int(width * scale), int(height * scale)
    if min_pixels is not None and 0 < height * width < min_pixels:
        scale = math.sqrt(min_pixels / (width * height))
        width, height = int(width * scale), int(height * scale)
    return height, width


def fitted_size(
    height: int,
    width: int,
    min_pixels: int | None,
    max_pixels: int | None,
    factor: int,
    *,
    processor_min_pixels: int,
    processor_max_pixels: int,
) -> tuple[int, int]:
    """(height, width) EasyR1's two stages give an image (``factor``: patch_size * merge_size). Raises
    ImageLoadError for an aspect ratio above 200, a side shrunk to 0, or a result ``smart_resize``
    would resize again."""
    check_aspect_ratio(height, width)
    h1, w1 = prescale_size(height, width, min_pixels, max_pixels)
    if min(h1, w1) < 1:
        raise ImageLoadError(
            f"data.max_pixels={max_pixels} shrinks this {width}x{height} image to {w1}x{h1}, a side of 0 pixels; "
            f"raise data.max_pixels"
        )
    limits = f"[{processor_min_pixels}, {processor_max_pixels}]"
    try:
        h, w = smart_resize(h1, w1, factor, processor_min_pixels, processor_max_pixels)
        again = smart_resize(h, w, factor, processor_min_pixels, processor_max_pixels)
    except ImageLoadError as err:
        raise ImageLoadError(
            f"image of {width}x{height}, resized to {w1}x{h1} by data.min_pixels/data.max_pixels, then to multiples "
            f"of {factor} with the processor's pixel limits {limits}: {err}; crop or pad the image"
        ) from err
    if again != (h, w):
        # smart_resize keeps a side >= factor and rounds up to min_pixels, so a very thin image can
        # land outside the processor's range; vLLM would then resize it again and its token count
        # would differ from the one training uses.
        raise ImageLoadError(
            f"image of {width}x{height} cannot be sized consistently: data.min_pixels/data.max_pixels give "
            f"{w1}x{h1}, the processor's limits {limits} give {w}x{h} ({h * w} pixels), which the processor and vLLM "
            f"would resize again to {again[1]}x{again[0]}; crop or pad the image to a less extreme aspect ratio"
        )
    return h, w


def check_pixel_limits(
    min_pixels: int | None,
    max_pixels: int | None,
    factor: int,
    *,
    processor_min_pixels: int,
    processor_max_pixels: int,
) -> None:
    """Raise a ValueError naming the setting if the pixel limits cannot size images."""
    for key, value in (("data.min_pixels", min_pixels), ("data.max_pixels", max_pixels)):
        if value is not None and value <= 0:
            raise ValueError(f"{key}={value} must be positive, or null for no limit")
    if min_pixels is not None and max_pixels is not None and min_pixels > max_pixels:
        raise ValueError(f"data.min_pixels={min_pixels} must be <= data.max_pixels={max_pixels}")
    if not 0 < processor_min_pixels <= processor_max_pixels or processor_max_pixels < factor * factor:
        raise ValueError(
            f"the image processor's pixel limits [{processor_min_pixels}, {processor_max_pixels}] (size.shortest_edge, "
            f"size.longest_edge in the model's preprocessor config) must satisfy 0 < min <= max and max >= one "
            f"{factor}x{factor} block ({factor * factor} pixels); fix the model's preprocessor config"
        )


def fit_image(
    image: Image.Image,
    min_pixels: int | None,
    max_pixels: int | None,
    factor: int,
    *,
    processor_min_pixels: int,
    processor_max_pixels: int,
) -> Image.Image:
    """An RGB copy of ``image`` at :func:`fitted_size`, resized once; ``image`` if already RGB at that size."""
    if image.mode != "RGB":
        image = image.convert("RGB")
    h, w = fitted_size(
        image.height,
        image.width,
        min_pixels,
        max_pixels,
        factor,
        processor_min_pixels=processor_min_pixels,
        processor_max_pixels=processor_max_pixels,
    )
    if (h, w) != (image.height, image.width):
        image = image.resize((w, h), resample=Image.Resampling.BICUBIC)
    return image


def resolve_image_path(
    path: str | os.PathLike, search_dirs: Sequence[str | os.PathLike | None], kind: str = "image"
) -> Path:
    """The existing file ``path`` names: itself if absolute, else the first ``search_dirs[i] / path``
    (none = the working directory). Raises ImageLoadError naming every place tried."""
    if isinstance(search_dirs, (str, bytes, os.PathLike)) or search_dirs is None:
        raise TypeError(f"search_dirs must be a list of directories, got {search_dirs!r}; wrap one directory in [...]")
    given = Path(os.path.expanduser(os.fspath(path)))
    if given.is_absolute():
        if given.is_file():
            return given
        raise ImageLoadError(f"{kind} file {os.fspath(path)!r} does not exist")
    dirs = list(dict.fromkeys(Path(d) for d in search_dirs if d is not None)) or [Path.cwd()]  # order kept
    for directory in dirs:
        if (directory / given).is_file():
            return directory / given
    tried = ", ".join(repr(str(d)) for d in dirs)
    raise ImageLoadError(
        f"{kind} file {os.fspath(path)!r} does not exist in any of the directories tried: {tried}. "
        f"Relative paths resolve against data.image_dir if it is set, else the data file's directory, "
        f"then the working directory"
    )


def load_image(value: Any, search_dirs: Sequence[str | os.PathLike | None] = ()) -> Image.Image:
    """A PIL image (fully decoded) from a path, bytes, ``{"bytes": ...}``, ``{"path": ...}`` or PIL;
    relative paths as in :func:`resolve_image_path`. Raises ImageLoadError saying what and why."""
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
        path = resolve_image_path(value, search_dirs)
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


@dataclass(frozen=True)
class LazyImages:
    """A row's images at full resolution, loaded only by :meth:`load` (tools that zoom); cheap to pickle."""

    values: tuple
    search_dirs: tuple

    def load(self) -> list[Image.Image]:
        return [load_image(value, self.search_dirs) for value in self.values]


def _short(value: Any, limit: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def image_processor_of(processor: Any) -> Any:
    """The image processor of a multimodal processor, ``processor`` itself if it is one, else None."""
    image_processor = getattr(processor, "image_processor", None)
    if image_processor is None and hasattr(processor, "patch_size"):
        image_processor = processor
    return image_processor


def _require_image_processor(processor: Any) -> Any:
    image_processor = image_processor_of(processor)
    if image_processor is None:
        raise ValueError(f"{type(processor).__name__} has no image_processor; this model cannot take images")
    return image_processor


def image_factor(processor: Any) -> int:
    """patch_size * merge_size of the processor's image processor (28 for Qwen2/2.5-VL, 32 for Qwen3-VL)."""
    image_processor = _require_image_processor(processor)
    return int(image_processor.patch_size) * int(image_processor.merge_size)


def processor_pixel_limits(processor: Any) -> tuple[int, int]:
    """(min_pixels, max_pixels) the model's image processor resizes to: transformers 5's ``size =
    {"shortest_edge", "longest_edge"}`` (pixel counts; what vLLM reads), else 4.x's keys or attributes."""
    image_processor = _require_image_processor(processor)
    size = getattr(image_processor, "size", None)
    forms = [
        (_field(size, "shortest_edge"), _field(size, "longest_edge")),
        (_field(size, "min_pixels"), _field(size, "max_pixels")),
        (getattr(image_processor, "min_pixels", None), getattr(image_processor, "max_pixels", None)),
    ]
    for low, high in forms:
        if low is not None and high is not None:
            return int(low), int(high)
    raise ValueError(
        f"cannot read the pixel limits of {type(image_processor).__name__}: its size is {size!r} and it has no "
        f"min_pixels/max_pixels; set size={{'shortest_edge': ..., 'longest_edge': ...}} in the model's "
        f"preprocessor config"
    )


def _field(size: Any, key: str) -> Any:
    """``size[key]`` for a dict, ``size.key`` for transformers' SizeDict, None if absent."""
    if isinstance(size, dict):
        return size.get(key)
    return getattr(size, key, None)
