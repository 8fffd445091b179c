"""What the rollout viewer records: one ``RolloutSample`` per sampled response, one JSON line each
(docs/viewer.md, "The JSONL rows"). ``capture_rollouts`` runs on the training step's path (plain
lists, no decoding); ``build_samples`` decodes and saves media in the writer thread."""

from __future__ import annotations

import dataclasses
import hashlib
import io
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import torch

# the frames of a video shown in the viewer: evenly spaced, first and last included
VIDEO_FRAMES_SHOWN = 4
MEDIA_DIR = "media"


@dataclass(frozen=True)
class RolloutSample:
    """One sampled response and everything the viewer shows beside it."""

    step: int
    split: str
    """"train" or "val"."""
    uid: str
    """The prompt group: the n samples of one prompt share it."""
    index: int
    prompt: str
    """The prompt text as the model saw it (format prompt and chat template applied)."""
    images: list[str]
    """PNG files relative to the rollouts directory (``videos``: a few frames of each)."""
    videos: list[list[str]]
    response: str
    ground_truth: str
    reward: float
    scores: dict[str, float]
    advantage: float | None
    """The advantage on the first response token; None where none was computed (validation)."""
    response_length: int
    tokens: list[str]
    """The response's tokens, each decoded alone (a character split across tokens shows as U+FFFD)."""
    logprobs: list[float]
    turns: list[dict] = dataclasses.field(default_factory=list)
    """Multi-turn samples: the turns after the prompt, ``{"role", "content", "images"}``; [] otherwise."""
    steps: list[dict] = dataclasses.field(default_factory=list)
    """Environment episodes, per model turn: ``{"screenshot", "size", "action", "click", "reward",
    "advantage", "reply"}`` (docs/viewer.md); [] for single-turn and tool samples."""


@dataclass
class RolloutCapture:
    """A step's rollouts in plain Python values, taken from the rollout Batch on the step's path."""

    step: int
    split: str
    uids: list[str]
    prompts: list[str]
    ground_truths: list[str]
    token_ids: list[list[int]]
    logprobs: list[list[float]]
    scores: dict[str, list[float]]
    overall: list[float]
    advantages: list[float] | None
    media: dict[str, tuple[list[Any], list[Any]]]
    """uid -> (PIL images, videos) of the group's first row."""
    trajectories: list[dict] | None = None
    """Multi-turn batches: each sample's ``trajectory`` (easyvlm.agents.loop), else None."""
    step_values: list[list[tuple[float, float | None]]] | None = None
    """Environment batches: :func:`capture_steps`, else None."""


def capture_rollouts(step: int, split: str, batch: Any, scores: dict[str, list[float]], overall: Sequence[float]) -> RolloutCapture:
    """What the viewer needs from a rollout ``Batch`` and its reward: plain lists, no decoding."""
    mask = batch["response_mask"].bool()
    responses = batch["responses"]
    token_ids = [responses[i][mask[i]].tolist() for i in range(len(batch))]
    logprob_rows = batch["rollout_logprobs"] if "rollout_logprobs" in batch else None
    logprobs = [logprob_rows[i][mask[i]].tolist() if logprob_rows is not None else [] for i in range(len(batch))]
    advantages = None
    if "advantages" in batch:
        first = mask.float().argmax(dim=1)  # the first response token (an empty response: column 0)
        advantages = batch["advantages"].gather(1, first.unsqueeze(1)).squeeze(1).tolist()
    uids = [str(u) for u in batch["uid"]]
    images = batch.get("images", [[]] * len(batch))
    videos = batch.get("videos", [[]] * len(batch))
    media: dict[str, tuple[list[Any], list[Any]]] = {}
    for i, uid in enumerate(uids):
        if uid not in media:
            media[uid] = (list(images[i] or []), list(videos[i] or []))
    return RolloutCapture(
        step=step,
        split=split,
        uids=uids,
        prompts=[str(p or "") for p in batch.get("prompt_text", [""] * len(batch))],
        ground_truths=[_text(g) for g in batch["ground_truth"]],
        token_ids=token_ids,
        logprobs=logprobs,
        scores={k: [float(v) for v in values] for k, values in scores.items()},
        overall=[float(v) for v in overall],
        advantages=advantages,
        media=media,
        trajectories=batch.get("trajectory"),
        step_values=capture_steps(batch) if "step_rewards" in batch and "turn_index" in batch else None,
    )


def capture_steps(batch: Any) -> list[list[tuple[float, float | None]]]:
    """Per sample, per step column (easyvlm.agents.loop's ``turn_index`` and ``step_rewards``): (the
    step's reward, the advantage on the step's first token; None without ``advantages`` or tokens)."""
    turn_index, step_rewards = batch["turn_index"], batch["step_rewards"]
    length, num_steps = turn_index.shape[1], step_rewards.shape[1]
    on_step = turn_index.unsqueeze(-1) == torch.arange(num_steps)  # (B, T, S): token t belongs to step k
    positions = torch.arange(length).view(1, length, 1).expand_as(on_step)
    first = torch.where(on_step, positions, length).min(dim=1).values  # (B, S); length: no token
    taken = (first < length).tolist()
    advantages = batch["advantages"].gather(1, first.clamp(max=length - 1)).tolist() if "advantages" in batch else None
    rewards = step_rewards.tolist()
    return [
        [(rewards[i][k], advantages[i][k] if advantages is not None and taken[i][k] else None) for k in range(num_steps)]
        for i in range(len(rewards))
    ]


