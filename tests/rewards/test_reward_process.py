"""ServingProcess: answers requests in a child process; a late child is killed, a dead one reported,
a failed setup raises StartError."""

from __future__ import annotations

import os
import time

import pytest

from easyvlm.rewards.process import ServingProcess, StartError

pytestmark = pytest.mark.slow  # starts processes


def setup_offset(offset: int) -> int:
    return offset


def handle(offset: int, request: str) -> tuple[str, object]:
    if request == "sleep":
        time.sleep(60)
    if request == "exit":
        os._exit(5)
    if request == "unpicklable":
        return "ok", lambda: None
    return "ok", (offset + len(request), os.getpid())


def setup_fails() -> None:
    raise ImportError("no module named nowhere")


def test_requests_timeout_death_and_restart():
    server = ServingProcess(setup_offset, (10,), handle, name="test-server")
    try:
        status, (value, pid) = server.call("abc", timeout=30)
        assert (status, value) == ("ok", 13)  # 10 + len("abc")
        assert server.call("sleep", timeout=0.5) == ("timeout", None)
        status, (value, new_pid) = server.call("ab", timeout=30)  # a new child took over
        assert (status, value) == ("ok", 12) and new_pid != pid
        assert server.call("exit", timeout=30) == ("died", 5)
        status, message = server.call("unpicklable", timeout=30)
        assert status == "unpicklable" and "Can't pickle" in message
        assert server.call("a", timeout=30)[0] == "ok"  # the child survives an unpicklable answer
    finally:
        server.stop()


def test_failed_setup_raises_start_error():
    server = ServingProcess(setup_fails, (), handle, name="test-server")
    with pytest.raises(StartError, match=r"test-server: setup failed in the child process: ImportError: no module named nowhere"):
        server.start()


def setup_slowly(seconds: float) -> float:
    time.sleep(seconds)
    return 0


def test_launched_children_set_up_side_by_side():
    """Two children whose setup sleeps 3 s: launched first, then waited for, they are ready in about
    3 s (plus process start-up); started one after the other they would need 6 s at least."""
    servers = [ServingProcess(setup_slowly, (3.0,), handle, name=f"test-server-{i}") for i in range(2)]
    try:
        start = time.monotonic()
        for server in servers:
            server.launch()
        for server in servers:
            server.start()
        assert time.monotonic() - start < 6.0
        assert [server.call("ab", timeout=30)[1][0] for server in servers] == [2, 2]  # 0 + len("ab")
    finally:
        for server in servers:
            server.stop()
