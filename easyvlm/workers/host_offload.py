"""Offload between phases through host buffers allocated once (``worker.*.offload``).

:class:`HostMirror` moves a set of tensors to host memory and back, keeping the tensor objects:
the modules, FSDP2 and the optimizer hold those objects, so only their ``.data`` changes. The host
copies are allocated on the first offload and reused by every later one; with CUDA they are
pinned (page-locked). :func:`easyvlm.workers.fsdp.offload_model` and friends use one mirror per
model and per optimizer (:func:`mirror_of`).

Why pinned buffers, allocated once: ``model.to("cpu")`` allocates fresh pageable host memory for
every tensor on every offload and frees it on the way back; at 7B that is about 29 GB of float32
parameters and 58 GB of float32 Adam moments (over all ranks) per phase, each way. Copies between
the GPU and pageable memory go through a small staging buffer of the driver, well below the link's
bandwidth, and ``non_blocking=True`` into pageable memory is synchronous anyway; page-faulting
tens of GB of new allocations comes on top. Pinned memory is copied by the GPU's copy engines at
the link's bandwidth, but pinning is itself slow (the OS locks every page), so it is done once, at
the first offload. The cost: the host memory stays held (and locked) between offloads, as much as
``model.to("cpu")`` takes at its peak. The rollout engine's sleep keeps its weights the same way
(``easyvlm/rollout/hf.py``).

On the CPU, ``offload_model`` and friends do nothing (the tensors are in host memory already); the
mirror takes the device (``restore``) and the pinning (``pin``) as parameters, so the tests run it
CPU to CPU (tests/workers/test_host_offload.py).
"""

from __future__ import annotations

from typing import Iterable
from weakref import WeakKeyDictionary

import torch
from torch import Tensor, nn


class HostMirror:
    """Host copies of a set of tensors. ``park(tensors)`` copies the tensors' data into host buffers
    and points the tensors at them; ``restore(device)`` gives them fresh device storage copied from
    those buffers, which stay for the next park.

    It mirrors storages, not tensors: the tensors that share a storage (FSDP2's padded shard and
    the parameter's local tensor, which is a view of it; tied weights) share one host buffer and,
    after a round trip, one device storage again, each at its own offset, size and strides.
    A storage is copied whole, so a tensor that views a small part of a big storage costs the
    whole storage.

    pin: allocate the host buffers pinned; by default where CUDA is available (pinning needs it).
    """

    def __init__(self, pin: bool | None = None):
        self.pin = torch.cuda.is_available() if pin is None else pin
        self._host: list[Tensor] = []  # one uint8 buffer per storage, kept across parks
        self._parked: list[list[Tensor]] = []  # the parked tensors, grouped by storage

    @property
    def parked(self) -> bool:
        return bool(self._parked)

    def park(self, tensors: Iterable[Tensor]) -> None:
        groups = _by_storage(tensors)
        sizes = [group[0].untyped_storage().nbytes() for group in groups]
        if [host.numel() for host in self._host] != sizes:
            # the first park, or other tensors than last time (e.g. the optimizer's state after its
            # first step, or new tensors after a checkpoint load): new buffers, the old ones freed first
            self._host = []
            self._host = [torch.empty(size, dtype=torch.uint8, pin_memory=self.pin) for size in sizes]
        for group, host in zip(groups, self._host):
            host.copy_(_storage_bytes(group[0]), non_blocking=self.pin)
        if self.pin:
            torch.cuda.synchronize()  # the copies must land before the device storage is freed below
        for group, host in zip(groups, self._host):
            _point_at(group, host)
        self._parked = groups

    def restore(self, device: str | torch.device) -> None:
        for group, host in zip(self._parked, self._host):
            _point_at(group, host.to(device, non_blocking=self.pin, copy=True))  # never aliasing the buffer
        if self.pin:
            torch.cuda.synchronize()  # FSDP2 all-gathers on its own streams: the weights must be there
        self._parked = []  # no references kept: the tensors may be replaced before the next park


def model_tensors(model: nn.Module) -> list[Tensor]:
    """The plain tensors that hold ``model``'s parameters and buffers: each parameter's local shard
    (FSDP2's parameters are DTensors) and, for FSDP2, the padded shard its all-gathers read
    (``FSDPParam._sharded_param_data``; the local shard is a view of it: moving one without the
    other would leave the all-gathers reading the old device copy).

    Reshards FSDP2's modules first, as FSDP2's own ``_apply`` (``model.to``) does: after a forward
    without backward the root keeps its gathered parameters, which would stay on the device.

    Why ``.data`` and not FSDP2's API: ``model.to`` allocates new tensors every time (and FSDP2's
    ``reset_sharded_param``, which it runs after, re-pads uneven shards into new ones), which is what
    this module avoids, and FSDP2 has no call that moves shards into given buffers; its
    ``CPUOffloadPolicy`` keeps the shards on the host for the whole run (the optimizer steps there),
    not between phases. ``.data`` keeps the objects FSDP2 and the optimizer hold.
    """
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import DTensor

    padded: list[Tensor] = []
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()  # registers the sharded parameters again, frees the gathered ones
            for group in module._get_fsdp_state()._fsdp_param_groups:
                padded.extend(fsdp_param._sharded_param_data for fsdp_param in group.fsdp_params)
    params = [p._local_tensor if isinstance(p, DTensor) else p for p in model.parameters()]
    return [*padded, *params, *model.buffers()]


def optimizer_tensors(optimizer: torch.optim.Optimizer) -> list[Tensor]:
    """The plain tensors of ``optimizer``'s state (local shards of DTensor states), ``step`` excepted:
    a scalar, and on the host already unless the optimizer is fused or capturable."""
    from torch.distributed.tensor import DTensor

    return [
        value._local_tensor if isinstance(value, DTensor) else value
        for state in optimizer.state.values()
        for key, value in state.items()
        if isinstance(value, Tensor) and key != "step"
    ]


_MIRRORS: WeakKeyDictionary = WeakKeyDictionary()


def mirror_of(owner: nn.Module | torch.optim.Optimizer) -> HostMirror:
    """The mirror of a model or an optimizer: made on first use, kept as long as ``owner`` lives."""
    return _MIRRORS.setdefault(owner, HostMirror())


def _by_storage(tensors: Iterable[Tensor]) -> list[list[Tensor]]:
    groups: dict[tuple[torch.device, int], list[Tensor]] = {}
    seen: set[int] = set()
    for tensor in tensors:
        if id(tensor) not in seen:  # a tied weight is listed twice
            seen.add(id(tensor))
            groups.setdefault((tensor.device, tensor.untyped_storage().data_ptr()), []).append(tensor)
    return list(groups.values())


def _storage_bytes(tensor: Tensor) -> Tensor:
    """The whole storage under ``tensor``, as a flat uint8 tensor (no copy)."""
    return torch.empty(0, dtype=torch.uint8, device=tensor.device).set_(tensor.untyped_storage())


def _point_at(group: list[Tensor], storage: Tensor) -> None:
    """Point each tensor of ``group`` at ``storage`` (flat uint8), at the offset, size and strides
    it had in its old storage. ``.data`` keeps the tensor objects (and their autograd identity)."""
    for tensor in group:
        tensor.data = torch.empty(0, dtype=tensor.dtype, device=storage.device).set_(
            storage.untyped_storage(), tensor.storage_offset(), tensor.size(), tensor.stride()
        )
