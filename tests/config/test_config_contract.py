"""The config contract, byte for byte: every key, its order, type, default and documentation, the
generated reference (docs/config.md and the README's block), the ``print_config=true`` YAML of the
defaults and of examples/config.yaml, and ``dataclasses.asdict(PPOConfig())`` with its key order.

Where a setting is declared (the config schema, or a component's settings that the schema
composes) must not change any of these. The golden file lists every key readably, so a failure's
diff names the key; the artifacts are compared by their SHA-256. After an intended change to the
contract, rewrite the golden file with ``EASYVLM_UPDATE_GOLDEN=1`` and review its diff.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from pathlib import Path

from easyvlm.config.introspect import all_keys, field_docs, field_types, is_section, render, type_at
from easyvlm.config.loader import load_config, to_yaml
from easyvlm.config.reference import render_readme_block, render_reference
from easyvlm.config.schema import PPOConfig

REPO = Path(__file__).resolve().parents[2]
GOLDEN = Path(__file__).with_name("config_contract.golden")


def _parent_and_field(key: str) -> tuple[type, dataclasses.Field]:
    parent_key, _, name = key.rpartition(".")
    parent = type_at(PPOConfig, parent_key) if parent_key else PPOConfig
    return parent, next(f for f in dataclasses.fields(parent) if f.name == name)


def key_listing() -> list[str]:
    """One entry per key, in order: ``key: type = default`` and its documentation, indented."""
    lines = []
    for key in all_keys(PPOConfig):
        parent, f = _parent_and_field(key)
        tp = field_types(parent)[f.name]
        doc = field_docs(parent).get(f.name, "")
        if is_section(tp):
            lines.append(f"{key}: (section)")
        else:
            default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
            lines.append(f"{key}: {render(tp)} = {default!r}")
        lines.append(f"    {doc}")
    return lines


def artifacts() -> dict[str, str]:
    """The generated texts of the contract, by name."""
    return {
        "docs/config.md": render_reference(),
        "README config block": render_readme_block(),
        "print_config of the defaults": to_yaml(PPOConfig()),
        "print_config of examples/config.yaml": to_yaml(load_config([f"config={REPO / 'examples' / 'config.yaml'}"])),
        "asdict(PPOConfig())": json.dumps(dataclasses.asdict(PPOConfig()), default=repr),
        "all_keys": "\n".join(all_keys(PPOConfig)),
    }


def golden_text() -> str:
    hashes = [f"sha256 {hashlib.sha256(text.encode()).hexdigest()}  {name}" for name, text in artifacts().items()]
    return "\n".join(hashes + [""] + key_listing()) + "\n"


def test_config_contract_is_unchanged():
    if os.environ.get("EASYVLM_UPDATE_GOLDEN") == "1":
        GOLDEN.write_text(golden_text())
    assert golden_text() == GOLDEN.read_text(), (
        "the config contract changed (a key, its order, type, default or documentation, or the generated "
        "reference or YAML); if intended, rewrite tests/config/config_contract.golden with EASYVLM_UPDATE_GOLDEN=1"
    )


def test_golden_lists_every_key_once():
    listed = [line.split(":", 1)[0] for line in GOLDEN.read_text().splitlines() if line and not line[0].isspace()
              and not line.startswith("sha256 ")]
    assert listed == all_keys(PPOConfig)
