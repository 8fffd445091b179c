"""RLDataset: prompt building, image tokens, length policy, and every bad-row case.

Token counts are by hand: the tiny tokenizer is byte-level (one ASCII character = one token) and
its chat template renders a user turn as
``<|im_start|>user\\n{content}<|im_end|>\\n<|im_start|>assistant\\n``: 1 + 5 + 1 + 1 + 1 + 10 = 19
tokens around the content, and an image as ``<|vision_start|>`` + n image pads + ``<|vision_end|>``.
"""

from __future__ import annotations

import re

import pytest
from data_testing import make_image, write_jsonl

from easyvlm.data.dataset import RLDataset
from easyvlm.data.loading import DataError

OVERHEAD = 19  # chat-template tokens around the user content (module docstring)


@pytest.fixture
def image_files(tmp_path):
    """Images of odd sizes (width x height) and the fitted size each gets (multiples of 28)."""
    sizes = {"a.png": (97, 55), "b.png": (30, 200), "c.png": (250, 57)}
    for name, (w, h) in sizes.items():
        make_image(tmp_path / "img" / name, w, h)
    # 97x55 -> 84x56 (3x2 tokens) ; 30x200 -> 28x196 (1x7) ; 250x57 -> 252x56 (9x2)
    return {"a.png": (84, 56), "b.png": (28, 196), "c.png": (252, 56)}


def test_three_images_in_placeholder_order(tmp_path, build, processor, image_files):
    rows = [{"problem": "<image>x<image>y<image>", "answer": "z", "images": ["img/c.png", "img/a.png", "img/b.png"], "level": 3}]
    ds = build(write_jsonl(tmp_path / "d.jsonl", rows))
    sample = ds[0]
    tok = processor.tokenizer
    pad = "<|image_pad|>"
    # tokens per image = (w/28) * (h/28): c 9*2 = 18, a 3*2 = 6, b 1*7 = 7
    content = f"<|vision_start|>{pad * 18}<|vision_end|>x<|vision_start|>{pad * 6}<|vision_end|>y<|vision_start|>{pad * 7}<|vision_end|>"
    expected = tok(f"<|im_start|>user\n{content}<|im_end|>\n<|im_start|>assistant\n", add_special_tokens=False)["input_ids"]
    assert sample["input_ids"].tolist() == expected
    assert len(expected) == OVERHEAD + 2 + 3 * 2 + 18 + 6 + 7
    # vLLM gets one pad per image and expands it itself
    assert sample["raw_prompt_ids"] == tok(sample["prompt_text"], add_special_tokens=False)["input_ids"]
    assert len(sample["raw_prompt_ids"]) == OVERHEAD + 2 + 3 * 3
    assert [im.size for im in sample["images"]] == [image_files["c.png"], image_files["a.png"], image_files["b.png"]]
    # sizes before fitting (what grounding rewards rescale boxes from), same order as images
    assert sample["original_image_sizes"] == [(250, 57), (97, 55), (30, 200)]
    # grid (t, h/14, w/14) in image order; pixel_values has one row per 14x14 patch
    assert sample["multi_modal_inputs"]["image_grid_thw"].tolist() == [[1, 4, 18], [1, 4, 6], [1, 14, 2]]
    assert sample["multi_modal_inputs"]["pixel_values"].shape[0] == 72 + 24 + 28
    assert sample["prompt_text"] == f"<|im_start|>user\n<|vision_start|>{pad}<|vision_end|>x<|vision_start|>{pad}<|vision_end|>y<|vision_start|>{pad}<|vision_end|><|im_end|>\n<|im_start|>assistant\n"
    assert sample["ground_truth"] == "z"
    assert sample["extra"] == {"level": 3}
    assert sample["uid"] == "train-0"
    assert sample["position_ids"].shape == (4, len(expected))


def test_images_without_placeholder_go_first_and_image_dir(tmp_path, build, image_files):
    rows = [{"problem": "what?", "answer": "a", "images": ["a.png"]}]
    # relative paths resolve against data.image_dir when it is set
    ds = build(write_jsonl(tmp_path / "sub" / "d.jsonl", rows), image_dir=str(tmp_path / "img"))
    text = ds[0]["prompt_text"]
    assert text == "<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>what?<|im_end|>\n<|im_start|>assistant\n"


