"""Videos (a file PyAV decodes, or a list of frame images): decode, sample frames and size them as
EasyR1's ``process_video`` does, in one bicubic resize as images (docs/data.md, "Video")."""

from __future__ import annotations

import inspect
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import numpy as np
from PIL import Image

from easyvlm.data.images import (
    ImageLoadError, check_aspect_ratio, image_processor_of, load_image, processor_pixel_limits, resolve_image_path,
)

FRAME_FACTOR = 2  # qwen-vl-utils: frame counts are even (the temporal patch of Qwen-VL models)
MIN_FRAMES = 4  # qwen-vl-utils' FPS_MIN_FRAMES
VIDEO_MIN_TOKENS = 128  # qwen-vl-utils' VIDEO_MIN_TOKEN_NUM: default per-frame minimum, in tokens
VIDEO_MAX_TOKENS = 768  # qwen-vl-utils' VIDEO_MAX_TOKEN_NUM: per-frame maximum, in tokens


class VideoLoadError(ImageLoadError):
    """A video in a data row that cannot be used; the message says which and why."""


@dataclass
class Video:
    """One video after sampling and sizing. frames (T, H, W, 3) uint8, T even; fps: the source's (a
    frame list: ``data.video_fps``); frames_indices: source frame of each kept frame."""

    frames: np.ndarray
    fps: float
    frames_indices: list[int]
    total_num_frames: int

    @property
    def sample_fps(self) -> float:
        """Frames per second of the kept frames (qwen-vl-utils' ``sample_fps``)."""
        return len(self.frames_indices) / self.total_num_frames * self.fps

    def metadata(self) -> dict[str, Any]:
        """What transformers' ``VideoMetadata`` and vLLM's video metadata take."""
        return {
            "fps": self.fps,
            "total_num_frames": self.total_num_frames,
            "frames_indices": list(self.frames_indices),
            "duration": self.total_num_frames / self.fps,
            "video_backend": "pyav",
        }

    def transformers_metadata(self) -> Any:
        from transformers.video_utils import VideoMetadata

        return VideoMetadata(**self.metadata())


def sample_indices(total_frames: int, raw_fps: float, fps: float, max_frames: int) -> list[int]:
    """The source frames EasyR1 keeps (``smart_nframes``'s count, evenly spaced). VideoLoadError under 2."""
    import torch
    from qwen_vl_utils.vision_process import smart_nframes

    if total_frames < FRAME_FACTOR:
        raise VideoLoadError(f"the video has {total_frames} frame(s); at least {FRAME_FACTOR} are needed")
    count = smart_nframes({"fps": fps, "max_frames": max_frames}, total_frames=total_frames, video_fps=raw_fps)
    return torch.linspace(0, total_frames - 1, count).round().long().tolist()


def decode_video_file(path: Path, fps: float, max_frames: int) -> tuple[list[np.ndarray], float, list[int], int]:
    """(kept frames as (H, W, 3) uint8 RGB, raw fps, kept indices, total frames) of a video file."""
    import av

    try:
        with av.open(str(path)) as container:
            if not container.streams.video:
                raise VideoLoadError(f"video file {str(path)!r} has no video stream")
            stream = container.streams.video[0]
            rate = stream.average_rate or stream.guessed_rate or stream.base_rate
            if not rate:
                raise VideoLoadError(f"video file {str(path)!r} does not say its frame rate")
            # Decoded in full: the container's frame count is not reliable for every format,
            # and the clips RL data sets use are short.
            frames = [frame.to_ndarray(format="rgb24") for frame in container.decode(stream)]
    except VideoLoadError:
        raise
    except Exception as err:  # av.error.* (corrupt, truncated, unknown format), OSError
        raise VideoLoadError(f"video file {str(path)!r} cannot be decoded: {err}") from err
    raw_fps = float(rate)
    indices = sample_indices(len(frames), raw_fps, fps, max_frames)
    return [frames[i] for i in indices], raw_fps, indices, len(frames)


