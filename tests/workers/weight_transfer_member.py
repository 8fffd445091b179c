"""One member of a weight-transfer group in its own process (tests/workers/test_weight_transfer.py):
``tensors RANK SIZE PORT OUT``: rank 0 sends ``member_tensors()``, the others save what they received,
over ``EASYVLM_TRANSFER_BACKEND`` (gloo, the default; nccl: member r on GPU r, the buffers there).
``workers RANK SIZE PORT OUT MODEL``: rank 0 is a HybridWorker whose actor's weights are moved off the
model files' (+ 1/64 each, exact in float32), the others RolloutHosts on the model files (the
transformers engine); each saves its weights (the sender: ``weights_for_sync``, a host: its engine's
state dict) after one ``send_weights`` / ``receive_weights``."""

from __future__ import annotations

import os
import sys

import torch

from easyvlm.workers.weight_transfer import Rendezvous, open_group, receive, send, transfer_device

BUCKET = 1000  # bytes: several buckets, one tensor (the 2400-byte one) larger than a bucket


def member_tensors() -> dict[str, torch.Tensor]:
    """A dtype mix (float32, bfloat16, float16, int64, bool), a 0-dim tensor, NaN and -0.0 bit patterns."""
    gen = torch.Generator().manual_seed(0)
    special = torch.tensor([float("nan"), -0.0, float("inf"), 1e-40])
    return {
        "a": torch.randn(4, 5, generator=gen), "b": torch.randn(7, generator=gen).to(torch.bfloat16),
        "big": torch.randn(600, generator=gen), "c": torch.arange(9, dtype=torch.int64).reshape(3, 3),
        "d": torch.randn(3, generator=gen).to(torch.float16), "mask": torch.tensor([True, False, True]),
        "scalar": torch.tensor(2.5), "special": special,
    }


def tensors(rank: int, meet: Rendezvous, out: str) -> None:
    if meet.backend == "nccl":
        torch.cuda.set_device(rank)  # NCCL refuses two members on one device
    group, device = open_group(meet, rank), transfer_device(meet.backend)
    if rank == 0:
        sent = send(group, member_tensors().items(), BUCKET, device)
        torch.save({"sent": sent}, out)
    else:
        torch.save({name: t.cpu().clone() for name, t in receive(group, device)}, out)


def workers(rank: int, meet: Rendezvous, out: str, model: str) -> None:
    from plan_testing import plan_for

    plan = plan_for(model, "worker.rollout.name=hf")
    if rank == 0:
        from easyvlm.workers.hybrid import HybridWorker

        worker = HybridWorker(plan.actor, None, None)
        worker.actor.trained.ensure_loaded()
        with torch.no_grad():
            for param in worker.actor.model.parameters():
                param.add_(1 / 64)
        worker.join_weight_transfer(meet)
        sent = worker.send_weights(BUCKET * 100)
        torch.save({"sent": sent, "weights": worker.weights_for_sync()}, out)
    else:
        from easyvlm.workers.hosts import RolloutHost

        host = RolloutHost(plan.rollout)
        host.join_weight_transfer(meet, rank)
        host.receive_weights()
        torch.save({name: t.clone() for name, t in host.rollout.model.state_dict().items()}, out)


if __name__ == "__main__":
    role, rank, size, port, out = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
    if role == "tensors":
        tensors(rank, Rendezvous("127.0.0.1", port, size, os.environ.get("EASYVLM_TRANSFER_BACKEND", "gloo"), 60.0), out)
    else:  # the workers' plan is the CPU's: gloo
        workers(rank, Rendezvous("127.0.0.1", port, size, timeout_s=60.0), out, sys.argv[6])
