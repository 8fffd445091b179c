"""The check of on-policy distillation (``worker.teacher``, ``algorithm.distill_*``): each refusal
names its key and the fix; a teacher whose files cannot score the student's rows is refused before
anything starts, naming both."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from test_validate import GAE, problems

from easyvlm.config.errors import ConfigError

TEACHER = ["algorithm.distill_coef=1.0", "worker.teacher.enable=true",
           "worker.teacher.model.model_path=builtin:tiny-qwen2.5-vl"]
PURE = [*TEACHER, "algorithm.distill_only=true", "algorithm.use_kl_loss=true"]


def keyed(*overrides: str) -> dict[str, str]:
    return {p.key: p.message for p in problems(*overrides)}


def test_valid_combinations_pass():
    assert problems(*TEACHER) == []
    assert problems(*TEACHER, "algorithm.distill_full_kl=true") == []
    assert problems(*TEACHER, "algorithm.distill_as_reward=true") == []
    assert problems(*PURE) == []
    assert problems(*PURE, "algorithm.distill_as_reward=true", "algorithm.disable_kl=true") == []


def test_a_coefficient_without_a_teacher_and_a_teacher_without_a_coefficient():
    assert "set worker.teacher.enable=true" in keyed("algorithm.distill_coef=0.5")["algorithm.distill_coef"]
    found = keyed("worker.teacher.enable=true", "worker.teacher.model.model_path=builtin:tiny-qwen2.5-vl")
    assert "loaded and never used" in found["worker.teacher.enable"] and "distill_coef > 0" in found["worker.teacher.enable"]
    found = keyed("algorithm.distill_coef=0.5", "worker.teacher.enable=true")
    assert "is unset" in found["worker.teacher.model.model_path"]


@pytest.mark.parametrize("value", ["-1", "nan", "inf"])
def test_the_coefficient_must_be_finite_and_not_negative(value):
    assert "finite number >= 0" in keyed(*TEACHER[1:], f"algorithm.distill_coef={value}")["algorithm.distill_coef"]


@pytest.mark.parametrize("key", ["distill_full_kl", "distill_as_reward", "distill_only"])
def test_the_forms_act_only_with_distillation_on(key):
    assert "acts only with distillation on" in keyed(f"algorithm.{key}=true")[f"algorithm.{key}"]


def test_the_full_kl_is_not_an_advantage():
    message = keyed(*TEACHER, "algorithm.distill_full_kl=true", "algorithm.distill_as_reward=true")["algorithm.distill_full_kl"]
    assert "keep one" in message


@pytest.mark.parametrize("overrides, key, words", [
    (GAE, "algorithm.distill_only", "adv_estimator=gae"),
    (["algorithm.adv_estimator=remax"], "algorithm.distill_only", "adv_estimator=remax"),
    (["algorithm.online_filtering=true"], "algorithm.online_filtering", "turn one of them off"),
    (["algorithm.use_kl_loss=false"], "algorithm.use_kl_loss", "use_kl_loss=true or disable_kl=true"),
])
def test_pure_distillation_refuses_what_acts_through_the_reward(overrides, key, words):
    assert words in keyed(*PURE, *overrides)[key]


def test_the_rollout_is_threshold_acts_on_the_one_sample_loss_without_rollout_is():
    # its upper bound truncates the distillation loss's off-policy weight (the full KL and the
    # advantage form have none): set alone, it is refused only where nothing reads it
    key = "algorithm.rollout_correction.rollout_is_threshold"
    assert problems(*TEACHER, f"{key}=3.0") == []
    for form in ("algorithm.distill_full_kl=true", "algorithm.distill_as_reward=true"):
        assert "rollout_is is null" in keyed(*TEACHER, form, f"{key}=3.0")[key]
    assert "rollout_is is null" in keyed(f"{key}=3.0")[key]


def test_the_teacher_is_never_trained():
    assert "no optimizer" in keyed(*TEACHER, "worker.teacher.offload.offload_optimizer=true")[
        "worker.teacher.offload.offload_optimizer"]


# ---------------------------------------------------------------------------------- the teacher's files
def refusal(tiny_model_path: str, teacher: str) -> str:
    from plan_testing import plan_for

    with pytest.raises(ConfigError) as caught:
        plan_for(tiny_model_path, *TEACHER[:2], f"worker.teacher.model.model_path={teacher}")
    (problem,) = caught.value.problems
    assert problem.key == "worker.teacher.model.model_path" and teacher in problem.message
    return problem.message


def test_a_teacher_with_another_tokenizer_is_refused(tiny_model_path):
    message = refusal(tiny_model_path, "builtin:tiny-qwen2.5-vl-words")  # the answer words are extra tokens
    assert "another tokenizer than the student" in message and "272 tokens against 264" in message


def test_a_teacher_of_another_family_is_refused(tiny_model_path):
    message = refusal(tiny_model_path, "builtin:tiny-qwen3-vl")
    assert "qwen3_vl model and the student a qwen2_5_vl one" in message


def test_a_teacher_with_another_image_processor_is_refused(tiny_model_path, tmp_path):
    teacher = Path(shutil.copytree(tiny_model_path, tmp_path / "teacher"))
    config = json.loads((teacher / "processor_config.json").read_text())
    config["image_processor"]["image_mean"] = [0.5, 0.5, 0.5]  # the pixel values the teacher was trained on differ
    (teacher / "processor_config.json").write_text(json.dumps(config))
    message = refusal(tiny_model_path, str(teacher))
    assert "another image processor" in message and "image_mean" in message


def test_the_distill_example_is_the_demo_with_a_teacher(monkeypatch):
    """examples/distill.yaml: the demo's settings, its teacher and pure distillation (exact KL), its
    own run name; the demo's 300 steps."""
    import dataclasses

    from test_validate import REPO

    from easyvlm.config.loader import load_config
    from easyvlm.config.validate import find_problems

    monkeypatch.chdir(REPO)
    distill, demo = load_config(["config=examples/distill.yaml"]), load_config(["config=examples/config.yaml"])
    assert find_problems(distill, check_files=True) == []
    assert (distill.worker.teacher.enable, distill.worker.teacher.model.model_path) == (True, "builtin:tiny-qwen2.5-vl-teacher")
    d = distill.algorithm.distill
    assert (d.distill_coef, d.distill_full_kl, d.distill_as_reward, d.distill_only) == (1.0, True, False, True)
    assert distill.worker == dataclasses.replace(demo.worker, teacher=distill.worker.teacher)
    assert dataclasses.replace(distill.algorithm, distill_coef=0.0, distill_full_kl=False, distill_only=False) == demo.algorithm
    assert dataclasses.replace(distill.trainer, experiment_name=demo.trainer.experiment_name) == demo.trainer
    assert distill.data == demo.data


def test_pure_distillation_keeps_a_reward_function_for_its_measurements():
    message = keyed(*PURE, "worker.reward.reward_function=null")["worker.reward.reward_function"]
    assert "is unset" in message and "set algorithm.distill_only=true" in message
    assert "distill_only" not in keyed("worker.reward.reward_function=null")["worker.reward.reward_function"]
