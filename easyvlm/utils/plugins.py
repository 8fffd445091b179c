"""Load a user function given as ``path/to/file.py:func`` (EasyR1's format). The driver ships the
file's text with the resolved spec, so a worker elsewhere needs no copy of the file."""

from __future__ import annotations

import hashlib
import importlib.util
import linecache
import sys
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any, Callable


class PluginError(ValueError):
    """A plugin spec that cannot be loaded; the message says what, where and how to fix it."""


@dataclass(frozen=True)
class PluginSpec:
    path: Path
    name: str

    def __str__(self) -> str:
        return f"{self.path}:{self.name}"


def is_plugin_spec(value: str) -> bool:
    """True for ``something.py`` or ``something.py:func`` (as opposed to a registry name)."""
    return value.split(":", 1)[0].endswith(".py")


def parse_plugin_spec(spec: str, default_name: str = "main") -> PluginSpec:
    """Split ``file.py:func`` into an absolute path and a function name (no import yet)."""
    file_part, sep, name = spec.partition(":")
    if not file_part.endswith(".py"):
        raise PluginError(f"{spec!r} is not a 'path/to/file.py:function' spec (the file must end in .py)")
    if sep and not name.isidentifier():
        raise PluginError(f"{spec!r}: {name!r} is not a valid Python function name")
    return PluginSpec(Path(file_part).expanduser().resolve(), name if sep else default_name)


def resolve_plugin_spec(spec: str, default_name: str = "main") -> str:
    """The same spec with an absolute path: do this in the driver before shipping to workers."""
    return str(parse_plugin_spec(spec, default_name))


def read_plugin_source(spec: str, default_name: str = "main") -> str | None:
    """The spec's file text to ship with it (driver side); None if unreadable (loading then names the file)."""
    path = parse_plugin_spec(spec, default_name).path
    try:
        return path.read_text()
    except (OSError, UnicodeDecodeError):
        return None


def load_module(path: Path, source: str | None = None) -> ModuleType:
    """Import a Python file under a unique module name (two reward.py files don't collide). With ``source``,
    its text is run instead of opening the file; tracebacks and ``__file__`` still name ``path``."""
    if source is None and not path.is_file():
        raise PluginError(f"plugin file not found: {path} (paths are relative to the working directory)")
    digest = hashlib.sha1(str(path).encode()).hexdigest()[:10]
    module_name = f"easyvlm_plugin_{path.stem}_{digest}"
    if module_name in sys.modules:
        return sys.modules[module_name]
    if source is None:
        spec = importlib.util.spec_from_file_location(module_name, path)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
    else:
        module = ModuleType(module_name)
        module.__file__ = str(path)
    sys.modules[module_name] = module
    try:
        if source is None:
            spec.loader.exec_module(module)
        else:
            # linecache: tracebacks show the shipped lines (mtime None: checkcache keeps the entry)
            linecache.cache[str(path)] = (len(source), None, source.splitlines(keepends=True), str(path))
            exec(compile(source, str(path), "exec", dont_inherit=True), module.__dict__)
    except Exception as exc:  # the user's file failed at import time: say which file
        del sys.modules[module_name]
        raise PluginError(f"importing {path} failed: {type(exc).__name__}: {exc}") from exc
    return module


def load_plugin(spec: str, default_name: str = "main", source: str | None = None) -> tuple[Callable[..., Any], ModuleType]:
    """``(function, module)`` for ``file.py:func`` (the module carries optional constants); ``source``: as in
    :func:`load_module`. Raises PluginError naming the file."""
    parsed = parse_plugin_spec(spec, default_name)
    module = load_module(parsed.path, source)
    fn = getattr(module, parsed.name, None)
    if fn is None:
        available = sorted(n for n, v in vars(module).items() if callable(v) and not n.startswith("_"))
        raise PluginError(f"{parsed.path} has no function {parsed.name!r}; callables defined there: {available}")
    if not callable(fn):
        raise PluginError(f"{parsed}: {parsed.name!r} is a {type(fn).__name__}, not a function")
    return fn, module
