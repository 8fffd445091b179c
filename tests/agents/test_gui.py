"""The GUI-style environment (easyvlm.agents.gui): scripted episodes with their rewards derived by
hand, the action grammar, hit-testing, the screenshots' pixels, determinism per seed, and the
environment through the contract (load_environment, environment_step) and the multi-turn rollout."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest
from agent_helpers import encoder_of, prompt_batch, run_scripted, tool_plan

from easyvlm.agents.environment import environment_step, load_environment, state_anchor
from easyvlm.agents.gui import (
    BACKGROUND, COLOURS, FONT, INK, PAPER, ActionError, Click, GuiEnvironment, clicked_widget, hit_test, label_origin,
    layout_task, make_task, parse_action, render_screen, solution,
)
from easyvlm.builtin.synthetic_gui import materialize_dataset

REPO = Path(__file__).resolve().parents[2]

# Boxes in cells 0 (red), 2 (blue) and 5 (red): labels 1, 2, 3 in reading order, then OK = 4 on the
# bottom row's left half and CLEAR = 5 on its right half. Cell 5 is column 1, row 1: x and y 28-55.
BOXES = [(5, "red"), (0, "red"), (2, "blue")]


def png(image) -> bytes:
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return buf.getvalue()


def play(task, actions):
    """[(message, done, reward)] of ``actions``, each step's screenshot compared with a fresh render."""
    env = GuiEnvironment()
    env.start(task)
    out = []
    for action in actions:
        observation, done, reward, _ = env.step(action)
        screenshot, message = observation
        assert png(screenshot) == png(render_screen(task, env.state.ticked))
        out.append((message, done, reward))
    return env, out


def test_the_layout_follows_reading_order():
    task = layout_task("tick", "red", BOXES, ok_left=True)
    assert [(w.label, w.kind, w.box, w.colour or w.text) for w in task.widgets] == [
        (1, "checkbox", (0, 0, 28, 28), "red"), (2, "checkbox", (56, 0, 84, 28), "blue"),
        (3, "checkbox", (28, 28, 56, 56), "red"), (4, "button", (0, 84, 56, 112), "OK"),
        (5, "button", (56, 84, 112, 112), "CLEAR"),
    ]
    # tick red: nothing ticked, boxes 1 and 3 to tick, n = 2 toggles + OK = 3, limit n + 2 = 5
    assert (task.initial, task.goal, task.min_actions, task.max_steps) == (frozenset(), {1, 3}, 3, 5)
    assert solution(task) == "click(1) click(3) click(4)"
    untick = layout_task("untick", "red", BOXES, ok_left=False)
    # untick red: all ticked, boxes 1 and 3 to untick (goal: only 2), OK is now 5
    assert (untick.initial, untick.goal, untick.min_actions) == ({1, 2, 3}, {2}, 3)
    assert solution(untick) == "click(1) click(3) click(5)"


def test_a_successful_episode():
    task = layout_task("tick", "red", BOXES, ok_left=True)
    env, steps = play(task, ["click(1)", "click(40, 40)", "All red boxes are ticked, so: click(4)"])
    # wrong boxes (ticked ^ goal {1, 3}): 2 -> 1 -> 0, each toggle earns (before - after) / n = 1/3;
    # OK with nothing wrong earns 1/n + SUCCESS_REWARD = 1/3 + 1
    assert steps == [("Box 1 is now ticked.", False, 1 / 3), ("Box 3 is now ticked.", False, 1 / 3),
                     ("Task complete.", True, 1 / 3 + 1.0)]
    assert (env.state.ticked, env.state.steps, env.state.outcome) == ({1, 3}, 3, "success")
    assert env.step("click(4)")[:3] == (None, True, 0.0)  # after the end: nothing happens


def test_a_detour_earns_nothing_and_a_success_still_returns_two():
    task = layout_task("tick", "red", BOXES, ok_left=True)
    # ticking blue box 2 adds a wrong box (1 -> 2 wrong after box 1): -1/3; unticking it gives it back
    env, steps = play(task, ["click(1)", "click(2)", "click(2)", "click(3)", "click(4)"])
    assert [r for _, _, r in steps] == [1 / 3, -1 / 3, 1 / 3, 1 / 3, 1 / 3 + 1.0]
    # the fifth step is the limit, but OK succeeded on it: a success, not a step limit
    assert env.state.outcome == "success" and steps[-1][:2] == ("Task complete.", True)
    assert sum(r for _, _, r in steps) == pytest.approx(2.0, abs=1e-12)  # thirds are not exact in binary


