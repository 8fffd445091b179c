"""RLDataset: data rows -> tokenized prompts with fitted images, every row checked at construction
(docs/data.md, "Bad rows"). :meth:`PromptEncoder.encode` alone makes the prompt the length filter
counts, the rollout gets and the training forward sees, so the three cannot disagree."""

from __future__ import annotations

import dataclasses
import logging
import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Sequence

import torch
from torch import Tensor

from easyvlm.data.settings import DataConfig
from easyvlm.data.batch import ORIGINAL_IMAGES_KEY
from easyvlm.data.images import (
    ImageLoadError,
    LazyImages,
    check_pixel_limits,
    fit_image,
    image_factor,
    load_image,
    processor_pixel_limits,
)
from easyvlm.data.loading import DataError, RowSource, describe, json_list_or_value, load_sources
from easyvlm.data.prompts import PromptError, build_messages, render_prompt, resolve_chat_template
from easyvlm.data.videos import Video, load_video, uncapped_frame_kwargs
from easyvlm.models.position_ids import get_position_ids

logger = logging.getLogger(__name__)

MAX_LISTED_BAD_ROWS = 10


class RowError(ValueError):
    """One row that cannot become a prompt (message: the problem, without the row's location)."""


@dataclass
class BadRow:
    where: str  # "path/to/file.jsonl row 3 (line 4)"
    problem: str

    def __str__(self) -> str:
        return f"{self.where}: {self.problem}"


@dataclass
class DatasetReport:
    """What the construction scan found. ``kept`` rows are used; the others are listed or counted."""

    key: str
    total: int = 0
    kept: int = 0
    bad_rows: list[BadRow] = field(default_factory=list)
    overlong: int = 0  # dropped by filter_overlong_prompts

    def summary(self) -> str:
        parts = [f"{self.key}: {self.kept} of {self.total} rows used"]
        if self.bad_rows:
            parts.append(f"{len(self.bad_rows)} bad rows skipped (data.on_bad_row=skip)")
        if self.overlong:
            parts.append(f"{self.overlong} rows longer than data.max_prompt_length dropped (data.filter_overlong_prompts)")
        return "; ".join(parts)


@dataclass
class EncodedPrompt:
    """One tokenized prompt. input_ids (P,): unpadded, vision expanded to its tokens; raw_prompt_ids:
    ONE pad token per image and video (vLLM expands it to the same input_ids)."""

    input_ids: list[int]
    raw_prompt_ids: list[int]
    images: list  # PIL images after fit_image
    # pixel_values (N_patches, D), image_grid_thw (N_img, 3); for videos pixel_values_videos,
    # video_grid_thw (N_vid, 3) and, for Qwen2.5-VL, second_per_grid_ts (N_vid,); {} if none
    multi_modal_inputs: dict[str, Tensor]
    prompt_text: str  # the chat-template text (one pad token per image and video), before any truncation
    original_image_sizes: list = dataclasses.field(default_factory=list)  # (width, height) before fit_image
    videos: list[Video] = dataclasses.field(default_factory=list)  # sampled and fitted frames


