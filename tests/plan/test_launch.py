"""easyvlm/plan/launch.py: how a command starts or joins Ray (``trainer.ray_address``) and what it
reserves, without starting Ray (``ray.init`` is recorded); the environment check before the config."""

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
    from easyvlm.plan.launch import start_ray

    start_ray(plan_for(tiny_model_path, "trainer.ray_address=10.1.2.3:6379"))
    [kwargs] = ray_init
    assert kwargs["address"] == "10.1.2.3:6379" and "num_cpus" not in kwargs


def test_without_ray_address_a_local_cluster_with_the_reward_cpus(tiny_model_path, ray_init, monkeypatch):
    from easyvlm.plan.launch import start_ray

    monkeypatch.setattr("os.cpu_count", lambda: 2)
    start_ray(plan_for(tiny_model_path, "worker.reward.num_cpus=3"))
    [kwargs] = ray_init
    # max(2 cores, trainer.n_gpus_per_node 1) logical CPUs for the workers + worker.reward.num_cpus 3
    assert "address" not in kwargs and kwargs["num_cpus"] == 5


def test_a_joined_cluster_gets_no_paths_of_the_drivers_machine(tiny_model_path, ray_init, monkeypatch):
    """Caches and import paths are each node's own (its `ray start` environment); behaviour settings
    still reach every worker. A local cluster is this machine: it gets them all."""
    from easyvlm.plan.launch import start_ray

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
    from easyvlm.plan.launch import plan_run

    monkeypatch.setenv("EASYVLM_CPU_LINEAR", "fast")
    monkeypatch.setattr("easyvlm.plan.launch.parse_and_validate", lambda *a: pytest.fail("went on despite the bad switch"))
    with pytest.raises(SystemExit) as exit_:
        plan_run([f"worker.actor.model.model_path={tiny_model_path}"])
    assert exit_.value.code == 2
    assert "EASYVLM_CPU_LINEAR='fast': use 'auto'" in capsys.readouterr().err
