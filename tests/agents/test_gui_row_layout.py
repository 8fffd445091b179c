"""The GUI environment's row layout (easyvlm.agents.gui, layout="row"): four boxes filling the top
row, so box N is always the N-th cell; its widgets, goal and step limit for a fixed seed, scripted
episodes with their transitions and rewards derived by hand, and the row's layout column."""

from __future__ import annotations

import pytest

from easyvlm.agents.gui import COLOURS, INK, PAPER, GuiEnvironment, layout_task, make_task, render_screen, solution

# random.Random(5) draws (make_task): 3 boxes of the colour (randint(1, 3)), red, the fourth box yellow,
# shuffled to red red yellow red, OK on the right. Everything below follows from these draws by hand.
SEED = 5
COLOURS_OF_SEED = ["red", "red", "yellow", "red"]


def test_a_row_task_is_four_boxes_in_the_top_row_then_the_buttons():
    task = make_task(SEED, "tick", layout="row")
    assert task == layout_task("tick", "red", list(enumerate(COLOURS_OF_SEED)), ok_left=False)
    # cells 0-3 are the top row, 28 px each: box N spans x 28(N-1) to 28N; CLEAR on the left half of
    # the bottom row (label 5), OK on the right (6)
    assert [(w.label, w.kind, w.box, w.colour or w.text) for w in task.widgets] == [
        (1, "checkbox", (0, 0, 28, 28), "red"), (2, "checkbox", (28, 0, 56, 28), "red"),
        (3, "checkbox", (56, 0, 84, 28), "yellow"), (4, "checkbox", (84, 0, 112, 28), "red"),
        (5, "button", (0, 84, 56, 112), "CLEAR"), (6, "button", (56, 84, 112, 112), "OK"),
    ]
    # tick red: boxes 1, 2, 4 to tick, n = 3 toggles + OK = 4, step limit n + 2 = 6
    assert (task.initial, task.goal, task.min_actions, task.max_steps) == (frozenset(), {1, 2, 4}, 4, 6)
    assert solution(task) == "click(1) click(2) click(4) click(6)"
    untick = make_task(SEED, "untick", layout="row")
    # untick red: all four ticked at the start, only yellow box 3 stays ticked
    assert (untick.initial, untick.goal, untick.min_actions) == ({1, 2, 3, 4}, {3}, 4)
    screen = render_screen(task, task.initial)
    # box 3's colour square starts at (56 + 11, 0 + 9); its label's black tag at (56 + 1, 0 + 1)
    assert screen.getpixel((67, 9)) == COLOURS["yellow"] and screen.getpixel((57, 1)) == INK
    assert screen.getpixel((56 + 14, 12)) == PAPER  # unticked: a white inside


def test_every_row_task_puts_box_n_in_cell_n():
    tasks = [make_task(seed, kind, layout="row") for seed in range(200) for kind in ("tick", "untick")]
    for t in tasks:
        boxes = [w for w in t.widgets if w.kind == "checkbox"]
        assert [(w.label, w.box[:2]) for w in boxes] == [(1, (0, 0)), (2, (28, 0)), (3, (56, 0)), (4, (84, 0))]
        assert {w.label for w in t.widgets if w.kind == "button"} == {5, 6}
        # the boxes to click are exactly those of the named colour, 1-3 of the 4
        assert t.initial ^ t.goal == {w.label for w in boxes if w.colour == t.colour}
    assert {t.min_actions for t in tasks} == {2, 3, 4}  # 1-3 toggles, then OK
    assert {t.button("OK").label for t in tasks} == {5, 6}  # OK on either side


