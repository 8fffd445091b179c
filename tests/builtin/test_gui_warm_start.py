"""The GUI demo's warm start (easyvlm.builtin.gui_warm_start): the scripted expert's episodes, and a
build through the RL rollout loop."""

import random
from pathlib import Path

import pytest

from easyvlm.agents.gui import ScreenState, advance, make_task
from easyvlm.builtin.gui_warm_start import GUI_FORMAT_PROMPT, expert_actions, right_click, train_on_screens

REPO = Path(__file__).resolve().parents[2]
TASK = make_task(4, "tick")  # blue boxes 1 and 3 to tick, OK is widget 4, step limit 3 + 2 = 5


def outcome(actions: list[str]) -> str | None:
    state = ScreenState(TASK.initial)
    for action in actions:
        state = advance(TASK, state, action).state
    return state.outcome


def test_the_warm_start_prompt_is_the_gui_demos_format_prompt():
    assert (REPO / "format_prompts" / "gui.jinja").read_text().strip() == GUI_FORMAT_PROMPT


def test_a_right_expert_toggles_the_wrong_boxes_lowest_label_first_then_presses_ok():
    episodes = {tuple(expert_actions(TASK, random.Random(seed), right_rate=1.0)) for seed in range(20)}
    # one order whatever the seed: box 1, box 3, then OK (widget 4)
    assert episodes == {("click(1)", "click(3)", "click(4)")}
    assert outcome(list(episodes.pop())) == "success"


def test_the_right_click_is_the_lowest_wrong_box_else_ok():
    # goal {1, 3}: nothing ticked -> 1; {1} -> 3; {1, 2, 3} -> 2 (an extra tick is wrong too); {1, 3} -> OK (4)
    assert [right_click(TASK, frozenset(t)) for t in ([], [1], [1, 2, 3], [1, 3])] == [1, 3, 2, 4]


def test_a_screen_sample_trains_on_its_click_token_and_eos_only(monkeypatch):
    """The screens phase's labels: exactly the target's click token and <|im_end|> of each row, with
    rows of different lengths (an untick instruction is longer), on either padding side."""
    from transformers import AutoProcessor

    from easyvlm.builtin.models import materialize_model

    processor = AutoProcessor.from_pretrained(materialize_model("tiny-qwen3-vl-clicks"))
    samples = [(make_task(4, "tick"), frozenset(), 1), (make_task(4, "untick"), frozenset({1, 2}), 4)]
    seen = {}

    def capture(model, optimizer, **inputs):
        seen.update(inputs)
        return 0.0

    monkeypatch.setattr("easyvlm.builtin.sft_steps.train_step", capture)
    tokens = processor.tokenizer.convert_tokens_to_ids
    for side in ("left", "right"):
        processor.tokenizer.padding_side = side
        train_on_screens(None, None, processor, samples)
        labels = seen["labels"]
        assert [row[row != -100].tolist() for row in labels] == [
            [tokens("click(1)"), tokens("<|im_end|>")], [tokens("click(4)"), tokens("<|im_end|>")]]
        lengths = seen["attention_mask"].sum(1)
        assert lengths[0] != lengths[1]  # padding was needed


def test_a_random_expert_plays_until_ok_or_the_step_limit():
    lengths = set()
    for seed in range(30):
        actions = expert_actions(TASK, random.Random(seed), right_rate=0.0)
        lengths.add(len(actions))
        # each episode ends exactly at its last action: OK pressed (success or failure) or 5 steps
        assert outcome(actions) is not None and outcome(actions[:-1]) is None
        assert actions[-1] == "click(4)" or len(actions) == TASK.max_steps == 5
        assert all(a in {f"click({w.label})" for w in TASK.widgets} for a in actions)
    assert min(lengths) < 5 == max(lengths)  # any widget, OK included: some end early, some at the limit


