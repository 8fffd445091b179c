"""easyvlm/trainer/main.py: the run's trackers open in the driver before Ray starts (Ray's start,
the plan and the environment check are easyvlm/plan/launch.py's: tests/plan/test_launch.py)."""

from __future__ import annotations

import pytest


@pytest.mark.parametrize("store", ["uri", "path"])
def test_a_tracker_that_cannot_start_exits_2_before_ray(e2e_base_args, tmp_path, monkeypatch, capsys, store):
    """trainer.logger=[mlflow] with a tracking store mlflow cannot create (under a regular file): the
    tracker is opened in the driver before Ray starts, so the run stops there, naming the logger."""
    import easyvlm.trainer.main as main_module

    blocker = tmp_path / "a_file"
    blocker.write_text("not a directory")
    target = blocker / "mlruns"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", target.as_uri() if store == "uri" else str(target))
    monkeypatch.setattr(main_module, "start_ray", lambda plan: pytest.fail("Ray started despite the tracker error"))
    with pytest.raises(SystemExit) as exit_info:
        main_module.main([*e2e_base_args, "trainer.logger=[console,mlflow]", f"trainer.save_checkpoint_path={tmp_path / 'run'}"])
    assert exit_info.value.code == 2
    assert "easyvlm: tracker error (trainer.logger: console, mlflow): " in capsys.readouterr().err


@pytest.mark.parametrize("store", ["uri", "path"])
def test_mlflow_takes_a_file_uri_or_a_plain_path_as_its_store(e2e_base_args, tmp_path, monkeypatch, store):
    """MLFLOW_TRACKING_URI as a file:// URI or a plain directory: the tracker opens (before Ray) and
    the store holds the run's experiment."""
    from mlflow import MlflowClient

    import easyvlm.trainer.main as main_module
    from easyvlm.plan.build import build_plan
    from easyvlm.config.cli import parse_and_validate

    target = tmp_path / "store"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", target.as_uri() if store == "uri" else str(target))
    cfg = parse_and_validate([*e2e_base_args, "trainer.logger=[mlflow]", f"trainer.save_checkpoint_path={tmp_path / 'run'}"])
    tracker = main_module.open_tracker_or_exit(build_plan(cfg, "cpu"), 8, None)
    tracker.log(1, {"reward/overall": 0.5})
    tracker.close()
    experiment = MlflowClient(tracking_uri=target.as_uri()).get_experiment_by_name("easyvlm")
    assert experiment is not None  # the project name (examples/config.yaml's trainer.project_name)


def test_a_batch_larger_than_the_training_set_exits_2_naming_the_key(e2e_base_args, tmp_path, monkeypatch, capsys):
    """data.rollout_batch_size above the prompts left after filtering, with generation rounds that fit: a
    config error before any tracker or Ray starts (it was reported as a tracker error)."""
    import easyvlm.trainer.main as main_module

    monkeypatch.setattr(main_module, "start_ray", lambda plan: pytest.fail("Ray started despite the config error"))
    monkeypatch.setattr(main_module, "open_tracker_or_exit", lambda *a: pytest.fail("a tracker opened"))
    with pytest.raises(SystemExit) as exit_info:
        # generation rounds of 8 prompts fit the 64 rows (the loader's own check passes), a step's 128 do not
        main_module.main([*e2e_base_args, "data.rollout_batch_size=128", "data.mini_rollout_batch_size=8",
                          "worker.actor.global_batch_size=128", "trainer.max_steps=null",
                          f"trainer.save_checkpoint_path={tmp_path / 'run'}"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "data.rollout_batch_size" in err and "is larger than the training set" in err, err
