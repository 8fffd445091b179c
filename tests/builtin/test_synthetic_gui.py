"""builtin:synthetic-gui: every row is the start of a GUI episode that GuiEnvironment rebuilds from
the row's seed and task; the answer solves it; splits never share a screen; the format prompt."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
from PIL import Image

from easyvlm.agents.gui import GuiEnvironment, make_task, solution
from easyvlm.builtin import synthetic
from easyvlm.builtin.synthetic import SyntheticDatasetError, resolve_builtin_dataset, split_of
from easyvlm.builtin.synthetic_gui import _content_hash, materialize_dataset, render_sample
from easyvlm.data.prompts import render_prompt

REPO = Path(__file__).resolve().parents[2]


def rows_of(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_rows_are_episode_starts_the_environment_rebuilds(tmp_path):
    path = materialize_dataset("val", cache_dir=tmp_path, num_samples=16)
    assert path == tmp_path / "datasets" / "synthetic-gui-val-16-v2" / "val.jsonl"
    rows = rows_of(path)
    assert len(rows) == 16 and {r["task"] for r in rows} == {"tick", "untick"}
    for row in rows:
        assert list(row) == ["problem", "answer", "images", "task", "seed", "max_steps"]
        task = make_task(row["seed"], row["task"])
        assert row["problem"] == "<image>" + task.instruction and row["answer"] == solution(task)
        assert row["max_steps"] == len(row["answer"].split()) + 2
        image = Image.open(path.parent / row["images"][0])
        assert image.size == (112, 112)
        env = GuiEnvironment()
        env.reset({**row, "ground_truth": row["answer"]})  # what the rollout loop passes
        assert image.convert("RGB").tobytes() == env.screenshot().tobytes()  # the row shows the env's first screen
        returns = sum(env.step(action)[2] for action in row["answer"].split())
        assert env.state.outcome == "success" and returns == pytest.approx(2.0, abs=1e-12)  # thirds: not exact


def test_splits_hold_different_screens_and_the_name_resolves(tmp_path):
    assert "synthetic-gui" in synthetic.builtin_dataset_names()
    val = resolve_builtin_dataset("builtin:synthetic-gui@val", cache_dir=tmp_path)  # the full 128 rows
    train = materialize_dataset("train", cache_dir=tmp_path, num_samples=200)

    def keys(path):
        out = set()
        for row in rows_of(path):
            image = Image.open(path.parent / row["images"][0]).convert("RGB")
            out.add(_content_hash(image, row["problem"]))
        return out

    val_keys, train_keys = keys(val), keys(train)
    assert len(val_keys) == 128 and len(train_keys) == 200 and not val_keys & train_keys
    assert {split_of(k) for k in val_keys} == {"val"} and {split_of(k) for k in train_keys} == {"train"}
    assert synthetic.dataset_cache_dir("train", tmp_path, "synthetic-gui").name == "synthetic-gui-train-2000-v2"
    with pytest.raises(SyntheticDatasetError, match="unknown GUI task 'drag'"):
        render_sample("drag", random.Random(0))


def test_the_format_prompt_states_the_grammar_and_the_step_limit():
    row = {"problem": "<image>Tick every red box and no other, then press OK.", "max_steps": 5}
    text = render_prompt(row["problem"], row, str(REPO / "format_prompts" / "gui.jinja"))
    assert text == (
        "<image>Tick every red box and no other, then press OK. One action per turn: click(N) clicks the widget "
        "labelled N, click(X, Y) the pixel at X, Y of the screenshot (from its top left corner). You have 5 steps."
    )


def test_the_row_layouts_rows_carry_their_layout(tmp_path):
    """builtin:synthetic-gui-row: the same rows with a layout column "row"; the environment rebuilds
    each first screen from it and the answer solves it; splits never share a screen."""
    assert "synthetic-gui-row" in synthetic.builtin_dataset_names()
    path = resolve_builtin_dataset("builtin:synthetic-gui-row@val", cache_dir=tmp_path)
    assert path == tmp_path / "datasets" / "synthetic-gui-row-val-128-v2" / "val.jsonl"
    rows = rows_of(path)
    assert len(rows) == 128 and {r["task"] for r in rows} == {"tick", "untick"}
    for row in rows[:16]:
        assert list(row) == ["problem", "answer", "images", "task", "seed", "max_steps", "layout"]
        assert row["layout"] == "row"
        task = make_task(row["seed"], row["task"], layout="row")
        # 1-3 boxes to toggle, then OK: 2-4 actions, the step limit 2 more
        assert row["answer"] == solution(task) and row["max_steps"] == len(row["answer"].split()) + 2 <= 6
        env = GuiEnvironment()
        env.reset({**row, "ground_truth": row["answer"]})
        assert Image.open(path.parent / row["images"][0]).convert("RGB").tobytes() == env.screenshot().tobytes()
        returns = sum(env.step(action)[2] for action in row["answer"].split())
        assert env.state.outcome == "success" and returns == pytest.approx(2.0, abs=1e-12)
    train = materialize_dataset("train", cache_dir=tmp_path, name="synthetic-gui-row", num_samples=200)
    assert train.parent.name == "synthetic-gui-row-train-200-v2"
    train_seeds = {(r["seed"], r["task"]) for r in rows_of(train)}
    # the content hash (screen + instruction) picks the split, so no val screen is a train screen
    train_screens = {_content_hash(Image.open(train.parent / r["images"][0]).convert("RGB"), r["problem"])
                     for r in rows_of(train)}
    val_screens = {_content_hash(Image.open(path.parent / r["images"][0]).convert("RGB"), r["problem"]) for r in rows}
    assert len(train_seeds) == 200 and len(val_screens) == 128 and not train_screens & val_screens


def test_the_red_rows_carry_their_colour_and_fit_the_layouts_screens(tmp_path):
    """builtin:synthetic-gui-row-red: the row layout, every task about red (1-3 red boxes); its own
    sizes, 500 / 56 / 56, since the layout has only 696 screens (14 placements x 3 colours for each
    other box x OK side x task: 2 * 2 * (4*27 + 6*9 + 4*3) = 696), 62 of them val by the split's hash."""
    assert "synthetic-gui-row-red" in synthetic.builtin_dataset_names()
    path = resolve_builtin_dataset("builtin:synthetic-gui-row-red@val", cache_dir=tmp_path)
    assert path == tmp_path / "datasets" / "synthetic-gui-row-red-val-56-v2" / "val.jsonl"
    rows = rows_of(path)
    assert len(rows) == 56 and {r["task"] for r in rows} == {"tick", "untick"}
    for row in rows:
        assert list(row) == ["problem", "answer", "images", "task", "seed", "max_steps", "layout", "colour"]
        assert row["layout"] == "row" and row["colour"] == "red" and " red box" in row["problem"]
        task = make_task(row["seed"], row["task"], layout="row", colour="red")
        reds = [w.label for w in task.widgets if w.colour == "red"]
        assert 1 <= len(reds) <= 3 and row["answer"] == solution(task)
        env = GuiEnvironment()
        env.reset({**row, "ground_truth": row["answer"]})
        assert Image.open(path.parent / row["images"][0]).convert("RGB").tobytes() == env.screenshot().tobytes()
    train = synthetic.dataset_cache_dir("train", tmp_path, "synthetic-gui-row-red")
    assert train.name == "synthetic-gui-row-red-train-500-v2"
