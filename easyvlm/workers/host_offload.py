"""Offload between phases (``worker.*.offload``) into host buffers allocated once and reused, keeping
the tensor objects FSDP2 and the optimizer hold (``model.to("cpu")`` would allocate every time)."""

from __future__ import annotations

from typing import Iterable
from weakref import WeakKeyDictionary

import torch
from torch import Tensor, nn


class HostMirror:
    """Host copies of a set of tensors: ``park(tensors)`` points them at host buffers, ``restore(device)``
    at fresh device copies. Mirrors storages, so tensors sharing one (a shard and its view, tied
    weights) share a buffer. pin: pinned host buffers (default: where CUDA is available)."""

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
    """The plain tensors holding ``model``'s parameters and buffers: local shards and FSDP2's padded
    shards they view (both must move), after resharding as FSDP2's ``model.to`` does."""
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
    """The plain tensors of ``optimizer``'s state (local shards), ``step`` excepted (a host scalar)."""
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
    return torch.empty(0, dtype=torch.uint8, device=tensor.device).set_(tensor.untyped_storage())


def _point_at(group: list[Tensor], storage: Tensor) -> None:
    """Point each tensor of ``group`` at ``storage`` (flat uint8) at its old offset, size and strides."""
    for tensor in group:
        tensor.data = torch.empty(0, dtype=tensor.dtype, device=storage.device).set_(
            storage.untyped_storage(), tensor.storage_offset(), tensor.size(), tensor.stride()
        )
