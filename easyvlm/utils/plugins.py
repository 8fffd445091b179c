"""Load a user function given as ``path/to/file.py:func`` (reward functions, estimators, losses).

The spec format is EasyR1's: ``file.py:func``; without ``:func`` the ``default_name`` is used.
Relative paths are resolved against the current working directory at *parse* time
(:func:`resolve_plugin_spec`), so the spec stays valid once shipped to a Ray worker whose working
directory differs. A process on another node of a cluster does not have the driver's files at all:
the driver reads a plug-in's text once (:func:`read_plugin_source`) and ships it with the spec, and
``load_plugin(spec, source=text)`` runs that text under the file's name, without opening the file.
"""

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
    """The text of the spec's file, for shipping with the spec (in the driver); None when the file
    cannot be read (loading it then fails with the file named)."""
    path = parse_plugin_spec(spec, default_name).path
    try:
        return path.read_text()
    except (OSError, UnicodeDecodeError):
        return None


def load_module(path: Path, source: str | None = None) -> ModuleType:
    """Import a Python file under a unique module name (two files named reward.py don't collide).

    ``source``: the file's text as the driver read it; the file itself is then not opened (it need
    not exist in this process's file system). Tracebacks and ``__file__`` still name ``path``.
    """
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
    """Return ``(function, module)`` for ``file.py:func``; the module carries optional constants.
    ``source``: the file's text (:func:`read_plugin_source` in the driver), run instead of opening it."""
    parsed = parse_plugin_spec(spec, default_name)
    module = load_module(parsed.path, source)
    fn = getattr(module, parsed.name, None)
    if fn is None:
        available = sorted(n for n, v in vars(module).items() if callable(v) and not n.startswith("_"))
        raise PluginError(f"{parsed.path} has no function {parsed.name!r}; callables defined there: {available}")
    if not callable(fn):
        raise PluginError(f"{parsed}: {parsed.name!r} is a {type(fn).__name__}, not a function")
    return fn, module
