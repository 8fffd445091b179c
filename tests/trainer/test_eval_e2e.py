"""``python -m easyvlm.eval`` on a checkpoint reproduces the trainer's last validation.

A 2-step run validates and saves at step 2 (per-request seeds); the eval of that checkpoint with the
same config samples the same answers (same batches, same seeds from the checkpoint's step) and so
reports the same accuracy, exactly. With 4 answers per prompt: pass@1 <= pass@2 <= pass@4 and
mean@4 <= pass@4.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from easyvlm.eval.run import main as eval_main
from easyvlm.trainer.main import main as train_main

# samples of a prompt score differently (the synthetic reward scores the untrained model 0 throughout)
REWARD = Path(__file__).parent / "e2e_reward.py"
SEEDED = ["worker.rollout.per_request_seed=true", "worker.rollout.enable_chunked_prefill=false",
          f"worker.reward.reward_function={REWARD}:compute_score"]


@pytest.fixture(scope="class")
def trained(e2e_ray, e2e_base_args, tmp_path_factory):
    save = tmp_path_factory.mktemp("eval_run")
    train_main([*e2e_base_args, *SEEDED, "trainer.val_freq=2", "trainer.save_freq=2", "trainer.logger=[file]",
                f"trainer.save_checkpoint_path={save}"])
    rows = [json.loads(line) for line in (save / "experiment_log.jsonl").read_text().splitlines()]
    return save, rows[-1]


@pytest.mark.usefixtures("e2e_ray")
class TestEval:
    def test_eval_of_the_checkpoint_reports_the_trainers_last_validation(self, trained, e2e_base_args, capsys):
        save, last = trained
        summary = eval_main([*e2e_base_args, *SEEDED, f"worker.actor.model.model_path={save / 'global_step_2'}",
                             f"trainer.save_checkpoint_path={save}"])
        assert summary["step"] == 2 and summary["k"] == 1
        assert 0 < last["val/accuracy_reward"] < 1  # right and wrong answers: the comparison bites
        assert summary["val/accuracy_reward"] == last["val/accuracy_reward"]
        assert summary["mean@1"] == summary["pass@1"] == last["val/accuracy_reward"]  # accuracy is 0 or 1
        printed = capsys.readouterr().out.strip().splitlines()[-1]
        assert json.loads(printed) == summary == json.loads((save / "global_step_2" / "eval" / "summary.json").read_text())
        rows = [json.loads(line) for line in (save / "global_step_2" / "eval" / "rollouts" / "eval_step_2.jsonl").read_text().splitlines()]
        assert len(rows) == summary["samples"] and {r["split"] for r in rows} == {"eval"}

    def test_k_answers_per_prompt(self, trained, e2e_base_args):
        save, _ = trained
        summary = eval_main([*e2e_base_args, *SEEDED, f"worker.actor.model.model_path={save}",  # a run dir: its latest checkpoint
                             "worker.rollout.val_override_config={n: 4}", f"trainer.save_checkpoint_path={save}"])
        assert summary["k"] == 4 and summary["samples"] == 4 * summary["prompts"]
        assert summary["pass@1"] <= summary["pass@2"] <= summary["pass@4"]
        assert summary["mean@4"] == pytest.approx(summary["pass@1"]) and summary["mean@4"] <= summary["pass@4"]
        assert summary["pass@4"] > summary["mean@4"]  # some prompt has right and wrong answers


def test_config_errors_exit_2_before_any_model_loads(e2e_base_args, e2e_env, tmp_path):
    import os

    result = subprocess.run(
        [sys.executable, "-m", "easyvlm.eval", *e2e_base_args, "data.val_files=", f"trainer.save_checkpoint_path={tmp_path}"],
        capture_output=True, text=True, env={**os.environ, **e2e_env}, timeout=120,
    )
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert "data.val_files" in result.stderr
