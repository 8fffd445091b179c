"""The easyvlm cache directory and an atomic "build once" helper for the assets the project builds.

Layout: ``$EASYVLM_CACHE`` (default ``~/.cache/easyvlm``) / ``<kind>`` / ``<name>-<version>``.
A finished entry is a directory that appeared in one ``os.rename``: a reader never sees half an
entry, and two processes that build the same entry at once both succeed (the loser's rename fails
because the target exists; it discards its own copy and uses the winner's).
"""

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
    """Return ``target``, calling ``build(tmp_dir)`` first if it does not exist yet.

    ``build`` fills an empty temporary directory created next to ``target`` (same file system, so
    the final ``os.rename`` is atomic). If the build raises, the temporary directory is removed and
    the error propagates; ``target`` is left untouched.
    """
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
    """The entry ``<root>/<kind>/<name>`` of another machine's cache, in this machine's cache.

    Entries are named by what they hold (name, build version, key), so the same name means the same
    build on every machine; only the root differs (``$EASYVLM_CACHE`` of each node)."""
    entry = Path(entry)
    return cache_root() / entry.parent.name / entry.name
