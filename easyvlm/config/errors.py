"""`ConfigError`: every problem of a config, each naming its dotted key, reported at once."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence


@dataclass(frozen=True)
class Problem:
    key: str
    """Full dotted key, e.g. ``worker.actor.global_batch_size`` (``config`` for the file itself)."""
    message: str
    """What is wrong and how to fix it."""

    def __str__(self) -> str:
        return f"{self.key}: {self.message}"


def format_problems(problems: Sequence[Problem]) -> str:
    """One ``  - key: message`` line per problem."""
    return "\n".join(f"  - {p}" for p in problems)


class ConfigError(ValueError):
    """The config has problems; ``.problems`` lists them all, ``str()`` prints one per line."""

    def __init__(self, problems: Sequence[Problem]):
        self.problems: list[Problem] = list(problems)
        count = len(self.problems)
        super().__init__(f"{count} problem{'s' if count != 1 else ''} in the config:\n{format_problems(self.problems)}")
