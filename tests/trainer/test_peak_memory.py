"""The step's memory metrics per process (easyvlm.trainer.topology.Workers.peak_memory): on GPU ranks
also EasyR1's ``perf/max_memory_allocated_gb`` and ``perf/max_memory_reserved_gb``, per worker group
(its largest rank's); on CPU ranks these keys are absent (not 0) and the ranks are not asked."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from plan_testing import plan_for

from easyvlm.distributed.worker_group import Resources
from easyvlm.trainer import topology

GiB = 2**30
# the fake ranks' answers: peak RSS, and (allocated, reserved) CUDA peaks in bytes
RANKS = ((GiB, (GiB, 2 * GiB)), (2 * GiB, (3 * GiB // 2, 5 * GiB // 2)))


class FakeRank:
    def __init__(self, rss: int, cuda: tuple[int, int], asked: list):
        self.peak_rss = SimpleNamespace(remote=lambda: rss)
        self.peak_cuda_memory = SimpleNamespace(remote=lambda: asked.append(cuda) or cuda)


def peak_metrics(monkeypatch, tiny_model_path, use_gpu: bool) -> tuple[dict[str, float], list]:
    """One step's memory metrics of the real `Workers` of a GAE plan (hybrid and critic groups) with
    fake ranks; and the CUDA answers the ranks were asked for."""
    asked: list = []

    def group(name, resources, factory, pg=None, share=1.0):
        return SimpleNamespace(name=name, pg="pg", workers=[FakeRank(rss, cuda, asked) for rss, cuda in RANKS])

    reward_actor = SimpleNamespace(peak_rss=SimpleNamespace(remote=lambda: GiB // 4))
    monkeypatch.setattr(topology, "WorkerGroup", group)
    monkeypatch.setattr(topology, "create_reward_actor", lambda settings, cpus: reward_actor)
    monkeypatch.setattr(topology, "ray", SimpleNamespace(get=lambda refs: refs, kill=lambda actor: None,
                                                         wait=lambda refs, num_returns, timeout: (list(refs), [])))
    plan = plan_for(tiny_model_path, "algorithm.adv_estimator=gae", f"worker.critic.model.model_path={tiny_model_path}")
    workers = topology.Workers(plan, Resources(world_size=2, cpus_per_worker=1, use_gpu=use_gpu), 3)
    return workers.peak_memory(generating_ahead=False), asked


@pytest.mark.parametrize("use_gpu", [True, False], ids=["gpu", "cpu"])
def test_gpu_ranks_log_their_cuda_peaks_per_group_and_cpu_ranks_none(monkeypatch, tiny_model_path, use_gpu):
    metrics, asked = peak_metrics(monkeypatch, tiny_model_path, use_gpu)
    cuda = {k: v for k, v in metrics.items() if k.startswith("perf/max_memory_")}
    # the resident-memory keys either way: each group's largest rank, the reward actor's own
    assert {k: v for k, v in metrics.items() if k.startswith("perf/peak_rss_gb/") and k != "perf/peak_rss_gb/driver"} == {
        "perf/peak_rss_gb/hybrid": 2.0, "perf/peak_rss_gb/critic": 2.0, "perf/peak_rss_gb/reward": 0.25}
    if use_gpu:
        # GiB of the largest rank's answer (ranks at 1 and 1.5 GiB allocated, 2 and 2.5 reserved);
        # the reward actor holds no GPU: no key of its own
        assert cuda == {"perf/max_memory_allocated_gb/hybrid": 1.5, "perf/max_memory_reserved_gb/hybrid": 2.5,
                        "perf/max_memory_allocated_gb/critic": 1.5, "perf/max_memory_reserved_gb/critic": 2.5}
        assert len(asked) == 4  # every rank of both groups, once
    else:
        assert cuda == {} and asked == []  # absent, not 0; CPU ranks are not asked
