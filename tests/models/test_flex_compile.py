"""The packed-attention kernel (easyvlm.models.flex_packed.compile_flex) compiles once for rows of
any length: dynamic shapes from the first call, not a static compile and a dynamic one after it.

The count is dynamo's (one graph for all lengths), checked three ways: with a counting backend that
runs the captured graph eagerly (fast, everywhere), with inductor's C++ kernel on the CPU (slow, needs
a C++ compiler), and on CUDA through ``flex_packed_attention`` (Triton, forward and backward).
"""

from __future__ import annotations

import pytest
import torch
from torch._dynamo.testing import CompileCounter, CompileCounterWithBackend

from easyvlm.models import flex_packed
from easyvlm.models.flex_packed import compile_flex, segment_block_mask
from easyvlm.models.segments import packed_segments

pytestmark = [pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile"),
              pytest.mark.usefixtures("one_torch_thread")]

HEADS, KV_HEADS, HEAD_SIZE = 4, 2, 16
# rows of 4, 3 and 2 blocks of 128 tokens (plain packing and shared-prompt branches), as positions.
# 4 blocks = the query heads and 3 = the three token intervals of the mask: sizes a first call must
# not tie to the row length's symbols (the kernel would be specialised to them, then compiled again)
ROWS = {
    4: [*range(100), *range(200), *range(100)],
    3: [*range(300), *range(7)],
    2: [*range(40), *range(30, 39), *range(30, 39), *range(130), *range(100, 120)],
}


@pytest.fixture(autouse=True)
def fresh_dynamo():
    """No compiled code or size history of flex_attention from earlier tests (torch remembers sizes
    that changed and would start such a function dynamic anyway)."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def packed_row(positions, device="cpu"):
    segments, n = packed_segments(positions), len(positions)
    gen = torch.Generator().manual_seed(n)
    q = torch.randn(1, HEADS, n, HEAD_SIZE, generator=gen)
    k, v = torch.randn(2, 1, KV_HEADS, n, HEAD_SIZE, generator=gen)
    return segments, q.to(device), k.to(device), v.to(device)


def eager(q, k, v, block_mask):
    from torch.nn.attention.flex_attention import flex_attention

    return flex_attention(q, k, v, block_mask=block_mask, scale=0.25, enable_gqa=True)


@pytest.mark.parametrize("first", [4, 3])
def test_one_graph_for_rows_of_every_length(first):
    counter = CompileCounter()
    attend = compile_flex(backend=counter)
    for blocks in (first, *(b for b in ROWS if b != first)):
        segments, q, k, v = packed_row(ROWS[blocks])
        block_mask = segment_block_mask(segments, q.shape[2], q.device)
        out = attend(q, k, v, block_mask=block_mask, scale=0.25, enable_gqa=True)
        torch.testing.assert_close(out, eager(q, k, v, block_mask))
    assert counter.frame_count == 1


def _cpp_compiler() -> str | None:
    from torch._inductor import cpp_builder

    try:
        return cpp_builder.get_cpp_compiler()
    except Exception:  # inductor's error when it finds none
        return None


@pytest.mark.slow
@pytest.mark.skipif(_cpp_compiler() is None, reason="inductor's CPU kernels need a C++ compiler (g++ or $CXX)")
def test_the_cpu_kernel_compiles_once():
    """Inductor's C++ flex_attention template, block-sparse, with dynamic sizes (~20 s on 2 cores).
    Forward only: torch has no compiled flex backward on the CPU."""
    counter = CompileCounterWithBackend("inductor")
    attend = compile_flex(backend=counter)
    frames = []
    for blocks in (4, 2):
        segments, q, k, v = packed_row(ROWS[blocks])
        block_mask = segment_block_mask(segments, q.shape[2], q.device)
        out = attend(q, k, v, block_mask=block_mask, scale=0.25, enable_gqa=True)
        torch.testing.assert_close(out, eager(q, k, v, block_mask))
        frames.append(counter.frame_count)
    assert frames[0] > 0 and frames[1] == frames[0]  # the second length ran the first compile's kernel


@pytest.mark.gpu
def test_the_cuda_kernel_compiles_once(monkeypatch):
    """What a GPU without flash-attn runs: flex_packed_attention through the compiled kernel, forward
    and backward, rows of three lengths; the compile count stays the first call's."""
    counter = CompileCounterWithBackend("inductor")
    attend = compile_flex(backend=counter)
    monkeypatch.setattr(flex_packed, "_compiled_flex", lambda: attend)
    frames = []
    for blocks in (4, 3, 2):
        segments, q, k, v = packed_row(ROWS[blocks], device="cuda")
        for tensor in (q, k, v):
            tensor.requires_grad_()
        out = flex_packed.flex_packed_attention(q, k, v, segments, 0.0, 0.25)
        out.sum().backward()
        frames.append(counter.frame_count)
    assert frames[0] > 0 and frames[1:] == frames[:1] * 2
