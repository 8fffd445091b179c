"""Videos: frame sampling (qwen-vl-utils' rule), decoding, sizing, the processor's tokens, bad rows.

Expected frame indices are worked out by hand from qwen-vl-utils' ``smart_nframes`` (count =
duration x fps, at least 4, at most max_frames and the clip, rounded down to even) and
``linspace(0, total - 1, count).round()``.
"""

from __future__ import annotations

import re

import numpy as np
import pytest
from data_testing import make_image, write_jsonl
from PIL import Image

from easyvlm.data.loading import DataError
from easyvlm.data.videos import VideoLoadError, load_video, sample_indices, write_video

RED, BLUE, GREEN = (220, 30, 30), (30, 70, 220), (30, 160, 50)
CODEC_TOLERANCE = 0  # write_video is lossless (H.264 in RGB, crf 0)


def clip(colours, size=(56, 56)):
    """Frames of one flat colour each, (H, W, 3) uint8."""
    h, w = size
    return [np.full((h, w, 3), c, dtype=np.uint8) for c in colours]


@pytest.mark.parametrize(
    "total,raw_fps,fps,max_frames,expected",
    [
        (8, 4.0, 2.0, 768, [0, 2, 5, 7]),  # 2 s x 2 fps = 4 frames; linspace(0, 7, 4) = 0, 2.33, 4.67, 7
        (30, 30.0, 2.0, 768, [0, 10, 19, 29]),  # 1 s -> 2 frames, raised to the minimum 4: 0, 9.67, 19.33, 29
        (100, 10.0, 2.0, 6, [0, 20, 40, 59, 79, 99]),  # 10 s -> 20, capped at 6: 0, 19.8, 39.6, 59.4, 79.2, 99
        (5, 5.0, 2.0, 768, [0, 1, 3, 4]),  # 1 s -> 2 -> min 4 (<= 5 frames): 0, 1.33, 2.67, 4
        (3, 1.0, 2.0, 768, [0, 2]),  # 3 s -> 6 -> the clip's 3 -> even 2
        (16, 4.0, 1.0, 768, [0, 5, 10, 15]),  # 4 s x 1 fps = 4
    ],
)
def test_sample_indices_follow_qwen_vl_utils(total, raw_fps, fps, max_frames, expected):
    assert sample_indices(total, raw_fps, fps, max_frames) == expected


def test_a_one_frame_clip_is_refused():
    with pytest.raises(VideoLoadError, match=r"the video has 1 frame\(s\); at least 2 are needed"):
        sample_indices(1, 4.0, 2.0, 768)


def load(value, root, processor, fps=2.0, max_frames=768, min_pixels=28 * 28 * 4, max_pixels=28 * 28 * 64):
    return load_video(value, [root], processor, fps=fps, max_frames=max_frames, min_pixels=min_pixels, max_pixels=max_pixels)


def test_a_video_file_is_decoded_and_sampled(tmp_path, processor):
    write_video(tmp_path / "v.mp4", clip([RED] * 4 + [BLUE] * 4), fps=4)
    video = load("v.mp4", tmp_path, processor)
    assert video.frames.shape == (4, 56, 56, 3) and video.frames.dtype == np.uint8
    assert (video.fps, video.frames_indices, video.total_num_frames, video.sample_fps) == (4.0, [0, 2, 5, 7], 8, 2.0)
    # source frames 0, 2 are red, 5, 7 blue
    for frame, colour in zip(video.frames, [RED, RED, BLUE, BLUE]):
        assert np.abs(frame.astype(int) - colour).max() <= CODEC_TOLERANCE
    assert video.metadata() == {"fps": 4.0, "total_num_frames": 8, "frames_indices": [0, 2, 5, 7], "duration": 2.0,
                                "video_backend": "pyav"}
    # data.video_fps = 1: 2 s -> 2 frames -> the minimum 4 (the same); max_frames (data.video_max_frames)
    # caps a longer clip
    write_video(tmp_path / "long.mp4", clip([RED] * 8 + [BLUE] * 8), fps=4)
    assert load("long.mp4", tmp_path, processor, fps=2.0).frames_indices == [0, 2, 4, 6, 9, 11, 13, 15]
    assert load("long.mp4", tmp_path, processor, fps=1.0).frames_indices == [0, 5, 10, 15]
    assert load("long.mp4", tmp_path, processor, fps=2.0, max_frames=4).frames_indices == [0, 5, 10, 15]


