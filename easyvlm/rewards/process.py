"""ServingProcess: a child process that runs untrusted, possibly slow code on request, and that the
parent can always stop (a thread cannot, while C code holds the GIL). Spawned, not forked (forking
Ray's threaded process can deadlock); requests run in its main thread, so signal timeouts work."""

from __future__ import annotations

import atexit
import multiprocessing
import multiprocessing.connection
import weakref
from typing import Any, Callable

START_TIMEOUT = 120.0  # seconds for a child to start and run its setup (imports of the reward files)


class StartError(RuntimeError):
    """The child process did not start or its setup failed."""


# Children are not daemons (a reward function may start processes of its own), so multiprocessing
# would wait for them at interpreter exit; they exit when asked, so ask first. atexit runs this
# before multiprocessing's own exit hook, which was registered earlier (at import).
_running: "weakref.WeakSet[ServingProcess]" = weakref.WeakSet()


@atexit.register
def _stop_all() -> None:
    for p in list(_running):
        p.stop()


class ServingProcess:
    """``setup(*setup_args) -> state`` once in the child, then ``handle(state, request) -> (status,
    value)`` per request (module-level functions). ``call`` returns the handler's pair,
    ``("timeout", None)`` (child killed), ``("died", exit_code)`` or ``("unpicklable", message)``."""

    def __init__(self, setup: Callable[..., Any], setup_args: tuple, handle: Callable[[Any, Any], Any], name: str):
        self._setup, self._setup_args, self._handle, self._name = setup, setup_args, handle, name
        self._process: multiprocessing.process.BaseProcess | None = None
        self.conn: multiprocessing.connection.Connection | None = None
        self._ready = False  # the child sent "ready": its setup is done

    # ------------------------------------------------------------------ lifecycle
    def launch(self) -> None:
        """Start the child if it is not running, without waiting for its setup (several set up side by side)."""
        if self._process is not None:
            return
        ctx = multiprocessing.get_context("spawn")
        self.conn, child_conn = ctx.Pipe()
        process = ctx.Process(
            target=_serve, args=(child_conn, self._setup, self._setup_args, self._handle), name=self._name
        )
        process.start()  # kept only once started: stop() and kill() join it
        self._process, self._ready = process, False
        _running.add(self)
        child_conn.close()

    def start(self) -> None:
        """Start the child (if not running) and wait until its setup is done; StartError if it fails."""
        self.launch()
        if self._ready:
            return
        if not self.conn.poll(START_TIMEOUT):
            self.kill()
            raise StartError(f"{self._name}: the process did not start within {START_TIMEOUT} s")
        try:
            status, message = self.conn.recv()
        except EOFError:
            status, message = "error", f"it exited with code {self._exitcode()} while starting"
        if status != "ready":
            self.kill()
            raise StartError(f"{self._name}: setup failed in the child process: {message}")
        self._ready = True

    def kill(self) -> None:
        """Stop the child now, whatever it is doing."""
        if self._process is not None:
            self._process.kill()
            self._process.join()
            self.conn.close()
        self._process, self.conn = None, None
        _running.discard(self)

    def stop(self) -> None:
        """Ask the child to exit; kill it if it does not within 5 s."""
        if self._process is None:
            return
        try:
            self.conn.send(None)
        except OSError:
            pass
        self._process.join(timeout=5.0)
        self.kill()

    def _exitcode(self) -> int | None:
        self._process.join(timeout=1.0)
        return self._process.exitcode

    # ------------------------------------------------------------------ requests
    def send(self, request: Any) -> None:
        """Send one request (the child must be started and idle). Pickling errors propagate."""
        self.conn.send(request)

    def receive(self) -> tuple[str, Any]:
        """The answer to the last request: the handler's (status, value), or ("died", exit_code)."""
        try:
            return self.conn.recv()
        except (EOFError, OSError):
            code = self._exitcode()
            self.kill()
            return "died", code

    def call(self, request: Any, timeout: float | None) -> tuple[str, Any]:
        """Start the child if needed, send ``request``, wait at most ``timeout`` s (None: forever)."""
        self.start()
        try:
            self.send(request)
        except OSError:  # the child died while idle
            return self.receive()
        if not self.conn.poll(timeout):
            self.kill()
            return "timeout", None
        return self.receive()


def _serve(conn: multiprocessing.connection.Connection, setup: Callable, setup_args: tuple, handle: Callable) -> None:
    try:
        state = setup(*setup_args)
    except BaseException as exc:
        conn.send(("error", f"{type(exc).__name__}: {exc}"))
        return
    conn.send(("ready", None))
    while True:
        try:
            request = conn.recv()
        except EOFError:  # the parent is gone
            return
        if request is None:
            return
        response = handle(state, request)  # handlers catch the user's exceptions themselves
        try:
            conn.send(response)
        except Exception as exc:  # the response could not be pickled
            conn.send(("unpicklable", f"{type(exc).__name__}: {exc}"))