def test_the_info_names_the_screen_and_the_outcome():
    # the screen is the set of ticked boxes: toggling box 3 twice comes back to the start's screen
    env = GuiEnvironment()
    seed = next(s for s in range(100) if make_task(s, "tick").goal == {1, 3} and len(make_task(s, "tick").widgets) == 5)
    assert env.reset({"seed": seed, "task": "tick"}) == {"state_key": "ticked "}
    infos = [env.step(action)[3] for action in ["click(3)", "click(3)", "click(3)", "click(1)"]]
    assert [i["state_key"] for i in infos] == ["ticked 3", "ticked ", "ticked 3", "ticked 1,3"]
    assert all(i["outcome"] is None and i["success"] is False for i in infos)
    ok = env.task.button("OK").label
    assert env.step(f"click({ok})")[3] == {"state_key": "ticked 1,3", "outcome": "success", "success": True}
    env.reset({"seed": seed, "task": "tick"})
    assert env.step(f"click({ok})")[3] == {"state_key": "ticked ", "outcome": "failed", "success": False}


def test_invalid_actions_are_answered_with_the_unchanged_screen_until_the_step_limit():
    task = layout_task("tick", "red", BOXES, ok_left=True)
    first = png(render_screen(task, task.initial))
    env, steps = play(task, ["press OK", "click(9)", "click(100, 10)", "click(1) click(3)", "click(200, 10)"])
    # (100, 10) is in cell 3, which holds no box; every error is a step with reward 0, the fifth the limit
    assert steps == [
        ("Error: no action found; write one action, e.g. click(3) or click(40, 60).", False, 0.0),
        ("Error: there is no widget 9; the widgets are numbered 1 to 5.", False, 0.0),
        ("Error: there is no widget at (100, 10).", False, 0.0),
        ("Error: write one action per turn, found 2.", False, 0.0),
        ("Error: (200, 10) is outside the 112x112 screen. The step limit (5) is reached: the episode ends.", True, 0.0),
    ]
    assert (env.state.ticked, env.state.steps, env.state.outcome) == (frozenset(), 5, "step_limit")
    assert png(env.screenshot()) == first


def test_pressing_ok_too_early_fails_the_episode():
    task = layout_task("tick", "red", BOXES, ok_left=True)
    env, steps = play(task, ["click(1)", "click(4)"])
    # box 3 is still unticked when OK is pressed: the episode ends, the OK step earns 0 (return 1/3)
    assert steps == [("Box 1 is now ticked.", False, 1 / 3),
                     ("OK was pressed before the task was complete: the episode ends.", True, 0.0)]
    assert env.state.outcome == "failed"
    assert env.step("click(3)")[:3] == (None, True, 0.0)


def test_the_step_limit_ends_an_untick_episode_and_clear_counts_as_progress():
    task = layout_task("untick", "red", BOXES, ok_left=True)
    env, steps = play(task, ["click(60, 100)", "click(2)", "click(2)", "click(2)", "click(3)"])
    # goal {2}, n = 3. Ticked {1,2,3} (2 wrong) -CLEAR-> {} (1 wrong): +1/3; -> {2} (0): +1/3;
    # -> {} (1): -1/3; -> {2} (0): +1/3; -> {2,3} (1): -1/3, and the fifth step is the limit
    assert steps == [
        ("Every box is now unticked.", False, 1 / 3), ("Box 2 is now ticked.", False, 1 / 3),
        ("Box 2 is now unticked.", False, -1 / 3), ("Box 2 is now ticked.", False, 1 / 3),
        ("Box 3 is now ticked. The step limit (5) is reached: the episode ends.", True, -1 / 3),
    ]
    assert (env.state.ticked, env.state.outcome) == ({2, 3}, "step_limit")


@pytest.mark.parametrize("text,click", [
    ("click(3)", Click(label=3)),
    ("I see box 12. click(12)", Click(label=12)),
    ("click( 40 , 60 )", Click(point=(40.0, 60.0))),
    ("<answer>click(40.5,7)</answer>", Click(point=(40.5, 7.0))),
])
def test_the_parser_reads_good_actions(text, click):
    assert parse_action(text) == click


@pytest.mark.parametrize("text,error", [
    ("", "no action found"),
    ("press OK", "no action found"),
    ("doubleclick(3)", "no action found"),  # `click` must be a word of its own
    ("Click(3)", "no action found"),  # the grammar is lower case
    ("click(3) then click(4)", "one action per turn, found 2"),
    ("click()", "click() is neither"),
    ("click(a)", "click(a) is neither"),
    ("click(-1, 5)", "click(-1, 5) is neither"),
    ("click(1, 2, 3)", "click(1, 2, 3) is neither"),
    ("click(3.5)", "click(3.5) is neither"),
])
def test_the_parser_refuses_bad_actions(text, error):
    with pytest.raises(ActionError, match=error.replace("(", r"\(").replace(")", r"\)")):
        parse_action(text)