@pytest.mark.parametrize("dataset", ["synthetic-gui", "synthetic-gui-row-red"])
def test_the_gui_warm_start_trains_on_screens_then_on_the_rl_loops_episodes(tmp_path, dataset):
    """Two steps of two screens, then two steps of two episodes: the build asserts each episode ran its
    script to its end through the environment (the expert's task and the environment's screen both from
    the row, in its layout), and a loadable model comes out with the demo's format prompt."""
    import dataclasses

    import torch
    from transformers import AutoModelForImageTextToText

    from easyvlm.builtin.models import materialize_model
    from easyvlm.builtin.warm_start import WARM_STARTS, build_warm_start

    spec = dataclasses.replace(WARM_STARTS["tiny-qwen3-vl-gui"], dataset=dataset, screen_steps=2, screen_batch_size=2,
                               episode_steps=2, batch_size=2)
    lines = []
    build_warm_start(spec, materialize_model(spec.base), tmp_path / "model", log=lines.append)
    assert [line.split(": loss ")[0] for line in lines] == [
        "easyvlm: warm start, screens 1/2", "easyvlm: warm start, screens 2/2",
        "easyvlm: warm start, episodes 1/2", "easyvlm: warm start, episodes 2/2"]
    assert (tmp_path / "model" / "format_prompt.jinja").read_text().strip() == GUI_FORMAT_PROMPT
    model = AutoModelForImageTextToText.from_pretrained(tmp_path / "model", dtype=torch.float32)
    assert model.config.image_token_id is not None


def test_the_qwen3_vl_clicks_base_gives_each_cell_one_image_token_and_each_click_one_token():
    """builtin:tiny-qwen3-vl-clicks (the Qwen3-VL base that learns the first click in
    bench/gui_first_click.py): its processor resizes the 112 px screen to 128 px (the nearest multiple
    of patch 16 x merge 2), 8 x 8 patches merged to 4 x 4 image tokens, so each 28 px cell of the
    4 x 4 screen is one token; its tower has learned position embeddings (a 16 x 16 grid = 256);
    click(1)..click(7) are seven consecutive single ids."""
    from transformers import AutoConfig, AutoProcessor

    from easyvlm.agents.gui import make_task, render_screen
    from easyvlm.builtin.models import materialize_model

    path = materialize_model("tiny-qwen3-vl-clicks")
    processor = AutoProcessor.from_pretrained(path)
    screen = render_screen(make_task(5, "tick", layout="row", colour="red"), frozenset())
    out = processor(text=["<|vision_start|><|image_pad|><|vision_end|>"], images=[screen], return_tensors="pt")
    assert out["image_grid_thw"].tolist() == [[1, 8, 8]]
    assert (out["input_ids"] == processor.tokenizer.convert_tokens_to_ids("<|image_pad|>")).sum().item() == 16
    ids = [processor.tokenizer(f"click({k})", add_special_tokens=False)["input_ids"] for k in range(1, 8)]
    first = ids[0][0]
    assert ids == [[first + k] for k in range(7)]
    config = AutoConfig.from_pretrained(path)
    assert (config.model_type, config.vision_config.num_position_embeddings) == ("qwen3_vl", 256)


def test_the_screens_phase_draws_train_tasks_only():
    """The screens phase makes its own tasks (not the rows), so it must skip those of the held-out
    splits: each val row's task is a val task by split_of_task (the rows' own rule), and 300 screen
    samples are all train tasks, where ~2 in 10 of the tasks drawn are not (SPLIT_BUCKETS)."""
    import json

    from easyvlm.agents.gui import task_of_row
    from easyvlm.builtin.gui_warm_start import screen_sample
    from easyvlm.builtin.synthetic_gui import materialize_dataset, split_of_task

    val = materialize_dataset("val", name="synthetic-gui-row-red")
    rows = [json.loads(line) for line in val.read_text().splitlines() if line.strip()]
    assert {split_of_task(task_of_row(row)) for row in rows} == {"val"}
    rng = random.Random(0)
    assert {split_of_task(screen_sample(rng, "row", "red")[0]) for _ in range(300)} == {"train"}
    drawn = [split_of_task(make_task(rng.getrandbits(31), "tick", layout="row", colour="red")) for _ in range(300)]
    assert 0 < drawn.count("train") < 300
