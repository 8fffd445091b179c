"""The weight transfer to separate engines (easyvlm/workers/weight_transfer.py): buckets by size, the
byte layout's round trip, and real groups of processes over gloo (3 members: a sender, 2 engines).

``EASYVLM_TRANSFER_BACKEND=nccl`` runs the tensor groups over NCCL, member r on GPU r (NCCL refuses two
members on one device): each test is skipped with fewer GPUs than members (bench/gpu_issue47.sh, stage
``transfer``). The workers' test stays on gloo (its plan is the CPU's)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from easyvlm.workers.dist import find_free_port
from easyvlm.workers.weight_transfer import ALIGN, buckets, layout, pack, unpack
from weight_transfer_member import member_tensors

REPO = Path(__file__).resolve().parents[2]
BACKEND = os.environ.get("EASYVLM_TRANSFER_BACKEND", "gloo")


def members_fit(size: int) -> pytest.MarkDecorator:
    """Skip under nccl without a GPU per member (none without CUDA)."""
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    return pytest.mark.skipif(BACKEND == "nccl" and gpus < size,
                              reason=f"EASYVLM_TRANSFER_BACKEND=nccl needs {size} CUDA devices, one per member; {gpus} here")


def bitwise_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Same dtype, shape and bytes (NaN == NaN, -0.0 != 0.0)."""
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(
        a.contiguous().reshape(-1).view(torch.uint8), b.contiguous().reshape(-1).view(torch.uint8))


def test_buckets_hold_at_most_the_limit_and_a_larger_tensor_alone():
    # bytes: a 4x4 float32 = 64, b 10 bfloat16 = 20, c 3 int64 = 24, d 50 float32 = 200, e 2 float16 = 4.
    # limit 100: a+b = 84, + c = 108 > 100 -> [a, b]; c + d = 224 -> [c]; d alone (> 100); d + e -> [d]; [e]
    named = [("a", torch.zeros(4, 4)), ("b", torch.zeros(10, dtype=torch.bfloat16)),
             ("c", torch.zeros(3, dtype=torch.int64)), ("d", torch.zeros(50)),
             ("e", torch.zeros(2, dtype=torch.float16))]
    assert [[name for name, _ in bucket] for bucket in buckets(iter(named), 100)] == [["a", "b"], ["c"], ["d"], ["e"]]
    assert [[name for name, _ in bucket] for bucket in buckets(iter(named), 10_000)] == [["a", "b", "c", "d", "e"]]


def test_layout_aligns_every_tensor():
    # 3 float16 = 6 bytes at 0; a float64 at the next multiple of ALIGN (64); 2 more bytes of int8 at 128
    header = [("x", torch.float16, (3,)), ("y", torch.float64, (2, 4)), ("z", torch.int8, (2,))]
    assert ALIGN == 64 and layout(header) == ([0, 64, 128], 130)


def test_pack_unpack_round_trip_is_bitwise_for_a_dtype_mix():
    tensors = member_tensors()
    header, buffer = pack(list(tensors.items()), torch.device("cpu"))
    assert buffer.dtype == torch.uint8 and buffer.numel() == layout(header)[1]
    out = dict(unpack(header, buffer))
    assert list(out) == list(tensors)
    for name, tensor in tensors.items():
        assert bitwise_equal(out[name], tensor), name


def run_members(role: str, size: int, tmp_path: Path, *extra: str, timeout: float = 240) -> list[dict]:
    """``size`` member processes of one group; what each saved. The rendezvous port is free when
    chosen, but another process may bind it before rank 0 does (EADDRINUSE): then again on another."""
    # not the rendezvous of a process group this pytest process (an earlier test) may have set up: the
    # member's HybridWorker picks a free port of its own (easyvlm.workers.dist.init_distributed)
    inherited = {k: v for k, v in os.environ.items() if k not in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env = {**inherited, "PYTHONPATH": f"{REPO}{os.pathsep}{REPO / 'tests'}", "OMP_NUM_THREADS": "1"}
    outs = [tmp_path / f"{role}-{rank}.pt" for rank in range(size)]
    for attempt in range(3):
        port = find_free_port()
        procs = [subprocess.Popen([sys.executable, str(REPO / "tests" / "workers" / "weight_transfer_member.py"),
                                   role, str(rank), str(size), str(port), str(out), *extra], cwd=REPO, env=env,
                                  stderr=subprocess.PIPE, text=True)
                 for rank, out in enumerate(outs)]
        try:
            errors = [proc.communicate(timeout=timeout)[1] for proc in procs]
        finally:
            for proc in procs:
                proc.kill()
        codes = [proc.returncode for proc in procs]
        if codes == [0] * size:
            return [torch.load(out, weights_only=False) for out in outs]
        if not any("EADDRINUSE" in error for error in errors) or attempt == 2:
            raise AssertionError(f"member exit codes {codes}:\n" + "\n".join(errors))
    raise AssertionError("unreachable")


@pytest.mark.parametrize("size", [pytest.param(2, marks=members_fit(2)), pytest.param(3, marks=members_fit(3))])
def test_the_receivers_get_every_tensor_bitwise_in_buckets(tmp_path, size):
    sender, *receivers = run_members("tensors", size, tmp_path)
    expected = member_tensors()
    # the payload: 20*4 + 7*2 + 600*4 + 9*8 + 3*2 + 3*1 + 4 + 4*4 = 2595 bytes
    assert sender["sent"] == 2595 and len(receivers) == size - 1
    for got in receivers:
        assert list(got) == list(expected)
        for name, tensor in expected.items():
            assert bitwise_equal(got[name], tensor), name


@pytest.mark.slow
def test_two_engines_hold_the_trainers_weights_bitwise_after_a_sync(tmp_path, tiny_model_path):
    """The actor's weights, moved off the model files', reach both engines' models bit for bit."""
    sender, *engines = run_members("workers", 3, tmp_path, tiny_model_path)
    weights = sender["weights"]
    assert sender["sent"] == sum(t.numel() * t.element_size() for t in weights.values())
    for engine in engines:
        assert set(weights) <= set(engine), sorted(set(weights) - set(engine))[:5]
        for name, tensor in weights.items():
            assert bitwise_equal(engine[name], tensor), name
