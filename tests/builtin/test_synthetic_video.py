"""The synthetic video task: answers read back from the frames that PyAV decodes, the frame-list
variant equal to the videos, disjoint and reproducible splits, and the dataset names."""

from __future__ import annotations

import colorsys
import hashlib
import json
from pathlib import Path

import av
import numpy as np
import pytest
from PIL import Image

from easyvlm.builtin import synthetic, synthetic_video
from easyvlm.builtin.synthetic import PALETTE, SPLIT_SEEDS, SyntheticDatasetError, resolve_builtin_dataset
from easyvlm.builtin.synthetic_video import generate_rows, materialize_dataset, write_dataset

TRAIN, VAL = 48, 24

# Hue ranges (degrees) that a person would call each colour name: independent of the palette values.
HUE_RANGES = {
    "red": [(0, 15), (345, 360)],
    "yellow": [(40, 70)],
    "green": [(90, 150)],
    "blue": [(200, 250)],
    "purple": [(260, 300)],
}


def _colour_name(rgb) -> str:
    h, s, v = colorsys.rgb_to_hsv(*(c / 255 for c in rgb))
    assert s > 0.5 and v > 0.5, f"{rgb} is not a saturated colour"
    names = [name for name, ranges in HUE_RANGES.items() if any(lo <= h * 360 < hi for lo, hi in ranges)]
    assert len(names) == 1, f"{rgb} (hue {h * 360:.0f}) matches {names}"
    return names[0]


def _read(jsonl) -> list[dict]:
    return [json.loads(line) for line in Path(jsonl).read_text().splitlines()]


def _decode(path) -> tuple[np.ndarray, float, float]:
    """(frames (T, H, W, 3) uint8, frames per second, duration in s), decoded with PyAV."""
    with av.open(str(path)) as container:
        stream = container.streams.video[0]
        frames = np.stack([frame.to_ndarray(format="rgb24") for frame in container.decode(stream)])
        return frames, float(stream.average_rate), float(stream.duration * stream.time_base)


def _frames_of(jsonl, row) -> np.ndarray:
    (video,) = row["videos"]
    base = Path(jsonl).parent
    if isinstance(video, list):
        return np.stack([np.asarray(Image.open(base / frame).convert("RGB")) for frame in video])
    return _decode(base / video)[0]


def _foreground(frame: np.ndarray) -> np.ndarray:
    return (frame != 255).any(axis=-1)  # the background is white


def _flat_colour(frame: np.ndarray) -> tuple[int, int, int]:
    """The one colour of the frame's shape (asserts there is exactly one)."""
    colours = np.unique(frame[_foreground(frame)], axis=0)
    assert len(colours) == 1, f"{len(colours)} shape colours in one frame; expected one flat colour"
    return tuple(int(c) for c in colours[0])


@pytest.fixture(scope="module")
def video_train(easyvlm_cache_dir) -> str:
    return str(materialize_dataset("train", cache_dir=easyvlm_cache_dir, num_samples=TRAIN))


@pytest.fixture(scope="module")
def video_val(easyvlm_cache_dir) -> str:
    return str(materialize_dataset("val", cache_dir=easyvlm_cache_dir, num_samples=VAL))


@pytest.fixture(scope="module")
def frames_train(easyvlm_cache_dir) -> str:
    name = "synthetic-video-frames"
    return str(materialize_dataset("train", cache_dir=easyvlm_cache_dir, name=name, num_samples=TRAIN))


@pytest.fixture(scope="module")
def direction_train(easyvlm_cache_dir) -> str:
    name = "synthetic-video-direction"
    return str(materialize_dataset("train", cache_dir=easyvlm_cache_dir, name=name, num_samples=TRAIN))