class PromptEncoder:
    """Turns a data row into an :class:`EncodedPrompt`. processor: None for a text-only model;
    model_config: the transformers config; config: the run's ``data`` section (absolute paths)."""

    def __init__(
        self, config: DataConfig, tokenizer: Any, processor: Any = None, model_config: Any = None,
        tools: Sequence[dict] = (),
    ):
        self.config = config
        # the tools' JSON schemas (worker.rollout.tools): the chat template shows them to the model
        self.tools = list(tools) or None
        self.tokenizer = tokenizer if tokenizer is not None else getattr(processor, "tokenizer", processor)
        # AutoProcessor gives a bare tokenizer for a text-only model: that is "no processor" here.
        self.processor = processor if getattr(processor, "image_processor", None) is not None else None
        processor = self.processor
        self.model_config = model_config
        self.prompt_key = config.prompt_key
        self.answer_key = config.answer_key
        self.image_key = config.image_key
        self.video_key = config.video_key
        self.image_dir = config.image_dir
        self.max_prompt_length = config.max_prompt_length
        self.format_prompt = config.format_prompt
        self.system_prompt = config.system_prompt
        self.truncation = config.prompt_truncation
        self.chat_template = resolve_chat_template(config.override_chat_template)
        self.factor = image_factor(processor) if processor is not None else None
        if self.factor is not None:
            # EasyR1's two stages: data.min/max_pixels (None = no limit), then the processor's own limits
            self.min_pixels, self.max_pixels = config.min_pixels, config.max_pixels
            self.processor_min_pixels, self.processor_max_pixels = processor_pixel_limits(processor)
            check_pixel_limits(
                self.min_pixels,
                self.max_pixels,
                self.factor,
                processor_min_pixels=self.processor_min_pixels,
                processor_max_pixels=self.processor_max_pixels,
            )
            self.merge_size = int(processor.image_processor.merge_size)
            self.image_token_id = int(
                getattr(model_config, "image_token_id", None) or getattr(processor, "image_token_id")
            )
            video_token_id = getattr(model_config, "video_token_id", None) or getattr(processor, "video_token_id", None)
            self.video_token_id = int(video_token_id) if video_token_id is not None else None
        if self.tokenizer is None:
            raise ValueError("PromptEncoder needs a tokenizer or a processor")
        self.pad_token_id = _pad_token_id(self.tokenizer)

    # ------------------------------------------------------------------ one row
    def raw_images(self, row: dict) -> list:
        value = json_list_or_value(row.get(self.image_key))
        if value is None or (isinstance(value, str) and not value.strip()):
            return []
        return list(value) if isinstance(value, (list, tuple)) else [value]

    def search_dirs(self, base_dir: Any) -> list:
        """Where relative media paths are looked for: data.image_dir, else the data file's directory; then cwd."""
        return [self.image_dir] if self.image_dir else [base_dir, os.getcwd()]

    def raw_videos(self, row: dict) -> list:
        """The row's videos, each a file path (or {"path": ...}) or a list of frame images."""
        value = json_list_or_value(row.get(self.video_key))
        if value is None or (isinstance(value, str) and not value.strip()):
            return []
        return list(value) if isinstance(value, (list, tuple)) else [value]

    def load_videos(self, row: dict, base_dir: Any) -> list[Video]:
        videos = []
        for k, value in enumerate(self.raw_videos(row)):
            try:
                videos.append(
                    load_video(
                        value,
                        self.search_dirs(base_dir),
                        self.processor,
                        fps=self.config.video_fps,
                        max_frames=self.config.video_max_frames,
                        min_pixels=self.min_pixels,
                        max_pixels=self.max_pixels,
                    )
                )
            except ImageLoadError as err:  # VideoLoadError included
                raise RowError(f"{self.video_key}[{k}]: {err}") from err
        return videos

    def load_images(self, row: dict, base_dir: Any) -> tuple[list, list]:
        """(fitted images, their (width, height) before fitting)."""
        images, sizes = [], []
        for k, value in enumerate(self.raw_images(row)):
            try:
                image = load_image(value, self.search_dirs(base_dir))
                sizes.append(image.size)
                images.append(
                    fit_image(
                        image,
                        self.min_pixels,
                        self.max_pixels,
                        self.factor,
                        processor_min_pixels=self.processor_min_pixels,
                        processor_max_pixels=self.processor_max_pixels,
                    )
                )
            except ImageLoadError as err:
                raise RowError(f"{self.image_key}[{k}]: {err}") from err
        return images, sizes

    def encode(self, row: dict, base_dir: Any = None) -> EncodedPrompt:
        """Row -> EncodedPrompt, before any length policy. Raises RowError naming the problem."""
        for key, config_key in ((self.prompt_key, "data.prompt_key"), (self.answer_key, "data.answer_key")):
            if row.get(key) is None:
                raise RowError(f"missing key {key!r} ({config_key}); the row has {sorted(row)}")
        content = row[self.prompt_key]
        if not isinstance(content, str):
            raise RowError(f"{self.prompt_key!r} must be a string, got {type(content).__name__}")
        if (self.raw_images(row) or self.raw_videos(row)) and self.processor is None:
            raise RowError("the row has images or videos but the model has no image processor (text-only model)")
        images, sizes = self.load_images(row, base_dir) if self.processor is not None else ([], [])
        videos = self.load_videos(row, base_dir) if self.processor is not None else []
        if videos and self.video_token_id is None:
            raise RowError("the row has videos but the model config has no video_token_id (the model cannot take videos)")
        try:
            text = render_prompt(content, row, self.format_prompt)
            messages = build_messages(
                text, len(images), self.system_prompt, multimodal=self.processor is not None, num_videos=len(videos)
            )
        except PromptError as err:
            raise RowError(str(err)) from err

        if self.processor is None:
            prompt_text = self.tokenizer.apply_chat_template(
                messages, add_generation_prompt=True, tokenize=False, chat_template=self.chat_template, tools=self.tools
            )
            input_ids = list(self.tokenizer(prompt_text, add_special_tokens=False)["input_ids"])
            return EncodedPrompt(input_ids, input_ids, [], {}, prompt_text)

        prompt_text = self.processor.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=False, chat_template=self.chat_template, tools=self.tools
        )
        # do_resize=False: the images and frames are already fitted; the processor must not resize
        # again. do_sample_frames=False: the frames are already sampled (data.video_fps); the
        # metadata says when they were taken (Qwen2.5-VL's second_per_grid_ts, Qwen3-VL's timestamps).
        video_kwargs: dict[str, Any] = {}
        if videos:
            video_kwargs = dict(
                videos=[v.frames for v in videos],
                video_metadata=[v.transformers_metadata() for v in videos],
                do_sample_frames=False,
                **uncapped_frame_kwargs(self.processor),
            )
        out = self.processor(
            text=[prompt_text],
            images=images or None,
            do_resize=False,
            add_special_tokens=False,
            return_tensors="pt",
            **video_kwargs,
        )
        input_ids = out["input_ids"][0].tolist()
        mm = {"pixel_values": out["pixel_values"], "image_grid_thw": out["image_grid_thw"]} if images else {}
        if videos:
            mm.update(pixel_values_videos=out["pixel_values_videos"], video_grid_thw=out["video_grid_thw"])
            if out.get("second_per_grid_ts") is not None:  # Qwen2.5-VL
                mm["second_per_grid_ts"] = torch.as_tensor(out["second_per_grid_ts"], dtype=torch.float32).reshape(-1)
        for kind, token_id, grid_key, count in (
            ("image", self.image_token_id, "image_grid_thw", len(images)),
            ("video", self.video_token_id, "video_grid_thw", len(videos)),
        ):
            found, expected = input_ids.count(token_id), sum(self.vision_tokens(mm, grid_key))
            if found != expected:
                raise RowError(
                    f"the tokenized prompt has {found} {kind} tokens but its {count} {kind}(s) give {expected} "
                    f"features (does the text contain the {kind} pad token literally?)"
                )
        raw_prompt_ids = list(self.tokenizer(prompt_text, add_special_tokens=False)["input_ids"])
        return EncodedPrompt(input_ids, raw_prompt_ids, images, mm, prompt_text, sizes, videos)

    def vision_tokens(self, mm: dict[str, Tensor], grid_key: str = "image_grid_thw") -> list[int]:
        """Tokens (= vision tower features) of each image or video: t * h * w / merge_size**2."""
        grid = mm.get(grid_key)
        return (grid.prod(-1) // self.merge_size**2).tolist() if grid is not None else []

    def count_vision_tokens(self, input_ids: list[int]) -> int:
        ids = {self.image_token_id, self.video_token_id} - {None}
        return sum(1 for t in input_ids if t in ids)

    def apply_length_policy(self, enc: EncodedPrompt) -> EncodedPrompt:
        """Truncate (left/right) or refuse (error) a prompt longer than data.max_prompt_length."""
        n = len(enc.input_ids)
        limit = self.max_prompt_length
        if n <= limit:
            return enc
        if self.truncation == "error":
            raise RowError(
                f"the prompt has {n} tokens, more than data.max_prompt_length={limit} "
                f"(data.prompt_truncation=error); raise max_prompt_length, lower data.max_pixels, set "
                f"data.filter_overlong_prompts=true to drop such rows, or prompt_truncation=left/right"
            )
        cut = n - limit
        kept = enc.input_ids[cut:] if self.truncation == "left" else enc.input_ids[:limit]
        if (enc.images or enc.videos) and self.count_vision_tokens(kept) != self.count_vision_tokens(enc.input_ids):
            raise RowError(
                f"the prompt has {n} tokens, more than data.max_prompt_length={limit}, and truncating it "
                f"({self.truncation}) would cut image or video tokens; raise max_prompt_length, lower "
                f"data.max_pixels or (videos) data.video_fps"
            )
        # The cut tokens are text (no vision token was cut), the same in input_ids and raw ids.
        raw = enc.raw_prompt_ids
        raw = raw[cut:] if self.truncation == "left" else raw[: len(raw) - cut]
        return dataclasses.replace(enc, input_ids=kept, raw_prompt_ids=raw)

    def position_ids(self, enc: EncodedPrompt) -> Tensor:
        """(4, P) for mRoPE models, (P,) otherwise."""
        ids = torch.tensor([enc.input_ids], dtype=torch.long)
        mask = torch.ones_like(ids, dtype=torch.bool)
        mm = enc.multi_modal_inputs
        return get_position_ids(
            ids, mask, mm.get("image_grid_thw"), mm.get("video_grid_thw"), self.model_config, mm.get("second_per_grid_ts")
        )[0]


def _pad_token_id(tokenizer: Any) -> int:
    for name in ("pad_token_id", "eos_token_id"):
        value = getattr(tokenizer, name, None)
        if isinstance(value, int):
            return value
    raise ValueError("the tokenizer has neither a pad token nor an eos token; set tokenizer.pad_token")


class RLDataset(torch.utils.data.Dataset):
    """Prompts of one split. files: what the config ``key`` holds; name: prefix of the per-row
    ``uid`` (``f"{name}-{row number over all files}"``, stable across runs)."""

    def __init__(
        self,
        files: str | Sequence[str],
        config: DataConfig,
        tokenizer: Any,
        processor: Any = None,
        model_config: Any = None,
        key: str = "data.train_files",
        name: str = "train",
        tools: Sequence[dict] = (),
    ):
        self.encoder = PromptEncoder(config, tokenizer, processor, model_config, tools)
        self.config = config
        self.key = key
        self.name = name
        on_bad_row = config.on_bad_row
        self.sources: list[RowSource] = load_sources(files, key)
        self.pad_token_id = self.encoder.pad_token_id
        self.report = DatasetReport(key, total=sum(len(s) for s in self.sources))
        if self.report.total == 0:
            raise DataError(f"{key}: {describe(self.sources)} has no rows")
        self.index: list[tuple[int, int, int]] = self._scan(on_bad_row)  # (source, row, uid number)
        self.report.kept = len(self.index)
        logger.info(self.report.summary())
        if not self.index:
            raise DataError(f"{key}: no usable rows in {describe(self.sources)} ({self.report.summary()})")

    # ------------------------------------------------------------------ scan
    def _check_row(self, job: tuple[int, int]) -> tuple[str, str | None]:
        """("ok" | "overlong" | "bad", problem)."""
        source_id, row_id = job
        source = self.sources[source_id]
        try:
            enc = self.encoder.encode(dict(source.rows[row_id]), source.base_dir)
            if len(enc.input_ids) > self.encoder.max_prompt_length and self.config.filter_overlong_prompts:
                return "overlong", None
            self.encoder.apply_length_policy(enc)
        except RowError as err:
            return "bad", str(err)
        return "ok", None

    def _scan(self, on_bad_row: str) -> list[tuple[int, int, int]]:
        jobs = [(s, r) for s, source in enumerate(self.sources) for r in range(len(source))]
        workers = self.config.filter_overlong_prompts_workers
        if workers > 1 and len(jobs) > 1:
            # Threads: image decoding, resizing and the processor's tensor ops release the GIL.
            with ThreadPoolExecutor(max_workers=workers) as pool:
                results = list(pool.map(self._check_row, jobs))
        else:
            results = [self._check_row(job) for job in jobs]
        kept = []
        for uid_number, ((s, r), (status, problem)) in enumerate(zip(jobs, results)):
            if status == "ok":
                kept.append((s, r, uid_number))
            elif status == "overlong":
                self.report.overlong += 1
            else:
                self.report.bad_rows.append(BadRow(self.sources[s].where(r), problem or ""))
        bad = self.report.bad_rows
        if bad and on_bad_row == "raise":
            listed = "\n".join(f"  {b}" for b in bad[:MAX_LISTED_BAD_ROWS])
            more = f"\n  ... and {len(bad) - MAX_LISTED_BAD_ROWS} more" if len(bad) > MAX_LISTED_BAD_ROWS else ""
            raise DataError(
                f"{self.key}: {len(bad)} bad row(s) of {self.report.total}:\n{listed}{more}\n"
                f"Fix these rows, or set data.on_bad_row=skip to drop them (the count is reported)."
            )
        if bad:
            logger.warning(
                "%s: skipped %d bad row(s) (data.on_bad_row=skip); first: %s", self.key, len(bad), bad[0]
            )
        return kept

    # ------------------------------------------------------------------ access
    def __len__(self) -> int:
        return len(self.index)

    def __getitem__(self, i: int) -> dict[str, Any]:
        """One sample: the prompt batch's keys unbatched (docs/data.md, "The prompt batch"), ``videos``
        and ``original_image_sizes`` ((width, height) before resizing)."""
        source_id, row_id, uid_number = self.index[i]
        source = self.sources[source_id]
        row = dict(source.rows[row_id])
        try:
            enc = self.encoder.apply_length_policy(self.encoder.encode(row, source.base_dir))
        except RowError as err:  # the scan passed, so the data changed on disk since
            raise DataError(f"{source.where(row_id)}: {err}") from err
        reserved = {self.encoder.prompt_key, self.encoder.answer_key, self.encoder.image_key, self.encoder.video_key}
        sample = {
            "input_ids": torch.tensor(enc.input_ids, dtype=torch.long),
            "position_ids": self.encoder.position_ids(enc),
            "raw_prompt_ids": enc.raw_prompt_ids,
            "images": enc.images,
            "original_image_sizes": enc.original_image_sizes,
            "videos": enc.videos,
            "multi_modal_inputs": enc.multi_modal_inputs,
            "ground_truth": row[self.encoder.answer_key],
            "uid": f"{self.name}-{uid_number}",
            "prompt_text": enc.prompt_text,
            "question": row[self.encoder.prompt_key],  # as the row has it (<image> placeholders): for a judge
            "extra": {k: v for k, v in row.items() if k not in reserved},
        }
        if self.encoder.tools:  # tools may zoom into the full-resolution images
            search_dirs = tuple(str(d) for d in self.encoder.search_dirs(source.base_dir) if d is not None)
            sample[ORIGINAL_IMAGES_KEY] = LazyImages(tuple(self.encoder.raw_images(row)), search_dirs)
        return sample