def test_a_frame_list_is_taken_as_sampled_at_video_fps(tmp_path, processor):
    for name, colour in zip("abc", [RED, GREEN, BLUE]):
        Image.fromarray(clip([colour])[0]).save(tmp_path / f"{name}.png")
    video = load(["a.png", "b.png", "c.png"], tmp_path, processor, fps=3.0)
    # padded to an even count with the last frame (qwen-vl-utils); PNG is lossless and 56x56 is kept
    assert video.frames.shape == (4, 56, 56, 3)
    assert [tuple(f[0, 0]) for f in video.frames] == [RED, GREEN, BLUE, BLUE]
    assert (video.fps, video.frames_indices, video.total_num_frames, video.sample_fps) == (3.0, [0, 1, 2, 3], 4, 3.0)


def test_frames_are_sized_like_images(tmp_path, processor):
    """Stage 1 (qwen-vl-utils, data limits 3136..50176 pixels, factor 28), then the video processor's own
    rule; the result is a fixed point of the processor, which gives the grid of the fitted frames."""
    import torch

    write_video(tmp_path / "wide.mp4", clip([RED] * 4, (60, 100)), fps=2)
    # 60x100: round to multiples of 28 -> 56x112 = 6272 pixels, within the limits
    assert load("wide.mp4", tmp_path, processor).frames.shape == (4, 56, 112, 3)
    write_video(tmp_path / "big.mp4", clip([RED] * 4, (300, 400)), fps=2)
    # 300x400 -> 308x392 = 120736 > 50176: beta = sqrt(300*400/50176) = 1.5465,
    # floor(300/1.5465/28)*28 = 168, floor(400/1.5465/28)*28 = 252 (42336 pixels)
    video = load("big.mp4", tmp_path, processor)
    assert video.frames.shape == (4, 168, 252, 3)
    resized = processor.video_processor(videos=[video.frames], do_resize=True, do_sample_frames=False, return_tensors="pt")
    kept = processor.video_processor(videos=[video.frames], do_resize=False, do_sample_frames=False, return_tensors="pt")
    assert resized["video_grid_thw"].tolist() == [[2, 12, 18]]  # 168/14, 252/14
    torch.testing.assert_close(resized["pixel_values_videos"], kept["pixel_values_videos"], rtol=0, atol=0)


def test_bad_videos_say_what_is_wrong(tmp_path, processor):
    (tmp_path / "broken.mp4").write_bytes(b"not a video at all")
    write_video(tmp_path / "one.mp4", clip([RED]), fps=2)
    make_image(tmp_path / "small.png", 28, 28)
    make_image(tmp_path / "big.png", 56, 56)
    cases = [
        ("missing.mp4", r"video file 'missing.mp4' does not exist in any of the directories tried"),
        ("broken.mp4", r"video file '.*broken.mp4' cannot be decoded"),
        ("one.mp4", r"the video has 1 frame\(s\); at least 2 are needed"),
        (["big.png"] * 6, r"the frame list has 6 frames, more than data.video_max_frames=4"),
        (["big.png", "small.png"], r"the frames have different sizes \[\(28, 28\), \(56, 56\)\]"),
        (["big.png", "gone.png"], r"frame 1: image file 'gone.png' does not exist"),
        ([], r"the frame list is empty"),
        (7, r"video of type int; expected a file path"),
    ]
    for value, message in cases:
        with pytest.raises(VideoLoadError, match=message):
            load(value, tmp_path, processor, max_frames=4)