def test_format_prompt_and_system_prompt(tmp_path, build):
    fmt = tmp_path / "f.jinja"
    fmt.write_text("Q: {{ content }} ({{ unit }})")
    rows = [{"problem": "2+2", "answer": "4", "unit": "apples"}]
    ds = build(write_jsonl(tmp_path / "d.jsonl", rows), format_prompt=str(fmt), system_prompt="Be brief.")
    assert ds[0]["prompt_text"] == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nQ: 2+2 (apples)<|im_end|>\n<|im_start|>assistant\n"
    )


def test_override_chat_template(tmp_path, build):
    template = "{% for m in messages %}[{{ m['role'] }}]{% for c in m['content'] %}{{ c['text'] }}{% endfor %}{% endfor %}>"
    ds = build(write_jsonl(tmp_path / "d.jsonl", [{"problem": "hi", "answer": "x"}]), override_chat_template=template)
    assert ds[0]["prompt_text"] == "[user]hi>"
    assert len(ds[0]["raw_prompt_ids"]) == len("[user]hi>")


def test_truncation_left_and_right_on_text(tmp_path, build):
    rows = [{"problem": "abcdefghij", "answer": "x"}]  # 19 + 10 = 29 tokens
    path = write_jsonl(tmp_path / "d.jsonl", rows)
    full = build(path)[0]["raw_prompt_ids"]
    assert len(full) == OVERHEAD + 10
    assert build(path, max_prompt_length=20, prompt_truncation="left")[0]["raw_prompt_ids"] == full[-20:]
    assert build(path, max_prompt_length=20, prompt_truncation="right")[0]["raw_prompt_ids"] == full[:20]


def test_filter_overlong_prompts_drops_and_counts(tmp_path, build):
    rows = [{"problem": "a" * n, "answer": "x"} for n in (1, 30, 2, 40)]  # 20, 49, 21, 59 tokens
    ds = build(write_jsonl(tmp_path / "d.jsonl", rows), max_prompt_length=40, filter_overlong_prompts=True)
    assert [ds[i]["uid"] for i in range(len(ds))] == ["train-0", "train-2"]
    assert (ds.report.total, ds.report.kept, ds.report.overlong) == (4, 2, 2)
    assert ds.report.summary() == (
        "data.train_files: 2 of 4 rows used; 2 rows longer than data.max_prompt_length dropped (data.filter_overlong_prompts)"
    )


def test_threads_give_the_same_scan(tmp_path, build, image_files):
    rows = [{"problem": f"{'b' * i}<image>", "answer": "x", "images": ["img/a.png"]} for i in range(6)]
    rows[3]["images"] = ["img/missing.png"]
    path = write_jsonl(tmp_path / "d.jsonl", rows)
    one = build(path, on_bad_row="skip", filter_overlong_prompts_workers=1)
    two = build(path, on_bad_row="skip", filter_overlong_prompts_workers=3)
    assert one.index == two.index and [str(b) for b in one.report.bad_rows] == [str(b) for b in two.report.bad_rows]


# ----------------------------------------------------------------------------- bad rows
def bad_row_error(build, path, **overrides) -> str:
    with pytest.raises(DataError) as info:
        build(path, **overrides)
    return str(info.value)


@pytest.mark.parametrize(
    "row,problem",
    [
        ({"problem": "<image>?", "answer": "a", "images": ["img/missing.png"]}, r"images\[0\]: image file '.*img/missing.png' does not exist"),
        ({"problem": "<image>?", "answer": "a", "images": ["img/broken.png"]}, r"images\[0\]: image file '.*broken.png' cannot be read"),
        ({"problem": "<image><image>?", "answer": "a", "images": ["img/a.png"]}, r"the prompt has 2 <image> placeholder\(s\) but the row has 1 image\(s\)"),
        ({"question": "?", "answer": "a"}, r"missing key 'problem' \(data.prompt_key\); the row has \['answer', 'question'\]"),
        ({"problem": "?"}, r"missing key 'answer' \(data.answer_key\)"),
        ({"problem": "?", "answer": "a", "videos": ["v.mp4"]}, r"videos\[0\]: video file 'v.mp4' does not exist in any of the directories tried"),
        ({"problem": "<video>?", "answer": "a"}, r"the prompt has 1 <video> placeholder\(s\) but the row has 0 video\(s\)"),
        ({"problem": "x" * 300, "answer": "a"}, r"the prompt has 319 tokens, more than data.max_prompt_length=256 \(data.prompt_truncation=error\)"),
        ({"problem": 5, "answer": "a"}, r"'problem' must be a string, got int"),
        ({"problem": "<|image_pad|>", "answer": "a"}, r"the tokenized prompt has 1 image tokens but its 0 image\(s\) give 0 features"),
    ],
    ids=["missing-image", "unreadable-image", "placeholder-count", "no-prompt", "no-answer", "video", "video-tag", "too-long", "not-str", "literal-pad"],
)
def test_bad_row_error_names_file_row_and_problem(tmp_path, build, image_files, row, problem):
    (tmp_path / "img" / "broken.png").write_bytes(b"\x89PNG\r\n\x1a\n not really")
    good = {"problem": "fine", "answer": "a"}
    path = write_jsonl(tmp_path / "d.jsonl", [good, row])
    message = bad_row_error(build, path)
    assert message.startswith("data.train_files: 1 bad row(s) of 2:\n")
    assert re.search(re.escape(f"{path} row 1 (line 2): ") + problem, message), message
    assert "set data.on_bad_row=skip" in message


