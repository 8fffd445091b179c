import os

import pytest
import ray
import torch

from easyvlm.data.batch import Batch
from easyvlm.distributed.worker_group import Resources, WorkerGroup


class EchoWorker:
    """Joins a gloo group from the env vars the group sets, like the real workers do."""

    def __init__(self):
        import torch.distributed as dist

        dist.init_process_group("gloo")
        self.rank = dist.get_rank()

    def tag(self, batch: Batch) -> Batch:
        out = batch.copy()
        out["rank"] = torch.full((len(batch),), self.rank)
        out["x2"] = batch["x"] * 2
        return out

    def allreduce_rank(self) -> int:
        import torch.distributed as dist

        t = torch.tensor([self.rank + 1])
        dist.all_reduce(t)
        return int(t)


@pytest.fixture(scope="module")
def ray_local():
    # workers import this test module by name: put its folder on their path
    here = os.path.dirname(os.path.abspath(__file__))
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, runtime_env={"env_vars": {"PYTHONPATH": here}})
    yield
    ray.shutdown()


@pytest.mark.slow
def test_dispatch_pads_chunks_and_restores_order(ray_local):
    group = WorkerGroup("echo", Resources(world_size=2, cpus_per_worker=1, use_gpu=False), EchoWorker)
    try:
        # all_reduce of (rank + 1) over ranks 0, 1 = 1 + 2 = 3 on both: the gloo group is real
        assert group.call_all("allreduce_rank") == [3, 3]
        batch = Batch({"x": torch.arange(5)}, {"name": list("abcde")})
        out = group.dispatch("tag", batch)
        # 5 rows padded to 6 -> rank 0 gets rows 0-2, rank 1 rows 3-4 (+ the pad row), pad dropped
        assert out["name"] == list("abcde")
        assert out["x2"].tolist() == [0, 2, 4, 6, 8]
        assert out["rank"].tolist() == [0, 0, 0, 1, 1]
        # where each rank runs (one node here): Ray's node id, the IP, the host
        assert len(group.nodes) == 2 and group.nodes[0] == group.nodes[1]
        assert group.nodes[0]["node_id"] == ray.get_runtime_context().get_node_id()
    finally:
        group.shutdown()


@pytest.mark.slow
def test_rank_zero_starts_while_the_probe_is_still_dying(ray_local, monkeypatch):
    """The rendezvous probe runs on rank 0's bundle and is killed before rank 0 starts; ray.kill
    returns before the GCS lets the actor go. Here the kill is held back 1 s (a loaded machine, as in
    the two-node CI run that failed with "The name easyvlm-hybrid-0 is already taken"): rank 0 must
    wait for the bundle, not collide with the probe's name."""
    import threading

    real_kill = ray.kill

    def late_kill(actor, **kwargs):
        threading.Timer(1.0, real_kill, (actor,), kwargs).start()

    monkeypatch.setattr(ray, "kill", late_kill)
    group = WorkerGroup("late", Resources(world_size=1, cpus_per_worker=1, use_gpu=False), EchoWorker)
    try:
        assert group.call_all("allreduce_rank") == [1]  # rank 0 alone: 0 + 1
    finally:
        monkeypatch.setattr(ray, "kill", real_kill)
        group.shutdown()


def test_placement_report_names_each_ranks_node():
    from easyvlm.distributed.worker_group import placement_report

    a = {"node_id": "a" * 56, "ip": "10.0.0.1", "host": "gpu-a"}
    b = {"node_id": "b" * 56, "ip": "10.0.0.2", "host": "gpu-b"}
    assert placement_report({"hybrid": [a, a]}, {"reward actor": a}, nnodes=1) == []  # one node, as asked
    [line] = placement_report({"hybrid": [a, b]}, {"reward actor": b}, nnodes=2)
    assert line == (f"placement: hybrid rank 0 -> node {'a' * 12} (10.0.0.1, gpu-a); hybrid rank 1 -> node "
                    f"{'b' * 12} (10.0.0.2, gpu-b); reward actor -> node {'b' * 12} (10.0.0.2, gpu-b)")
    # asked for 2 nodes, packed onto 1: said, with why
    line, note = placement_report({"hybrid": [a, a]}, {"reward actor": b}, nnodes=2)
    assert note.startswith("note: trainer.nnodes=2 but the 2 hybrid ranks run on 1 node(s)")


