"""The GUI demo's warm start (``builtin:tiny-qwen2.5-vl-gui``, examples/gui.yaml): whole episodes of
the GUI environment (easyvlm.agents.gui), in the layout of the recipe's rows, played by a noisy
scripted expert, trained on with the loss on the model's turns.

The expert, at every step: with probability ``right_rate`` a right action (``click(N)`` on a box
whose state differs from the goal's, chosen at random among them, or OK once none does), else a
click on any widget (OK included, which ends the episode). Its episodes, and the observations after
each action, come from the RL rollout loop itself (easyvlm.agents.loop) with the model's turns
given, so the warm start trains on exactly the tokens, positions and screenshots RL will see.
"""

from __future__ import annotations

import random
from pathlib import Path

from easyvlm.agents.gui import GuiTask, ScreenState, advance, task_of_row

GUI_FORMAT_PROMPT = (
    "{{ content }} One action per turn: click(N) clicks the widget labelled N, click(X, Y) the pixel at X, Y "
    "of the screenshot (from its top left corner). You have {{ max_steps }} steps."
)
"""The GUI demo's format prompt; format_prompts/gui.jinja holds the same text (a test checks)."""
ACTION_TOKENS = tuple(f"click({label})" for label in range(1, 8))
"""Single tokens of the GUI demo's base model: every click(N) of a screen (at most 5 boxes + 2 buttons)."""


def expert_actions(task: GuiTask, rng: random.Random, right_rate: float) -> list[str]:
    """One episode of the noisy expert on ``task``: its actions, up to the one that ends it."""
    state, actions = ScreenState(task.initial), []
    while state.outcome is None:
        wrong = sorted(state.ticked ^ task.goal)
        if rng.random() < right_rate:
            label = rng.choice(wrong) if wrong else task.button("OK").label
        else:
            label = rng.choice([widget.label for widget in task.widgets])
        actions.append(f"click({label})")
        state = advance(task, state, actions[-1]).state
    return actions


def train_gui_warm_start(spec, base: str, processor, model_config, data_file: Path, prompt_file: Path, log):
    """``spec.steps`` steps of ``spec.batch_size`` expert episodes on train rows; returns the model.
    ``spec.answer_rate`` is the expert's ``right_rate``."""
    from easyvlm.agents.gui import GuiEnvironment
    from easyvlm.builtin.sft_steps import episodes_of, start_training, train_on_episodes

    episodes = episodes_of(spec, processor, model_config, data_file, prompt_file, length=1024, environment=GuiEnvironment)
    model, optimizer, rng = start_training(spec, base)
    for step in range(spec.steps):
        picked, rows = episodes.sample(rng, spec.batch_size)
        scripts = [expert_actions(task_of_row(row), rng, spec.answer_rate) for row in rows]
        # the samples still going at turn k are those whose script is longer (in batch order)
        out = episodes.play(picked, lambda k: [script[k] for script in scripts if len(script) > k])
        assert all(t["finish"] == "done" and t["num_turns"] == len(s) for t, s in zip(out["trajectory"], scripts))
        loss = train_on_episodes(model, optimizer, out)
        if step % 20 == 0 or step == spec.steps - 1:
            log(f"easyvlm: warm start {step + 1}/{spec.steps}: loss {loss:.3f}")
    return model
