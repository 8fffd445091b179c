"""build_once: builds once, atomically, and tolerates a concurrent builder."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest

from easyvlm.utils.cache import build_once, cache_root


def _leftovers(parent: Path) -> list[str]:
    return sorted(p.name for p in parent.iterdir() if ".tmp-" in p.name)


def test_builds_once(tmp_path):
    calls = []

    def build(out: Path) -> None:
        calls.append(out)
        (out / "data.txt").write_text("built")

    target = tmp_path / "models" / "m-v1"
    assert build_once(target, build) == target
    assert build_once(target, build) == target
    assert len(calls) == 1
    assert (target / "data.txt").read_text() == "built"
    assert _leftovers(target.parent) == []


def test_losing_a_race_keeps_the_winner(tmp_path):
    target = tmp_path / "m-v1"

    def build(out: Path) -> None:
        (out / "data.txt").write_text("loser")
        target.mkdir()  # another process renamed its finished build into place meanwhile
        (target / "data.txt").write_text("winner")

    assert build_once(target, build) == target
    assert (target / "data.txt").read_text() == "winner"
    assert _leftovers(tmp_path) == []


def test_concurrent_builders(tmp_path):
    target = tmp_path / "m-v1"
    barrier = threading.Barrier(2)

    def build(out: Path) -> None:
        barrier.wait()  # both threads are building at the same time
        (out / "data.txt").write_text(threading.current_thread().name)
        time.sleep(0.05)

    results, errors = [], []

    def worker() -> None:
        try:
            results.append(build_once(target, build))
        except Exception as err:  # noqa: BLE001 - reported below
            errors.append(err)

    threads = [threading.Thread(target=worker, name=f"builder{i}") for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == [] and results == [target, target]
    assert (target / "data.txt").read_text() in {"builder0", "builder1"}
    assert _leftovers(tmp_path) == []


def test_failed_build_leaves_nothing(tmp_path):
    target = tmp_path / "m-v1"

    def build(out: Path) -> None:
        (out / "half.txt").write_text("...")
        raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        build_once(target, build)
    assert not target.exists() and _leftovers(tmp_path) == []


def test_cache_root_precedence(tmp_path, monkeypatch):
    monkeypatch.setenv("EASYVLM_CACHE", str(tmp_path / "env"))
    assert cache_root(tmp_path / "explicit") == tmp_path / "explicit"
    assert cache_root() == tmp_path / "env"
    monkeypatch.delenv("EASYVLM_CACHE")
    assert cache_root() == Path("~/.cache/easyvlm").expanduser().resolve()
