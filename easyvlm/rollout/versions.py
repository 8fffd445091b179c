"""The policy's version on the driver (training updates done) and the one record of which versions'
weights are published and which the engines hold, so weights are sent only when needed. ``cond``
guards it; the asynchronous producers wait on it and keep their own state under it."""

from __future__ import annotations

import threading
from typing import Any

NOT_SYNCED = -1
"""The engines hold no version the driver sent: the model files' weights (start, resume, restart)."""


class PolicyVersions:
    def __init__(self) -> None:
        self.cond = threading.Condition()
        self.current = 0
        """Updates done: the version the trainer trains its next step from."""
        self.held = NOT_SYNCED
        """The version whose weights the rollout engines hold."""
        self.generating = 0
        """The version the generation in progress uses (set under the service's engine lock), which
        an engine restarted during that generation is given again."""
        self._published: dict[int, Any] = {}

    def start(self, version: int) -> None:
        """Training starts (or resumes) at ``version``, nothing published; what the engines hold stays
        (validation before the first step may have synced them)."""
        with self.cond:
            self.current = version
            self._published.clear()
            self.cond.notify_all()

    def advance(self) -> None:
        """One more update done, with no weights published (no later generation needs them)."""
        with self.cond:
            self.current += 1
            self.cond.notify_all()

    def publish(self, version: int, weights: Any) -> None:
        """``version`` becomes current together with its weights (no reader sees one without the other)."""
        with self.cond:
            self.current = version
            self._published[version] = weights
            self.cond.notify_all()

    def weights(self, version: int | None = None) -> tuple[int, Any]:
        """(version, weights): ``version``'s published weights, else the newest ones."""
        with self.cond:
            version = max(self._published) if version is None else version
            return version, self._published[version]

    def published(self, version: int) -> bool:
        with self.cond:
            return version in self._published

    def release_before(self, version: int) -> None:
        """Forget the weights of versions older than ``version``: no later generation uses them."""
        with self.cond:
            for old in [v for v in self._published if v < version]:
                del self._published[old]

    def engines_need(self, version: int) -> bool:
        """Whether the engines must be sent ``version``'s weights before generating with them."""
        return self.held != version

    def engines_hold(self, version: int) -> None:
        self.held = version

    def engines_lost(self) -> None:
        """An engine restarted (or the actor loaded a checkpoint): it holds the model files' weights."""
        self.held = NOT_SYNCED