def video_rows(root):
    write_video(root / "clips" / "rb.mp4", clip([RED] * 8 + [BLUE] * 8), fps=4)
    for name, colour in zip("abc", [RED, GREEN, BLUE]):
        Image.fromarray(clip([colour])[0]).save(root / f"{name}.png")
    return [
        {"problem": "How many?", "answer": "0"},
        {"problem": "<image>Which colour?", "answer": "red", "images": ["a.png"]},
        {"problem": "<video>Which colour first?", "answer": "red", "videos": ["clips/rb.mp4"]},
        {"problem": "<video>Which order?", "answer": "rgb", "videos": [["a.png", "b.png", "c.png"]]},
        {"problem": "Is <image> in <video>?", "answer": "yes", "images": ["b.png"], "videos": ["clips/rb.mp4"]},
    ]


def test_rows_mixing_text_images_and_videos(tmp_path, build, model_config):
    path = write_jsonl(tmp_path / "d.jsonl", video_rows(tmp_path))
    ds = build(path)
    image_token, video_token = model_config.image_token_id, model_config.video_token_id
    counts = [(int((s["input_ids"] == image_token).sum()), int((s["input_ids"] == video_token).sum()))
              for s in (ds[i] for i in range(len(ds)))]
    # a 56x56 image: 2x2 merged patches = 4 tokens; a video of 8 frames of 56x56: (8/2) x 2 x 2 = 16 tokens,
    # one of 4 frames (the frame list, padded from 3): 8 tokens
    assert counts == [(0, 0), (4, 0), (0, 16), (0, 8), (4, 16)]
    video = ds[2]
    assert video["multi_modal_inputs"]["video_grid_thw"].tolist() == [[4, 4, 4]]
    # 8 of 16 frames at 4 fps: sampled at 2 fps, so a temporal patch of 2 frames spans 1 second
    assert video["multi_modal_inputs"]["second_per_grid_ts"].tolist() == [1.0]
    assert video["videos"][0].frames_indices == [0, 2, 4, 6, 9, 11, 13, 15]
    # data.video_fps = 1: 4 frames, sampled at 1 fps: 2 seconds per temporal patch
    slow = build(path, video_fps=1.0)[2]
    assert slow["multi_modal_inputs"]["video_grid_thw"].tolist() == [[2, 4, 4]]
    assert slow["multi_modal_inputs"]["second_per_grid_ts"].tolist() == [2.0]
    # raw_prompt_ids: one pad token per image and video (what vLLM expands)
    mixed = ds[4]
    assert mixed["raw_prompt_ids"].count(image_token) == 1 and mixed["raw_prompt_ids"].count(video_token) == 1
    assert mixed["prompt_text"].count("<|video_pad|>") == 1
    # data.video_max_frames caps a file's frames
    assert build(path, video_max_frames=4)[2]["multi_modal_inputs"]["video_grid_thw"].tolist() == [[2, 4, 4]]


def test_a_missing_video_fails_before_training_naming_file_and_row(tmp_path, build):
    rows = video_rows(tmp_path)
    rows[2]["videos"] = ["clips/gone.mp4"]
    path = write_jsonl(tmp_path / "d.jsonl", rows)
    with pytest.raises(DataError) as info:
        build(path)
    assert re.search(
        re.escape(f"{path} row 2 (line 3): videos[0]: video file 'clips/gone.mp4' does not exist"), str(info.value)
    )
    assert len(build(path, on_bad_row="skip")) == 4  # data.on_bad_row applies


def test_video_tokens_beyond_max_prompt_length_are_a_bad_row(tmp_path, build):
    path = write_jsonl(tmp_path / "d.jsonl", video_rows(tmp_path)[2:3])
    with pytest.raises(DataError, match=r"row 0 \(line 1\): the prompt has \d+ tokens, more than data.max_prompt_length=30"):
        build(path, max_prompt_length=30, prompt_truncation="error")
    with pytest.raises(DataError, match="would cut image or video tokens"):
        build(path, max_prompt_length=30, prompt_truncation="left")
