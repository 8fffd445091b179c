"""docs/config.md is generated from the schema and must be current."""

from __future__ import annotations

from pathlib import Path

from easyvlm.config.introspect import all_keys
from easyvlm.config.reference import README, main, render_reference, sync_readme
from easyvlm.config.schema import PPOConfig

DOC = Path(__file__).resolve().parents[2] / "docs" / "config.md"


def test_docs_config_md_is_current():
    assert DOC.read_text() == render_reference(), "regenerate with: python -m easyvlm.config.reference"


def test_readme_config_block_is_current():
    assert sync_readme(README, check=True), "regenerate with: python -m easyvlm.config.reference"


def test_every_key_is_documented():
    text = render_reference()
    sections = {chunk.split("`", 1)[0]: chunk for chunk in text.split("\n## `")[1:]}  # heading key -> its text
    for key in all_keys(PPOConfig):
        if key in sections:
            continue
        # the nearest documented ancestor has a row for the key or says "Same keys as"
        parent = key.rpartition(".")[0]
        while parent and parent not in sections:
            parent = parent.rpartition(".")[0]
        body = sections[parent]
        assert "Same keys as" in body or f"| `{key[len(parent) + 1:]}` |" in body, key


def test_table_row_shows_type_default_and_meaning():
    text = render_reference()
    assert '| `kl_penalty` | "kl" \\| "abs" \\| "mse" \\| "low_var_kl" \\| "full" | `kl` | KL estimator:' in text
    assert "| `max_steps` | int \\| None | `null` |" in text
    assert "| `logger` | list[" in text and "`[console, file, tensorboard]`" in text
    assert "## `worker.critic.model`\n\nThe value model" in text
    assert "Same keys as [`worker.actor.model`](#workeractormodel), subsections included." in text
    assert "## `worker.critic.model.lora`" not in text


def test_check_mode(tmp_path, capsys):
    stale = tmp_path / "config.md"
    stale.write_text("old\n")
    assert main(["--check", str(stale)]) == 1
    assert "out of date" in capsys.readouterr().err
    assert main(["--output", str(stale)]) == 0
    assert main(["--check", str(stale)]) == 0
