"""The GUI demo's warm start (``builtin:tiny-qwen3-vl-gui``, examples/gui.yaml), in two phases
(why two: docs/benchmarks.md, "The GUI demo's warm start").

1. Screens: single first-turn prompts (the demo's format prompt and one screenshot) of train tasks
   at their first state, a random tick state or the goal, each with one target: the expert's click.
   This is where the model learns to read the screen; on whole episodes from the start it does not.
2. Episodes: whole episodes of the GUI environment, in the layout of the recipe's rows, played by the
   expert through the RL rollout loop with its turns given (the loss on the model's turns), so the
   model sees exactly the tokens, positions and screenshots RL will see, and learns to act on the
   newest screenshot after earlier turns.

The expert, at every step: with probability ``right_rate`` the lowest-labelled box whose state differs
from the goal's (``click(N)``), or OK once none does; else a click on any widget (OK included, which
ends the episode). A fixed order among the right boxes: with a random one the targets of a screen are
ambiguous and the tiny model stays at chance (docs/benchmarks.md).
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path

from easyvlm.agents.gui import GuiTask, ScreenState, advance, make_task, render_screen, task_of_row

GUI_FORMAT_PROMPT = (
    "{{ content }} One action per turn: click(N) clicks the widget labelled N, click(X, Y) the pixel at X, Y "
    "of the screenshot (from its top left corner). You have {{ max_steps }} steps."
)
"""The GUI demo's format prompt; format_prompts/gui.jinja holds the same text (a test checks)."""
ACTION_TOKENS = tuple(f"click({label})" for label in range(1, 8))
"""Single tokens of the GUI demo's base model: every click(N) of a screen (at most 5 boxes + 2 buttons)."""
IMAGE = "<|vision_start|><|image_pad|><|vision_end|>"  # a Qwen-VL chat's image, as the data pipeline writes it


@dataclass(frozen=True)
class GuiWarmStartSpec:
    base: str
    dataset: str  # a builtin:synthetic-gui* data set: its layout and colour, its train rows
    screen_steps: int
    screen_batch_size: int
    episode_steps: int
    batch_size: int  # episodes per step
    lr: float  # both phases (each its own AdamW)
    right_rate: float = 1.0  # the episodes' expert
    seed: int = 0
    max_pixels: int | None = None  # data.max_pixels of the prompts (None: the processor's own)


def right_click(task: GuiTask, ticked: frozenset[int]) -> int:
    """The expert's right action on a screen: the lowest-labelled box that differs from the goal, else OK."""
    wrong = sorted(ticked ^ task.goal)
    return wrong[0] if wrong else task.button("OK").label


def expert_actions(task: GuiTask, rng: random.Random, right_rate: float) -> list[str]:
    """One episode of the noisy expert on ``task``: its actions, up to the one that ends it."""
    state, actions = ScreenState(task.initial), []
    while state.outcome is None:
        right = rng.random() < right_rate
        label = right_click(task, state.ticked) if right else rng.choice([widget.label for widget in task.widgets])
        actions.append(f"click({label})")
        state = advance(task, state, actions[-1]).state
    return actions


def first_turn_text(tokenizer, task: GuiTask) -> str:
    """The chat text up to the assistant's first token, as the data pipeline renders the task's row."""
    prompt = GUI_FORMAT_PROMPT.replace("{{ content }}", IMAGE + task.instruction).replace("{{ max_steps }}", str(task.max_steps))
    return tokenizer.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False, add_generation_prompt=True)


def screen_sample(rng: random.Random, layout: str, colour: str | None) -> tuple[GuiTask, frozenset[int], int]:
    """(task, the boxes ticked on the screen, the expert's label) for one phase-1 sample: a task of the
    train split (the val and test tasks stay held out), at its first state, a random one or its goal."""
    from easyvlm.builtin.synthetic_gui import split_of_task

    task = make_task(rng.getrandbits(31), rng.choice(["tick", "untick"]), layout=layout, colour=colour)
    while split_of_task(task) != "train":
        task = make_task(rng.getrandbits(31), rng.choice(["tick", "untick"]), layout=layout, colour=colour)
    boxes, state = [w.label for w in task.widgets if w.kind == "checkbox"], rng.random()
    if state < 0.45:
        ticked = task.initial
    elif state < 0.9:
        ticked = frozenset(b for b in boxes if rng.random() < 0.5)
    else:  # the goal reached: press OK, not CLEAR (left or right; a random state rarely asks for it)
        ticked = task.goal
    return task, ticked, right_click(task, ticked)


def train_on_screens(model, optimizer, processor, samples: list[tuple[GuiTask, frozenset[int], int]]) -> float:
    """One supervised step on single screens: the loss on each target's click token and EOS."""
    import torch

    from easyvlm.builtin.sft_steps import train_step

    texts = [first_turn_text(processor.tokenizer, task) + f"click({label})<|im_end|>" for task, _, label in samples]
    inputs = processor(text=texts, images=[render_screen(task, ticked) for task, ticked, _ in samples],
                       return_tensors="pt", padding=True)
    labels = torch.full_like(inputs["input_ids"], -100)
    for row, mask in enumerate(inputs["attention_mask"]):
        last_two = mask.nonzero().flatten()[-2:]  # the click token and EOS, whichever side the padding is on
        labels[row, last_two] = inputs["input_ids"][row, last_two]
    return train_step(model, optimizer, **inputs, labels=labels)


def train_gui_warm_start(spec: GuiWarmStartSpec, base: str, processor, model_config, data_file: Path,
                         prompt_file: Path, log):
    """The two phases on ``spec.dataset``'s screens and train rows; returns the model."""
    import torch

    from easyvlm.agents.gui import GuiEnvironment
    from easyvlm.builtin.sft_steps import episodes_of, start_training, train_on_episodes
    from easyvlm.builtin.synthetic_gui import DATASETS

    layout, colour = DATASETS[spec.dataset]
    model, optimizer, rng = start_training(spec, base)
    for step in range(spec.screen_steps):
        loss = train_on_screens(model, optimizer, processor, [screen_sample(rng, layout, colour) for _ in range(spec.screen_batch_size)])
        if step % 50 == 0 or step == spec.screen_steps - 1:
            log(f"easyvlm: warm start, screens {step + 1}/{spec.screen_steps}: loss {loss:.3f}")

    episodes = episodes_of(spec, processor, model_config, data_file, prompt_file, length=1024, environment=GuiEnvironment)
    optimizer, rng = torch.optim.AdamW(model.parameters(), lr=spec.lr, weight_decay=0.0), random.Random(spec.seed)
    for step in range(spec.episode_steps):
        picked, rows = episodes.sample(rng, spec.batch_size)
        scripts = [expert_actions(task_of_row(row), rng, spec.right_rate) for row in rows]
        out = episodes.play_scripts(picked, scripts)
        assert all(t["finish"] == "done" and t["num_turns"] == len(s) for t, s in zip(out["trajectory"], scripts))
        loss = train_on_episodes(model, optimizer, out)
        if step % 20 == 0 or step == spec.episode_steps - 1:
            log(f"easyvlm: warm start, episodes {step + 1}/{spec.episode_steps}: loss {loss:.3f}")
    return model
