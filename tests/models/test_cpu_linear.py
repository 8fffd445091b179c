"""CPU linear layers through oneDNN (easyvlm.models.cpu_linear): same values and gradients as
``F.linear``, the oneDNN operator really runs, and it is used only where it is meant to be."""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.profiler import ProfilerActivity, profile

from easyvlm.models.cpu_linear import ENV_SWITCH, OneDNNLinear, onednn_linear, onednn_linear_available, use_onednn_linears

pytestmark = pytest.mark.skipif(not onednn_linear_available(), reason="oneDNN linears are for x86-64 CPUs with mkldnn")

ONEDNN_OP = "mkldnn::_linear_pointwise"


@pytest.fixture
def every_call(monkeypatch):
    """oneDNN for calls of any size (the tests' small ones are below MIN_ONEDNN_MACS), unmeasured."""
    monkeypatch.setattr("easyvlm.models.cpu_linear.MIN_ONEDNN_MACS", 1)
    monkeypatch.setenv(ENV_SWITCH, "onednn")


def op_counts(fn) -> dict[str, int]:
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    return {e.key: e.count for e in prof.key_averages()}


def test_hand_derived_values_and_gradients_exactly(every_call):
    # x = [[1, 2], [3, 4]], W = [[1, 0], [2, 1], [0, -1]], b = [1, 1, 1]
    # y = x W^T + b: row 1: [1*1+2*0, 1*2+2*1, 1*0+2*(-1)] + 1 = [2, 5, -1]
    #                row 2: [3, 3*2+4*1, -4] + 1 = [4, 11, -3]
    # loss = sum(y * G) with G = [[1, 0, 2], [0, 1, 1]]:
    # dL/dx = G W: row 1: 1*[1,0] + 2*[0,-1] = [1, -2]; row 2: 1*[2,1] + 1*[0,-1] = [2, 0]
    # dL/dW = G^T x: row 1: 1*[1,2] = [1, 2]; row 2: 1*[3,4] = [3, 4]; row 3: 2*[1,2] + 1*[3,4] = [5, 8]
    # dL/db = column sums of G = [1, 1, 3]
    # (small integers: every float32 product and sum is exact, so equality is exact)
    x = torch.tensor([[1.0, 2.0], [3.0, 4.0]], requires_grad=True)
    weight = torch.tensor([[1.0, 0.0], [2.0, 1.0], [0.0, -1.0]], requires_grad=True)
    bias = torch.ones(3, requires_grad=True)
    y = onednn_linear(x, weight, bias)
    assert torch.equal(y, torch.tensor([[2.0, 5.0, -1.0], [4.0, 11.0, -3.0]]))
    (y * torch.tensor([[1.0, 0.0, 2.0], [0.0, 1.0, 1.0]])).sum().backward()
    assert torch.equal(x.grad, torch.tensor([[1.0, -2.0], [2.0, 0.0]]))
    assert torch.equal(weight.grad, torch.tensor([[1.0, 2.0], [3.0, 4.0], [5.0, 8.0]]))
    assert torch.equal(bias.grad, torch.tensor([1.0, 1.0, 3.0]))


def test_matches_f_linear_on_random_3d_inputs(every_call):
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(3, 37, 64, generator=gen)
    weight, bias = torch.randn(96, 64, generator=gen), torch.randn(96, generator=gen)
    upstream = torch.randn(3, 37, 96, generator=gen)
    grads = []
    for fn in (onednn_linear, F.linear):
        leaves = [t.clone().requires_grad_() for t in (x, weight, bias)]
        out = fn(*leaves)
        (out * upstream).sum().backward()
        grads.append((out.detach(), *[t.grad for t in leaves]))
    # both are float32 sums of 64 (forward, dL/dx) or 111 (dL/dW, dL/db) products, possibly added in
    # other orders: they may differ by a few roundings of partial sums (2^-24 ~ 6e-8 of values up to
    # ~40 here: ~1e-6; on this machine they came out equal); 1e-5 relative + 1e-5 absolute allows
    # that, while a bfloat16 product (~4e-3 relative) or a wrong term would fail
    for ours, reference in zip(*grads):
        torch.testing.assert_close(ours, reference, rtol=1e-5, atol=1e-5)


