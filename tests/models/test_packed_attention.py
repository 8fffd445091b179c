"""The batched packed-attention kernel (torch's flex_attention with a BlockMask built from the
packed row's segments, easyvlm.models.flex_packed) against the per-sequence SDPA path, and the
choice between the kernels (easyvlm.models.padding_free.packed_attention_kernel).

On the CPU flex_attention runs eagerly: torch's dense reference implementation (scores for all N
keys, the mask applied with ``mask_mod``). Its forward is public on the CPU; its backward exists
(the same dense math) but ``flex_attention`` refuses inputs that require grad on the CPU, so the
gradient tests lift that one refusal (fixture ``flex_cpu_backward``). The block structure, which
the eager path does not read, is checked against torch's own ``create_block_mask`` and, in one
slow test, through the compiled (block-sparse) CPU kernel.

Tolerances: both kernels compute softmax(q k^T * scale) v in float32 over exactly the same keys per
query; they differ only in summation order (one matmul over the whole row against one per
sequence), ~1e-7 relative per operation, so torch's float32 defaults (rtol 1.3e-6, atol 1e-5) hold
for attention outputs and q/k/v gradients; through the tiny model (2 decoder layers, a vision tower,
an LM head) the differences measured are <= 5e-7 on log-probs (of magnitude up to 6) and <= 1.3e-7
on gradients (up to 0.17), so log-probs keep the defaults and gradients take atol 1e-6.
"""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch
from PIL import Image

import easyvlm.models.padding_free as padding_free
from easyvlm.models.flex_packed import segment_block_mask, token_intervals
from easyvlm.models.padding_free import (
    KERNEL_KWARG,
    _packed_attention,
    pack_inputs,
    packed_attention_kernel,
    varlen_attention_forward,
)
from easyvlm.models.segments import Segment, packed_segments

pytestmark = [pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile"),
              pytest.mark.usefixtures("one_torch_thread")]

# trunk 40 | branches on its first 30 tokens: 9, 9 (one run), 4 | trunk 1 | trunk 130 | branch on its
# first 100: 20 | trunk 5. Lengths 1 and > 128 (flex's block) included.
SHARED = [
    *range(40), *range(30, 39), *range(30, 39), *range(30, 34), 0, *range(130), *range(100, 120), *range(5)
]
PLAIN = [*range(37), 0, *range(130), *range(64), *range(5)]


def allow_flex_backward_on_cpu() -> None:
    """Lift flex_attention's refusal of inputs that require grad on the CPU (every other check of
    ``_validate_device`` stays). Its eager backward is torch's dense math, device-independent."""
    import torch.nn.attention.flex_attention as fa

    original = fa._validate_device
    fa._validate_device = lambda q, k, v: original(q.detach(), k.detach(), v.detach())


@pytest.fixture
def flex_cpu_backward(monkeypatch):
    import torch.nn.attention.flex_attention as fa

    monkeypatch.setattr(fa, "_validate_device", fa._validate_device)  # restored after the test
    allow_flex_backward_on_cpu()


def allowed_by_hand(segments: list[Segment], N: int) -> torch.Tensor:
    """(N, N) bool: token i sees j iff j is in i's segment at or before i, or in its trunk's prefix."""
    allowed = torch.zeros(N, N, dtype=torch.bool)
    for seg in segments:
        for i in range(seg.start, seg.start + seg.length):
            allowed[i, seg.start : i + 1] = True
            allowed[i, seg.trunk_start : seg.trunk_start + seg.prefix] = True
    return allowed


def test_kernel_choice(monkeypatch):
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    # the CPU: always per-sequence SDPA (the demo's path), whatever is installed
    monkeypatch.setattr(padding_free, "_flash_attn_available", lambda: True)
    monkeypatch.setattr(padding_free, "flex_available", lambda device: True)
    assert packed_attention_kernel(cpu) == "sdpa"
    assert packed_attention_kernel(cpu, shared_prompts=True) == "sdpa"
    # CUDA with flash-attn: flash-attn for plain packing; shared prompts need flex's mask
    assert packed_attention_kernel(cuda) == "flash_attn"
    assert packed_attention_kernel(cuda, dropout=0.1) == "flash_attn"
    assert packed_attention_kernel(cuda, shared_prompts=True) == "flex"
    # CUDA without flash-attn: flex, unless dropout (flex has none) or no Triton
    monkeypatch.setattr(padding_free, "_flash_attn_available", lambda: False)
    assert packed_attention_kernel(cuda) == "flex"
    assert packed_attention_kernel(cuda, shared_prompts=True) == "flex"
    assert packed_attention_kernel(cuda, dropout=0.1) == "sdpa"
    monkeypatch.setattr(padding_free, "flex_available", lambda device: False)
    assert packed_attention_kernel(cuda) == "sdpa"
    assert packed_attention_kernel(cuda, shared_prompts=True) == "sdpa"


