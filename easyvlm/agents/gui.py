"""A GUI-style environment drawn with Pillow: numbered widgets on a 112x112 screen, tasks of 2-5
dependent clicks, a screenshot after every action; offline, deterministic per seed. Screen, actions
and rewards: docs/agents.md, "The GUI environment" (a success returns ``1 + SUCCESS_REWARD`` whatever
its detours). ``GuiEnvironment`` wraps these pure functions; its rows are ``builtin:synthetic-gui``."""

from __future__ import annotations

import dataclasses
import random
import re
from dataclasses import dataclass

from PIL import Image, ImageDraw

CELL = 28
COLUMNS = 4
BOX_ROWS = 3  # checkbox rows; the buttons take the row below
SCREEN = CELL * COLUMNS  # 112 px square
KINDS = ("tick", "untick")
LAYOUTS = ("random", "row")
"""random: boxes in random cells of the top three rows, so a box's label depends on where the others
are; row: four boxes filling the top row, so box N is always the N-th cell (OK and CLEAR: 5 and 6)."""
COLOURS: dict[str, tuple[int, int, int]] = {
    "red": (220, 30, 30), "green": (30, 160, 50), "blue": (30, 70, 220), "yellow": (235, 200, 20),
}
INSTRUCTIONS = {
    "tick": "Tick every {colour} box and no other, then press OK.",
    "untick": "Untick every {colour} box and leave the others ticked, then press OK.",
}
SUCCESS_REWARD = 1.0
SLACK_STEPS = 2  # steps allowed beyond the shortest solution

BACKGROUND, INK, PAPER = (240, 240, 240), (0, 0, 0), (255, 255, 255)
BUTTON_EDGE = (80, 80, 80)
# (fill, caption): OK is the primary button, dark as in most GUIs, so a screen shows which half it is
# by its shade and not only by a 3x5 caption (the tiny demo policy reads colours, not that glyph)
BUTTON_STYLES = {"OK": ((70, 70, 70), PAPER), "CLEAR": ((205, 205, 205), INK)}

# 3x5 glyphs, drawn 2x without anti-aliasing: the same pixels on every machine and Pillow version.
FONT: dict[str, tuple[str, ...]] = {
    "0": ("111", "101", "101", "101", "111"), "1": ("010", "110", "010", "010", "111"),
    "2": ("111", "001", "111", "100", "111"), "3": ("111", "001", "111", "001", "111"),
    "4": ("101", "101", "111", "001", "001"), "5": ("111", "100", "111", "001", "111"),
    "6": ("111", "100", "111", "101", "111"), "7": ("111", "001", "001", "001", "001"),
    "8": ("111", "101", "111", "101", "111"), "9": ("111", "101", "111", "001", "111"),
    "O": ("111", "101", "101", "101", "111"), "K": ("101", "110", "100", "110", "101"),
    "C": ("111", "100", "100", "100", "111"), "L": ("100", "100", "100", "100", "111"),
    "E": ("111", "100", "111", "100", "111"), "A": ("010", "101", "111", "101", "101"),
    "R": ("110", "101", "110", "101", "101"),
}
SCALE = 2


class ActionError(ValueError):
    """An action that cannot be read or hits no widget; the message is what the model reads."""


@dataclass(frozen=True)
class Widget:
    label: int
    kind: str  # "checkbox" or "button"
    box: tuple[int, int, int, int]  # x1, y1, x2, y2 in screen pixels, x2 and y2 excluded
    colour: str | None = None  # checkboxes
    text: str | None = None  # buttons: "OK" or "CLEAR"


@dataclass(frozen=True)
class GuiTask:
    kind: str
    colour: str
    widgets: tuple[Widget, ...]
    initial: frozenset[int]  # labels of the boxes ticked at the start
    goal: frozenset[int]  # labels of the boxes that must be ticked when OK is pressed
    max_steps: int

    @property
    def instruction(self) -> str:
        return INSTRUCTIONS[self.kind].format(colour=self.colour)

    @property
    def min_actions(self) -> int:
        """n: a toggle per box that differs from the goal, then OK."""
        return len(self.initial ^ self.goal) + 1

    def button(self, text: str) -> Widget:
        return next(w for w in self.widgets if w.text == text)


@dataclass(frozen=True)
class ScreenState:
    ticked: frozenset[int]
    steps: int = 0
    outcome: str | None = None  # None while the episode runs; "success", "failed" or "step_limit"


