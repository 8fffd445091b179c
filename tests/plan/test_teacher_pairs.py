"""Which teachers the plan accepts for a student (``plan.roles.teacher_problem``, ``teacher_spec``): an
MoE teacher of a dense student's generation (and the reverse), and output layers padded past the
tokenizer to another size; other families, other tokenizers and layers smaller than the tokenizer
stay refused, naming the key."""

from __future__ import annotations

import pytest
from plan_testing import plan_for
from teacher_testing import padded_teacher, with_files_of

from easyvlm.config.errors import ConfigError
from easyvlm.plan.roles import reads_same_inputs

KEY = "worker.teacher.model.model_path"


def distilling(teacher: str, *extra: str) -> tuple[str, ...]:
    return ("algorithm.disable_kl=true", "algorithm.distill_coef=1.0", "worker.teacher.enable=true", f"{KEY}={teacher}",
            *extra)


def refusal(student: str, teacher: str, *extra: str) -> str:
    with pytest.raises(ConfigError) as caught:
        plan_for(student, *distilling(teacher, *extra))
    (problem,) = caught.value.problems
    assert problem.key == KEY and teacher in problem.message
    return problem.message


@pytest.fixture(scope="module")
def built(easyvlm_cache_dir):
    """name -> the directory of a builtin model (each builds in seconds, once per cache)."""
    from easyvlm.builtin.models import materialize_model

    return lambda name: str(materialize_model(name, cache_dir=easyvlm_cache_dir))


def test_the_table_of_same_input_model_types():
    # the same generation, in either direction; a family with itself; nothing across generations
    assert reads_same_inputs("qwen3_vl_moe", "qwen3_vl") and reads_same_inputs("qwen3_vl", "qwen3_vl_moe")
    assert reads_same_inputs("qwen3_5_moe", "qwen3_5") and reads_same_inputs("qwen3_5", "qwen3_5_moe")
    assert reads_same_inputs("qwen2_5_vl", "qwen2_5_vl")
    assert not reads_same_inputs("qwen3_vl_moe", "qwen3_5") and not reads_same_inputs("qwen3_vl", "qwen3_5")
    assert not reads_same_inputs("qwen3_5_moe", "qwen3_vl") and not reads_same_inputs("qwen2_vl", "qwen2_5_vl")


@pytest.mark.parametrize(("student", "teacher"), [("tiny-qwen3.5", "tiny-qwen3.5-moe"), ("tiny-qwen3.5-moe", "tiny-qwen3.5")])
def test_an_moe_teacher_of_the_dense_students_generation_is_accepted(built, student, teacher):
    # the two share the tokenizer (272 tokens, answer words included), the processor and the ids
    plan = plan_for(built(student), *distilling(f"builtin:{teacher}"))
    assert plan.teacher.model.hf_config.model_type == teacher.replace("tiny-", "").replace(".", "_").replace("-", "_")
    assert plan.actor.model.hf_config.model_type != plan.teacher.model.hf_config.model_type
    # same output rows: the teacher blocks exactly the student's ids
    assert plan.teacher.forward.blocked_token_ids == plan.actor.forward.blocked_token_ids


def test_the_builtin_qwen3_vl_moe_has_another_tokenizer_than_qwen3_vl(built):
    # its answer words are 8 extra tokens: the family is accepted now, the tokenizer still is not
    message = refusal(built("tiny-qwen3-vl"), "builtin:tiny-qwen3-vl-moe")
    assert "another tokenizer than the student" in message and "272 tokens against 264" in message


def test_an_moe_teacher_with_the_students_tokenizer_and_more_rows_is_accepted(built, tmp_path):
    # tiny-qwen3-vl-moe's weights with tiny-qwen3-vl's tokenizer: its 272 output rows cover the
    # student's 264 tokens; rows 264..271 are past the tokenizer, so the teacher blocks them
    student = built("tiny-qwen3-vl")
    teacher = with_files_of(built("tiny-qwen3-vl-moe"), student, tmp_path / "teacher")
    plan = plan_for(student, *distilling(str(teacher), "algorithm.distill_full_kl=true"))
    assert plan.teacher.model.hf_config.model_type == "qwen3_vl_moe"
    assert plan.teacher.model.hf_config.get_text_config().vocab_size == 272
    assert plan.teacher.forward.blocked_token_ids == (*plan.actor.forward.blocked_token_ids, *range(264, 272))


@pytest.mark.parametrize(("student", "teacher"), [("tiny-qwen3.5", "tiny-qwen3-vl-moe"), ("tiny-qwen3-vl", "tiny-qwen3.5")])
def test_other_generations_stay_refused(built, student, teacher):
    message = refusal(built(student), f"builtin:{teacher}")
    assert "must be of the student's family (or its MoE / dense sibling of the same generation)" in message


def test_a_teacher_padded_past_the_tokenizer_is_accepted(tiny_model_path, tmp_path):
    teacher = padded_teacher(tiny_model_path, 8, tmp_path / "padded")
    plan = plan_for(tiny_model_path, *distilling(str(teacher), "algorithm.distill_full_kl=true"))
    assert plan.teacher.model.hf_config.get_text_config().vocab_size == 272
    assert plan.actor.model.hf_config.get_text_config().vocab_size == 264
    # its 8 padding rows leave its distribution (-inf), so both have all their mass on ids 0..263
    assert plan.teacher.forward.blocked_token_ids == (*plan.actor.forward.blocked_token_ids, *range(264, 272))


def test_a_teacher_with_fewer_rows_than_the_tokenizer_is_refused(tiny_model_path):
    message = refusal(tiny_model_path, "builtin:tiny-qwen2.5-vl",
                      "worker.teacher.model.override_config={text_config: {vocab_size: 200}}")
    assert "has 200 output rows (text_config.vocab_size in its config.json) for the 264 tokens" in message
    assert "must cover the tokenizer" in message


def test_the_off_policy_weights_cap_is_the_rollout_corrections_threshold(tiny_model_path):
    # algorithm.rollout_correction.rollout_is_threshold: its upper bound truncates the distillation
    # loss's weight (acts without rollout_is; IcePop bounds l_u give their u)
    assert plan_for(tiny_model_path, *distilling("builtin:tiny-qwen2.5-vl")).actor.distill_weight_cap == 2.0
    for threshold, cap in (("3.5", 3.5), ("0.5_4.0", 4.0)):
        plan = plan_for(tiny_model_path, *distilling("builtin:tiny-qwen2.5-vl",
                                                     f"algorithm.rollout_correction.rollout_is_threshold={threshold}"))
        assert plan.actor.distill_weight_cap == cap