def test_hit_testing_uses_the_widget_cells():
    task = layout_task("tick", "red", BOXES, ok_left=True)
    label = lambda x, y: getattr(hit_test(task.widgets, x, y), "label", None)  # noqa: E731
    # box 1: x, y in [0, 28); cell 1 (x 28-55, row 0) is empty; box 2: x in [56, 84); box 3: [28, 56)^2
    assert [label(0, 0), label(27.9, 27.9), label(28, 0), label(56, 0), label(83.9, 27.9)] == [1, 1, None, 2, 2]
    assert [label(28, 28), label(55.9, 55.9), label(56, 56), label(27.9, 28)] == [3, 3, None, None]
    # the buttons split the bottom row (y in [84, 112)) at x = 56: OK left, CLEAR right
    assert [label(55.9, 84), label(56, 84), label(111.9, 111.9), label(0, 83.9), label(0, 112)] == [4, 5, 5, None, None]
    with pytest.raises(ActionError, match=r"\(112, 0\) is outside the 112x112 screen"):
        clicked_widget(task, Click(point=(112.0, 0.0)))


def read_label(image, widget) -> str:
    """The digit drawn at the widget's label, read back from the pixels (white on the black tag)."""
    x, y = label_origin(widget)
    bits = tuple("".join("1" if image.getpixel((x + 2 * c, y + 2 * r)) == PAPER else "0" for c in range(3))
                 for r in range(5))
    return "".join(d for d in "0123456789" if FONT[d] == bits)


def test_the_screenshot_shows_labels_and_tick_states():
    task = layout_task("tick", "red", BOXES, ok_left=True)
    before, after = render_screen(task, frozenset()), render_screen(task, frozenset({3}))
    assert before.size == (112, 112) and before.getpixel((30, 5)) == BACKGROUND  # empty cell 1
    assert [read_label(after, w) for w in task.widgets] == ["1", "2", "3", "4", "5"]
    assert after.getpixel((0 + 2, 0 + 1)) == INK  # box 1's tag
    # box 3 (cell at 28, 28): the frame is red; the inside (from +14, +12) is white until ticked,
    # then red with a white check mark through (+17, +19)
    assert before.getpixel((28 + 11, 28 + 9)) == COLOURS["red"] == after.getpixel((28 + 11, 28 + 9))
    assert before.getpixel((28 + 14, 28 + 12)) == PAPER and after.getpixel((28 + 14, 28 + 12)) == COLOURS["red"]
    assert before.getpixel((28 + 17, 28 + 19)) == PAPER == after.getpixel((28 + 17, 28 + 19))
    assert after.getpixel((14, 12)) == PAPER  # box 1 is not ticked
    # OK (left here, x 0-55 of the bottom row) is the dark primary button, CLEAR the light one: a spot
    # inside each fill, right of the caption and below the frame (x + 50, y + 4)
    assert after.getpixel((50, 84 + 4)) == (70, 70, 70) and after.getpixel((56 + 50, 84 + 4)) == (205, 205, 205)
    changed = [(x, y) for x in range(112) for y in range(112) if before.getpixel((x, y)) != after.getpixel((x, y))]
    assert changed and all(42 <= x < 52 and 40 <= y < 50 for x, y in changed)  # only box 3's inside


def test_tasks_are_deterministic_per_seed_and_span_two_to_five_actions():
    a, b = make_task(1234, "tick"), make_task(1234, "tick")
    assert a == b and png(render_screen(a, a.initial)) == png(render_screen(b, b.initial))
    screens = {png(render_screen(make_task(seed, "tick"), frozenset())) for seed in range(20)}
    assert len(screens) == 20  # different seeds, different screens
    tasks = [make_task(seed, kind) for seed in range(300) for kind in ("tick", "untick")]
    assert {t.min_actions for t in tasks} == {2, 3, 4, 5}
    # never every box of the colour: a box that must stay as it is is always there
    assert all(len(t.goal ^ t.initial) < sum(w.kind == "checkbox" for w in t.widgets) for t in tasks)
    # the shortest solution solves every task
    for t in tasks[:50]:
        env = GuiEnvironment()
        env.start(t)
        rewards = [env.step(action)[2] for action in solution(t).split()]
        assert env.state.outcome == "success" and sum(rewards) == pytest.approx(2.0, abs=1e-12)


def test_reset_reads_the_row_and_says_what_is_missing():
    env = GuiEnvironment()
    env.reset({"seed": 77, "task": "untick", "ground_truth": "ignored"})
    assert env.task == make_task(77, "untick") and env.state.ticked == env.task.initial
    env.reset({"seed": 77, "task": "untick", "max_steps": 1})
    assert env.step("click(60, 200)")[1:3] == (True, 0.0)  # one step allowed
    with pytest.raises(ValueError, match="no seed column"):
        env.reset({"task": "tick"})
    with pytest.raises(ValueError, match=r"unknown GUI task 'drag'; known: \['tick', 'untick'\]"):
        env.reset({"seed": 1, "task": "drag"})


