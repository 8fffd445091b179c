"""The reward Ray actor (asynchronous scoring, errors reaching the driver), math_equal inside Ray
actors, and build_reward_inputs over a rollout Batch with the built-in tokenizer."""

from __future__ import annotations

import sys
import threading

import pytest
import torch
from PIL import Image
from rewards_testing import SHIPPED, inp, write_file

from easyvlm.plan.build import reward_settings_of
from easyvlm.rewards.settings import RewardConfig, RewardFunctionConfig
from easyvlm.data.batch import Batch
from easyvlm.rewards import RewardError
from easyvlm.rewards.actor import build_reward_inputs, create_reward_actor

ray = pytest.importorskip("ray")


@pytest.fixture(scope="module")
def ray_session():
    started = not ray.is_initialized()
    if started:
        ray.init(num_cpus=1, include_dashboard=False, log_to_driver=False)
    yield
    if started:
        ray.shutdown()


class MathCheckActor:
    """math_equal called in the actor's method (the main thread) and in a thread the method starts."""

    def check(self, prediction: str, truth: str, timeout: float, in_thread: bool) -> tuple[bool, bool]:
        from easyvlm.rewards.mathcheck import math_equal

        box = {}

        def run():
            box["main"] = threading.current_thread() is threading.main_thread()
            box["equal"] = math_equal(prediction, truth, timeout=timeout)

        if in_thread:
            thread = threading.Thread(target=run)
            thread.start()
            thread.join()
        else:
            run()
        return box["main"], box["equal"]


@pytest.mark.slow
def test_math_equal_in_a_ray_actor(ray_session):
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # this test module is not importable there
    actor = ray.remote(num_cpus=0)(MathCheckActor).remote()
    try:
        calls = {
            ("main thread", "right"): actor.check.remote("\\frac{1}{2}", "0.5", 5.0, False),
            ("main thread", "hangs"): actor.check.remote("10^{10^{10}}", "1", 1.0, False),
            ("other thread", "right"): actor.check.remote("\\frac{1}{2}", "0.5", 5.0, True),
            ("other thread", "hangs"): actor.check.remote("10^{10^{10}}", "1", 1.0, True),
            ("other thread", "wrong"): actor.check.remote("3", "4", 5.0, True),
        }
        results = {k: ray.get(v, timeout=60) for k, v in calls.items()}
    finally:
        ray.kill(actor)
    assert results == {
        ("main thread", "right"): (True, True),
        ("main thread", "hangs"): (True, False),
        ("other thread", "right"): (False, True),
        ("other thread", "hangs"): (False, False),
        ("other thread", "wrong"): (False, False),
    }


FAILING = '''
def compute_score(items):
    return [1 / len(x["response"]) for x in items]
'''


@pytest.mark.slow
def test_reward_actor_scores_asynchronously_and_raises_in_the_driver(ray_session, tmp_path, monkeypatch):
    inverse = write_file(tmp_path, "inverse.py", FAILING)
    monkeypatch.chdir(SHIPPED.parent)  # a relative path, resolved in the driver
    config = RewardConfig(num_cpus=1, timeout=60, reward_functions=[
        RewardFunctionConfig("./reward_functions/math.py:compute_score", {}, 1.0),
        RewardFunctionConfig(f"{inverse}:compute_score", {}, 2.0),
    ])
    actor = create_reward_actor(reward_settings_of(config), num_cpus=1)
    try:
        right, wrong = "<think>a</think>\\boxed{\\frac{1}{2}}", "<think>a</think>\\boxed{3}"
        assert (len(right), len(wrong)) == (35, 25)
        ref = actor.compute.remote([inp(right, "0.5"), inp(wrong, "4")])  # returns at once
        result = ray.get(ref, timeout=120)
        # math: right 1.0, wrong 0.1 (format only); inverse: 1/35, 1/25, weighted 2
        assert result.overall == pytest.approx([1.0 + 2 / 35, 0.1 + 2 / 25])
        assert result.scores["math/accuracy"] == [1.0, 0.0]
        with pytest.raises(RewardError) as err:
            ray.get(actor.compute.remote([inp("<think>a</think>\\boxed{1}", "1"), inp("", "1")]), timeout=120)
    finally:
        ray.kill(actor)
    assert (f"reward function {inverse}:compute_score (batch) failed on sample 1 (response ''): it raised "
            "ZeroDivisionError: division by zero (at inverse.py:3 in ") in str(err.value)
    assert err.value.sample_index == 1


def test_bad_spec_fails_in_the_driver_before_any_actor(tmp_path):
    from easyvlm.config.errors import ConfigError
    from easyvlm.config.schema import PPOConfig
    from easyvlm.config.worker_schema import WorkerConfig
    from easyvlm.plan.build import reward_settings
    from easyvlm.rewards.settings import RewardConfig

    cfg = PPOConfig(worker=WorkerConfig(reward=RewardConfig(reward_function=str(tmp_path / "missing.py"))))
    with pytest.raises(ConfigError, match=r"missing\.py:main: plugin file not found") as info:
        reward_settings(cfg)  # the plan builder's check, in the driver before Ray starts
    assert info.value.problems[0].key == "worker.reward"


def test_build_reward_inputs(tiny_model_path):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_path)
    red = tok("red", add_special_tokens=False)["input_ids"]
    four = tok("four", add_special_tokens=False)["input_ids"]
    eos, pad = tok.convert_tokens_to_ids("<|im_end|>"), tok.pad_token_id
    # sample 0: "red" + EOS, then padding; sample 1: "four" cut at the length limit (no EOS)
    T = len(four) + 2
    rows = [red + [eos] + [pad] * (T - len(red) - 1), four + [pad] * 2]
    lengths = [len(red) + 1, len(four)]
    mask = torch.tensor([[t < n for t in range(T)] for n in lengths])
    image = Image.new("RGB", (28, 28))
    batch = Batch(
        {"responses": torch.tensor(rows), "response_mask": mask},
        {
            "ground_truth": ["red", "4"],
            "prompt_text": ["<|im_start|>user\nQ1", "<|im_start|>user\nQ2"],
            "images": [[image], []],
            "original_image_sizes": [[(100, 50)], []],
            "extra": [{"task": "colour"}, {"task": "count", "response": "not the response"}],
            "uid": ["u0", "u1"],
        },
    )
    inputs = build_reward_inputs(batch, tok)
    assert [x.response for x in inputs] == ["red", "four"]  # EOS dropped (skip_special_tokens)
    assert [x.response_length for x in inputs] == [4, 4]  # byte tokens: r e d <eos> / f o u r
    assert [x.ground_truth for x in inputs] == ["red", "4"]
    assert [x.prompt for x in inputs] == ["<|im_start|>user\nQ1", "<|im_start|>user\nQ2"]
    assert inputs[0].images == [image] and inputs[1].images == []
    assert inputs[0].original_image_sizes == [(100, 50)]
    assert inputs[1].to_dict()["response"] == "four" and inputs[1].to_dict()["task"] == "count"
    assert build_reward_inputs(batch, tok, skip_special_tokens=False)[0].response == "red<|im_end|>"
    # a Batch without the optional objects still works
    bare = build_reward_inputs(batch.select("responses", "response_mask", "ground_truth"), tok)
    assert (bare[0].prompt, bare[0].images, bare[0].original_image_sizes, bare[0].extra) == ("", [], None, {})