def test_token_intervals_by_hand():
    # trunk of 4, a branch of 2 on its first 3 tokens, a trunk of 2
    segments = packed_segments([0, 1, 2, 3, 3, 4, 0, 1])
    own, lo, hi = token_intervals(segments, 8, torch.device("cpu"))
    assert own.tolist() == [0, 0, 0, 0, 4, 4, 6, 6]
    assert lo.tolist() == [0, 0, 0, 0, 0, 0, 0, 0] and hi.tolist() == [0, 0, 0, 0, 3, 3, 0, 0]
    with pytest.raises(ValueError, match="the segments cover 8 tokens, the row has 9"):
        token_intervals(segments, 9, torch.device("cpu"))


# a branch right after its trunk, on all of it: its prefix and own keys form one run (packed_segments
# reads such a row as one trunk, which is the same attention; built by hand here)
TOUCHING = [Segment(0, 10), Segment(10, 16, prefix=10, trunk_start=0), Segment(26, 7)]


@pytest.mark.parametrize("block_size", [4, 16, 128])
@pytest.mark.parametrize(
    "segments", [packed_segments(SHARED), packed_segments(PLAIN), TOUCHING], ids=["shared", "plain", "touching"]
)
def test_block_mask_equals_torch_builder(segments, block_size):
    """Our BlockMask (from the segments' intervals) against torch's create_block_mask, which
    evaluates the same mask_mod on all N x N pairs: the same partial and full blocks, in the same
    order; and the mask_mod itself is the segment rule written out by hand."""
    from torch.nn.attention.flex_attention import create_block_mask, create_mask

    N = segments[-1].start + segments[-1].length
    ours = segment_block_mask(segments, N, torch.device("cpu"), block_size)
    dense = create_mask(ours.mask_mod, 1, 1, N, N, device="cpu")[0, 0]
    torch.testing.assert_close(dense, allowed_by_hand(segments, N), rtol=0, atol=0)
    theirs = create_block_mask(ours.mask_mod, 1, 1, N, N, device="cpu", BLOCK_SIZE=block_size)
    assert ours.shape == theirs.shape and ours.BLOCK_SIZE == theirs.BLOCK_SIZE
    for counts, indices in (("kv_num_blocks", "kv_indices"), ("full_kv_num_blocks", "full_kv_indices")):
        n_ours, n_theirs = getattr(ours, counts), getattr(theirs, counts)
        torch.testing.assert_close(n_ours, n_theirs, rtol=0, atol=0)
        for row, n in enumerate(n_ours[0, 0].tolist()):  # the first n indices of a row are its blocks
            assert getattr(ours, indices)[0, 0, row, :n].tolist() == getattr(theirs, indices)[0, 0, row, :n].tolist()
    if block_size == 4:  # small blocks: every kind occurs
        assert int(ours.full_kv_num_blocks.sum()) > 0 and int(ours.kv_num_blocks.sum()) > 0
        assert int((ours.to_dense() == 0).sum()) > 0


CASES = {  # name: (positions, query heads, key/value heads, scaling)
    "lengths": (PLAIN, 4, 4, None),
    "gqa": (PLAIN, 4, 2, None),
    "gqa-one-kv-head-scaled": (PLAIN, 4, 1, 0.3),
    "shared-prompts": (SHARED, 4, 4, None),
    "shared-prompts-gqa-scaled": (SHARED, 4, 2, 0.3),
}