def test_the_environment_plugs_into_the_contract():
    cls = load_environment(f"{REPO / 'examples' / 'environments' / 'gui.py'}:GuiEnvironment")
    env = cls()
    env.reset({"seed": 5, "task": "tick"})
    task = env.task
    first = solution(task).split()[0]
    observation, done, reward, info = environment_step(env, first, timeout=5.0)
    assert observation.ok and not done and reward == 1 / task.min_actions
    assert len(observation.images) == 1 and observation.images[0].size == (112, 112)
    assert observation.text == f"Box {first[6:-1]} is now ticked."
    assert info == {"state_key": f"ticked {first[6:-1]}", "outcome": None, "success": False}
    observation, done, reward, info = environment_step(env, "nonsense", timeout=5.0)
    assert observation.ok and not done and reward == 0.0 and observation.text.startswith("Error: no action found")


def test_episodes_through_the_multi_turn_rollout(tiny_model_path, tmp_path):
    path = materialize_dataset("val", cache_dir=tmp_path, num_samples=8)
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    row = next(r for r in rows if len(r["answer"].split()) == 3)  # two toggles, then OK
    # the scripted engine tells samples apart by their prompt's text: another instruction
    other = next(r for r in rows if r["problem"] != row["problem"])
    environment = f"{REPO / 'examples' / 'environments' / 'gui.py'}:GuiEnvironment"
    plan = tool_plan(tiny_model_path, 512, f"worker.rollout.environment={environment}", "worker.rollout.max_turns=7",
                     "data.prompt_key=problem", "data.max_prompt_length=512",
                     # examples/config.yaml's limits: the 112x112 screenshots are shown at their size
                     "data.min_pixels=3136", "data.max_pixels=50176",
                     f"data.format_prompt={REPO / 'format_prompts' / 'gui.jinja'}")
    encoder = encoder_of(plan)
    prompts = prompt_batch(encoder, [row, other], path.parent)
    prompts["extra"] = [{k: r[k] for k in ("task", "seed", "max_steps")} for r in (row, other)]
    task = make_task(row["seed"], row["task"])
    ok = f"click({make_task(other['seed'], other['task']).button('OK').label})"
    out, _ = run_scripted(plan, encoder, prompts, [row["answer"].split(), [ok]])  # the other presses OK at once
    solved, failed = out["trajectory"]
    assert (solved["finish"], solved["num_turns"], failed["finish"], failed["num_turns"]) == ("done", 3, "done", 1)
    # 1/3 + 1/3 + (1/3 + 1) for the solution; the early OK ends the episode with 0
    assert solved["environment_reward"] == pytest.approx(2.0, abs=1e-12) and failed["environment_reward"] == 0.0
    # the screenshots after the two toggles are shown (not the last one: the episode is over), as the env drew them
    first, second = sorted(task.initial ^ task.goal)
    verb = "ticked" if task.kind == "tick" else "unticked"
    assert [m["content"] for m in solved["messages"] if m["role"] == "user"] == [f"Box {first} is now {verb}.",
                                                                                f"Box {second} is now {verb}."]
    assert [png(i) for i in solved["images"]] == [png(render_screen(task, task.initial ^ {first})),
                                                   png(render_screen(task, task.initial ^ {first, second}))]
    # a 112x112 screenshot is 4x4 merged 28 px patches: 16 image tokens each, none of them trained
    pad = encoder.tokenizer.convert_tokens_to_ids("<|image_pad|>")
    responses, mask = out["responses"][0], out["response_mask"][0]
    assert int((responses == pad).sum()) == 2 * 16 and not bool(mask[responses == pad].any())
    # per step (max_turns = 7 columns): the rewards above; the screens the turns acted from, named by the env
    assert out["step_rewards"][0].tolist() == pytest.approx([1 / 3, 1 / 3, 1 / 3 + 1, 0, 0, 0, 0], abs=1e-7)
    assert out["step_rewards"][1].tolist() == [0.0] * 7
    screens = [task.initial, task.initial ^ {first}, task.initial ^ {first, second}]
    keys = ["ticked " + ",".join(str(label) for label in sorted(screen)) for screen in screens]
    assert out["step_anchors"][0].tolist() == [state_anchor({"state_key": key}) for key in keys] + [0] * 4
    assert solved["environment_info"] == {"state_key": keys[-1], "outcome": "success", "success": True}
    assert failed["environment_info"]["outcome"] == "failed" and failed["environment_info"]["success"] is False
    assert out["turn_index"][0][mask].unique_consecutive().tolist() == [0, 1, 2]
    assert (out["turn_index"][0][~mask] == -1).all()
