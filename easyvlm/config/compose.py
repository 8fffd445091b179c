"""How the schema composes the components' settings, so that each setting is declared once.

A component declares its settings where it lives (``easyvlm.algorithms.settings``,
``easyvlm.workers.settings``, ...): a frozen dataclass whose fields carry the type, the default and,
in the docstring below each field, the meaning. The schema uses it in one of two ways:

- as a whole section (``worker.actor.fsdp: FSDPConfig``): the dataclass is the section;
- as flat keys in an existing section, where EasyR1's YAML has them (``worker.actor.clip_ratio_low``
  among the actor's other keys): `fields_of` splices the settings' fields into the section's
  dataclass at their place, and a property of the section gives the component its settings object
  back (``cfg.worker.actor.policy_loss``).

`settings_of` is also how the plan fills a slice from config sections: the fields it shares with
them by name are copied, and only what the plan derives is written out.

The generated reference reads a spliced field's documentation from the settings' class
(``easyvlm.config.introspect.field_docs``), so type, default and meaning are written only there.
"""

from __future__ import annotations

import dataclasses
import typing
from typing import Any, Callable, TypeVar

T = TypeVar("T")

SOURCES = "__field_sources__"
"""Class attribute of a section: ``{field name: the settings class that declares it}``."""


def fields_of(settings: type, *, after: str, read_as: str) -> Callable[[type], type]:
    """Class decorator, under ``@dataclass``: ``settings``' fields, in their order and with their
    types and defaults, become fields of the decorated section right after its field ``after``; the
    section's property ``read_as`` gives them back as a ``settings`` object (`settings_of`)."""
    if not dataclasses.is_dataclass(settings):
        raise TypeError(f"{settings.__name__} is not a dataclass")
    hints = typing.get_type_hints(settings)

    def splice(section: type) -> type:
        own = dict(section.__dict__.get("__annotations__", {}))
        if after not in own:
            raise TypeError(f"{section.__name__} has no field {after!r} to put {settings.__name__}'s fields after")
        clash = [name for name in [f.name for f in dataclasses.fields(settings)] + [read_as] if name in own]
        if clash:
            raise TypeError(f"{section.__name__} declares {clash} itself, which {settings.__name__} splices in")
        annotations: dict[str, Any] = {}
        for name, annotation in own.items():
            annotations[name] = annotation
            if name == after:
                for f in dataclasses.fields(settings):
                    annotations[f.name] = hints[f.name]
                    setattr(section, f.name, _default_of(f))
        section.__annotations__ = annotations

        def read(self: Any) -> Any:
            return settings_of(settings, self)

        read.__doc__ = f"This section's keys {', '.join(f.name for f in dataclasses.fields(settings))}, as a {settings.__name__}."
        setattr(section, read_as, property(read))
        sources = {**section.__dict__.get(SOURCES, {}), **{f.name: settings for f in dataclasses.fields(settings)}}
        setattr(section, SOURCES, sources)
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
