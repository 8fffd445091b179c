"""Checkpoint directories: atomic commit, latest lookup, and pruning that keeps the best and the latest.

Layout under ``save_dir`` (EasyR1's names, so its tooling finds them)::

    global_step_<N>/                 one complete checkpoint (workers write actor/, critic/ inside)
        trainer_state.pt             step, dataloader position, RNG states, KL controller, val score
        COMPLETE                     written last, before the rename
    latest_checkpointed_iteration.txt

With ``trainer.save_model_only`` a checkpoint holds only ``actor/huggingface/`` (the policy in
Hugging Face format, loadable by transformers and vLLM) and ``COMPLETE`` (which records
``"model_only": true``): no optimizer, scheduler, critic, data-loader or RNG state, so training
cannot resume from it. Resuming from one (automatically or via ``load_checkpoint_path``) raises a
`CheckpointError` that says how to start a new run from its weights instead.

Atomicity: everything is written into ``.global_step_<N>.partial`` and renamed to ``global_step_<N>``
only when complete, then the pointer file is replaced (write + ``os.replace``). A crash at any moment
leaves either the previous checkpoint as latest or the new one, never a half-written one; leftover
``.partial`` directories are removed at the next start.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path

from easyvlm.config.schema import TrainerConfig

POINTER = "latest_checkpointed_iteration.txt"
HF_EXPORT_DIR = "actor/huggingface"  # inside a checkpoint: the policy in Hugging Face format
_STEP_DIR = re.compile(r"^global_step_(\d+)$")


class CheckpointError(RuntimeError):
    pass


class CheckpointManager:
    def __init__(self, save_dir: str | Path, save_limit: int = -1):
        self.save_dir = Path(save_dir)
        self.save_limit = save_limit
        self.save_dir.mkdir(parents=True, exist_ok=True)
        for partial in self.save_dir.glob(".global_step_*.partial"):
            shutil.rmtree(partial, ignore_errors=True)

    def partial_dir(self, step: int) -> Path:
        """Where workers write checkpoint ``step`` before it is committed."""
        path = self.save_dir / f".global_step_{step}.partial"
        shutil.rmtree(path, ignore_errors=True)
        path.mkdir(parents=True)
        return path

    def commit(self, step: int, score: float | None = None, model_only: bool = False) -> Path:
        """Mark ``step`` complete, make it the latest, prune old ones. ``score``: higher is better.
        ``model_only``: the checkpoint holds only the Hugging Face export (``trainer.save_model_only``)."""
        partial = self.save_dir / f".global_step_{step}.partial"
        (partial / "COMPLETE").write_text(json.dumps({"step": step, "score": score, "model_only": model_only}))
        final = self.save_dir / f"global_step_{step}"
        if final.exists():  # re-saving a step after a resume: the new one replaces it
            shutil.rmtree(final)
        os.rename(partial, final)
        tmp = self.save_dir / f".{POINTER}.tmp"
        tmp.write_text(str(step))
        os.replace(tmp, self.save_dir / POINTER)
        self._prune()
        return final

    def completed_steps(self) -> list[int]:
        return completed_steps(self.save_dir)

    def latest(self) -> Path | None:
        return latest_checkpoint(self.save_dir)

    def _score(self, step: int) -> float | None:
        return checkpoint_info(self.save_dir / f"global_step_{step}").get("score")

    def _prune(self) -> None:
        if self.save_limit <= 0:
            return
        steps = self.completed_steps()
        keep = set(steps[-self.save_limit :])
        scored = [(s, self._score(s)) for s in steps]
        scored = [(s, v) for s, v in scored if v is not None]
        if scored:  # the best by validation score survives pruning
            keep.add(max(scored, key=lambda sv: (sv[1], sv[0]))[0])
        for step in steps:
            if step not in keep:
                shutil.rmtree(self.save_dir / f"global_step_{step}", ignore_errors=True)


def resolve_checkpoint(path: str | Path) -> Path:
    """A user's ``load_checkpoint_path``: a ``global_step_N`` dir or a save dir holding several."""
    path = Path(path)
    if (path / "COMPLETE").exists():
        return path
    found = latest_checkpoint(path) if path.is_dir() else None
    if found is not None:
        return found
    raise CheckpointError(
        f"trainer.load_checkpoint_path={str(path)!r} is not a complete checkpoint: expected a "
        f"global_step_<N> directory containing COMPLETE, or a directory holding such checkpoints"
    )


def checkpoint_info(path: Path) -> dict:
    """What ``COMPLETE`` of the checkpoint ``path`` records: step, score, model_only."""
    return json.loads((path / "COMPLETE").read_text())


def check_resumable(path: Path) -> None:
    """Raise `CheckpointError` if the checkpoint ``path`` cannot resume training (model only)."""
    if not checkpoint_info(path).get("model_only", False):
        return
    export = path / HF_EXPORT_DIR
    raise CheckpointError(
        f"cannot resume from {path}: it was saved with trainer.save_model_only=true and holds only the model "
        f"({export}), no optimizer, data-loader or RNG state. To train on from its weights, start a new run "
        f"with worker.actor.model.model_path={export} and another trainer.save_checkpoint_path (or "
        f"trainer.find_last_checkpoint=false); to start over, remove the checkpoint or set "
        f"trainer.find_last_checkpoint=false"
    )


def completed_steps(save_dir: Path) -> list[int]:
    steps = []
    for path in save_dir.iterdir():
        match = _STEP_DIR.match(path.name)
        if match and (path / "COMPLETE").exists():
            steps.append(int(match.group(1)))
    return sorted(steps)


def latest_checkpoint(save_dir: Path) -> Path | None:
    """The newest complete checkpoint under ``save_dir``, or None."""
    pointer = save_dir / POINTER
    if pointer.exists():
        path = save_dir / f"global_step_{pointer.read_text().strip()}"
        if (path / "COMPLETE").exists():
            return path
    steps = completed_steps(save_dir)  # pointer missing or stale: fall back to scanning
    return save_dir / f"global_step_{steps[-1]}" if steps else None


def resume_checkpoint(trainer: TrainerConfig, save_dir: Path) -> Path | None:
    """The checkpoint a run resumes from, checked (the driver calls this before Ray starts):
    ``trainer.load_checkpoint_path``, else with ``trainer.find_last_checkpoint`` the newest one in
    ``save_dir``, else None. Raises `CheckpointError` naming the problem."""
    if trainer.load_checkpoint_path:
        path = resolve_checkpoint(trainer.load_checkpoint_path)
    elif trainer.find_last_checkpoint and save_dir.is_dir():
        path = latest_checkpoint(save_dir)
    else:
        path = None
    if path is not None:
        check_resumable(path)
    return path