def frame_size_stage1(height: int, width: int, factor: int, min_pixels: int | None, max_pixels: int | None) -> tuple[int, int]:
    """Stage 1: qwen-vl-utils' per-frame size with EasyR1's ``data.min_pixels`` / ``data.max_pixels``."""
    from qwen_vl_utils.vision_process import smart_resize

    low = min_pixels if min_pixels is not None else VIDEO_MIN_TOKENS * factor * factor
    high = max(VIDEO_MAX_TOKENS * factor * factor, int(low * 1.05))  # qwen-vl-utils' cap (short clips)
    if max_pixels is not None:
        high = min(high, max_pixels)
    try:
        return smart_resize(height, width, factor=factor, min_pixels=low, max_pixels=high)
    except ValueError as err:  # aspect ratio above 200
        raise VideoLoadError(f"video frames of {width}x{height}: {err}") from err


def uncapped_frame_kwargs(processor: Any) -> dict[str, bool]:
    """``{"cap_pixels_per_frame": False}`` for video processors with the switch, else ``{}``: stage 1
    already capped each frame."""
    video_processor = getattr(processor, "video_processor", None)
    return {"cap_pixels_per_frame": False} if hasattr(video_processor, "cap_pixels_per_frame") else {}


def _video_processor(processor: Any) -> Any:
    video_processor = getattr(processor, "video_processor", None)
    if video_processor is None:
        raise VideoLoadError(f"{type(processor).__name__} has no video_processor; this model cannot take videos")
    return video_processor


def processor_frame_size(processor: Any, num_frames: int, height: int, width: int) -> tuple[int, int]:
    """Stage 2: the size the video processor's own ``smart_resize`` and limits give the frames."""
    video_processor = _video_processor(processor)
    resize = getattr(sys.modules[type(video_processor).__module__], "smart_resize", None)
    if resize is None:
        raise VideoLoadError(f"{type(video_processor).__name__}: no smart_resize rule known for this video processor")
    min_pixels, max_pixels = processor_pixel_limits(video_processor)
    kwargs = dict(
        factor=int(video_processor.patch_size) * int(video_processor.merge_size), min_pixels=min_pixels, max_pixels=max_pixels
    )
    if "num_frames" in inspect.signature(resize).parameters:
        kwargs.update(num_frames=num_frames, temporal_factor=int(video_processor.temporal_patch_size))
    try:
        return tuple(resize(height=height, width=width, **kwargs))
    except ValueError as err:
        raise VideoLoadError(f"video frames of {width}x{height}: {err}") from err


def fitted_frame_size(
    processor: Any, num_frames: int, height: int, width: int, factor: int, min_pixels: int | None, max_pixels: int | None
) -> tuple[int, int]:
    """(height, width) of every frame after both stages; raises VideoLoadError if vLLM would resize again."""
    check_aspect_ratio(height, width)
    h1, w1 = frame_size_stage1(height, width, factor, min_pixels, max_pixels)
    h, w = processor_frame_size(processor, num_frames, h1, w1)
    again = processor_frame_size(processor, num_frames, h, w)
    if again != (h, w):
        raise VideoLoadError(
            f"video of {num_frames} frames of {width}x{height} cannot be sized consistently: data.min_pixels/"
            f"data.max_pixels give {w1}x{h1}, the video processor's limits {w}x{h}, which the processor and vLLM "
            f"would resize again to {again[1]}x{again[0]}; change data.max_pixels or the video's size"
        )
    return h, w


