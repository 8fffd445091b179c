"""trainer.save_model_only: checkpoints that hold only the Hugging Face export, and a clear error
(not a crash, not a silent restart) when a run would resume from one."""

from __future__ import annotations

import json

import pytest
import torch

from easyvlm.run.checkpoint import (
    HF_EXPORT_DIR,
    CheckpointError,
    CheckpointManager,
    check_resumable,
    checkpoint_info,
    resolve_checkpoint,
)


def test_model_only_commit_is_recorded_and_refused_for_resume(tmp_path):
    mgr = CheckpointManager(tmp_path, save_limit=1)
    (mgr.partial_dir(2) / "trainer_state.pt").write_text("state")
    mgr.commit(2, score=0.5)
    (mgr.partial_dir(4) / "weights").write_text("w")
    mgr.commit(4, score=0.1, model_only=True)

    assert checkpoint_info(tmp_path / "global_step_2") == {"step": 2, "score": 0.5, "model_only": False}
    assert checkpoint_info(tmp_path / "global_step_4") == {"step": 4, "score": 0.1, "model_only": True}
    # pruning treats both kinds alike: the latest (4) and the best (2) stay
    assert mgr.completed_steps() == [2, 4]
    check_resumable(tmp_path / "global_step_2")  # a full checkpoint: no error
    latest = resolve_checkpoint(tmp_path)
    assert latest == tmp_path / "global_step_4"
    with pytest.raises(CheckpointError) as err:
        check_resumable(latest)
    message = str(err.value)
    assert "save_model_only=true" in message
    assert f"worker.actor.model.model_path={latest / HF_EXPORT_DIR}" in message


def test_checkpoints_of_older_versions_are_resumable(tmp_path):
    # COMPLETE files written before save_model_only existed have no "model_only" key
    step = tmp_path / "global_step_3"
    step.mkdir()
    (step / "COMPLETE").write_text(json.dumps({"step": 3, "score": None}))
    check_resumable(step)


@pytest.mark.slow
@pytest.mark.usefixtures("e2e_ray")
def test_training_run_saves_only_the_model(e2e_base_args, tiny_model_path, tmp_path, capsys):
    """1 step and its checkpoint: only the HF export is written, it holds the trained weights, and
    rerunning the command stops with the clear error."""
    from transformers import AutoModelForImageTextToText

    from easyvlm.trainer.main import main

    argv = [
        *e2e_base_args,
        "worker.rollout.name=hf",  # no vLLM engine to build: this test is about the checkpoint
        "trainer.max_steps=1",
        "trainer.save_freq=1",
        "trainer.save_model_only=true",
        f"trainer.save_checkpoint_path={tmp_path}",
    ]
    main(argv)

    ckpt = tmp_path / "global_step_1"
    assert sorted(p.name for p in ckpt.iterdir()) == ["COMPLETE", "MANIFEST.json", "actor"]  # no trainer_state.pt
    assert sorted(p.name for p in (ckpt / "actor").iterdir()) == ["huggingface"]  # no model_optim/, extra_state
    assert checkpoint_info(ckpt) == {"step": 1, "score": None, "model_only": True}
    initial = AutoModelForImageTextToText.from_pretrained(tiny_model_path).state_dict()
    trained = AutoModelForImageTextToText.from_pretrained(ckpt / HF_EXPORT_DIR).state_dict()
    assert trained.keys() == initial.keys()
    changed = [k for k in initial if not torch.equal(trained[k], initial[k])]
    assert "lm_head.weight" in changed  # the export holds the weights after the update (lr 3e-4)

    # resuming from it is refused in the driver, before Ray starts: exit 2 with the reason
    with pytest.raises(SystemExit) as info:
        main(argv)
    assert info.value.code == 2
    assert "checkpoint error: cannot resume" in capsys.readouterr().err