def test_truncation_that_would_cut_image_tokens(tmp_path, build, image_files):
    rows = [{"problem": "<image>" + "q" * 10, "answer": "a", "images": ["img/c.png"]}]  # 19 + 2 + 18 + 10 = 49
    path = write_jsonl(tmp_path / "d.jsonl", rows)
    # left keeps the last 40 tokens: the first 9 (<|im_start|> user\n <|vision_start|> + 2 pads) go
    message = bad_row_error(build, path, max_prompt_length=40, prompt_truncation="left")
    assert f"{path} row 0 (line 1): the prompt has 49 tokens, more than data.max_prompt_length=40, and truncating it (left) would cut image or video tokens" in message
    # right keeps the first 40: the image (tokens 7..24) survives, 9 text tokens at the end go
    sample = build(path, max_prompt_length=40, prompt_truncation="right")[0]
    full = build(path)[0]
    assert sample["input_ids"].tolist() == full["input_ids"].tolist()[:40]
    assert sample["raw_prompt_ids"] == full["raw_prompt_ids"][:40 - 17]  # 18 image tokens -> 1


def test_all_bad_rows_are_listed_at_once(tmp_path, build):
    rows = [{"problem": "ok", "answer": "a"}] + [{"answer": "a"}] * 12
    path = write_jsonl(tmp_path / "d.jsonl", rows)
    message = bad_row_error(build, path)
    assert "12 bad row(s) of 13" in message
    assert f"{path} row 10 (line 11): missing key 'problem'" in message
    assert "... and 2 more" in message


def test_skip_bad_rows_counts_them(tmp_path, build, image_files):
    rows = [
        {"problem": "<image>a", "answer": "1", "images": ["img/a.png"]},
        {"problem": "<image>b", "answer": "2", "images": ["img/nope.png"]},
        {"problem": "c", "answer": "3"},
        {"problem": "d"},
    ]
    path = write_jsonl(tmp_path / "d.jsonl", rows)
    ds = build(path, on_bad_row="skip")
    assert [ds[i]["ground_truth"] for i in range(len(ds))] == ["1", "3"]
    assert [b.where for b in ds.report.bad_rows] == [f"{path} row 1 (line 2)", f"{path} row 3 (line 4)"]
    assert ds.report.bad_rows[1].problem.startswith("missing key 'answer'")
    assert ds.report.summary() == "data.train_files: 2 of 4 rows used; 2 bad rows skipped (data.on_bad_row=skip)"


def test_empty_dataset(tmp_path, build):
    path = tmp_path / "empty.jsonl"
    path.write_text("\n")
    assert bad_row_error(build, path) == f"data.train_files: {path} has no rows"
    all_bad = write_jsonl(tmp_path / "bad.jsonl", [{"answer": "a"}])
    message = bad_row_error(build, all_bad, on_bad_row="skip")
    assert message.startswith(f"data.train_files: no usable rows in {all_bad} (data.train_files: 0 of 1 rows used; 1 bad rows skipped")


