"""The easyvlm cache (``<root>/<kind>/<name>-<version>``) and an atomic build-once: an entry appears in
one ``os.rename``, so readers never see half of one and concurrent builders both succeed."""

from __future__ import annotations

import errno
import os
import shutil
import tempfile
from pathlib import Path
from typing import Callable

DEFAULT_CACHE_DIR = "~/.cache/easyvlm"


def cache_root(cache_dir: str | os.PathLike | None = None) -> Path:
    """``cache_dir`` if given, else ``$EASYVLM_CACHE``, else ``~/.cache/easyvlm`` (not created)."""
    if cache_dir is None:
        cache_dir = os.environ.get("EASYVLM_CACHE") or DEFAULT_CACHE_DIR
    return Path(cache_dir).expanduser().resolve()


def build_once(target: Path, build: Callable[[Path], None]) -> Path:
    """``target``, built first by ``build(tmp_dir)`` into a fresh directory beside it if missing; on an error
    the temporary directory is removed and ``target`` is untouched."""
    target = Path(target)
    if target.is_dir():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
    try:
        build(tmp)
        os.chmod(tmp, 0o755)  # mkdtemp makes it private (0o700); the cache may be shared
        try:
            os.rename(tmp, target)
        except OSError as err:
            # Another process finished first: its entry is as good as ours.
            if err.errno not in (errno.EEXIST, errno.ENOTEMPTY) or not target.is_dir():
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return target


def same_entry_here(entry: str | os.PathLike) -> Path:
    """Another machine's cache entry ``<root>/<kind>/<name>`` under this machine's root."""
    entry = Path(entry)
    return cache_root() / entry.parent.name / entry.name
