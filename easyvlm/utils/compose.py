"""How the schema composes the components' settings, so that each setting is declared once (type,
default and meaning in the component's frozen dataclass): as a whole section, or spliced as flat
keys into a section (`fields_of`; a section may give some of them its own default and
documentation) and handed back whole by a property. `settings_of` fills a settings object or plan
slice from sections by field name. See docs/architecture.md, "Each setting is declared once".
Imports nothing from easyvlm, so that a component's own section may splice its settings (the
``worker.reward`` and ``worker.judge`` sections in ``easyvlm.rewards.settings``).
"""

from __future__ import annotations

import dataclasses
import typing
from typing import Any, Callable, Mapping, TypeVar

T = TypeVar("T")

SOURCES = "__field_sources__"
"""Class attribute of a section: ``{field name: the settings class that declares it}``."""
DOCS = "__field_docs__"
"""Class attribute of a section: ``{field name: this section's own documentation of a spliced field}``."""


def fields_of(
    settings: type, *, after: str | None, read_as: str, defaults: Mapping[str, Any] | None = None,
    docs: Mapping[str, str] | None = None,
) -> Callable[[type], type]:
    """Class decorator, under ``@dataclass``: ``settings``' fields, in their order and with their
    types and defaults, become fields of the decorated section right after its field ``after`` (None:
    at its start, so that a section may be made of splices alone); the section's property
    ``read_as`` gives them back as a ``settings`` object (`settings_of`).
    ``defaults`` and ``docs`` replace, for this section only, the default or the documentation of
    some of the fields: one settings class serves two sections that differ there (the actor's and
    the critic's forward keys)."""
    if not dataclasses.is_dataclass(settings):
        raise TypeError(f"{settings.__name__} is not a dataclass")
    hints = typing.get_type_hints(settings)
    names = [f.name for f in dataclasses.fields(settings)]
    defaults, docs = dict(defaults or {}), dict(docs or {})
    unknown = [name for name in [*defaults, *docs] if name not in names]
    if unknown:
        raise TypeError(f"{settings.__name__} has no field {unknown} to give a section's own default or doc")

    def splice(section: type) -> type:
        own = dict(section.__dict__.get("__annotations__", {}))
        if after is not None and after not in own:
            raise TypeError(f"{section.__name__} has no field {after!r} to put {settings.__name__}'s fields after")
        clash = [name for name in names + [read_as] if name in own]
        if clash:
            raise TypeError(f"{section.__name__} declares {clash} itself, which {settings.__name__} splices in")
        annotations: dict[str, Any] = {}

        def put_settings() -> None:
            for f in dataclasses.fields(settings):
                annotations[f.name] = hints[f.name]
                setattr(section, f.name, defaults[f.name] if f.name in defaults else _default_of(f))

        if after is None:
            put_settings()
        for name, annotation in own.items():
            annotations[name] = annotation
            if name == after:
                put_settings()
        section.__annotations__ = annotations

        def read(self: Any) -> Any:
            return settings_of(settings, self)

        read.__doc__ = f"This section's keys {', '.join(f.name for f in dataclasses.fields(settings))}, as a {settings.__name__}."
        setattr(section, read_as, property(read))
        sources = {**section.__dict__.get(SOURCES, {}), **{f.name: settings for f in dataclasses.fields(settings)}}
        setattr(section, SOURCES, sources)
        setattr(section, DOCS, {**section.__dict__.get(DOCS, {}), **docs})
        return section

    return splice


def _default_of(f: dataclasses.Field) -> Any:
    """What a class body would say after ``name: type =`` for the field ``f``."""
    if f.default_factory is not dataclasses.MISSING:
        return dataclasses.field(default_factory=f.default_factory)
    if f.default is dataclasses.MISSING:
        raise TypeError(f"settings field {f.name!r} needs a default to become a config key")
    return f.default


def settings_of(settings: type[T], *sections: Any, **given: Any) -> T:
    """A ``settings`` object (a component's settings, or a slice of the run plan) with each field
    ``given`` here or else copied by name from the one of ``sections`` that has it: the fields
    `fields_of` spliced into a config section, or a group of fields it shares names with. A field
    no section has keeps its default; one that two sections have must be ``given``."""
    values = dict(given)
    for f in dataclasses.fields(settings):
        if f.name in given:
            continue
        having = [section for section in sections if _has_value(section, f.name)]
        if len(having) > 1:
            names = ", ".join(type(section).__name__ for section in having)
            raise TypeError(f"{settings.__name__}.{f.name} is in {names}: give it explicitly")
        if having:
            values[f.name] = getattr(having[0], f.name)
    return settings(**values)


def _has_value(section: Any, name: str) -> bool:
    """Whether ``section`` (a dataclass) holds a value called ``name``: a field, or a property such
    as the settings objects `fields_of` adds (not a method)."""
    fields = {f.name for f in dataclasses.fields(section)}
    return name in fields or isinstance(getattr(type(section), name, None), property)


def settings_problems(section: Any, prefix: str = "") -> list[tuple[str, str]]:
    """(dotted key, message) for every range rule the components' settings state about their own keys
    (a settings class's static ``problems(values)``), over the config tree under ``section``: the
    config check walks them instead of restating them."""
    classes = [*dict.fromkeys(getattr(type(section), SOURCES, {}).values()), type(section)]  # spliced; whole
    classes = [settings for settings in classes if callable(getattr(settings, "problems", None))]
    found = [(f"{prefix}{key}", message) for settings in classes for key, message in settings.problems(section)]
    for f in dataclasses.fields(section):
        value = getattr(section, f.name)
        if dataclasses.is_dataclass(value) and not isinstance(value, type):
            found += settings_problems(value, f"{prefix}{f.name}.")
    return found