def test_runs_the_onednn_operator_forward_and_backward(every_call):
    x = torch.randn(8, 16, requires_grad=True)
    layer = nn.Linear(16, 4)
    use_onednn_linears(layer)

    def step():
        layer(x).sum().backward()

    counts = op_counts(step)
    assert counts.get(ONEDNN_OP) == 3  # y = x W^T, then g W and g^T x in backward
    assert "aten::addmm" not in counts and "aten::mm" not in counts


def test_falls_back_to_f_linear_where_it_does_not_apply(every_call):
    weight = torch.randn(4, 16)
    for x in (torch.randn(8, 16, dtype=torch.bfloat16), torch.randn(0, 16)):
        w = weight.to(x.dtype)
        counts = op_counts(lambda: onednn_linear(x, w))
        assert ONEDNN_OP not in counts
        assert torch.equal(onednn_linear(x, w), F.linear(x, w))


def test_small_calls_stay_with_f_linear(monkeypatch):
    monkeypatch.setenv(ENV_SWITCH, "onednn")  # the size floor, without the measured choice
    # 2^13 rows x 32 in x 32 out = 2^23 multiply-adds: the threshold; one row fewer is below it
    weight = torch.randn(32, 32)
    at_threshold = op_counts(lambda: onednn_linear(torch.randn(2**13, 32), weight))
    below = op_counts(lambda: onednn_linear(torch.randn(2**13 - 1, 32), weight))
    assert at_threshold.get(ONEDNN_OP) == 1 and ONEDNN_OP not in below


def test_swaps_plain_linears_only_and_keeps_parameters_and_state_dict():
    class Special(nn.Linear):  # a subclass keeps its own forward (e.g. a quantized layer)
        pass

    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Sequential(nn.Linear(8, 8, bias=False)), Special(8, 2))
    params_before = dict(model.named_parameters())
    keys_before = list(model.state_dict())
    x = torch.randn(5, 4)
    expected = model(x)
    assert use_onednn_linears(model) == 2
    assert [type(m).__name__ for m in (model[0], model[2][0], model[3])] == ["OneDNNLinear", "OneDNNLinear", "Special"]
    assert isinstance(model[0], nn.Linear)
    assert all(p is params_before[name] for name, p in model.named_parameters())
    assert list(model.state_dict()) == keys_before
    torch.testing.assert_close(model(x), expected, rtol=1e-5, atol=1e-6)


def test_environment_switch(monkeypatch):
    monkeypatch.setenv(ENV_SWITCH, "aten")
    assert not onednn_linear_available()
    for mode in ("auto", "onednn"):
        monkeypatch.setenv(ENV_SWITCH, mode)
        assert onednn_linear_available()
    monkeypatch.setenv(ENV_SWITCH, "mkl")
    with pytest.raises(ValueError, match="EASYVLM_CPU_LINEAR='mkl': use 'auto'"):
        onednn_linear_available()



def test_memory_does_not_grow_with_every_new_token_count():
    # oneDNN caches a primitive per shape (1024 by default); a training step's micro-batches each
    # have another token count. Uncapped, each new count here kept ~3.5 MiB (40 counts: ~100 MiB);
    # with the capacity easyvlm sets at import, the cache is full after a few counts and stops growing.
    import subprocess
    import sys

    code = """
import ctypes
import torch
import easyvlm.models.cpu_linear as cl
torch.set_num_threads(1)
cl.MIN_ONEDNN_MACS = 1
def rss_mib():
    ctypes.CDLL(None).malloc_trim(0)
    return int(open("/proc/self/statm").read().split()[1]) * 4096 / 2**20
w1, w2 = torch.randn(1024, 256, requires_grad=True), torch.randn(256, 1024, requires_grad=True)
for i, rows in enumerate(range(500, 900, 10)):
    x = torch.randn(rows, 256, requires_grad=True)
    cl.onednn_linear(torch.relu(cl.onednn_linear(x, w1)), w2).sum().backward()
    if i == 10:
        after_ten = rss_mib()
print(rss_mib() - after_ten)
"""
    env = {k: v for k, v in os.environ.items() if k not in ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "LRU_CACHE_CAPACITY")}
    env[ENV_SWITCH] = "onednn"  # every call through oneDNN, unmeasured: this is about its primitive cache
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300, check=True)
    growth_mib = float(out.stdout.strip().splitlines()[-1])
    assert growth_mib < 20, f"RSS grew by {growth_mib:.0f} MiB over 29 new token counts"
