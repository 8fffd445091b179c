"""Loading reward files: specs, module constants, signature checks, and their error messages."""

from __future__ import annotations

import re

import pytest
from rewards_testing import write_file

from easyvlm.rewards import RewardError, RewardFunctionSpec, load_reward_function


def load(spec: str, **kwargs) -> object:
    return load_reward_function(RewardFunctionSpec(spec, **kwargs))


def test_constants_default_name_and_relative_path(tmp_path, monkeypatch):
    write_file(tmp_path, "my_reward.py", """
        REWARD_NAME = "mine"
        REWARD_TYPE = "sequential"
        def main(reward_input):
            return 1.0
    """)
    monkeypatch.chdir(tmp_path)
    reward = load("my_reward.py")  # no ":func" -> main; relative to the working directory
    assert reward.spec == f"{tmp_path / 'my_reward.py'}:main"
    assert (reward.name, reward.reward_type, reward.weight, reward.kwargs) == ("mine", "sequential", 1.0, {})
    # resolved() makes the spec independent of the working directory it is used in later
    assert RewardFunctionSpec("my_reward.py").resolved().reward_function == f"{tmp_path / 'my_reward.py'}:main"


def test_defaults_without_constants_and_config_override(tmp_path):
    path = write_file(tmp_path, "plain.py", "def score(items, scale=1.0):\n    return [scale for _ in items]\n")
    reward = load(f"{path}:score", reward_function_kwargs={"scale": 2.0}, weight=0.5)
    assert (reward.name, reward.reward_type, reward.kwargs, reward.weight) == ("plain", "batch", {"scale": 2.0}, 0.5)
    assert load(f"{path}:score", reward_type="sequential").reward_type == "sequential"


def test_missing_file(tmp_path):
    with pytest.raises(RewardError, match=r"reward function .*nowhere\.py:main: plugin file not found: .*nowhere\.py"):
        load(str(tmp_path / "nowhere.py"))


def test_missing_function_lists_the_ones_there(tmp_path):
    path = write_file(tmp_path, "r.py", "def compute_score(items):\n    return []\n")
    with pytest.raises(RewardError, match=r"r\.py:main: .*r\.py has no function 'main'; callables defined there: \['compute_score'\]"):
        load(path)


def test_import_error_names_the_file(tmp_path):
    path = write_file(tmp_path, "broken.py", "import not_a_module_anywhere\n")
    with pytest.raises(RewardError, match=r"importing .*broken\.py failed: ModuleNotFoundError"):
        load(path)


@pytest.mark.parametrize(
    "source, kwargs, expected",
    [
        # two required positional arguments: EasyR1's old (response, ground_truth) style
        ("def f(response, ground_truth):\n    return 0.0\n", {}, r"missing a required argument: 'ground_truth'"),
        # no argument at all
        ("def f():\n    return []\n", {}, r"too many positional arguments"),
        # a kwarg from the config that the function does not take
        ("def f(items, format_weight=0.1):\n    return []\n", {"fromat_weight": 0.5}, r"unexpected keyword argument 'fromat_weight'"),
    ],
)
def test_wrong_signature(tmp_path, source, kwargs, expected):
    path = write_file(tmp_path, "sig.py", source)
    with pytest.raises(RewardError) as err:
        load(f"{path}:f", reward_function_kwargs=kwargs)
    message = str(err.value)
    assert f"reward function {path}:f: its signature f(" in message
    assert "exactly one positional argument (reward_inputs: list[dict])" in message
    assert re.search(expected, message)


def test_async_function_refused(tmp_path):
    path = write_file(tmp_path, "a.py", "async def f(items):\n    return []\n")
    with pytest.raises(RewardError, match=r"a\.py:f is an async function"):
        load(f"{path}:f")


def test_bad_reward_type_names_its_source(tmp_path):
    path = write_file(tmp_path, "t.py", "REWARD_TYPE = 'batched'\ndef f(items):\n    return []\n")
    with pytest.raises(RewardError, match=r"REWARD_TYPE in t\.py is 'batched'; use one of \['batch', 'sequential'\]"):
        load(f"{path}:f")
    with pytest.raises(RewardError, match=r"worker\.reward\.reward_type is 'seq'"):
        load(f"{path}:f", reward_type="seq")


def test_spec_without_py_suffix():
    with pytest.raises(RewardError, match=r"'rewards:main'.*must end in \.py"):
        RewardFunctionSpec("rewards:main").resolved()


def test_the_spec_carries_the_files_text_to_where_it_runs(tmp_path):
    """Resolved in the driver, the spec holds the file's text: the reward actor and its worker
    processes (on a cluster maybe on a node without the file) run that text."""
    from rewards_testing import inp, manager

    path = write_file(tmp_path, "travelling.py", """
        import os
        def score(items):
            return [{"overall": 1.0, "file_here": float(os.path.exists(__file__))} for _ in items]
    """)
    spec = RewardFunctionSpec(f"{path}:score").resolved()
    assert "def score(items)" in spec.source and spec == RewardFunctionSpec(f"{path}:score")  # text not compared
    (tmp_path / "travelling.py").unlink()
    assert load_reward_function(spec).name == "travelling"
    with manager(spec, timeout=60) as m:  # the worker process loads it again, from the text
        assert m.compute([inp("a")]).scores == {"overall": [1.0], "file_here": [0.0]}
