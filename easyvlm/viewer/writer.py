"""``RolloutWriter``: writes viewer pages in a background thread of the driver, off the training
step's path. At most ``MAX_PENDING`` pages wait (then the step waits, rather than memory grow); a page
that fails to write is reported on stderr and skipped, and ``close`` counts the lost ones."""

from __future__ import annotations

import copy
import queue
import sys
import threading
import traceback
from pathlib import Path
from typing import Any, Callable, Sequence

from easyvlm.viewer.pages import write_page
from easyvlm.viewer.records import RolloutCapture, RolloutSample, build_samples

MAX_PENDING = 2
# (step, split, samples, root, page name) -> None: e.g. Tracker.log_rollouts
PageCallback = Callable[[int, str, Sequence[RolloutSample], Path, str], None]


def page_name(split: str, step: int) -> str:
    return f"step_{step}" if split == "train" else f"{split}_step_{step}"


def page_title(split: str, step: int) -> str:
    return {"train": "training rollouts", "val": "validation"}.get(split, split) + f", step {step}"


class RolloutWriter:
    def __init__(self, root: Path, tokenizer: Any, skip_special_tokens: bool = True, on_page: PageCallback | None = None):
        self.root = Path(root)
        # the driver's tokenizer is used by the main thread meanwhile; a Rust tokenizer shared
        # across threads can fail with "Already borrowed", so this thread decodes with its own copy
        self.tokenizer = copy.deepcopy(tokenizer)
        self.skip_special_tokens = skip_special_tokens
        self.on_page = on_page
        self.failures = 0
        self.written: list[Path] = []
        self._queue: queue.Queue = queue.Queue(maxsize=MAX_PENDING)
        self._thread = threading.Thread(target=self._run, name="easyvlm-rollout-writer", daemon=True)
        self._thread.start()

    def submit(self, captures: Sequence[RolloutCapture]) -> None:
        """Queue one page: the captures of one step (validation: one per validation batch)."""
        if captures:
            self._queue.put(list(captures))

    def close(self) -> None:
        """Write what is queued, then stop the thread."""
        self._queue.put(None)
        self._thread.join()
        if self.failures:
            print(f"easyvlm: rollout viewer: {self.failures} page(s) could not be written (see the errors above)", file=sys.stderr, flush=True)

    def _run(self) -> None:
        while True:
            captures = self._queue.get()
            if captures is None:
                return
            try:
                self.write(captures)
            except Exception:  # noqa: BLE001 - a lost page must not stop training
                self.failures += 1
                print(f"easyvlm: rollout viewer: could not write the page of step {captures[0].step}:\n{traceback.format_exc()}", file=sys.stderr, flush=True)

    def write(self, captures: Sequence[RolloutCapture]) -> Path:
        """Write one page now (the thread's work; also callable directly)."""
        first = captures[0]
        samples = [s for c in captures for s in build_samples(c, self.tokenizer, self.root, self.skip_special_tokens)]
        name = page_name(first.split, first.step)
        path = write_page(samples, self.root, name, page_title(first.split, first.step))
        self.written.append(path)
        if self.on_page is not None:
            self.on_page(first.step, first.split, samples, self.root, name)
        return path