@pytest.mark.parametrize("case", CASES)
def test_flex_equals_per_sequence_sdpa(case, flex_cpu_backward):
    positions, H, Hkv, scaling = CASES[case]
    segments = packed_segments(positions)
    N, D = len(positions), 16
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(1, H, N, D, generator=gen, requires_grad=True)
    k, v = (torch.randn(1, Hkv, N, D, generator=gen, requires_grad=True) for _ in range(2))
    weight = torch.randn(1, N, H, D, generator=gen)
    results = {}
    for kernel in ("sdpa", "flex"):
        out = _packed_attention(q, k, v, segments, 0.0, scaling, kernel)  # (1, N, H, D)
        grads = torch.autograd.grad((out * weight).sum(), (q, k, v))
        results[kernel] = (out.detach(), *grads)
    for name, expected, got in zip(("out", "dq", "dk", "dv"), results["sdpa"], results["flex"]):
        torch.testing.assert_close(got, expected, msg=name)
    # the default on the CPU is the per-sequence path, bit for bit
    default = _packed_attention(q, k, v, segments, 0.0, scaling)
    torch.testing.assert_close(default, results["sdpa"][0], rtol=0, atol=0)


def test_dropout_and_unknown_kernels_are_refused():
    segments = packed_segments(PLAIN)
    q = k = v = torch.zeros(1, 2, len(PLAIN), 8)
    with pytest.raises(ValueError, match="flex_attention has no attention dropout"):
        _packed_attention(q, k, v, segments, 0.1, None, "flex")
    choose = r"easyvlm_attention_kernel='xformers': choose one of \('flash_attn', 'flex', 'sdpa'\)"
    with pytest.raises(ValueError, match=choose):
        _packed_attention(q, k, v, segments, 0.0, None, "xformers")
    with pytest.raises(ValueError, match="flash-attn's varlen kernel cannot run shared-prompt branches"):
        _packed_attention(q, k, v, packed_segments(SHARED), 0.0, None, "flash_attn")


@pytest.mark.slow
def test_compiled_block_sparse_kernel_on_cpu():
    """torch.compile(flex_attention) on the CPU (inductor's C++ template) reads the BlockMask's
    blocks: skips the empty ones and does not apply the mask in the full ones, so a wrong block
    would show here. One fixed shape (dynamic=False), the kernel on its own; the dynamic-shape compile
    the workers use (`compile_flex`: heads and head size static) is tests/models/test_flex_compile.py's
    (inductor's CPU template failed on automatically dynamic sizes in torch 2.14). Forward only (no CPU
    backward). ~10 s to compile."""
    from torch.nn.attention.flex_attention import flex_attention

    positions = [*range(300), *range(200, 330), *range(200, 330), *range(200), *range(50, 90)]
    segments, N = packed_segments(positions), len(positions)
    block_mask = segment_block_mask(segments, N, torch.device("cpu"))
    assert int(block_mask.full_kv_num_blocks.sum()) >= 3  # the long trunks fill whole blocks
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(1, 4, N, 16, generator=gen)
    k, v = torch.randn(2, 1, 2, N, 16, generator=gen)
    compiled = torch.compile(flex_attention, dynamic=False)
    got = compiled(q, k, v, block_mask=block_mask, scale=0.2, enable_gqa=True).transpose(1, 2)
    torch.testing.assert_close(got, _packed_attention(q, k, v, segments, 0.0, 0.2, "sdpa"))


@pytest.mark.gpu
@pytest.mark.parametrize("case", CASES)
def test_compiled_flex_on_cuda_equals_per_sequence_sdpa(case):
    """What a GPU without flash-attn runs by default: torch.compile(flex_attention) (Triton) with the
    block-sparse BlockMask, forward and backward, against per-sequence SDPA on the same GPU. float32;
    tolerance 1e-4 in case either kernel multiplies in TF32."""
    from easyvlm.models.padding_free import _flash_attn_available

    positions, H, Hkv, scaling = CASES[case]
    segments, N, device = packed_segments(positions), len(positions), torch.device("cuda")
    shared = any(seg.prefix for seg in segments)
    expected_default = "flash_attn" if _flash_attn_available() and not shared else "flex"
    assert packed_attention_kernel(device, shared_prompts=shared) == expected_default
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(1, H, N, 64, generator=gen).to(device).requires_grad_()
    k, v = (torch.randn(1, Hkv, N, 64, generator=gen).to(device).requires_grad_() for _ in range(2))
    weight = torch.randn(1, N, H, 64, generator=gen).to(device)
    results = {}
    for kernel in ("sdpa", "flex"):
        out = _packed_attention(q, k, v, segments, 0.0, scaling, kernel)
        results[kernel] = (out.detach(), *torch.autograd.grad((out * weight).sum(), (q, k, v)))
    for name, expected, got in zip(("out", "dq", "dk", "dv"), results["sdpa"], results["flex"]):
        torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4, msg=name)


