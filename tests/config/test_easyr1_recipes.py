"""EasyR1's own config and its 20 example recipes pass easyvlm's config check unchanged.

``easyr1/config.yaml`` restates EasyR1's ``examples/config.yaml``; ``easyr1/recipes.json`` holds the
arguments each of its 20 recipe scripts (``examples/*.sh``, ``examples/baselines/*.sh``) passes after
``config=examples/config.yaml``, as bash hands them over (quotes removed). Each runs in a directory
laid out like EasyR1's repository, with ``print_config=true``, as an EasyR1 user would check a recipe.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import yaml

from easyvlm.config.cli import parse_and_validate

HERE = Path(__file__).parent / "easyr1"
REPO = Path(__file__).resolve().parents[2]
RECIPES = json.loads((HERE / "recipes.json").read_text())


@pytest.fixture(scope="module")
def easyr1_checkout(tmp_path_factory) -> Path:
    """A directory with EasyR1's layout: examples/config.yaml, format prompts and reward files
    (easyvlm's versions of math, r1v and dapo; the GUI task's files only need to exist here)."""
    root = tmp_path_factory.mktemp("easyr1")
    (root / "examples" / "format_prompt").mkdir(parents=True)
    (root / "examples" / "reward_function").mkdir()
    shutil.copy(HERE / "config.yaml", root / "examples" / "config.yaml")
    for name in ("math", "r1v", "dapo"):
        shutil.copy(REPO / "format_prompts" / f"{name}.jinja", root / "examples" / "format_prompt" / f"{name}.jinja")
        shutil.copy(REPO / "reward_functions" / f"{name}.py", root / "examples" / "reward_function" / f"{name}.py")
    (root / "examples" / "format_prompt" / "android_gui.jinja").write_text("{{ content | trim }}\n")
    (root / "examples" / "reward_function" / "android_gui.py").write_text(
        "def compute_score(reward_inputs):\n    return [{'overall': 0.0} for _ in reward_inputs]\n"
    )
    return root


def test_twenty_recipes():
    assert len(RECIPES) == 20


@pytest.mark.parametrize("recipe", sorted(RECIPES))
def test_recipe_passes_print_config(recipe, easyr1_checkout, monkeypatch, capsys):
    monkeypatch.chdir(easyr1_checkout)
    args = ["config=examples/config.yaml", *RECIPES[recipe], "print_config=true"]
    with pytest.raises(SystemExit) as exit_info:
        parse_and_validate(args)
    out = capsys.readouterr()
    assert exit_info.value.code == 0, out.err
    printed = yaml.safe_load(out.out)
    # the recipe's own values reached the printed config (spot checks: the last override of each)
    key, _, value = RECIPES[recipe][-1].partition("=")
    node = printed
    for part in key.split("."):
        node = node[part]
    assert node == yaml.safe_load(value) or str(node) == value, (key, node, value)
