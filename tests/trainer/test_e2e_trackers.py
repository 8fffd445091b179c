"""Real 2-step runs logging to mlflow and to swanlab (offline, in tmp_path): the metrics are read
back from each store and equal the file logger's, and the run's viewer pages reach the store."""

from __future__ import annotations

import json
import os

import pytest
from test_tracking import leveldb_records

from easyvlm.trainer.main import main


@pytest.fixture
def tracker_env(monkeypatch):
    """No tracker settings from the machine; swanlab offline. HOME stays: Ray keeps its session
    token there, and a Ray head started with an empty HOME timed out in CI."""
    for key in list(os.environ):
        if key.startswith(("WANDB_", "SWANLAB_", "MLFLOW_")):
            monkeypatch.delenv(key)
    monkeypatch.setenv("SWANLAB_PROBE_REQUIREMENTS", "false")
    monkeypatch.setenv("SWANLAB_MODE", "offline")
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # what the backend sets; undone after the test


def file_rewards(run_dir) -> dict[int, float]:
    rows = [json.loads(line) for line in (run_dir / "experiment_log.jsonl").read_text().splitlines()]
    return {r["step"]: r["reward/overall"] for r in rows if "reward/overall" in r}


@pytest.mark.usefixtures("e2e_ray", "tracker_env")
class TestTrackerRuns:
    def test_mlflow_run_holds_the_metrics_and_the_viewer_pages(self, e2e_base_args, tmp_path):
        from mlflow import MlflowClient

        main([*e2e_base_args, "trainer.logger=[console,file,mlflow]", "trainer.rollout_log_freq=2",
              "trainer.project_name=proj", f"trainer.save_checkpoint_path={tmp_path}"])
        client = MlflowClient(tracking_uri=(tmp_path / "mlruns").as_uri())
        (run,) = client.search_runs([client.get_experiment_by_name("proj").experiment_id])
        stored = {m.step: m.value for m in client.get_metric_history(run.info.run_id, "reward/overall")}
        assert stored == pytest.approx(file_rewards(tmp_path), abs=1e-9) and sorted(stored) == [1, 2]
        listed = {a.path for a in client.list_artifacts(run.info.run_id, "rollouts")}
        assert {"rollouts/step_2.html", "rollouts/step_2.jsonl", "rollouts/media"} <= listed
        assert (tmp_path / "learning_curve.png").is_file()

    def test_swanlab_run_holds_the_metrics(self, e2e_base_args, tmp_path):
        from swanlab.proto.swanlab.record.v1.record_pb2 import Record

        main([*e2e_base_args, "trainer.logger=[console,file,swanlab]", f"trainer.save_checkpoint_path={tmp_path}"])
        (run_dir,) = (tmp_path / "swanlog").glob("run-*")
        stored = {}
        for raw in leveldb_records(next(run_dir.glob("run-*.swanlab"))):
            record = Record()
            record.ParseFromString(raw)
            if record.WhichOneof("record_type") == "scalar" and record.scalar.key == "reward/overall":
                stored[record.scalar.step] = record.scalar.value.number
        assert stored == pytest.approx(file_rewards(tmp_path), abs=1e-6) and sorted(stored) == [1, 2]
