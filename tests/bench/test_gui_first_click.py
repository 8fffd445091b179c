"""bench/gui_first_click.py: the supervised first-click samples and their targets, checked by hand."""

from __future__ import annotations

import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

from gui_first_click import training_screen  # noqa: E402


def sample(seed: int, targets: str):
    task, ticked, label = training_screen(random.Random(seed), "row", "red", targets)
    return [w.colour for w in task.widgets if w.kind == "checkbox"], task.kind, sorted(ticked), label


def test_the_target_is_a_box_whose_state_differs_from_the_goal():
    # seed 3: tick, boxes green red red red, nothing ticked: the goal is {2, 3, 4}, so 2 is the first
    # wrong box and the random choice among the three drew 4
    assert sample(3, "first") == (["green", "red", "red", "red"], "tick", [], 2)
    assert sample(3, "any") == (["green", "red", "red", "red"], "tick", [], 4)
    # seed 4: untick in its first state (every box ticked), red red yellow green: the goal is {3, 4},
    # boxes 1 and 2 differ from it
    assert sample(4, "first") == (["red", "red", "yellow", "green"], "untick", [1, 2, 3, 4], 1)
    assert sample(4, "any") == (["red", "red", "yellow", "green"], "untick", [1, 2, 3, 4], 2)
    # seed 0: untick in a random state (1, 2, 4 ticked), green red red blue: the goal is {1, 4}, only 2 differs
    assert sample(0, "first") == sample(0, "any") == (["green", "red", "red", "blue"], "untick", [1, 2, 4], 2)


def test_a_screen_that_already_matches_the_goal_asks_for_ok():
    for seed in range(200):
        task, ticked, label = training_screen(random.Random(seed), "row", "red", "first")
        if ticked == task.goal:
            assert label == task.button("OK").label
            return
    raise AssertionError("no screen in the goal state among 200 seeds")