@dataclass(frozen=True)
class Click:
    label: int | None = None
    point: tuple[float, float] | None = None


@dataclass(frozen=True)
class StepResult:
    state: ScreenState
    reward: float
    message: str


# ------------------------------------------------------------------ tasks


def layout_task(kind: str, colour: str, boxes: list[tuple[int, str]], ok_left: bool,
                max_steps: int | None = None) -> GuiTask:
    """The task with checkboxes ``boxes`` = (cell, colour) (cells 0-11, row-major over the top three
    rows) and OK on the left or right of the bottom row; labels follow reading order."""
    if kind not in KINDS:
        raise ValueError(f"unknown GUI task {kind!r}; known: {list(KINDS)}")
    if colour not in COLOURS or any(c not in COLOURS for _, c in boxes):
        raise ValueError(f"GUI colours are {list(COLOURS)}, got {colour!r} and boxes {boxes}")
    widgets = []
    for label, (cell, box_colour) in enumerate(sorted(boxes), start=1):
        x, y = (cell % COLUMNS) * CELL, (cell // COLUMNS) * CELL
        widgets.append(Widget(label, "checkbox", (x, y, x + CELL, y + CELL), colour=box_colour))
    half, top = SCREEN // 2, BOX_ROWS * CELL
    for offset, text in enumerate(("OK", "CLEAR") if ok_left else ("CLEAR", "OK")):
        box = (offset * half, top, (offset + 1) * half, SCREEN)
        widgets.append(Widget(len(widgets) + 1, "button", box, text=text))
    chosen = frozenset(w.label for w in widgets if w.colour == colour)
    every = frozenset(w.label for w in widgets if w.kind == "checkbox")
    initial, goal = (frozenset(), chosen) if kind == "tick" else (every, every - chosen)
    task = GuiTask(kind, colour, tuple(widgets), initial, goal, max_steps=0)
    steps = task.min_actions + SLACK_STEPS if max_steps is None else int(max_steps)
    if steps < 1:
        raise ValueError(f"max_steps must be at least 1, got {max_steps}")
    return dataclasses.replace(task, max_steps=steps)


def make_task(seed: int, kind: str, max_steps: int | None = None, layout: str = "random",
              colour: str | None = None) -> GuiTask:
    """The task of ``seed`` in ``layout`` (LAYOUTS): random, 3-5 boxes in random cells, 1-4 of them
    (never all) of the task's colour; row, 4 boxes in the top row's cells, 1-3 of them of the colour.
    The task's colour is drawn from the seed unless ``colour`` names it."""
    if layout not in LAYOUTS:
        raise ValueError(f"unknown GUI layout {layout!r}; known: {list(LAYOUTS)}")
    if colour is not None and colour not in COLOURS:
        raise ValueError(f"GUI colours are {list(COLOURS)}, got {colour!r}")
    rng = random.Random(seed)
    count = COLUMNS if layout == "row" else rng.randint(3, 5)
    chosen = rng.randint(1, min(4, count - 1))
    names = sorted(COLOURS)
    drawn = rng.choice(names)  # drawn even when given, so the rest of the screen is the seed's either way
    colour = colour or drawn
    colours = [colour] * chosen + [rng.choice([c for c in names if c != colour]) for _ in range(count - chosen)]
    rng.shuffle(colours)
    cells = list(range(COLUMNS)) if layout == "row" else sorted(rng.sample(range(BOX_ROWS * COLUMNS), count))
    return layout_task(kind, colour, list(zip(cells, colours)), ok_left=rng.random() < 0.5, max_steps=max_steps)


def task_of_row(row: dict) -> GuiTask:
    """The task a data row starts: its ``seed`` and ``task``; ``max_steps``, ``layout`` and ``colour`` if
    given (random layout and the seed's colour when absent, as in the rows of builtin:synthetic-gui)."""
    missing = [key for key in ("seed", "task") if key not in row]
    if missing:
        raise ValueError(f"GuiEnvironment: the data row has no {' and no '.join(missing)} column; use the rows of "
                         "builtin:synthetic-gui or give each row a 'seed' (integer) and a 'task' (tick or untick)")
    layout = row.get("layout") or "random"
    if layout not in LAYOUTS:
        raise ValueError(f"GuiEnvironment: the data row's layout column is {layout!r}; known: {list(LAYOUTS)} "
                         "(builtin:synthetic-gui-row has row, rows without the column are random)")
    colour = row.get("colour")
    if colour is not None and colour not in COLOURS:
        raise ValueError(f"GuiEnvironment: the data row's colour column is {colour!r}; known: {list(COLOURS)} "
                         "(leave it out for the seed's colour)")
    return make_task(int(row["seed"]), str(row["task"]), row.get("max_steps"), layout, colour)


def solution(task: GuiTask) -> str:
    """A shortest solution: the boxes to toggle, in label order, then OK."""
    labels = [*sorted(task.initial ^ task.goal), task.button("OK").label]
    return " ".join(f"click({label})" for label in labels)


# ------------------------------------------------------------------ actions

_ACTION = re.compile(r"\bclick\s*\(([^()]*)\)")
_NUMBER = re.compile(r"\d+(\.\d+)?")


def parse_action(text: str) -> Click:
    """The one ``click(N)`` or ``click(X, Y)`` in ``text``; ActionError says what is wrong."""
    found = _ACTION.findall(text)
    if not found:
        raise ActionError("no action found; write one action, e.g. click(3) or click(40, 60)")
    if len(found) > 1:
        raise ActionError(f"write one action per turn, found {len(found)}")
    args = [a.strip() for a in found[0].split(",")]
    if len(args) == 1 and args[0].isdigit():
        return Click(label=int(args[0]))
    if len(args) == 2 and all(_NUMBER.fullmatch(a) for a in args):
        return Click(point=(float(args[0]), float(args[1])))
    raise ActionError(f"click({found[0]}) is neither click(N) with a widget number nor click(X, Y) with pixel coordinates")


def hit_test(widgets: tuple[Widget, ...], x: float, y: float) -> Widget | None:
    return next((w for w in widgets if w.box[0] <= x < w.box[2] and w.box[1] <= y < w.box[3]), None)


def clicked_widget(task: GuiTask, click: Click) -> Widget:
    if click.label is not None:
        found = next((w for w in task.widgets if w.label == click.label), None)
        if found is None:
            raise ActionError(f"there is no widget {click.label}; the widgets are numbered 1 to {len(task.widgets)}")
        return found
    x, y = click.point
    if not (0 <= x < SCREEN and 0 <= y < SCREEN):
        raise ActionError(f"({x:g}, {y:g}) is outside the {SCREEN}x{SCREEN} screen")
    found = hit_test(task.widgets, x, y)
    if found is None:
        raise ActionError(f"there is no widget at ({x:g}, {y:g})")
    return found


# ------------------------------------------------------------------ transitions


def wrong_boxes(task: GuiTask, ticked: frozenset[int]) -> int:
    return len(ticked ^ task.goal)


def advance(task: GuiTask, state: ScreenState, action: str) -> StepResult:
    """One step of a running episode: the new state, the step's reward and what the model reads."""
    if state.outcome is not None:
        raise ValueError(f"the episode has ended ({state.outcome}); reset before stepping again")
    steps, n = state.steps + 1, task.min_actions
    try:
        widget = clicked_widget(task, parse_action(action))
    except ActionError as err:
        return _count_step(task, ScreenState(state.ticked, steps), 0.0, f"Error: {err}.")
    if widget.text == "OK":
        if state.ticked == task.goal:
            return StepResult(ScreenState(state.ticked, steps, "success"), 1 / n + SUCCESS_REWARD, "Task complete.")
        return StepResult(ScreenState(state.ticked, steps, "failed"), 0.0,
                          "OK was pressed before the task was complete: the episode ends.")
    if widget.text == "CLEAR":
        ticked, message = frozenset(), "Every box is now unticked."
    else:
        ticked = state.ticked ^ {widget.label}
        message = f"Box {widget.label} is now {'ticked' if widget.label in ticked else 'unticked'}."
    reward = (wrong_boxes(task, state.ticked) - wrong_boxes(task, ticked)) / n
    return _count_step(task, ScreenState(ticked, steps), reward, message)


def _count_step(task: GuiTask, state: ScreenState, reward: float, message: str) -> StepResult:
    if state.steps >= task.max_steps:
        ended = dataclasses.replace(state, outcome="step_limit")
        return StepResult(ended, reward, f"{message} The step limit ({task.max_steps}) is reached: the episode ends.")
    return StepResult(state, reward, message)


# ------------------------------------------------------------------ rendering


def text_width(text: str, gap: int = SCALE) -> int:
    return len(text) * (3 * SCALE + gap) - gap


def draw_text(draw: ImageDraw.ImageDraw, text: str, x: int, y: int, fill: tuple[int, int, int], gap: int = SCALE) -> None:
    """``text`` in the 3x5 font at SCALE, top left corner at (x, y), glyphs ``gap`` px apart."""
    for k, char in enumerate(text):
        for row, bits in enumerate(FONT[char]):
            for col, bit in enumerate(bits):
                if bit == "1":
                    px, py = x + k * (3 * SCALE + gap) + col * SCALE, y + row * SCALE
                    draw.rectangle((px, py, px + SCALE - 1, py + SCALE - 1), fill=fill)


def label_origin(widget: Widget) -> tuple[int, int]:
    """Top left corner of the label's first glyph: its tag is a black box around it."""
    x, y = widget.box[:2]
    return (x + 3, y + 2) if widget.kind == "checkbox" else (x + 6, y + 9)


def _draw_checkbox(draw: ImageDraw.ImageDraw, widget: Widget, ticked: bool) -> None:
    x, y = widget.box[:2]
    colour = COLOURS[widget.colour]
    draw.rectangle((x + 11, y + 9, x + 26, y + 24), fill=colour)  # 16x16, a 3 px frame around the inside
    if ticked:  # the inside stays the colour, with a white check mark
        draw.line([(x + 15, y + 16), (x + 17, y + 19), (x + 22, y + 13)], fill=PAPER, width=2)
    else:
        draw.rectangle((x + 14, y + 12, x + 23, y + 21), fill=PAPER)


def _draw_button(draw: ImageDraw.ImageDraw, widget: Widget) -> None:
    x, y = widget.box[:2]
    fill, caption = BUTTON_STYLES[widget.text]
    draw.rectangle((x + 2, y + 2, x + 53, y + 25), fill=fill, outline=BUTTON_EDGE)
    # the caption is centred between the label's tag (ending at x + 12) and the right edge
    width = text_width(widget.text, gap=1)
    draw_text(draw, widget.text, x + 16 + (37 - width) // 2, y + 9, caption, gap=1)


def render_screen(task: GuiTask, ticked: frozenset[int]) -> Image.Image:
    image = Image.new("RGB", (SCREEN, SCREEN), BACKGROUND)
    draw = ImageDraw.Draw(image)
    for widget in task.widgets:
        if widget.kind == "checkbox":
            _draw_checkbox(draw, widget, widget.label in ticked)
        else:
            _draw_button(draw, widget)
        lx, ly = label_origin(widget)
        digits = str(widget.label)
        draw.rectangle((lx - 2, ly - 1, lx + text_width(digits) + 1, ly + 5 * SCALE), fill=INK)
        draw_text(draw, digits, lx, ly, PAPER)
    return image


# ------------------------------------------------------------------ the environment contract


class GuiEnvironment:
    """Every step answers [screenshot, text]; the episode ends on OK or at the step limit. Info:
    ``state_key``; a step's also ``outcome`` (None, success, failed or step_limit) and ``success``."""

    def reset(self, row: dict) -> dict:
        """row: the data row's columns; ``seed`` and ``task`` rebuild its screen (``max_steps``, ``layout``: optional)."""
        self.start(task_of_row(row))
        return {"state_key": self.state_key()}

    def start(self, task: GuiTask) -> None:
        self.task, self.state = task, ScreenState(task.initial)

    def screenshot(self) -> Image.Image:
        return render_screen(self.task, self.state.ticked)

    def state_key(self) -> str:
        """The screen's identity: the ticked boxes (the step count is not on the screen)."""
        return "ticked " + ",".join(str(label) for label in sorted(self.state.ticked))

    def step(self, action: str):
        """action: the text of the model's turn. Returns ([screenshot, message], done, reward, info)."""
        if self.state.outcome is not None:
            return None, True, 0.0, self.info()
        result = advance(self.task, self.state, action)
        self.state = result.state
        return [self.screenshot(), result.message], self.state.outcome is not None, result.reward, self.info()

    def info(self) -> dict:
        outcome = self.state.outcome
        return {"state_key": self.state_key(), "outcome": outcome, "success": outcome == "success"}
