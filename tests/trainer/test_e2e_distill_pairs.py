"""On-policy distillation end to end with teachers the plan accepts since issue 55: an MoE teacher
of a dense student's generation, and a teacher whose output layer is padded past the tokenizer.
Each trains 2 steps through ``main(argv)`` (one Ray session for both, as tests/trainer/test_e2e.py)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
from teacher_testing import padded_teacher, with_files_of
from test_e2e import HASH_REWARD, assert_finite, read_jsonl

DISTILL_KEYS = ["actor/distill_loss", "distill/reverse_kl", "distill/teacher_logprob", "timing_s/teacher",
                "actor/pg_loss", "actor/grad_norm", "reward/overall"]


def run(base_args: list[str], tmp_path: Path, *overrides: str) -> list[dict]:
    from easyvlm.trainer.main import main

    returned = main([*base_args, f"worker.reward.reward_function={HASH_REWARD}", "worker.rollout.name=hf",
                     "algorithm.disable_kl=true", "algorithm.distill_coef=1.0", "worker.teacher.enable=true",
                     *overrides, f"trainer.save_checkpoint_path={tmp_path / 'run'}"])
    assert returned["training/global_step"] == 2.0
    rows = read_jsonl(tmp_path / "run" / "experiment_log.jsonl")
    assert [row["step"] for row in rows] == [1, 2]
    for row in rows:
        print({key: row.get(key) for key in DISTILL_KEYS[:3]})
        assert_finite(row, DISTILL_KEYS)
        assert row["actor/skipped_steps"] == 0.0  # finite loss and gradients: the optimizer stepped
    return rows


@pytest.mark.slow
@pytest.mark.usefixtures("e2e_ray")
class TestDistillationPairs:
    def test_an_moe_teacher_distils_into_a_dense_student(self, e2e_base_args, easyvlm_cache_dir, tmp_path):
        """tiny-qwen3-vl-moe's weights with tiny-qwen3-vl's tokenizer (the builtin MoE has 8 answer
        words more, which the check refuses), into tiny-qwen3-vl: its 272 output rows cover the
        student's 264 tokens. Two PPO epochs, so the second's tokens are off-policy (old log-probs
        pass, importance-weighted one-sample loss)."""
        from easyvlm.builtin.models import materialize_model

        student = materialize_model("tiny-qwen3-vl", cache_dir=easyvlm_cache_dir)
        teacher = with_files_of(materialize_model("tiny-qwen3-vl-moe", cache_dir=easyvlm_cache_dir), student,
                                tmp_path / "teacher")
        rows = run(e2e_base_args, tmp_path, f"worker.actor.model.model_path={student}",
                   f"worker.teacher.model.model_path={teacher}", "worker.actor.ppo_epochs=2")
        for row in rows:
            assert "timing_s/old" in row  # two epochs: the old log-probs pass ran
            # another model: the teacher finds the student's random tokens less likely than it does
            assert row["distill/reverse_kl"] != 0.0 and row["distill/teacher_logprob"] < 0

    def test_a_padded_teacher_and_the_full_kl(self, e2e_base_args, tiny_model_path, tmp_path):
        """The student's own starting model with 8 output rows past the tokenizer, and the exact KL:
        over the 264 shared rows the teacher is the student at step 1 (KL ~0: the padding rows are
        blocked, not compared), and the reward's policy gradient has moved the student by step 2."""
        teacher = padded_teacher(tiny_model_path, 8, tmp_path / "padded")
        rows = run(e2e_base_args, tmp_path, f"worker.teacher.model.model_path={teacher}",
                   "algorithm.distill_full_kl=true")
        assert abs(rows[0]["distill/reverse_kl"]) < 1e-6
        assert rows[1]["distill/reverse_kl"] > 1e-6 and math.isfinite(rows[1]["actor/distill_loss"])