def test_a_scripted_untick_episode_with_a_detour():
    env = GuiEnvironment()
    assert env.reset({"seed": SEED, "task": "untick", "layout": "row"}) == {"state_key": "ticked 1,2,3,4"}
    actions = ["click(1)", "click(3)", "click(70, 10)", "click(2)", "click(4)", "click(6)"]
    steps = [env.step(action) for action in actions]
    # goal {3}, n = 4. Wrong boxes (ticked ^ goal): 3 at the start; box 1 off -> 2 (+1/4); yellow box 3
    # off -> 3 (-1/4); (70, 10) is in cell 2 = box 3, back on -> 2 (+1/4); boxes 2, 4 off -> 1, 0
    # (+1/4 each); OK with nothing wrong on step 6 = the limit: 1/4 + 1, a success. Return 2.
    assert [(obs[1], done, reward, info["state_key"]) for obs, done, reward, info in steps] == [
        ("Box 1 is now unticked.", False, 1 / 4, "ticked 2,3,4"),
        ("Box 3 is now unticked.", False, -1 / 4, "ticked 2,4"),
        ("Box 3 is now ticked.", False, 1 / 4, "ticked 2,3,4"),
        ("Box 2 is now unticked.", False, 1 / 4, "ticked 3,4"),
        ("Box 4 is now unticked.", False, 1 / 4, "ticked 3"),
        ("Task complete.", True, 1 / 4 + 1.0, "ticked 3"),
    ]
    assert (env.state.steps, env.state.outcome, steps[-1][3]["success"]) == (6, "success", True)
    # every screenshot shows the boxes its state_key names as ticked
    for obs, _, _, info in steps:
        ticked = frozenset(int(label) for label in info["state_key"].split()[1].split(","))
        assert obs[0].tobytes() == render_screen(env.task, ticked).tobytes()


def test_a_scripted_tick_episode_that_clears_then_presses_ok_too_early():
    env = GuiEnvironment()
    env.reset({"seed": SEED, "task": "tick", "layout": "row"})
    rewards = [env.step(action)[2] for action in ["click(1)", "click(2)"]]
    observation, done, reward, info = env.step("click(5)")  # CLEAR
    # goal {1, 2, 4}: 3 wrong -> 2 -> 1 (+1/4 each); CLEAR unticks 1 and 2: 1 -> 3 wrong, -2/4
    assert rewards == [1 / 4, 1 / 4] and (observation[1], done, reward) == ("Every box is now unticked.", False, -2 / 4)
    assert observation[0].tobytes() == render_screen(env.task, frozenset()).tobytes()  # the start screen again
    observation, done, reward, info = env.step("click(6)")  # OK with three boxes still wrong
    assert (observation[1], done, reward, info["outcome"]) == (
        "OK was pressed before the task was complete: the episode ends.", True, 0.0, "failed")


def test_the_layout_column_of_a_row():
    env = GuiEnvironment()
    env.reset({"seed": SEED, "task": "tick", "layout": "row"})
    assert env.task == make_task(SEED, "tick", layout="row") != make_task(SEED, "tick")
    for absent in ({}, {"layout": None}, {"layout": "random"}):  # no column (the synthetic-gui rows): random
        env.reset({"seed": SEED, "task": "tick", **absent})
        assert env.task == make_task(SEED, "tick")
    with pytest.raises(ValueError, match=r"layout column is 'grid'; known: \['random', 'row'\]"):
        env.reset({"seed": SEED, "task": "tick", "layout": "grid"})
    with pytest.raises(ValueError, match=r"unknown GUI layout 'grid'"):
        make_task(SEED, "tick", layout="grid")


def test_the_colour_column_names_the_task_colour_and_keeps_the_seeds_screen():
    """colour given: the same draws (randint 3, choice red, yellow for the fourth box, the same shuffle),
    with the named colour where the seed's was: green green yellow green; the goal follows."""
    task = make_task(SEED, "tick", layout="row", colour="green")
    boxes = [w for w in task.widgets if w.kind == "checkbox"]
    assert [w.colour for w in boxes] == ["green", "green", "yellow", "green"]
    assert task.colour == "green" and task.goal == {1, 2, 4} and task.initial == frozenset()
    assert [w.box for w in task.widgets] == [w.box for w in make_task(SEED, "tick", layout="row").widgets]
    assert task.instruction == "Tick every green box and no other, then press OK."
    env = GuiEnvironment()
    env.reset({"seed": SEED, "task": "tick", "layout": "row", "colour": "green"})
    assert env.task == task
    env.reset({"seed": SEED, "task": "tick", "layout": "row", "colour": None})  # no colour: the seed's (red)
    assert env.task == make_task(SEED, "tick", layout="row")
    with pytest.raises(ValueError, match=r"colour column is 'purple'; known: \['red', 'green', 'blue', 'yellow'\]"):
        env.reset({"seed": SEED, "task": "tick", "colour": "purple"})
    with pytest.raises(ValueError, match=r"GUI colours are \['red', 'green', 'blue', 'yellow'\], got 'purple'"):
        make_task(SEED, "tick", colour="purple")