def test_row_format(video_train, frames_train, direction_train):
    for jsonl, task, as_frames in [(video_train, "order", False), (frames_train, "order", True),
                                   (direction_train, "direction", False)]:
        rows = _read(jsonl)
        assert len(rows) == TRAIN
        for row in rows:
            assert list(row) == ["problem", "answer", "videos", "task", "options"]
            assert row["problem"] == "<video>" + synthetic_video.QUESTIONS[task] and row["task"] == task
            assert row["answer"] in row["options"]
            assert synthetic.normalize_answer(row["answer"]) == row["answer"]
            (video,) = row["videos"]  # one video per row
            paths = video if as_frames else [video]
            assert isinstance(video, list) == as_frames and len(paths) == (4 if as_frames else 1)
            for rel in paths:
                assert not Path(rel).is_absolute() and (Path(jsonl).parent / rel).is_file()
                assert rel.endswith(".png" if as_frames else ".mp4")


def test_order_answer_is_the_first_colour_of_the_decoded_video(video_train):
    answers, pairs = [], set()
    for row in _read(video_train):
        frames, fps, duration = _decode(Path(video_train).parent / row["videos"][0])
        assert frames.shape == (4, 56, 56, 3) and fps == 2 and duration == 2
        colours = [_flat_colour(frame) for frame in frames]
        names = [_colour_name(rgb) for rgb in colours]
        assert names[0] == names[1] == row["answer"], (row, names)
        assert names[2] == names[3] != row["answer"], (row, names)
        # Lossless: every shape pixel is exactly its palette colour, the background exactly white.
        assert colours == [PALETTE[name] for name in names]
        assert all(((frame == 255).all(axis=-1) | _foreground(frame)).all() for frame in frames)
        # The same shape at the same place in all four frames: only the colour changes.
        masks = [_foreground(frame) for frame in frames]
        assert masks[0].sum() > 0 and all((mask == masks[0]).all() for mask in masks)
        answers.append(row["answer"])
        pairs.add((names[0], names[2]))
    assert set(answers) == set(PALETTE)  # every colour is an answer somewhere
    assert len(pairs) >= 12  # many (first, second) colour pairs, not a fixed second colour


def test_direction_answer_matches_the_motion(direction_train):
    steps = {"left": (-1, 0), "right": (1, 0), "up": (0, -1), "down": (0, 1)}
    answers = []
    for row in _read(direction_train):
        frames, _, _ = _decode(Path(direction_train).parent / row["videos"][0])
        assert len({_colour_name(_flat_colour(frame)) for frame in frames}) == 1  # one colour
        centres = []
        for frame in frames:
            ys, xs = np.nonzero(_foreground(frame))
            centres.append((xs.mean(), ys.mean()))
        moves = np.diff(np.array(centres), axis=0)  # (3, 2): dx, dy per frame
        dx, dy = steps[row["answer"]]
        along = moves @ np.array([dx, dy])
        across = moves @ np.array([dy, dx])
        # A constant step of 4-6 px along the answer's direction, none across it (centroids: float).
        assert np.allclose(along, along[0]) and 4 - 1e-6 <= along[0] <= 6 + 1e-6, (row, moves)
        assert np.allclose(across, 0), (row, moves)
        answers.append(row["answer"])
    assert set(answers) == set(steps)


def test_frame_lists_equal_the_decoded_videos(video_train, frames_train):
    videos, frame_lists = _read(video_train), _read(frames_train)
    for video_row, frames_row in zip(videos, frame_lists, strict=True):
        assert {**video_row, "videos": None} == {**frames_row, "videos": None}  # same samples, same order
        decoded = _frames_of(video_train, video_row)
        pngs = _frames_of(frames_train, frames_row)
        assert pngs.shape == decoded.shape == (4, 56, 56, 3)
        assert (pngs == decoded).all()
        colours = [[_colour_name(_flat_colour(frame)) for frame in clip] for clip in (pngs, decoded)]
        assert colours[0] == colours[1] and colours[0][0] == frames_row["answer"] != colours[0][2]


def _content_keys(jsonl) -> set:
    return {(hashlib.sha256(_frames_of(jsonl, row).tobytes()).hexdigest(), row["problem"]) for row in _read(jsonl)}