def test_text_only_model_refuses_images(tmp_path, processor, image_files):
    rows = [{"problem": "hi", "answer": "a"}, {"problem": "<image>", "answer": "a", "images": ["img/a.png"]}]
    path = write_jsonl(tmp_path / "d.jsonl", rows)
    from data_testing import data_config

    with pytest.raises(DataError, match=re.escape(f"{path} row 1 (line 2): the row has images or videos but the model has no image processor")):
        RLDataset(str(path), data_config(), processor.tokenizer, None, None)
    ds = RLDataset(str(path), data_config(on_bad_row="skip"), processor.tokenizer, None, None)
    sample = ds[0]
    assert sample["prompt_text"] == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert sample["position_ids"].tolist() == list(range(OVERHEAD + 2))  # 1-D ids for a text-only model
    assert sample["multi_modal_inputs"] == {} and sample["images"] == []
    # AutoProcessor returns a bare tokenizer for text-only models: accepted as "no processor"
    same = RLDataset(str(path), data_config(on_bad_row="skip"), None, processor.tokenizer, None)[0]
    assert same["raw_prompt_ids"] == sample["raw_prompt_ids"]


def test_column_keys_name_the_columns(tmp_path, build, image_files):
    """data.prompt_key / answer_key / image_key / video_key pick the row's columns; a column of another
    name is just an extra column."""
    rows = [{"q": "<image>hi", "a": "7", "pics": ["img/a.png"], "images": ["not read"], "videos": ["not read"]}]
    path = write_jsonl(tmp_path / "d.jsonl", rows)
    sample = build(path, prompt_key="q", answer_key="a", image_key="pics", video_key="clips")[0]
    assert sample["prompt_text"] == "<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>hi<|im_end|>\n<|im_start|>assistant\n"
    assert sample["ground_truth"] == "7"
    assert [im.size for im in sample["images"]] == [image_files["a.png"]]  # from "pics", fitted
    assert sample["extra"] == {"images": ["not read"], "videos": ["not read"]}
    # the same row read with the defaults has no "prompt" column
    message = bad_row_error(build, path, prompt_key="prompt")
    assert "missing key 'prompt' (data.prompt_key)" in message
    # video_key names the column read as videos
    message = bad_row_error(build, path, prompt_key="q", answer_key="a", image_key="pics", video_key="videos")
    assert "videos[0]: video file 'not read' does not exist" in message


def test_pixel_limits_resize_the_rows_images(tmp_path, build):
    """data.min_pixels / data.max_pixels reach the encoder: stage 1 of the fitting (tests/data/test_images.py)."""
    make_image(tmp_path / "big.png", 500, 500)
    make_image(tmp_path / "small.png", 30, 30)
    rows = [{"problem": "<image>", "answer": "a", "images": [name]} for name in ("big.png", "small.png")]
    path = write_jsonl(tmp_path / "d.jsonl", rows)

    def sizes(**limits):
        ds = build(path, **limits)
        return [ds[i]["images"][0].size for i in range(len(ds))]

    # the test limits (56x56 .. 224x224 pixels): 500x500 = 250000 > 50176: x sqrt(50176 / 250000) = 0.448 -> 224;
    # 30x30 = 900 < 3136: x sqrt(3136 / 900) = 1.867 -> 56 (then rounded to multiples of 28: unchanged)
    assert sizes() == [(224, 224), (56, 56)]
    # max_pixels 12544 = 112x112: x 0.224 -> 112
    assert sizes(max_pixels=12544) == [(112, 112), (56, 56)]
    # min_pixels 12544: 30 x sqrt(12544 / 900) = 30 x 3.733 -> 112
    assert sizes(min_pixels=12544) == [(224, 224), (112, 112)]


def test_scan_threads_follow_filter_overlong_prompts_workers(tmp_path, build, monkeypatch):
    """The construction scan runs in a pool of data.filter_overlong_prompts_workers threads (1: no pool)."""
    import easyvlm.data.dataset as dataset_module

    pools = []

    class RecordingPool(dataset_module.ThreadPoolExecutor):
        def __init__(self, max_workers):
            pools.append(max_workers)
            super().__init__(max_workers=max_workers)

    monkeypatch.setattr(dataset_module, "ThreadPoolExecutor", RecordingPool)
    path = write_jsonl(tmp_path / "d.jsonl", [{"problem": f"q{i}", "answer": "a"} for i in range(4)])
    assert len(build(path, filter_overlong_prompts_workers=3)) == 4
    assert pools == [3]
    build(path, filter_overlong_prompts_workers=1)
    assert pools == [3]
