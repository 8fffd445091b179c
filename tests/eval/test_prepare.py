"""easyvlm/eval/run.py's ``prepare``: argv -> the run plan with the config parsed and validated once;
a checkpoint is evaluated through its Hugging Face export, at its step, into ``<checkpoint>/eval``."""

from __future__ import annotations

import json
import shutil

import pytest
from plan_testing import BASE_OVERRIDES, REPO


def eval_args(model_path: str, save: str) -> list[str]:
    return [*BASE_OVERRIDES, "data.val_files=builtin:synthetic@val", f"worker.actor.model.model_path={model_path}",
            f"worker.reward.reward_function={REPO / 'reward_functions' / 'synthetic.py'}:compute_score",
            f"trainer.save_checkpoint_path={save}"]


def test_a_checkpoint_is_planned_through_its_export_with_one_parse(tiny_model_path, tmp_path, monkeypatch):
    import easyvlm.eval.run as eval_run
    import easyvlm.plan.launch as launch

    checkpoint = tmp_path / "run" / "global_step_3"  # a checkpoint as the trainer commits it, minus the state
    shutil.copytree(tiny_model_path, checkpoint / "actor" / "huggingface")  # 2.5 MB
    (checkpoint / "COMPLETE").write_text(json.dumps({"step": 3, "score": None, "model_only": True}))
    parsed = []
    parse = eval_run.parse_and_validate
    monkeypatch.setattr(eval_run, "parse_and_validate", lambda argv: parsed.append(list(argv)) or parse(argv))
    monkeypatch.setattr(launch, "parse_and_validate", lambda *a: pytest.fail("the config was parsed a second time"))

    plan, step, out_dir, found = eval_run.prepare(eval_args(str(checkpoint), str(tmp_path / "run")))
    assert len(parsed) == 1 and parsed[0][-1] == "trainer.val_only=true"
    export = str(checkpoint / "actor" / "huggingface")
    assert plan.actor.model.model_path == export and plan.driver.val_only
    assert (step, out_dir, found) == (3, checkpoint / "eval", checkpoint)


def test_a_model_directory_is_planned_as_given_into_the_save_path(tiny_model_path, tmp_path):
    from easyvlm.eval.run import prepare

    plan, step, out_dir, found = prepare(eval_args(tiny_model_path, str(tmp_path / "run")))
    assert plan.actor.model.model_path == tiny_model_path
    assert (step, out_dir, found) == (0, tmp_path / "run" / "eval", None)
