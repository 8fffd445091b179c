"""The built-in preference pairs: the rule reward ranks every pair as the pair says, and the splits
share no image."""

from __future__ import annotations

import importlib.util
import json
from collections import Counter
from pathlib import Path

import pytest

from easyvlm.builtin.synthetic import resolve_builtin_dataset

REPO = Path(__file__).resolve().parents[2]


def rule_reward():
    spec = importlib.util.spec_from_file_location("synthetic_reward", REPO / "reward_functions" / "synthetic.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.compute_score


@pytest.mark.parametrize("name", ["synthetic-preference", "synthetic-colour-preference"])
def test_the_rule_reward_prefers_every_chosen_response(name):
    path = resolve_builtin_dataset(f"builtin:{name}@test")
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert len(rows) == 256
    score = rule_reward()
    chosen = score([{"response": r["chosen"], "ground_truth": r["answer"]} for r in rows])
    rejected = score([{"response": r["rejected"], "ground_truth": r["answer"]} for r in rows])
    assert all(c["accuracy"] == 1.0 for c in chosen)
    assert all(r["accuracy"] == 0.0 for r in rejected)
    kinds = Counter("empty" if not r["rejected"] else "twice" if " " in r["rejected"] else "word" for r in rows)
    assert kinds["empty"] > 0 and kinds["twice"] > 0  # the distractors a policy can game a reward model with
    if name == "synthetic-colour-preference":
        assert {r["task"] for r in rows} == {"colour"}


def test_splits_share_no_image():
    import hashlib

    def digests(split: str) -> set[str]:
        path = resolve_builtin_dataset(f"builtin:synthetic-colour-preference@{split}")
        rows = [json.loads(line) for line in path.read_text().splitlines()]
        return {hashlib.sha256((path.parent / r["images"][0]).read_bytes() + r["prompt"].encode()).hexdigest() for r in rows}

    assert not digests("train") & digests("test")
