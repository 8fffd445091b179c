"""RewardManager: scores and metrics, batch and sequential calling, combined functions, and every
failure mode with its message. All user code runs in worker processes (hence slow)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from PIL import Image
from rewards_testing import SHIPPED, inp, manager, write_file

from easyvlm.plan.build import reward_settings_of
from easyvlm.rewards import RewardError, RewardFunctionSpec, RewardSettings
from easyvlm.rewards.settings import RewardCallSettings, RewardConfig, RewardFunctionConfig

pytestmark = pytest.mark.slow

# One file whose functions misbehave on request: the response text picks the behaviour.
MISBEHAVING = '''
import math, os, time

REWARD_NAME = "toy"


def _one(item):
    r = item["response"]
    if r == "raise":
        raise KeyError("no such key")
    if r == "nan":
        return {"overall": math.nan, "accuracy": 0.0}
    if r == "inf":
        return {"overall": 1.0, "accuracy": math.inf}
    if r == "text":
        return "1.0"
    if r == "no-overall":
        return {"accuracy": 1.0}
    if r == "str-value":
        return {"overall": 1.0, "note": "good"}
    if r == "other-keys":
        return {"overall": 1.0, "bonus": 1.0}
    if r == "sleep":
        time.sleep(60)
    if r == "exit":
        os._exit(3)
    right = float(r == item["ground_truth"])
    return {"overall": right, "accuracy": right}


def batch(items):
    return [_one(x) for x in items]


def seq(item):
    return _one(item)


def wrong_count(items):
    return [1.0] * (len(items) - 1)


def returns_dict(items):
    return {"overall": 1.0}


def returns_generator(items):
    return ({"overall": 1.0} for _ in items)


def fails_in_batch_only(items):
    if len(items) > 1:
        raise RuntimeError("batch too big")
    return [1.0]


def echo(items):
    out = []
    for x in items:
        out.append({
            "overall": float(len(x["images"])),
            "width": x["images"][0].size[0],
            "original_width": x["original_image_sizes"][0][0],
            "length": x["response_length"],
            "prompt_ok": x["prompt"] == "Q?",
            "task_is_colour": x["task"] == "colour",
            "standard_key_kept": x["response"] == "real" and x["extra"]["response"] == "EXTRA",
        })
    return out
'''


def line_of(code: str) -> int:
    """Line number of ``code`` in the written misbehaving.py."""
    return [line.strip() for line in MISBEHAVING.splitlines()].index(code) + 1


@pytest.fixture(scope="module")
def toy(tmp_path_factory) -> str:
    return write_file(tmp_path_factory.mktemp("toy"), "misbehaving.py", MISBEHAVING)


@pytest.fixture(scope="module")
def batch_manager(toy):
    with manager(f"{toy}:batch", timeout=60) as m:
        yield m


@pytest.fixture(scope="module")
def seq_manager(toy):
    with manager(RewardFunctionSpec(f"{toy}:seq", reward_type="sequential"), timeout=60, num_workers=2) as m:
        yield m


def test_batch_scores_and_metrics(batch_manager):
    result = batch_manager.compute([inp("a", "a"), inp("b", "a"), inp("c", "c")])
    assert result.scores == {"overall": [1.0, 0.0, 1.0], "accuracy": [1.0, 0.0, 1.0]}
    assert result.overall == [1.0, 0.0, 1.0]
    assert result.metrics == pytest.approx({"reward/overall": 2 / 3, "reward/accuracy": 2 / 3, "reward/error_count": 0.0})
    assert result.errors == []


def test_sequential_keeps_sample_order_over_two_workers(seq_manager):
    truths = ["a", "b", "c", "d", "e"]
    responses = ["a", "x", "c", "x", "e"]
    result = seq_manager.compute([inp(r, t) for r, t in zip(responses, truths)])
    assert result.overall == [1.0, 0.0, 1.0, 0.0, 1.0]


def test_empty_batch(batch_manager):
    result = batch_manager.compute([])
    assert result.overall == [] and result.metrics["reward/error_count"] == 0.0


FAILURES = [
    ("raise", r"it raised KeyError: 'no such key' \(at misbehaving\.py:" + str(line_of('raise KeyError("no such key")'))
              + r" in _one: raise KeyError\(\"no such key\"\)\)"),
    ("nan", r"its 'overall' is nan \(not finite: NaN or infinite\)"),
    ("inf", r"its 'accuracy' is inf \(not finite: NaN or infinite\)"),
    ("text", r"it returned str '1\.0'; a score is a float or a dict with an 'overall' float"),
    ("no-overall", r"it returned a dict without 'overall' \(keys: \['accuracy'\]\)"),
    ("str-value", r"its 'note' is str 'good', not a float"),
    ("other-keys", r"it returned the keys \['bonus', 'overall'\], but for sample 0 it returned \['accuracy', 'overall'\]"),
]


@pytest.mark.parametrize("response, problem", FAILURES, ids=[f[0] for f in FAILURES])
@pytest.mark.parametrize("mode", ["batch", "sequential"])
def test_failure_names_file_function_sample_and_problem(mode, response, problem, toy, batch_manager, seq_manager):
    m, func = (batch_manager, "batch") if mode == "batch" else (seq_manager, "seq")
    with pytest.raises(RewardError) as err:
        m.compute([inp("a", "a"), inp(response, "a"), inp("a", "a")])
    message = str(err.value)
    assert message.startswith(f"reward function {toy}:{func} ({mode}) failed on sample 1 (response {response!r}): ")
    assert re.search(problem, message), message
    assert message.endswith("Set worker.reward.on_error=zero to score failing samples 0 and keep training "
                            "(they are counted in reward/error_count).")
    assert (err.value.spec, err.value.sample_index) == (f"{toy}:{func}", 1)


def test_wrong_number_of_outputs(toy):
    with manager(f"{toy}:wrong_count") as m, pytest.raises(RewardError) as err:
        m.compute([inp("a"), inp("b"), inp("c")])
    assert str(err.value).startswith(
        f"reward function {toy}:wrong_count (batch) failed on the batch of 3 samples: it returned 2 scores for "
        "3 inputs; a batch reward returns one score per input, in order."
    )
    assert err.value.sample_index is None


def test_batch_function_returning_one_dict_hints_at_sequential(toy):
    with manager(f"{toy}:returns_dict") as m, pytest.raises(RewardError) as err:
        m.compute([inp("a"), inp("b")])
    assert "it returned dict {'overall': 1.0}, not a list of 2 scores (one per input). If the function scores " \
           "one sample per call, set REWARD_TYPE = 'sequential' in the file (or worker.reward.reward_type=sequential). " \
           "Set worker.reward.on_error=zero" in str(err.value)


def test_unpicklable_output(toy):
    with manager(f"{toy}:returns_generator") as m, pytest.raises(RewardError) as err:
        m.compute([inp("a"), inp("b")])
    assert "failed on the batch of 2 samples: it returned a value that cannot be sent back from its worker process " \
           "(TypeError: cannot pickle 'generator' object); return floats or dicts of floats." in str(err.value)


def test_exception_only_in_batch_calls_is_reported_unlocated(toy):
    with manager(f"{toy}:fails_in_batch_only") as m, pytest.raises(RewardError) as err:
        m.compute([inp("a"), inp("b")])
    line = line_of('raise RuntimeError("batch too big")')
    assert (f"failed on the batch of 2 samples: it raised RuntimeError: batch too big (at misbehaving.py:{line} in "
            "fails_in_batch_only: raise RuntimeError(\"batch too big\")) (calling it on one sample at a time did not "
            "locate the failing sample). Set") in str(err.value)


@pytest.mark.parametrize("mode", ["batch", "sequential"])
def test_timeout_kills_the_call_and_the_manager_recovers(mode, toy):
    spec = RewardFunctionSpec(f"{toy}:batch") if mode == "batch" else RewardFunctionSpec(f"{toy}:seq", reward_type="sequential")
    with manager(spec, timeout=1.0) as m:
        with pytest.raises(RewardError) as err:
            m.compute([inp("a", "a"), inp("sleep", "a")])
        where = "the batch of 2 samples" if mode == "batch" else "sample 1 (response 'sleep')"
        # a sequential function's timeout is for the whole batch: the message says how long the sample ran
        detail = " (its worker" if mode == "batch" else ", the time a sequential function has for the whole batch " \
                                                      "(this sample ran for "
        assert f"({mode}) failed on {where}: the call did not return within worker.reward.timeout=1.0 s{detail}" \
               in str(err.value)
        assert "its worker process was killed and will be restarted)" in str(err.value)
        assert m.compute([inp("a", "a")]).overall == [1.0]  # a new worker process took over


@pytest.mark.parametrize("mode", ["batch", "sequential"])
def test_worker_process_death_is_reported(mode, toy):
    spec = RewardFunctionSpec(f"{toy}:batch") if mode == "batch" else RewardFunctionSpec(f"{toy}:seq", reward_type="sequential")
    with manager(spec, timeout=60) as m:
        with pytest.raises(RewardError, match=r"its worker process died \(exit code 3: a crash in native code"):
            m.compute([inp("exit", "a")])
        assert m.compute([inp("b", "b")]).overall == [1.0]


def test_on_error_zero_sequential_counts_failures(toy):
    spec = RewardFunctionSpec(f"{toy}:seq", reward_type="sequential")
    with manager(spec, timeout=1.0, on_error="zero", num_workers=2) as m:
        result = m.compute([inp("a", "a"), inp("raise", "a"), inp("nan", "a"), inp("b", "a"), inp("sleep", "a")])
    # failed samples 1, 2, 4 get 0 for every key; sample 3 is a plain wrong answer
    assert result.scores == {"overall": [1.0, 0.0, 0.0, 0.0, 0.0], "accuracy": [1.0, 0.0, 0.0, 0.0, 0.0]}
    assert result.metrics["reward/error_count"] == 3.0
    assert result.metrics["reward/overall"] == pytest.approx(0.2)
    assert [re.search(r"failed on sample (\d)", e).group(1) for e in result.errors] == ["1", "2", "4"]
    assert "KeyError" in result.errors[0] and "nan" in result.errors[1] and "timeout=1.0 s" in result.errors[2]
    assert not any("on_error=zero" in e for e in result.errors)  # the fix hint is only for raise


def test_on_error_zero_batch_keeps_the_samples_that_succeed_alone(toy):
    with manager(f"{toy}:batch", on_error="zero") as m:
        result = m.compute([inp("a", "a"), inp("raise", "a"), inp("c", "c")])
    assert result.overall == [1.0, 0.0, 1.0]
    assert result.metrics["reward/error_count"] == 1.0 and len(result.errors) == 1
    with manager(f"{toy}:wrong_count", on_error="zero") as m:
        result = m.compute([inp("a"), inp("b"), inp("c")])
    assert result.overall == [0.0, 0.0, 0.0]
    assert result.metrics["reward/error_count"] == 3.0 and len(result.errors) == 1  # one message for the batch


def test_weighted_combination_and_key_names(toy):
    synthetic = RewardFunctionSpec(f"{SHIPPED / 'synthetic.py'}:compute_score", weight=1.0)
    toy_spec = RewardFunctionSpec(f"{toy}:batch", weight=0.5)
    with manager(synthetic, toy_spec, RewardFunctionSpec(f"{toy}:batch", weight=2.0)) as m:
        result = m.compute([inp("red", "red"), inp("blue", "red")])
    # synthetic: right one word -> 1.0, wrong one word -> 0.1; toy: 1, 0
    # overall = 1 * synthetic + 0.5 * toy + 2 * toy = [1 + 0.5 + 2, 0.1 + 0 + 0]
    assert result.overall == pytest.approx([3.5, 0.1])
    assert sorted(result.scores) == [
        "overall", "synthetic/accuracy", "synthetic/format", "synthetic/overall",
        "toy/accuracy", "toy/overall", "toy_2/accuracy", "toy_2/overall",
    ]
    assert result.scores["synthetic/overall"] == pytest.approx([1.0, 0.1])
    assert result.metrics["reward/toy/accuracy"] == 0.5
    # each function's own (unweighted) overall, in the config's order: GDPO's r_k (normalize_then_sum)
    assert result.function_keys == ["synthetic/overall", "toy/overall", "toy_2/overall"]
    assert result.scores["toy_2/overall"] == pytest.approx([1.0, 0.0])


def test_single_weighted_function_scales_overall_only(toy):
    with manager(RewardFunctionSpec(f"{toy}:batch", weight=0.5)) as m:
        result = m.compute([inp("a", "a")])
    assert result.scores == {"overall": [0.5], "accuracy": [1.0]}
    assert result.function_keys == []  # one function: nothing to normalise apart


@pytest.mark.parametrize("mode", ["batch", "sequential"])
def test_input_dict_carries_prompt_images_sizes_and_extra_columns(mode, toy):
    spec = RewardFunctionSpec(f"{toy}:echo", reward_type=mode)
    if mode == "sequential":  # the same function, called with one dict: wrap it
        path = write_file(Path(toy).parent, "echo_seq.py", f"""
            import importlib.util
            spec = importlib.util.spec_from_file_location("toy_echo", {toy!r})
            toy = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(toy)
            REWARD_TYPE = "sequential"
            def echo(item):
                return toy.echo([item])[0]
        """)
        spec = RewardFunctionSpec(f"{path}:echo")
    sample = inp(
        "real", "a", response_length=7, prompt="Q?", images=[Image.new("RGB", (28, 56))],
        original_image_sizes=[(100, 200)], extra={"task": "colour", "response": "EXTRA"},
    )
    with manager(spec) as m:
        scores = m.compute([sample]).scores
    assert scores == {
        "overall": [1.0], "width": [28.0], "original_width": [100.0], "length": [7.0],
        "prompt_ok": [1.0], "task_is_colour": [1.0], "standard_key_kept": [1.0],
    }


EASYR1_BATCH = r'''
import re
from typing import Any

REWARD_NAME = "easyr1_math"
REWARD_TYPE = "batch"


def format_reward(response: str) -> float:
    return 1.0 if re.fullmatch(r"<think>.*</think>.*\\boxed\{.*\}.*", response, re.DOTALL) else 0.0


def accuracy_reward(response: str, ground_truth: str) -> float:
    found = re.findall(r"\\boxed\{(.*?)\}", response)
    return 1.0 if found and found[-1].strip() == ground_truth.strip() else 0.0


def compute_score(reward_inputs: list[dict[str, Any]], format_weight: float = 0.1) -> list[dict[str, float]]:
    if not isinstance(reward_inputs, list):
        raise ValueError("Please use `reward_type=batch` for this reward function.")
    scores = []
    for reward_input in reward_inputs:
        response = re.sub(r"\s*(<|>|/)\s*", r"\1", reward_input["response"])
        format_score = format_reward(response)
        accuracy_score = accuracy_reward(response, reward_input["ground_truth"])
        scores.append({
            "overall": (1 - format_weight) * accuracy_score + format_weight * format_score,
            "format": format_score,
            "accuracy": accuracy_score,
        })
    return scores
'''

EASYR1_SEQUENTIAL = r'''
REWARD_NAME = "easyr1_len"
REWARD_TYPE = "sequential"


def compute_score(reward_input: dict, max_length: int = 4) -> dict[str, float]:
    if not isinstance(reward_input, dict):
        raise ValueError("Please use `reward_type=sequential` for this reward function.")
    short = float(reward_input["response_length"] <= max_length)
    right = float(reward_input["response"] == reward_input["ground_truth"])
    return {"overall": right * short, "short": short}
'''


def test_easyr1_reward_files_work_unchanged(tmp_path):
    batch_file = write_file(tmp_path, "easyr1_math.py", EASYR1_BATCH)
    seq_file = write_file(tmp_path, "easyr1_len.py", EASYR1_SEQUENTIAL)
    inputs = [
        inp("<think> 2+2 </think> so \\boxed{4}", "4", response_length=12),
        inp("\\boxed{4}", "4", response_length=3),
        inp("<think>hm</think>\\boxed{5}", "4", response_length=4),
    ]
    with manager(RewardFunctionSpec(f"{batch_file}:compute_score", {"format_weight": 0.2})) as m:
        result = m.compute(inputs)
    # (format, accuracy): (1, 1) -> 1.0; (0, 1) -> 0.8; (1, 0) -> 0.2
    assert result.scores["overall"] == pytest.approx([1.0, 0.8, 0.2])
    assert result.scores["format"] == [1.0, 0.0, 1.0] and result.scores["accuracy"] == [1.0, 1.0, 0.0]
    with manager(f"{seq_file}:compute_score") as m:
        result = m.compute([inp("4", "4", response_length=2), inp("4", "4", response_length=9)])
    assert result.scores == {"overall": [1.0, 0.0], "short": [1.0, 0.0]}


def test_settings_from_the_real_config(tmp_path, monkeypatch, toy):
    write_file(tmp_path, "r.py", "def main(items):\n    return [0.0 for _ in items]\n")
    monkeypatch.chdir(tmp_path)
    settings = reward_settings_of(RewardConfig(
        reward_function="r.py", reward_function_kwargs={}, timeout=7.0, on_error="zero", num_workers=3))
    assert settings == RewardSettings(
        (RewardFunctionSpec(f"{tmp_path / 'r.py'}:main", {}, 1.0, None),), RewardCallSettings(7.0, "zero", 3))
    settings = reward_settings_of(RewardConfig(reward_type="sequential", reward_functions=[
        RewardFunctionConfig("r.py:main", {"k": 1}, 0.3), RewardFunctionConfig(f"{toy}:batch", {}, 2.0)]))
    assert settings.functions == (
        RewardFunctionSpec(f"{tmp_path / 'r.py'}:main", {"k": 1}, 0.3, "sequential"),
        RewardFunctionSpec(f"{toy}:batch", {}, 2.0, "sequential"),
    )
    with pytest.raises(RewardError, match="worker.reward.reward_function is unset"):
        reward_settings_of(RewardConfig())


@pytest.mark.parametrize("kwargs", [{"on_error": "ignore"}, {"timeout": 0}, {"num_workers": 0}])
def test_settings_refuse_what_the_config_check_refuses(kwargs):
    # the same rules, by key, as the config check reports (tests/config/test_validate.py: worker.reward.*)
    key = next(iter(kwargs))
    with pytest.raises(ValueError, match=f"worker.reward.{key} must"):
        RewardCallSettings(**kwargs)
