"""Every config key acts or is refused: a key that is accepted and ignored is the worst bug a
config-driven tool can have.

tests/config/key_effects.py gives every leaf key of the schema an entry; this module checks that
1. the table's keys are exactly the schema's leaf keys (a new key without an entry fails, and so
   does an entry whose key left the schema);
2. every test an ``effects`` entry names exists (read with ``ast``, never imported) and its source
   names the key (full name, leaf name or a ``via`` alias), so an entry cannot point at an
   unrelated test;
3. a ``refused`` (or ``gap``) key's non-default values, derived from its type, are refused by the
   check (``find_problems`` or the loader) under that key, while its default passes;
4. a ``fixed`` key's type allows one value, and the loader refuses another.
"""

from __future__ import annotations

import ast
import functools
import re
import sys
from pathlib import Path
from typing import Any

import pytest
from key_effects import ENTRIES, KEY_EFFECTS, Effects, Fixed, Gap, Refused
from test_validate import BASE

from easyvlm.config.errors import ConfigError, Problem
from easyvlm.config.introspect import all_keys, is_section, literal_values, type_at, unwrap_optional
from easyvlm.config.loader import load_config
from easyvlm.config.schema import PPOConfig
from easyvlm.config.validate import find_problems

REPO = Path(__file__).resolve().parents[2]


def leaf_keys(root: type = PPOConfig) -> list[str]:
    """Every dotted key of ``root`` that holds a value, not a section (a list of sections, such as
    ``worker.reward.reward_functions``, is one value)."""
    return [key for key in all_keys(root) if not is_section(type_at(root, key))]


# --------------------------------------------------------------------------------------------- 1.
def test_the_table_has_exactly_the_schemas_leaf_keys():
    keys = leaf_keys()
    missing = [key for key in keys if key not in KEY_EFFECTS]
    stale = [key for key in KEY_EFFECTS if key not in keys]
    assert not missing, f"keys without an entry in tests/config/key_effects.py (a test of their effect, or refused): {missing}"
    assert not stale, f"entries of tests/config/key_effects.py for keys the schema no longer has: {stale}"
    assert len(ENTRIES) == len(KEY_EFFECTS)


# --------------------------------------------------------------------------------------------- 2.
@functools.cache
def _module(path: str) -> tuple[str, ast.Module]:
    file = REPO / path
    assert file.is_file(), f"{path} does not exist"
    text = file.read_text()
    return text, ast.parse(text)


def _definitions(tree: ast.Module) -> dict[str, list[ast.AST]]:
    """Module-level functions, classes and assignments by name."""
    defs: dict[str, list[ast.AST]] = {}
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            defs.setdefault(node.name, []).append(node)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for target in targets:
                for name in ast.walk(target):
                    if isinstance(name, ast.Name):
                        defs.setdefault(name.id, []).append(node)
    return defs


def _find_test(tree: ast.Module, parts: list[str]) -> ast.FunctionDef | None:
    body = tree.body
    for i, name in enumerate(parts):
        found = next((n for n in body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and n.name == name), None)
        if found is None:
            return None
        if i == len(parts) - 1:
            return found if isinstance(found, (ast.FunctionDef, ast.AsyncFunctionDef)) else None
        body = found.body
    return None


def _source(text: str, node: ast.AST) -> str:
    decorators = getattr(node, "decorator_list", [])
    return "\n".join(ast.get_source_segment(text, n) or "" for n in [*decorators, node])


def source_of_test(test_id: str) -> str:
    """The test's source with its decorators, plus (transitively) every module-level function, class
    or constant of its own file that it names or takes as a fixture."""
    path, *parts = test_id.split("::")
    text, tree = _module(path)
    node = _find_test(tree, parts)
    assert node is not None and parts[-1].startswith("test"), f"{test_id}: no such test"
    defs = _definitions(tree)
    seen: set[int] = set()
    pieces = []
    todo: list[ast.AST] = [node]
    while todo:
        current = todo.pop()
        if id(current) in seen:
            continue
        seen.add(id(current))
        pieces.append(_source(text, current))
        names = {n.id for n in ast.walk(current) if isinstance(n, ast.Name)}
        names |= {a.arg for n in ast.walk(current) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) for a in n.args.args}
        for name in names:
            todo.extend(defs.get(name, []))
    return "\n".join(pieces)


def names_the_key(source: str, key: str, via: tuple[str, ...]) -> bool:
    """The full dotted key, its leaf name (3 characters or more: ``n`` would match anything) or an
    alias, as a whole word."""
    leaf = key.rsplit(".", 1)[-1]
    words = [key, *via] + ([leaf] if len(leaf) >= 3 else [])
    return any(re.search(rf"(?<!\w){re.escape(w)}(?!\w)", source) for w in words)


EFFECT_ROWS = [(key, test) for key, entry in KEY_EFFECTS.items() if isinstance(entry, Effects) for test in entry.tests]


def test_every_effects_entry_names_a_test():
    assert all(entry.tests for entry in KEY_EFFECTS.values() if isinstance(entry, Effects))


