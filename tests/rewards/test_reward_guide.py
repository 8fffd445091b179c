"""docs/rewards.md stays true: its example file works unchanged, and its table of input keys is
the one the code builds."""

from __future__ import annotations

import re

import pytest
from rewards_testing import REPO_ROOT, inp, manager

from easyvlm.rewards import RewardFunctionSpec
from easyvlm.rewards.types import STANDARD_KEYS

GUIDE = (REPO_ROOT / "docs" / "rewards.md").read_text()


def example_code() -> str:
    """The first ```python block after the '<!-- example: my_reward.py' marker."""
    after = GUIDE.split("<!-- example: my_reward.py", 1)[1]
    return re.search(r"```python\n(.*?)```", after, re.DOTALL).group(1)


@pytest.mark.slow  # runs the file in a worker process, as training does
def test_guide_example_works_unchanged(tmp_path, monkeypatch):
    (tmp_path / "my_reward.py").write_text(example_code())
    monkeypatch.chdir(tmp_path)  # the guide's relative path, as a user would run it
    spec = RewardFunctionSpec("./my_reward.py:compute_score", {"max_words": 3})
    inputs = [
        inp("the cat sat", "cat"),  # right, 3 words <= 3: 0.8 + 0.2 = 1.0
        inp("a dog is here now", "cat"),  # wrong, 5 words: 0.0
        inp("cat cat cat cat", "CAT"),  # right (case-insensitive), 4 words: 0.8
    ]
    with manager(spec) as m:
        result = m.compute(inputs)
    assert sorted(result.scores) == ["accuracy", "brevity", "overall"]
    assert result.overall == pytest.approx([1.0, 0.0, 0.8])
    assert result.scores["accuracy"] == [1.0, 0.0, 1.0] and result.scores["brevity"] == [1.0, 0.0, 0.0]
    assert result.metrics["reward/accuracy"] == pytest.approx(2 / 3)
    assert m.names == ["keyword"]  # REWARD_NAME from the file


def test_guide_example_is_about_twenty_lines():
    assert len(example_code().strip().splitlines()) <= 25


def test_guide_lists_exactly_the_input_keys():
    section = GUIDE.split("Each input dict has these keys:", 1)[1].split("\n\n", 2)[1]
    listed = re.findall(r"^\| `(\w+)` \|", section, re.MULTILINE)
    assert listed == list(STANDARD_KEYS)
    assert set(inp("x").to_dict()) == set(STANDARD_KEYS)
