"""The built-in GUI-style environment (easyvlm.agents.gui, docs/agents.md): numbered checkboxes and
buttons on a 112x112 screenshot, tasks of 2-5 clicks, ``click(N)`` or ``click(X, Y)`` per turn.
Its rows are ``builtin:synthetic-gui@train`` / ``@val``, its format prompt format_prompts/gui.jinja.

worker.rollout.environment=examples/environments/gui.py:GuiEnvironment
"""

from easyvlm.agents.gui import GuiEnvironment

__all__ = ["GuiEnvironment"]