class PortTakenOnce:
    """Rank 0's first start fails as torch's TCPStore does when another process bound the rendezvous
    port first; every start is counted in ``log`` (a file: the ranks are separate processes)."""

    def __init__(self, log: str, message: str = "The server socket has failed to listen on any local "
                 "network address. port: 29500, useIpv6: false, code: -98, name: EADDRINUSE, message: "
                 "address already in use"):
        import torch.distributed as dist

        rank = int(os.environ["RANK"])
        with open(log, "a") as f:
            f.write(f"{rank} {os.environ['MASTER_PORT']}\n")
        if rank == 0 and sum(line.startswith("0 ") for line in open(log)) == 1:
            raise RuntimeError(message)
        dist.init_process_group("gloo")
        self.rank = dist.get_rank()

    def allreduce_rank(self) -> int:
        return EchoWorker.allreduce_rank(self)


@pytest.mark.slow
def test_ranks_start_again_on_a_new_port_when_the_rendezvous_port_was_taken(ray_local, tmp_path):
    """A CI run failed with EADDRINUSE: the probe's free port was bound by another process before
    rank 0's TCPStore bound it. The group starts its ranks again on a new port."""
    import functools

    log = tmp_path / "starts"
    factory = functools.partial(PortTakenOnce, str(log))
    group = WorkerGroup("retry", Resources(world_size=2, cpus_per_worker=1, use_gpu=False), factory)
    try:
        assert group.call_all("allreduce_rank") == [3, 3]  # (0 + 1) + (1 + 1): a real gloo group
    finally:
        group.shutdown()
    starts = [line.split() for line in log.read_text().splitlines()]
    rank0_ports = [port for rank, port in starts if rank == "0"]
    assert len(rank0_ports) == 2 and rank0_ports[0] != rank0_ports[1]  # started twice, on two ports


@pytest.mark.slow
def test_other_start_errors_are_not_retried(ray_local, tmp_path):
    import functools

    log = tmp_path / "starts"
    factory = functools.partial(PortTakenOnce, str(log), "no such model: /nowhere")
    with pytest.raises(Exception, match="no such model"):
        WorkerGroup("noretry", Resources(world_size=1, cpus_per_worker=1, use_gpu=False), factory)
    assert log.read_text().count("\n") == 1


def test_rendezvous_port_is_below_the_ephemeral_range_and_free(monkeypatch):
    import socket

    from easyvlm.workers import dist as dist_module

    low = dist_module._ephemeral_port_start()
    if low is None:
        pytest.skip("no readable ephemeral port range above 20000 here")
    ports = {dist_module.find_free_port() for _ in range(20)}
    # 20000 <= port < the kernel's first ephemeral port (32768 on a default Linux): never handed to
    # an outgoing connection, above Ray's worker ports
    assert all(20000 <= p < low for p in ports)
    assert len(ports) > 1  # random, so that concurrent runs do not race for one port
    with socket.socket() as s:
        s.bind(("", ports.pop()))  # still free
    # where the range is unknown: an ephemeral port from the kernel
    monkeypatch.setattr(dist_module, "_ephemeral_port_start", lambda: None)
    assert dist_module.find_free_port() >= low


def test_port_was_taken_reads_torchs_message():
    from easyvlm.distributed.worker_group import port_was_taken

    assert port_was_taken(RuntimeError("... name: EADDRINUSE, message: address already in use"))
    assert port_was_taken(OSError("[Errno 98] Address already in use"))
    assert not port_was_taken(RuntimeError("Connection reset by peer"))

