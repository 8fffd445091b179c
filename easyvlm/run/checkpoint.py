"""Checkpoint directories under ``save_dir`` (EasyR1's names: ``global_step_<N>/``, ``latest_checkpointed_iteration.txt``):
atomic commit (written into ``.global_step_<N>.partial``, renamed when complete, then the pointer replaced: a crash never
leaves a half-written one as latest), latest lookup, pruning that keeps the best and the latest, manifest checks.
Model-only checkpoints cannot resume. docs/cluster.md, "Checkpoints need shared storage"; docs/security.md."""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from easyvlm.utils.safe_state import CONVERT_COMMAND

POINTER = "latest_checkpointed_iteration.txt"
MANIFEST = "MANIFEST.json"
MANIFEST_FORMAT = 1
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
        write_manifest(partial)
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


# ------------------------------------------------------------------------------------------------
# Manifest: what a complete checkpoint holds, checked before anything loads it

_CHUNK = 8 << 20


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            digest.update(chunk)  # hashlib releases the GIL on large updates: files hash in parallel
    return digest.hexdigest()


def _hash_all(paths: list[Path]) -> list[str]:
    total = sum(p.stat().st_size for p in paths if p.is_file())
    if total > 1 << 30:  # progress for large checkpoints: hashing runs at about 1 GB/s per thread
        sys.stderr.write(f"easyvlm: hashing {len(paths)} checkpoint files ({total / (1 << 30):.1f} GiB)\n")
    with ThreadPoolExecutor(max_workers=min(8, os.cpu_count() or 1)) as pool:
        return list(pool.map(_sha256, paths))


def write_manifest(path: Path) -> None:
    """Write ``path/MANIFEST.json``: the relative path, size and SHA-256 of every other file."""
    files = sorted(p for p in path.rglob("*") if p.is_file() and p.name != MANIFEST)
    hashes = _hash_all(files)
    entries = {
        p.relative_to(path).as_posix(): {"size": p.stat().st_size, "sha256": h} for p, h in zip(files, hashes)
    }
    (path / MANIFEST).write_text(json.dumps({"format": MANIFEST_FORMAT, "files": entries}, indent=1))


def read_manifest(path: Path) -> dict[str, dict]:
    """The file entries of ``path/MANIFEST.json``; `CheckpointError` when it is missing or unreadable."""
    manifest = path / MANIFEST
    if not manifest.is_file():
        raise CheckpointError(
            f"{path} has no {MANIFEST}: it was written by an easyvlm version older than its safe-state format "
            f"(whose state files a safe load refuses), or by another tool. If you trust where it came from, "
            f"convert it once: {CONVERT_COMMAND} {path}"
        )
    try:
        entries = json.loads(manifest.read_text())["files"]
        if not isinstance(entries, dict) or not all(isinstance(e.get("size"), int) and isinstance(e.get("sha256"), str) for e in entries.values()):
            raise ValueError("entries are not {path: {size, sha256}}")
    except (ValueError, KeyError, TypeError, AttributeError) as err:
        raise CheckpointError(f"{manifest} is damaged ({err}); the checkpoint cannot be verified: use another one") from None
    return entries


def verify_checkpoint(path: Path, under: str | None = None) -> None:
    """Check ``path`` against its manifest (size and hash of every file) and that each state file loads safely;
    ``under``: only the files below this relative directory. Raises `CheckpointError` naming every failing file."""
    from easyvlm.utils.safe_state import UnsafeStateError, load_state, read_dcp_metadata

    entries = read_manifest(path)
    if under is not None:
        entries = {k: v for k, v in entries.items() if k.startswith(under.rstrip("/") + "/")}
    problems, present = [], []
    for rel, entry in entries.items():
        file = path / rel
        if not file.is_file():
            problems.append(f"{file} is missing")
        elif (size := file.stat().st_size) != entry["size"]:
            problems.append(f"{file} has {size} bytes, the manifest {entry['size']} ({'truncated' if size < entry['size'] else 'grown'})")
        else:
            present.append((file, entry))
    for (file, entry), digest in zip(present, _hash_all([f for f, _ in present])):
        if digest != entry["sha256"]:
            problems.append(f"{file} was altered (its SHA-256 differs from the manifest's)")
    if not problems:
        for file, _ in present:
            try:
                if file.suffix == ".pt":
                    load_state(file)
                elif file.name.endswith(".metadata"):
                    read_dcp_metadata(file)
            except UnsafeStateError as err:
                problems.append(str(err))
    if problems:
        raise CheckpointError(f"checkpoint {path} failed verification:\n  - " + "\n  - ".join(problems))


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


def resume_checkpoint(load_checkpoint_path: str | None, find_last_checkpoint: bool, save_dir: Path) -> Path | None:
    """The checkpoint a run resumes from, checked: ``trainer.load_checkpoint_path``, else with
    ``trainer.find_last_checkpoint`` the newest in ``save_dir``, else None. Raises `CheckpointError`
    for a model-only checkpoint or one that fails :func:`verify_checkpoint`."""
    if load_checkpoint_path:
        path = resolve_checkpoint(load_checkpoint_path)
    elif find_last_checkpoint and save_dir.is_dir():
        path = latest_checkpoint(save_dir)
    else:
        path = None
    if path is not None:
        verify_checkpoint(path)  # first: check_resumable reads COMPLETE, which may be damaged
        check_resumable(path)
    return path