def load_video(
    value: Any,
    search_dirs: Sequence[str | os.PathLike | None],
    processor: Any,
    *,
    fps: float,
    max_frames: int,
    min_pixels: int | None,
    max_pixels: int | None,
) -> Video:
    """A :class:`Video` from a file path (or ``{"path": ...}``) or a list of frame images; the other
    arguments are the ``data.video_*`` / ``data.*_pixels`` settings (None = qwen-vl-utils' defaults).
    Raises VideoLoadError."""
    if isinstance(value, dict) and value.get("path"):
        value = value["path"]
    if isinstance(value, (str, os.PathLike)):
        try:
            path = resolve_image_path(value, search_dirs, kind="video")  # same lookup rule as images
        except ImageLoadError as err:
            raise VideoLoadError(str(err)) from err
        frames, raw_fps, indices, total = decode_video_file(path, fps, max_frames)
        pil_frames = [Image.fromarray(f) for f in frames]
    elif isinstance(value, (list, tuple)):
        if len(value) > max_frames:
            raise VideoLoadError(
                f"the frame list has {len(value)} frames, more than data.video_max_frames={max_frames}; "
                f"sample fewer frames or raise data.video_max_frames"
            )
        if not value:
            raise VideoLoadError("the frame list is empty")
        pil_frames = []
        for k, item in enumerate(value):
            try:
                pil_frames.append(load_image(item, search_dirs).convert("RGB"))
            except ImageLoadError as err:
                raise VideoLoadError(f"frame {k}: {err}") from err
        if len({f.size for f in pil_frames}) > 1:
            raise VideoLoadError(f"the frames have different sizes {sorted({f.size for f in pil_frames})}; a video's frames share one size")
        pil_frames += [pil_frames[-1]] * (-len(pil_frames) % FRAME_FACTOR)  # even count, as qwen-vl-utils
        raw_fps, indices, total = float(fps), list(range(len(pil_frames))), len(pil_frames)
    else:
        raise VideoLoadError(
            f"video of type {type(value).__name__}; expected a file path, {{'path': ...}} or a list of frame images"
        )
    width, height = pil_frames[0].size
    factor = int(_video_processor(processor).patch_size) * int(_video_processor(processor).merge_size)
    h, w = fitted_frame_size(processor, len(pil_frames), height, width, factor, min_pixels, max_pixels)
    if (h, w) != (height, width):
        pil_frames = [f.resize((w, h), resample=Image.Resampling.BICUBIC) for f in pil_frames]
    array = np.stack([np.asarray(f.convert("RGB"), dtype=np.uint8) for f in pil_frames])
    return Video(frames=array, fps=raw_fps, frames_indices=indices, total_num_frames=total)


# Lossless H.264 in RGB: no YUV conversion, no chroma subsampling, bit-exact frames. One encoder
# thread keeps the bytes reproducible.
VIDEO_CODEC = "libx264rgb"
VIDEO_OPTIONS = {"crf": "0", "preset": "medium"}


def encode_video(frames: Sequence[np.ndarray | Image.Image], fps: float) -> bytes:
    """Lossless, deterministic MP4 bytes of RGB ``frames`` (one size, even sides)."""
    import io
    from fractions import Fraction

    import av

    images = [f if isinstance(f, Image.Image) else Image.fromarray(np.asarray(f, dtype=np.uint8)) for f in frames]
    sizes = {image.size for image in images}
    if not images or len(sizes) != 1 or any(side % 2 for side in images[0].size):
        raise ValueError(f"encode_video: need frames of one size with even sides, got {sorted(sizes)}")
    buffer = io.BytesIO()
    with av.open(buffer, "w", format="mp4") as container:
        stream = container.add_stream(VIDEO_CODEC, rate=Fraction(fps).limit_denominator(1000))
        stream.width, stream.height = images[0].size
        stream.pix_fmt = "rgb24"
        stream.options = dict(VIDEO_OPTIONS)
        stream.codec_context.thread_count = 1
        for index, image in enumerate(images):
            frame = av.VideoFrame.from_image(image.convert("RGB"))
            frame.pts = index
            container.mux(stream.encode(frame))
        container.mux(stream.encode(None))  # flush
    return buffer.getvalue()


def write_video(path: str | os.PathLike, frames: Sequence[np.ndarray | Image.Image], fps: float) -> Path:
    """:func:`encode_video` into the file ``path`` (its directory is created)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(encode_video(frames, fps))
    return path


def vllm_mm_processor_kwargs(processor: Any) -> dict[str, dict[str, Any]]:
    """``mm_processor_kwargs`` that make vLLM resize images and frames with the processor's limits, per
    modality (Qwen3-VL's two processors differ); ``{}`` for a text-only model."""
    if image_processor_of(processor) is None:
        return {}
    min_pixels, max_pixels = processor_pixel_limits(processor)
    kwargs: dict[str, dict[str, Any]] = {"images_kwargs": {"size": {"shortest_edge": min_pixels, "longest_edge": max_pixels}}}
    video_processor = getattr(processor, "video_processor", None)
    if video_processor is not None:
        low, high = processor_pixel_limits(video_processor)
        kwargs["videos_kwargs"] = {"size": {"shortest_edge": low, "longest_edge": high}, **uncapped_frame_kwargs(processor)}
    return kwargs