@pytest.mark.parametrize(("key", "test_id"), EFFECT_ROWS, ids=[f"{k}-{t.split('::')[-1]}" for k, t in EFFECT_ROWS])
def test_effect_test_exists_and_names_the_key(key, test_id):
    entry = KEY_EFFECTS[key]
    source = source_of_test(test_id)
    leaf = key.rsplit(".", 1)[-1]
    assert names_the_key(source, key, entry.via), (
        f"{test_id} does not name {key} (nor {leaf!r}{''.join(f', {v!r}' for v in entry.via)}): is it the test of this key? "
        "If it takes the key under another name, add it to via= in tests/config/key_effects.py"
    )


# --------------------------------------------------------------------------------------------- 3.
def default_of(key: str) -> Any:
    value: Any = PPOConfig()
    for part in key.split("."):
        value = getattr(value, part)
    return value


def non_default_values(key: str) -> list[Any]:
    """One or two values of the key's type that differ from its default: bool flipped, another
    literal, other numbers, a plausible string."""
    tp = type_at(PPOConfig, key)
    inner, _ = unwrap_optional(tp)
    default = default_of(key)
    literals = literal_values(tp)
    if literals is not None:
        return [v for v in literals if v != default][:2]
    if inner is bool:
        return [not default]
    if inner is int:
        base = 0 if default is None else default
        return [base + 1, base + 7]
    if inner is float:
        base = 0.0 if default is None else default
        return [base + 1.0, base / 2 if base else 0.5]
    if inner is str:
        return [f"{default}_other" if default else "./elsewhere"]
    raise NotImplementedError(f"{key}: derive non-default values of {tp} for the refusal check")


def _yaml(value: Any) -> str:
    return "null" if value is None else str(value).lower() if isinstance(value, bool) else str(value)


def check_problems(overrides: list[str]) -> list[Problem]:
    """What the loader and the check say about BASE (tests/config/test_validate.py) + ``overrides``."""
    try:
        cfg = load_config(BASE + overrides)
    except ConfigError as err:
        return err.problems
    return find_problems(cfg)


REFUSAL_ROWS = [(key, entry) for key, entry in KEY_EFFECTS.items() if isinstance(entry, (Refused, Gap))]


@pytest.mark.parametrize(("key", "entry"), REFUSAL_ROWS, ids=[k for k, _ in REFUSAL_ROWS])
def test_non_default_values_are_refused(key, entry):
    context = list(entry.context)
    assert check_problems(context) == [], "the base config (with the entry's context) must pass"
    unrefused = []
    for value in non_default_values(key):
        if not any(p.key == key for p in check_problems([*context, f"{key}={_yaml(value)}"])):
            unrefused.append(value)
    why = f" ({entry.why}): refuse its non-default values in easyvlm/config/validate.py or wire it" if isinstance(entry, Gap) else ""
    assert not unrefused, f"{key}={unrefused} is accepted but acts nowhere{why}"


# --------------------------------------------------------------------------------------------- 4.
FIXED_KEYS = [key for key, entry in KEY_EFFECTS.items() if isinstance(entry, Fixed)]


@pytest.mark.parametrize("key", FIXED_KEYS)
def test_fixed_keys_have_one_value(key):
    values = literal_values(type_at(PPOConfig, key))
    assert values is not None and len(values) == 1 and default_of(key) == values[0], f"{key}: {values}"
    with pytest.raises(ConfigError) as err:
        load_config([f"{key}={values[0]}_other"])
    assert [p.key for p in err.value.problems] == [key]


# ---------------------------------------------------------------------------- the checks can fail
def test_a_key_without_an_entry_or_an_entry_without_a_key_fails(monkeypatch):
    this, schema_keys = sys.modules[__name__], all_keys
    monkeypatch.setattr(this, "all_keys", lambda root: [*schema_keys(root), "data.new_key"])  # a key added to the schema
    with pytest.raises(AssertionError, match=r"without an entry .*\['data.new_key'\]"):
        test_the_table_has_exactly_the_schemas_leaf_keys()
    monkeypatch.undo()
    monkeypatch.delitem(KEY_EFFECTS, "data.shuffle")  # an entry removed
    with pytest.raises(AssertionError, match=r"\['data.shuffle'\]"):
        test_the_table_has_exactly_the_schemas_leaf_keys()
    monkeypatch.undo()
    monkeypatch.setitem(KEY_EFFECTS, "data.gone", Refused())  # a key that left the schema
    with pytest.raises(AssertionError, match=r"no longer has: \['data.gone'\]"):
        test_the_table_has_exactly_the_schemas_leaf_keys()


def test_an_unrelated_or_missing_test_fails(monkeypatch):
    monkeypatch.setitem(KEY_EFFECTS, "data.shuffle", Effects(("tests/trainer/test_core.py::test_count_tokens",)))
    with pytest.raises(AssertionError, match="does not name data.shuffle"):
        test_effect_test_exists_and_names_the_key("data.shuffle", "tests/trainer/test_core.py::test_count_tokens")
    with pytest.raises(AssertionError, match="no such test"):
        test_effect_test_exists_and_names_the_key("data.shuffle", "tests/trainer/test_core.py::test_never_written")
    with pytest.raises(AssertionError, match="does not exist"):
        source_of_test("tests/trainer/test_nothing.py::test_x")


def test_an_accepted_key_is_not_refused():
    with pytest.raises(AssertionError, match=r"data.shuffle=\[False\] is accepted but acts nowhere"):
        test_non_default_values_are_refused("data.shuffle", Refused())
