"""Reading the schema itself: field types by dotted key, type descriptions, attribute docstrings
(for the loader, `validate` and the reference generator).
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import inspect
import math
import re
import textwrap
import typing
from typing import Any, Literal, Union

from easyvlm.utils.compose import DOCS, SOURCES

_NONE = type(None)


@functools.cache
def field_types(cls: type) -> dict[str, Any]:
    """``{field name: resolved type}`` of a config dataclass, in declaration order."""
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls)}


def is_section(tp: Any) -> bool:
    """True for a nested config dataclass (a YAML section), not for a value."""
    return isinstance(tp, type) and dataclasses.is_dataclass(tp)


def unwrap_optional(tp: Any) -> tuple[Any, bool]:
    """``Optional[X]`` -> ``(X, True)``; anything else -> ``(tp, False)``."""
    if typing.get_origin(tp) is Union:
        args = [a for a in typing.get_args(tp) if a is not _NONE]
        if len(args) < len(typing.get_args(tp)):
            return (args[0] if len(args) == 1 else Union[tuple(args)]), True
    return tp, False


def literal_values(tp: Any) -> tuple[Any, ...] | None:
    """The allowed values of a ``Literal[...]`` (also inside ``Optional``), else None."""
    inner, _ = unwrap_optional(tp)
    if typing.get_origin(inner) is Literal:
        return typing.get_args(inner)
    return None


def list_item_type(tp: Any) -> Any | None:
    """``list[X]`` -> X, else None."""
    inner, _ = unwrap_optional(tp)
    if typing.get_origin(inner) is list:
        return typing.get_args(inner)[0]
    return None


_INDEX = re.compile(r"\[(\d+)\]")


def type_at(root: type, key: str) -> Any | None:
    """Type of the dotted ``key`` (``a.b[0].c`` allowed) under ``root``; None if there is none."""
    tp: Any = root
    for part in _INDEX.sub(r".[\1]", key).split("."):
        if part.startswith("["):
            tp = list_item_type(tp)
        elif is_section(tp):
            tp = field_types(tp).get(part)
        else:
            return None
        if tp is None:
            return None
    return tp


def all_keys(root: type, prefix: str = "") -> list[str]:
    """Every dotted key under ``root``, sections included (``worker``, ``worker.actor``, ...)."""
    keys = []
    for name, tp in field_types(root).items():
        key = f"{prefix}.{name}" if prefix else name
        keys.append(key)
        if is_section(tp):
            keys.extend(all_keys(tp, key))
    return keys


# ------------------------------------------------------------------------------- describing types
def describe(tp: Any) -> str:
    """Plain-English type for messages: ``an integer or null``, ``one of 'a', 'b'``."""
    inner, optional = unwrap_optional(tp)
    values = literal_values(inner)
    if values is not None:
        text = "one of " + ", ".join(repr(v) for v in values)
    elif inner is bool:
        text = "true or false"
    elif inner is int:
        text = "an integer"
    elif inner is float:
        text = "a number"
    elif inner is str:
        text = "a string"
    elif typing.get_origin(inner) is tuple:
        args = typing.get_args(inner)
        text = f"a list of {len(args)} {'numbers' if all(a is float for a in args) else 'values'}"
    elif typing.get_origin(inner) is list:
        item = typing.get_args(inner)[0]
        text = "a list of mappings" if is_section(item) else f"a list whose items are each {describe(item)}"
    elif typing.get_origin(inner) is dict or inner is dict:
        text = "a mapping (key: value)"
    elif is_section(inner):
        text = "a section (a mapping of its keys)"
    else:
        text = str(inner)
    return f"{text} or null" if optional else text


def render(tp: Any) -> str:
    """Compact type for the reference tables: ``int``, ``str | None``, ``"a" | "b"``."""
    inner, optional = unwrap_optional(tp)
    values = literal_values(inner)
    if values is not None:
        text = " \\| ".join(f'"{v}"' for v in values)
    elif inner is Any:
        text = "Any"
    elif isinstance(inner, type) and not typing.get_args(inner):
        text = inner.__name__
    else:
        origin = typing.get_origin(inner)
        args = ", ".join(render(a) for a in typing.get_args(inner))
        text = f"{origin.__name__}[{args}]" if origin is not None else str(inner)
    return f"{text} \\| None" if optional else text


# ---------------------------------------------------------------------------------- type checking
def matches(tp: Any, value: Any) -> bool:
    """Whether ``value`` is a valid value of type ``tp`` (as the loader would have produced it)."""
    inner, optional = unwrap_optional(tp)
    if value is None:
        return optional or inner is Any
    values = literal_values(inner)
    if values is not None:
        return value in values
    if inner is Any:
        return True
    if inner is bool:
        return isinstance(value, bool)
    if inner is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if inner is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if inner is str:
        return isinstance(value, str)
    origin = typing.get_origin(inner)
    if origin is tuple:
        args = typing.get_args(inner)
        return isinstance(value, (tuple, list)) and len(value) == len(args) and all(map(matches, args, value))
    if origin is list:
        return isinstance(value, list) and all(matches(typing.get_args(inner)[0], v) for v in value)
    if origin is dict or inner is dict:
        return isinstance(value, dict)
    if is_section(inner):
        return isinstance(value, inner)
    return isinstance(value, inner)


def is_finite_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


# ------------------------------------------------------------------------------------- docstrings
@functools.cache
def field_docs(cls: type) -> dict[str, str]:
    """Attribute docstrings: the string literal right after each field, whitespace collapsed, in
    field order. A field spliced in from a component's settings (``easyvlm.utils.compose``) has its
    docstring where that class declares it, or the section's own where ``fields_of`` gives one."""
    own = _attribute_docstrings(cls)
    sources, overrides = cls.__dict__.get(SOURCES, {}), cls.__dict__.get(DOCS, {})
    docs = {}
    for name in [f.name for f in dataclasses.fields(cls)] if dataclasses.is_dataclass(cls) else list(own):
        if name in overrides:
            doc = " ".join(overrides[name].split())
        else:
            doc = field_docs(sources[name]).get(name) if name in sources else own.get(name)
        if doc is not None:
            docs[name] = doc
    return docs


def _attribute_docstrings(cls: type) -> dict[str, str]:
    """The docstrings written in ``cls``'s own class body."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    body = tree.body[0].body  # type: ignore[attr-defined]
    docs = {}
    for stmt, nxt in zip(body, body[1:]):
        if (
            isinstance(stmt, ast.AnnAssign)
            and isinstance(stmt.target, ast.Name)
            and isinstance(nxt, ast.Expr)
            and isinstance(nxt.value, ast.Constant)
            and isinstance(nxt.value.value, str)
        ):
            docs[stmt.target.id] = " ".join(nxt.value.value.split())
    return docs
