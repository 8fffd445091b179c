"""The zoom task: the colour is invisible in the fitted view and plain after zooming on the right
quadrant; rows carry the box a right zoom call gives; the reward file scores answers and calls."""

from __future__ import annotations

import json
import random
from pathlib import Path

from PIL import Image

from easyvlm.agents.shipped import image_zoom
from easyvlm.builtin.synthetic import PALETTE
from easyvlm.builtin.synthetic_zoom import (
    IMAGE_SIZE, PATCH, VIEW_SIZE, call_tokens, materialize_dataset, quadrant_box, render_sample, zoom_call,
)
from easyvlm.data.images import fit_image
from easyvlm.utils.plugins import load_plugin

REPO = Path(__file__).resolve().parents[2]


def view_of(image):
    # what the pipeline shows the model with examples/tools.yaml's limits (max_pixels = 112 * 112)
    return fit_image(image, 3136, VIEW_SIZE * VIEW_SIZE, 28, processor_min_pixels=3136, processor_max_pixels=50176)


def test_the_colour_needs_the_zoom():
    for seed in range(10):
        image, row = render_sample("zoom", random.Random(seed))
        assert image.size == (IMAGE_SIZE, IMAGE_SIZE)
        view = view_of(image)
        assert view.size == (VIEW_SIZE, VIEW_SIZE)
        # in the view, the patch's inside is one grey whatever the colour: (c + (255 - c)) / 2 per channel
        x1, y1, x2, y2 = row["box"]
        quadrant = view.crop((x1, y1, x2, y2))
        inside = [p for p in quadrant.getdata() if p != (255, 255, 255)]
        assert len(inside) >= (PATCH // 2 - 2) ** 2
        grey = [p for p in inside if sum(abs(c - 128) for c in p) <= 3]
        assert len(grey) >= (PATCH // 2 - 4) ** 2  # the 40x40 px patch of the view but its blurred 2 px edge
        # zoomed on its quadrant: full resolution, the stripes in the palette colour and its complement
        zoomed = image_zoom(row["box"], images=[view], original_images=[image])
        assert zoomed.size == (VIEW_SIZE, VIEW_SIZE)
        colour = PALETTE[row["answer"]]
        complement = tuple(255 - c for c in colour)
        assert set(zoomed.getdata()) == {(255, 255, 255), colour, complement}
        # the question names the quadrant; every other quadrant holds another colour
        assert ["top left", "top right", "bottom left", "bottom right"][row["quadrant"]] in row["problem"]
        others = set()
        for q in set(range(4)) - {row["quadrant"]}:
            pixels = set(image_zoom(quadrant_box(q), images=[view], original_images=[image]).getdata()) - {(255, 255, 255)}
            assert len(pixels) == 2 and colour not in pixels
            others |= pixels
        assert len(others) == 6  # three other colours and their complements


def test_rows_and_call_tokens(tmp_path):
    path = materialize_dataset("val", cache_dir=tmp_path, num_samples=8)
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert len(rows) == 8 and all(r["box"] == quadrant_box(r["quadrant"]) for r in rows)
    image = Image.open(path.parent / rows[0]["images"][0])
    assert image.size == (IMAGE_SIZE, IMAGE_SIZE)
    assert quadrant_box(3) == [56, 56, 112, 112]
    assert zoom_call([0, 56, 56, 112]) == '<tool_call>{"name":"image_zoom","arguments":{"box":[0,56,56,112]}}</tool_call>'
    assert "0,56,56,112" in call_tokens() and len(call_tokens()) == 8


def test_reward_scores_the_answer_and_reports_the_zoom():
    compute_score, _ = load_plugin(f"{REPO / 'reward_functions' / 'zoom.py'}:compute_score")
    right = {"name": "image_zoom", "arguments": {"box": [56, 0, 112, 56]}, "ok": True, "error": None}
    wrong = {**right, "arguments": {"box": [0, 0, 56, 56]}}
    inputs = [
        {"response": "Red.", "ground_truth": "red", "box": [56, 0, 112, 56], "tool_calls": [right]},
        {"response": "blue", "ground_truth": "red", "box": [56, 0, 112, 56], "tool_calls": [wrong, right]},
        {"response": "red", "ground_truth": "red", "box": [56, 0, 112, 56]},  # single-turn input
    ]
    assert compute_score(inputs) == [
        {"overall": 1.0, "accuracy": 1.0, "zoom_correct": 1.0, "zoom_used": 1.0},
        {"overall": 0.0, "accuracy": 0.0, "zoom_correct": 0.0, "zoom_used": 1.0},  # the first call counts
        {"overall": 1.0, "accuracy": 1.0, "zoom_correct": 0.0, "zoom_used": 0.0},
    ]


def test_a_zoom_call_is_five_tokens_of_the_tools_model_and_decodes_unchanged():
    from easyvlm.builtin.models import build_tokenizer

    tok = build_tokenizer(call_tokens())
    call = zoom_call(quadrant_box(1))
    ids = tok(call, add_special_tokens=False)["input_ids"]
    # <tool_call>, the prefix, the box, the suffix, </tool_call>: punctuation decodes unchanged too
    assert len(ids) == 5 and tok.decode(ids) == call
    assert len(build_tokenizer()(call, add_special_tokens=False)["input_ids"]) == len(call.encode())