def build_samples(capture: RolloutCapture, tokenizer: Any, root: Path, skip_special_tokens: bool = True) -> list[RolloutSample]:
    """The records of a capture; saves its media under ``root/media`` (existing files are kept).
    Responses are decoded as the reward function saw them (``worker.reward.skip_special_tokens``)."""
    media_paths = {uid: save_media(images, videos, root) for uid, (images, videos) in capture.media.items()}
    responses = tokenizer.batch_decode(capture.token_ids, skip_special_tokens=skip_special_tokens)
    # one decode call for every token of the step (a token alone: ids -> text)
    flat = [[t] for ids in capture.token_ids for t in ids]
    decoded = iter(tokenizer.batch_decode(flat, skip_special_tokens=False, clean_up_tokenization_spaces=False) if flat else [])
    index_in_group: dict[str, int] = {}
    samples = []
    for i, uid in enumerate(capture.uids):
        j = index_in_group[uid] = index_in_group.get(uid, -1) + 1
        images, videos = media_paths[uid]
        turns = _turns(capture.trajectories[i], root) if capture.trajectories else []
        samples.append(
            RolloutSample(
                step=capture.step,
                split=capture.split,
                uid=uid,
                index=j,
                prompt=capture.prompts[i],
                images=images,
                videos=videos,
                response=responses[i],
                ground_truth=capture.ground_truths[i],
                reward=capture.overall[i],
                scores={k: v[i] for k, v in capture.scores.items()},
                advantage=None if capture.advantages is None else capture.advantages[i],
                response_length=len(capture.token_ids[i]),
                tokens=[next(decoded) for _ in capture.token_ids[i]],
                logprobs=capture.logprobs[i],
                turns=turns,
                steps=_steps(turns, images, capture.media[uid][0], capture.trajectories[i], capture.step_values[i], root)
                if capture.step_values is not None else [],
            )
        )
    return samples


def _turns(trajectory: dict, root: Path) -> list[dict]:
    """The turns of a multi-turn sample, each tool or observation message with its images saved."""
    images = iter(save_media(trajectory.get("images", []), [], root)[0])
    turns = []
    for message in trajectory["messages"]:
        count = message.get("num_images", 0)
        turns.append({"role": message["role"], "content": str(message["content"]),
                      "images": [next(images) for _ in range(count)]})
    return turns


def _steps(turns: list[dict], prompt_paths: list[str], prompt_images: list[Any], trajectory: dict,
           values: list[tuple[float, float | None]], root: Path) -> list[dict]:
    """An episode's steps (``RolloutSample.steps``); the screenshot is the last image before each turn."""
    sizes = dict(zip(prompt_paths, (list(image.size) for image in prompt_images)))
    returned = iter(trajectory.get("images", []))
    for turn in turns:  # the observations' images, in the order _turns saved them
        for path in turn["images"]:
            sizes[path] = list(next(returned).size)
    screenshot = prompt_paths[-1] if prompt_paths else None
    steps: list[dict] = []
    for turn in turns:
        if turn["role"] == "assistant":
            reward, advantage = values[len(steps)]
            steps.append({"screenshot": screenshot, "size": sizes.get(screenshot), "action": turn["content"],
                          "click": _click(turn["content"]), "reward": reward, "advantage": advantage, "reply": None})
            continue
        if steps and steps[-1]["reply"] is None:
            steps[-1]["reply"] = turn["content"]
        if turn["images"]:
            screenshot = turn["images"][-1]
    return steps


def _click(action: str) -> dict | None:
    """Where ``action`` clicks in easyvlm.agents.gui's grammar: {"x", "y"}, {"label"} or None."""
    from easyvlm.agents.gui import ActionError, parse_action

    try:
        click = parse_action(action)
    except ActionError:
        return None
    return {"label": click.label} if click.label is not None else {"x": click.point[0], "y": click.point[1]}


def save_media(images: Sequence[Any], videos: Sequence[Any], root: Path) -> tuple[list[str], list[list[str]]]:
    """PNG files of a prompt's images and of a few frames of each video, relative to ``root``."""
    image_paths = [_save_png(image, root) for image in images]
    video_paths = []
    for video in videos:
        frames = video.frames
        count = len(frames)
        picks = sorted({round(k * (count - 1) / max(1, VIDEO_FRAMES_SHOWN - 1)) for k in range(min(count, VIDEO_FRAMES_SHOWN))})
        video_paths.append([_save_png(_frame_image(frames[p]), root) for p in picks])
    return image_paths, video_paths


def _save_png(image: Any, root: Path) -> str:
    buffer = io.BytesIO()
    image.convert("RGB").save(buffer, format="PNG")
    data = buffer.getvalue()
    name = f"{MEDIA_DIR}/{hashlib.sha256(data).hexdigest()[:20]}.png"
    path = root / name
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_bytes(data)
        tmp.replace(path)
    return name


def _frame_image(frame: Any) -> Any:
    from PIL import Image

    return Image.fromarray(frame)


def is_correct(scores: dict[str, float]) -> bool:
    """Whether the ``accuracy`` (else ``overall``) reward is full (>= 1): a partial score is not correct."""
    value = scores.get("accuracy", scores.get("overall", 0.0))
    return isinstance(value, (int, float)) and value >= 1.0 - 1e-6


def is_format_failure(scores: dict[str, float]) -> bool:
    """The reward's ``format`` key below full marks (samples without one never fail format)."""
    value = scores.get("format")
    return isinstance(value, (int, float)) and value < 1.0 - 1e-6


def _text(value: Any) -> str:
    return value if isinstance(value, str) else json.dumps(value, default=str)


def sample_to_json(sample: RolloutSample) -> str:
    """One JSONL line; non-finite floats become strings (JSON has none)."""
    return json.dumps(_finite(dataclasses.asdict(sample)), ensure_ascii=False)


def sample_from_json(line: str) -> RolloutSample:
    return RolloutSample(**json.loads(line))


def _finite(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_finite(v) for v in value]
    return value
