"""HostMirror (easyvlm/workers/host_offload.py), CPU to CPU: the offload between phases that
``offload_model`` / ``offload_optimizer`` run on GPUs, here with host and device both the CPU, on
FSDP2 models (one rank, gloo; two for uneven shards) and the workers' optimizers. What only a
GPU can show (pinned copies, their speed, the device memory freed) is not checked here."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from easyvlm.workers.settings import OptimConfig
from easyvlm.workers.host_offload import HostMirror, model_tensors, optimizer_tensors
from easyvlm.workers.optim import build_optimizer


class Net(nn.Module):
    """Two blocks (each its own FSDP unit, as the decoder layers), a head in the root's unit (as
    the embeddings and LM head) and a buffer in the root and in a block."""

    def __init__(self):
        super().__init__()
        self.first, self.second, self.head = nn.Linear(5, 6), nn.Linear(6, 3), nn.Linear(3, 2)
        self.register_buffer("scale", torch.linspace(0.5, 1.5, 6))
        self.second.register_buffer("shift", torch.arange(3.0))

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, 5) -> (B, 2)
        return self.head(self.second(torch.tanh(self.first(x)) * self.scale) + self.second.shift)


def sharded_net(strategy: str) -> tuple[nn.Module, torch.optim.Optimizer]:
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = Net()
    fully_shard(model.first)
    fully_shard(model.second)
    fully_shard(model)
    return model, build_optimizer(model.parameters(), OptimConfig(strategy=strategy, lr=1e-2, weight_decay=0.1))


def train(model: nn.Module, optimizer: torch.optim.Optimizer, steps: int, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        model(torch.randn(4, 5, generator=gen)).square().sum().backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)


def held(model: nn.Module, optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """The parameters' local shards, the buffers and the optimizer's state (``step`` excepted), as
    the model and optimizer show them (not through ``model_tensors`` / ``optimizer_tensors``)."""
    from torch.distributed.tensor import DTensor

    local = [p.to_local() if isinstance(p, DTensor) else p for p in model.parameters()]
    states = [v.to_local() for state in optimizer.state.values() for k, v in state.items() if k != "step"]
    return [*local, *model.buffers(), *states]


def snapshot(model: nn.Module, optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [t.detach().clone() for t in held(model, optimizer)]


def assert_bitwise_equal(tensors: list[torch.Tensor], expected: list[torch.Tensor]) -> None:
    assert len(tensors) == len(expected)
    for tensor, want in zip(tensors, expected):
        assert tensor.dtype == want.dtype and tensor.shape == want.shape and torch.equal(tensor, want)


def fsdp_params(model: nn.Module) -> list:
    from torch.distributed.fsdp import FSDPModule

    return [p for module in model.modules() if isinstance(module, FSDPModule)
            for group in module._get_fsdp_state()._fsdp_param_groups for p in group.fsdp_params]


def inside(tensor: torch.Tensor, buffers: list[torch.Tensor]) -> bool:
    return any(b.data_ptr() <= tensor.data_ptr() < b.data_ptr() + max(b.numel(), 1) for b in buffers)


@pytest.fixture
def mirrors():
    return HostMirror(), HostMirror()  # the model's and the optimizer's, as offload_model keeps them


@pytest.mark.parametrize("strategy", ["adamw", "adamw_bf16"])
def test_a_round_trip_leaves_parameters_buffers_and_optimizer_state_bitwise_equal(process_group, mirrors, strategy):
    from torch.distributed.tensor import DTensor

    model, optimizer = sharded_net(strategy)
    train(model, optimizer, 2, seed=1)
    before = snapshot(model, optimizer)
    with torch.no_grad():
        model(torch.ones(1, 5))  # a forward without backward (the reference's): the root stays gathered
    assert not all(isinstance(p, DTensor) for p in model.parameters())
    model_mirror, optim_mirror = mirrors
    model_mirror.park(model_tensors(model))
    optim_mirror.park(optimizer_tensors(optimizer))
    assert model_mirror.parked and optim_mirror.parked
    steps = [state["step"] for state in optimizer.state.values()]  # stays where the optimizer wants it
    assert steps and not any(t is step for t in optimizer_tensors(optimizer) for step in steps)
    # parked: the sharded parameters registered again, and everything lives in the host buffers;
    # FSDP's padded shard (what its all-gather reads) and the parameter's local tensor moved together
    assert all(isinstance(p, DTensor) for p in model.parameters())
    parked = held(model, optimizer)
    assert all(inside(t, [*model_mirror._host, *optim_mirror._host]) for t in parked)
    for p in fsdp_params(model):
        assert p.sharded_param._local_tensor.data_ptr() == p._sharded_param_data.data_ptr()
    assert_bitwise_equal(parked, before)

    model_mirror.restore("cpu")
    optim_mirror.restore("cpu")
    assert not model_mirror.parked and not optim_mirror.parked
    restored = held(model, optimizer)
    assert not any(inside(t, [*model_mirror._host, *optim_mirror._host]) for t in restored)  # fresh "device" storage
    for p in fsdp_params(model):
        assert p.sharded_param._local_tensor.data_ptr() == p._sharded_param_data.data_ptr()
    assert_bitwise_equal(restored, before)


def test_the_host_buffers_are_allocated_once(process_group, mirrors):
    model, optimizer = sharded_net("adamw_bf16")
    train(model, optimizer, 1, seed=1)
    model_mirror, optim_mirror = mirrors
    pointers = []
    for seed in (2, 3):
        model_mirror.park(model_tensors(model))
        optim_mirror.park(optimizer_tensors(optimizer))
        pointers.append([h.data_ptr() for h in (*model_mirror._host, *optim_mirror._host)])
        model_mirror.restore("cpu")
        optim_mirror.restore("cpu")
        train(model, optimizer, 1, seed=seed)  # new values, same tensors: the next park reuses the buffers
    assert pointers[0] == pointers[1]
    # the second park carried the values of the step in between
    expected = snapshot(model, optimizer)
    model_mirror.park(model_tensors(model))
    optim_mirror.park(optimizer_tensors(optimizer))
    assert_bitwise_equal(held(model, optimizer), expected)


def step_and_round_trip(model, optimizer, twin, twin_optimizer, mirrors: tuple[HostMirror, HostMirror], seed: int) -> None:
    """One training step of the model and of its twin; then the model and its optimizer state go to
    the host and back (CPU to CPU)."""
    model_mirror, optim_mirror = mirrors
    train(model, optimizer, 1, seed)
    train(twin, twin_optimizer, 1, seed)
    model_mirror.park(model_tensors(model))
    optim_mirror.park(optimizer_tensors(optimizer))
    model_mirror.restore("cpu")
    optim_mirror.restore("cpu")


def test_training_after_round_trips_is_training_without_them(process_group, mirrors):
    """The optimizer and FSDP hold the same parameter objects after each round trip: the steps of an
    offloaded model are bit for bit those of its twin that never left its memory."""
    model, optimizer = sharded_net("adamw_bf16")
    twin, twin_optimizer = sharded_net("adamw_bf16")
    params = list(model.parameters())
    for seed in range(3):
        step_and_round_trip(model, optimizer, twin, twin_optimizer, mirrors, seed)
        assert all(a is b for a, b in zip(model.parameters(), params))
        assert all(a is b for a, b in zip(optimizer.param_groups[0]["params"], params))
    train(model, optimizer, 1, seed=9)
    train(twin, twin_optimizer, 1, seed=9)
    assert_bitwise_equal(snapshot(model, optimizer), snapshot(twin, twin_optimizer))
    x = torch.randn(3, 5, generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        assert torch.equal(model(x), twin(x))  # FSDP's all-gather reads the restored shards


def test_tensors_that_share_a_storage_share_it_after_a_round_trip():
    # FSDP's padded shard and the parameter's local tensor (a narrower view of it on ranks whose
    # shard is padded), a tied weight listed twice
    padded = torch.arange(8.0)
    local = padded.view(4, 2).narrow(0, 0, 3)
    tail = padded[6:]
    other = torch.randn(2, 3)
    mirror = HostMirror()
    mirror.park([padded, local, tail, other, other])
    assert len(mirror._host) == 2 and mirror._host[0].numel() == 8 * 4
    mirror.restore("cpu")
    assert local.data_ptr() == padded.data_ptr() and tail.data_ptr() == padded.data_ptr() + 6 * 4
    assert torch.equal(local, torch.arange(6.0).view(3, 2)) and torch.equal(tail, torch.tensor([6.0, 7.0]))
    with torch.no_grad():
        local[0, 0] = -1.0
    assert padded[0] == -1.0


def test_the_buffers_are_pinned_only_where_cuda_is(monkeypatch):
    assert not torch.cuda.is_available()
    mirror = HostMirror()
    assert mirror.pin is False
    mirror.park([torch.ones(3)])  # pinning without a GPU would raise here
    assert not mirror._host[0].is_pinned()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert HostMirror().pin is True


def test_offload_and_load_are_no_ops_on_the_cpu(process_group):
    from easyvlm.workers.fsdp import load_model_to, load_optimizer_to, offload_model, offload_optimizer

    model, optimizer = sharded_net("adamw")
    train(model, optimizer, 1, seed=1)
    pointers = [t.data_ptr() for t in held(model, optimizer)]
    offload_model(model)
    offload_optimizer(optimizer)
    load_model_to(model, torch.device("cpu"))
    load_optimizer_to(optimizer, torch.device("cpu"))
    assert [t.data_ptr() for t in held(model, optimizer)] == pointers


def uneven_main(rank: int, world_size: int, port: int, out_file: str) -> None:
    """On 2 ranks: ``second`` (3 rows) is padded on rank 1, whose local shards are narrower views of
    FSDP's padded shards. Three steps with a round trip after each, against a twin without."""
    from fsdp_testing import _finish, _init

    _init(rank, world_size, port)
    model, optimizer = sharded_net("adamw_bf16")
    twin, twin_optimizer = sharded_net("adamw_bf16")
    mirrors = HostMirror(), HostMirror()
    for seed in range(3):
        step_and_round_trip(model, optimizer, twin, twin_optimizer, mirrors, seed)
    x = torch.randn(3, 5, generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        same_output = torch.equal(model(x), twin(x))
    padded = [p for p in fsdp_params(model) if p.sharded_param.to_local().shape != p.padded_sharded_param_size]
    _finish(rank, {
        "padded": len(padded),
        "views_share": all(p.sharded_param._local_tensor.data_ptr() == p._sharded_param_data.data_ptr()
                           for p in fsdp_params(model)),
        "same_state": all(torch.equal(a, b) for a, b in zip(held(model, optimizer), held(twin, twin_optimizer))),
        "same_output": same_output,
    }, out_file)


def test_uneven_shards_on_two_ranks(tmp_path):
    from fsdp_testing import spawn

    out = str(tmp_path / "out.pt")
    spawn(uneven_main, out)
    ranks = torch.load(out)
    assert [r["padded"] for r in ranks] == [0, 2]  # second's weight and bias on rank 1
    assert all(r["views_share"] and r["same_state"] and r["same_output"] for r in ranks), ranks