# ------------------------------------------------------------------------------------------------
# The tiny Qwen2.5-VL through the padding-free path


def _vl_rows(tiny_model_path: str, share: bool):
    """Five rows, prompt length P, responses of different lengths: two image prompts used twice each
    and a text-only one; with ``share`` the repeats keep only their responses. Returns the model's
    packed inputs, the labels' packed positions and the response mask."""
    from transformers import AutoConfig, AutoProcessor

    from easyvlm.models.position_ids import get_position_ids

    processor = AutoProcessor.from_pretrained(tiny_model_path)
    config = AutoConfig.from_pretrained(tiny_model_path)
    rng = np.random.default_rng(0)
    image = lambda w, h: Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8))  # noqa: E731
    vision = "<|vision_start|><|image_pad|><|vision_end|>"
    prompts = [f"{vision}what is it?", f"<|im_start|>user\n{vision}count", "hello there"]
    enc = processor(text=prompts, images=[image(56, 56), image(84, 56)], return_tensors="pt", padding=True)
    prompt_rows = [0, 0, 1, 1, 2]
    ids, mask = enc["input_ids"][prompt_rows], enc["attention_mask"][prompt_rows].bool()  # left padded
    P, T = ids.shape[1], 6
    gen = torch.Generator().manual_seed(1)
    responses = torch.randint(0, 200, (5, T), generator=gen)
    response_mask = torch.arange(T)[None, :] < torch.tensor([6, 3, 5, 1, 4])[:, None]
    input_ids = torch.cat([ids, responses * response_mask], 1)
    attention_mask = torch.cat([mask, response_mask], 1)
    grid = enc["image_grid_thw"][[0, 0, 1, 1]]
    pos = get_position_ids(input_ids, attention_mask, grid, model_config=config)  # (B, 4, L)
    sources = torch.tensor([0, 0, 2, 2, 4]) if share else None
    packed = pack_inputs(input_ids, attention_mask, pos, prompt_length=P, prompt_source=sources)
    if share:  # only the rows that run their prompt bring their images
        vision_inputs = dict(pixel_values=enc["pixel_values"], image_grid_thw=enc["image_grid_thw"])
    else:
        patches = enc["image_grid_thw"].prod(-1).tolist()
        first, second = enc["pixel_values"].split(patches)
        vision_inputs = dict(pixel_values=torch.cat([first, first, second, second]), image_grid_thw=grid)
    # the packed position predicting response token t of row b is that of padded column P - 1 + t
    index = packed.padded_to_packed[:, P - 1 : P - 1 + T][response_mask]
    labels = responses[response_mask]
    return packed, vision_inputs, index, labels


@pytest.mark.parametrize("share", [False, True], ids=["packed", "shared-prompts"])
def test_tiny_vl_logprobs_and_gradients_equal_per_sequence(tiny_model_path, share, flex_cpu_backward, monkeypatch):
    from transformers import AutoModelForImageTextToText

    from easyvlm.models.flex_packed import flex_packed_attention

    padding_free.register_varlen_attention()
    attn = {"": "sdpa", "text_config": padding_free.VARLEN_ATTENTION, "vision_config": "sdpa"}
    model = AutoModelForImageTextToText.from_pretrained(tiny_model_path, attn_implementation=attn, dtype=torch.float32)
    packed, vision_inputs, index, labels = _vl_rows(tiny_model_path, share)
    calls = []
    monkeypatch.setattr(padding_free, "flex_packed_attention", lambda *a: calls.append(1) or flex_packed_attention(*a))
    results = {}
    for kernel in ("sdpa", "flex"):
        model.zero_grad(set_to_none=True)
        logits = model(input_ids=packed.input_ids, position_ids=packed.position_ids, use_cache=False,
                       **vision_inputs, **{KERNEL_KWARG: kernel}).logits[0]
        logprobs = torch.log_softmax(logits[index].float(), -1).gather(-1, labels[:, None])[:, 0]
        (-logprobs.mean()).backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        results[kernel] = logprobs.detach(), grads
    assert len(calls) == model.config.text_config.num_hidden_layers  # flex ran in every decoder layer
    (lp_sdpa, g_sdpa), (lp_flex, g_flex) = results["sdpa"], results["flex"]
    torch.testing.assert_close(lp_flex, lp_sdpa)
    assert g_flex.keys() == g_sdpa.keys() and any(n.startswith("model.visual") for n in g_sdpa)
    for name, grad in g_sdpa.items():
        # gradients up to ~0.17, measured differences <= 1.3e-7 (float32 summation order)
        torch.testing.assert_close(g_flex[name], grad, rtol=1.3e-6, atol=1e-6, msg=name)


