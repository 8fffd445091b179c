"""A two-step environment: the model answers, sees its image again with its first answer, and
answers once more. Small on purpose: it shows the environment contract (easyvlm.agents.environment,
docs/agents.md) and is what the end-to-end test trains.

worker.rollout.environment=examples/environments/look_again.py:LookAgain
"""

from __future__ import annotations

from PIL import Image


class LookAgain:
    def reset(self, row: dict) -> None:
        """row: the data row's extra columns and its ``ground_truth``."""
        self.answer = str(row["ground_truth"]).strip().lower()
        self.turns = 0

    def step(self, action: str):
        """action: the text of the model's turn. Returns (observation, done, reward)."""
        self.turns += 1
        correct = float(action.strip().lower() == self.answer)
        if self.turns == 1:
            hint = Image.new("RGB", (56, 56), (128, 128, 128))  # an image observation mid-trajectory
            return [hint, f"You said {action.strip()[:20]!r}. Look again and answer in one word."], False, correct
        return None, True, correct