def test_train_and_val_are_disjoint(video_train, video_val):
    train, val = _content_keys(video_train), _content_keys(video_val)
    assert len(train) == TRAIN and len(val) == VAL  # also: no duplicate clip within a split
    assert not train & val


def test_splits_are_disjoint_even_from_the_same_random_stream():
    seed = SPLIT_SEEDS["val"]
    tasks = {"order": 1.0, "direction": 1.0}

    def keys(split):
        return {(b"".join(f.tobytes() for f in frames), row["problem"])
                for frames, row in generate_rows(split, 30, tasks, seed=seed)}

    train, val = keys("train"), keys("val")
    assert len(train) == len(val) == 30
    assert not train & val


def test_generation_is_deterministic(tmp_path):
    for out in ("a", "b"):
        write_dataset(tmp_path / out / "video", "train", 6, {"order": 1.0, "direction": 1.0})
        write_dataset(tmp_path / out / "frames", "train", 6, {"order": 1.0}, as_frames=True)
    files = sorted(p.relative_to(tmp_path / "a") for p in (tmp_path / "a").rglob("*") if p.is_file())
    assert len(files) == (1 + 6) + (1 + 6 * 4)  # JSONL + 6 mp4 files; JSONL + 24 PNG frames
    for rel in files:
        assert (tmp_path / "a" / rel).read_bytes() == (tmp_path / "b" / rel).read_bytes(), rel


def test_builtin_names_resolve(tmp_path, video_train, easyvlm_cache_dir):
    names = {name for name, module in synthetic.EXTERNAL_DATASETS.items() if module == synthetic_video.__name__}
    assert names == set(synthetic_video.VIDEO_DATASETS)
    assert {"synthetic", "synthetic-video", "synthetic-video-frames"} <= set(synthetic.builtin_dataset_names())

    val = resolve_builtin_dataset("builtin:synthetic-video@val", cache_dir=tmp_path)  # the full 128 rows
    assert val == tmp_path / "datasets" / "synthetic-video-val-128-v1" / "val.jsonl"
    assert len(_read(val)) == 128
    # Train (1000 rows) is only located here, not built; the image task's names still resolve as before.
    assert synthetic.dataset_cache_dir("train", tmp_path, "synthetic-video").name == "synthetic-video-train-1000-v1"
    assert synthetic.dataset_cache_dir("train", tmp_path, "synthetic").name == "synthetic-train-2000-v1"
    again = synthetic.materialize_dataset("train", easyvlm_cache_dir, "synthetic-video", num_samples=TRAIN)
    assert str(again) == video_train

    with pytest.raises(SyntheticDatasetError, match=r"unknown synthetic split 'dev'"):
        resolve_builtin_dataset("builtin:synthetic-video@dev", cache_dir=tmp_path)
    unknown = r"unknown built-in data set 'synthetic-vid'; known: .*'synthetic-video'"
    with pytest.raises(SyntheticDatasetError, match=unknown):
        resolve_builtin_dataset("builtin:synthetic-vid@val", cache_dir=tmp_path)
    with pytest.raises(SyntheticDatasetError, match="bad synthetic task mix"):
        next(generate_rows("train", 1, {"colour": 1.0}))


def test_video_tokens_per_clip(tiny_model_path, video_train, frames_train):
    # 4 frames of 56x56 -> (temporal patch 2) x (4x4 patches of 14 px) / (2x2 merge) = 2 x 4 = 8 tokens.
    from transformers import AutoProcessor

    processor = AutoProcessor.from_pretrained(tiny_model_path).video_processor
    for jsonl in (video_train, frames_train):
        frames = _frames_of(jsonl, _read(jsonl)[0])
        grid = processor(videos=[frames], return_tensors="pt")["video_grid_thw"]
        assert grid.tolist() == [[2, 4, 4]]
        assert int(grid.prod()) // processor.merge_size**2 == 8
