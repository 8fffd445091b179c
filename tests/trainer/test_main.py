"""easyvlm/trainer/main.py: how the driver starts or joins Ray (``trainer.ray_address``) and what
it reserves, without starting Ray (``ray.init`` is recorded)."""

from __future__ import annotations

import pytest
from plan_testing import plan_for

ray = pytest.importorskip("ray")


@pytest.fixture
def ray_init(monkeypatch):
    """Calls of ray.init, with Ray reported as not yet running and no RAY_ADDRESS in the environment."""
    calls = []
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "init", lambda **kwargs: calls.append(kwargs))
    return calls


def test_ray_address_joins_that_cluster(tiny_model_path, ray_init):
    from easyvlm.trainer.main import start_ray

    start_ray(plan_for(tiny_model_path, "trainer.ray_address=10.1.2.3:6379"))
    [kwargs] = ray_init
    assert kwargs["address"] == "10.1.2.3:6379" and "num_cpus" not in kwargs


def test_without_ray_address_a_local_cluster_with_the_reward_cpus(tiny_model_path, ray_init, monkeypatch):
    from easyvlm.trainer.main import start_ray

    monkeypatch.setattr("os.cpu_count", lambda: 2)
    start_ray(plan_for(tiny_model_path, "worker.reward.num_cpus=3"))
    [kwargs] = ray_init
    # max(2 cores, trainer.n_gpus_per_node 1) logical CPUs for the workers + worker.reward.num_cpus 3
    assert "address" not in kwargs and kwargs["num_cpus"] == 5


def test_a_joined_cluster_gets_no_paths_of_the_drivers_machine(tiny_model_path, ray_init, monkeypatch):
    """Caches and import paths are each node's own (its `ray start` environment); behaviour settings
    still reach every worker. A local cluster is this machine: it gets them all."""
    from easyvlm.trainer.main import start_ray

    for key, value in {"EASYVLM_CACHE": "/driver/cache", "HF_HOME": "/driver/hf", "PYTHONPATH": "/driver/src",
                       "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "EASYVLM_CPU_LINEAR": "aten"}.items():
        monkeypatch.setenv(key, value)
    start_ray(plan_for(tiny_model_path, "trainer.ray_address=10.1.2.3:6379"))
    start_ray(plan_for(tiny_model_path))
    joined, local = (kwargs["runtime_env"]["env_vars"] for kwargs in ray_init)
    assert not {"EASYVLM_CACHE", "HF_HOME", "PYTHONPATH"} & set(joined)
    assert joined["HF_HUB_OFFLINE"] == "1" and joined["OMP_NUM_THREADS"] == "1" and joined["EASYVLM_CPU_LINEAR"] == "aten"
    assert local["EASYVLM_CACHE"] == "/driver/cache" and local["PYTHONPATH"] == "/driver/src"


def test_a_bad_cpu_linear_switch_exits_2_before_the_plan(tiny_model_path, monkeypatch, capsys):
    from easyvlm.trainer.main import plan_run

    monkeypatch.setenv("EASYVLM_CPU_LINEAR", "fast")
    monkeypatch.setattr("easyvlm.trainer.main.parse_and_validate", lambda *a: pytest.fail("went on despite the bad switch"))
    with pytest.raises(SystemExit) as exit_:
        plan_run([f"worker.actor.model.model_path={tiny_model_path}"])
    assert exit_.value.code == 2
    assert "EASYVLM_CPU_LINEAR='fast': use 'auto'" in capsys.readouterr().err


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