# ------------------------------------------------------------------------------------------------
# Ulysses: two ranks, one sequence-parallel group


def _ulysses_rank(rank: int, port: int, out_file: str) -> None:
    import torch.distributed as dist

    from easyvlm.models.ulysses import UlyssesAttention, new_ulysses_group, pad_packed_row

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    allow_flex_backward_on_cpu()
    sp = new_ulysses_group(2)
    row = SHARED[:-1]  # 217 tokens: padded to 218, the pad token a trunk of its own
    _, positions = pad_packed_row(torch.zeros(1, len(row), dtype=torch.long), torch.tensor([row]), 2)
    attention = UlyssesAttention(sp=sp, segments=packed_segments(positions))
    N, n = positions.shape[1], positions.shape[1] // 2
    gen = torch.Generator().manual_seed(0)  # the same whole row on both ranks; each keeps its half
    q, k, v = torch.randn(1, 4, N, 16, generator=gen), *torch.randn(2, 1, 2, N, 16, generator=gen)
    weight = torch.randn(1, N, 4, 16, generator=gen)
    mine = slice(rank * n, (rank + 1) * n)
    flex, calls = padding_free.flex_packed_attention, []
    padding_free.flex_packed_attention = lambda *a: calls.append(1) or flex(*a)  # counts the flex calls
    out = {}
    for kernel in ("sdpa", "flex"):
        ql, kl, vl = (t[:, :, mine].clone().requires_grad_() for t in (q, k, v))
        o, _ = varlen_attention_forward(
            torch.nn.Module(), ql, kl, vl, None, scaling=0.3, position_ids=positions[:, mine],
            easyvlm_ulysses=attention, easyvlm_attention_kernel=kernel,
        )
        grads = torch.autograd.grad((o * weight[:, mine]).sum(), (ql, kl, vl))
        out[kernel] = (o.detach(), *grads)
    if rank == 0:
        # the whole row in one process, per-sequence SDPA: the reference for both ranks' halves
        qf, kf, vf = (t.clone().requires_grad_() for t in (q, k, v))
        o = _packed_attention(qf, kf, vf, packed_segments(positions), 0.0, 0.3, "sdpa")
        out["whole"] = (o.detach(), *torch.autograd.grad((o * weight).sum(), (qf, kf, vf)))
    out["flex_calls"] = len(calls)
    gathered = [None, None]
    dist.all_gather_object(gathered, out)
    if rank == 0:
        torch.save(gathered, out_file)
    dist.destroy_process_group()


@pytest.mark.slow
def test_ulysses_with_flex_equals_one_process(tmp_path):
    """Each rank holds half of a padded packed row (shared prompts, a pad trunk at the end); the
    attention runs on all tokens of its heads (after the all-to-all) with flex or per-sequence SDPA.
    Both equal the single-process whole-row result, forward and q/k/v gradients."""
    import torch.multiprocessing as mp

    from easyvlm.workers.dist import find_free_port

    out_file = str(tmp_path / "ranks.pt")
    mp.spawn(_ulysses_rank, args=(find_free_port(), out_file), nprocs=2, join=True)
    ranks = torch.load(out_file, weights_only=False)
    whole = ranks[0]["whole"]
    n = whole[0].shape[1] // 2
    for rank in (0, 1):
        assert ranks[rank]["flex_calls"] == 1  # forced by the keyword; the default on the CPU is SDPA
        for kernel in ("sdpa", "flex"):
            for name, got, expected in zip(("out", "dq", "dk", "dv"), ranks[rank][kernel], whole):
                tokens = slice(rank * n, (rank + 1) * n)  # out is (1, N, H, D), the gradients (1, H, N, D)
                half = expected[:, tokens] if name == "out" else expected[:, :, tokens]
                torch.testing.assert_close(got, half, msg=f"{rank} {kernel} {name}")
