"""Qwen3.5's linear-attention layers on packed and shared-prompt rows (easyvlm/models/linear_attention.py)
against independent references: transformers' per-token recurrence and causal conv on each unshared
sequence, and transformers' own unmodified model run one sequence at a time.

Tolerances. The models run in float32. The packed forward cuts the delta rule's 64-token chunks
at other places than the per-sequence forward (a branch's chunks start at its prefix, not at 0),
the chunked and the per-token forms of the rule sum in other orders, and the packed row's matmuls
have other shapes: the same math, rounded differently. Measured with these seeds: log-probs within
6e-6 of the reference (values up to 9.5), each gradient within 1.4e-5 of its tensor's largest
entry. That is float32's own rounding: transformers' float32 model is 1.3e-5 (log-probs) and 6.5e-6
(gradients, of the largest entry) away from the same model in float64. Hence rtol = atol = 1e-5 on
log-probs, and on gradients rtol = 1e-5 with atol = 5e-5 times the tensor's largest entry (about 3x
the worst measured; a gradient is a sum over every token, so only its scale makes an absolute bound
meaningful). The deliberate breaks (no state reset, no fork, a conv across a boundary) move
log-probs by 2 to 4 nats. The padded path (no segments) runs transformers' code and is bitwise equal.
"""

from __future__ import annotations

import inspect

import pytest
import torch
from transformers import (
    Qwen3_5Config,
    Qwen3_5ForCausalLM,
    Qwen3_5ForConditionalGeneration,
    Qwen3_5MoeForCausalLM,
    Qwen3_5MoeTextConfig,
    Qwen3_5TextConfig,
    Qwen2Config,
)
from transformers.models.qwen3_5 import modeling_qwen3_5

from easyvlm.models.linear_attention import (
    SEGMENTS_KWARG,
    SegmentedGatedDeltaNet,
    _delta_rule_rounds,
    delta_rule_kernel,
    has_linear_attention,
    segment_causal_conv1d,
    segment_gated_delta_rule,
    segment_linear_attention,
)
from easyvlm.models.padding_free import VARLEN_ATTENTION, register_varlen_attention
from easyvlm.models.segments import Segment, packed_segments

pytestmark = pytest.mark.usefixtures("one_torch_thread")

# transformers' torch functions themselves (its wrappers would call causal-conv1d / fla when installed)
causal_conv1d_fn = inspect.unwrap(modeling_qwen3_5.causal_conv1d_fn)
torch_recurrent_gated_delta_rule = inspect.unwrap(modeling_qwen3_5.torch_recurrent_gated_delta_rule)

TOL = dict(rtol=1e-5, atol=1e-5)  # log-probs, see the module docstring
GRAD_RTOL, GRAD_ATOL = 1e-5, 5e-5  # a model's gradients: atol in units of the tensor's largest entry

# ------------------------------------------------------------------------------------------------
# The pure functions against transformers' per-sequence functions


def positions(*runs: tuple[int, int]) -> list[int]:
    """Text positions of a packed row from (first position, length) runs."""
    return [p for first, length in runs for p in range(first, first + length)]


# trunk of 9 with branches at prefixes 6 (two of them), 2 (< K - 1: zeros in the branch's conv
# context) and 9 (the whole trunk); a one-token trunk; a trunk of 70 (> one 64-token chunk) with
# a branch of 67 at prefix 66 (its state crosses a chunk boundary); a trunk of 5 without branches
ROW = positions((0, 9), (6, 4), (6, 1), (2, 3), (9, 2), (0, 1), (0, 70), (66, 67), (0, 5))


def unshared(segment: Segment) -> list[int]:
    """The packed-row indices of the sequence a segment ends: its trunk's prefix, then its own tokens."""
    prefix = range(segment.trunk_start, segment.trunk_start + segment.prefix)
    return [*prefix, *range(segment.start, segment.start + segment.length)]


def test_the_rounds_fork_each_trunk_at_its_branches():
    # (start, length, parent: index of the piece in the round before whose final state it starts
    # from, -1 for zero). Trunk 0 (9 tokens) is cut at 2, 6 and 9: pieces [0, 2), [2, 6), [6, 9) in
    # rounds 0-2, its branches at 2 and 6 in rounds 1 and 2, the one at 9 in round 3 (after [6, 9));
    # the trunk at 20 (70 tokens) is cut at 66; the trunks at 19 and 157 run whole in round 0
    assert _delta_rule_rounds(packed_segments(ROW)) == [
        [(0, 2, -1), (19, 1, -1), (20, 66, -1), (157, 5, -1)],
        [(2, 4, 0), (86, 4, 2), (14, 3, 0), (90, 67, 2)],
        [(6, 3, 0), (9, 4, 0), (13, 1, 0)],
        [(17, 2, 0)],
    ]


@pytest.mark.parametrize("row", [ROW, positions((0, 3), (0, 1), (0, 4))], ids=["shared", "plain"])
def test_segment_conv_is_the_causal_conv_of_each_unshared_sequence(row):
    torch.manual_seed(0)
    segments, n, channels = packed_segments(row), len(row), 6
    x = torch.randn(1, channels, n, requires_grad=True)
    weight = torch.randn(channels, 4, requires_grad=True)
    out = segment_causal_conv1d(x, weight, segments, "silu")
    expected = torch.zeros_like(out)
    for seg in segments:  # transformers' conv on prompt + own tokens; keep the own tokens' outputs
        conv = causal_conv1d_fn(x[:, :, unshared(seg)], weight, activation="silu")
        expected = expected.index_copy(2, torch.arange(seg.start, seg.start + seg.length), conv[:, :, seg.prefix :])
    # the same K-term sums on a longer row: measured 6e-8; the weight's gradient sums over all
    # tokens (values up to 25): measured 4e-6
    torch.testing.assert_close(out, expected, rtol=0, atol=1e-6)
    weights = torch.randn_like(out)
    grads = torch.autograd.grad((out * weights).sum(), (x, weight))
    expected_grads = torch.autograd.grad((expected * weights).sum(), (x, weight))
    for got, want in zip(grads, expected_grads):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-5)


@pytest.mark.parametrize("row", [ROW, positions((0, 80), (0, 2), (0, 1))], ids=["shared", "plain"])
def test_segment_delta_rule_is_the_recurrence_of_each_unshared_sequence(row):
    torch.manual_seed(0)
    segments, n, heads = packed_segments(row), len(row), 2
    query, key = (torch.randn(1, n, heads, 8, requires_grad=True) for _ in range(2))
    value = torch.randn(1, n, heads, 5, requires_grad=True)
    g = (-torch.rand(1, n, heads) * 0.3).requires_grad_()  # decays exp(g) in (0.74, 1]: the state lasts
    beta = torch.rand(1, n, heads, requires_grad=True)
    inputs = (query, key, value, g, beta)
    out = segment_gated_delta_rule(*inputs, segments)
    expected = torch.zeros_like(out)
    for seg in segments:  # transformers' token-by-token recurrence from a zero state, per unshared sequence
        index = torch.tensor(unshared(seg))
        rule, _ = torch_recurrent_gated_delta_rule(
            *(t[:, index] for t in inputs[:3]), g=g[:, index], beta=beta[:, index], use_qk_l2norm_in_kernel=True)
        expected = expected.index_copy(1, torch.arange(seg.start, seg.start + seg.length), rule[:, seg.prefix :])
    # chunked (64 tokens, cut at the forks) against per-token sums: measured 2e-7 on outputs, 7e-7
    # on gradients (values up to 2.2)
    torch.testing.assert_close(out, expected, rtol=1e-6, atol=1e-6)
    weights = torch.randn_like(out)
    grads = torch.autograd.grad((out * weights).sum(), inputs)
    expected_grads = torch.autograd.grad((expected * weights).sum(), inputs)
    for name, got, want in zip(("query", "key", "value", "g", "beta"), grads, expected_grads):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6, msg=name)


def stand_in_fla(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
                 use_qk_l2norm_in_kernel=False, cu_seqlens=None):
    """flash-linear-attention's ``chunk_gated_delta_rule`` API (one row, ``cu_seqlens``, one initial
    state per sequence), computed by transformers' recurrence sequence by sequence: the CPU stand-in
    that checks what easyvlm hands the real kernel (which needs CUDA and Triton)."""
    assert q.shape[0] == 1 and cu_seqlens.dtype == torch.long and scale is None and output_final_state
    bounds = cu_seqlens.tolist()
    assert bounds[0] == 0 and bounds[-1] == q.shape[1]
    assert initial_state is None or initial_state.shape[0] == len(bounds) - 1
    outs, finals = [], []
    for i, (lo, hi) in enumerate(zip(bounds[:-1], bounds[1:])):
        out, final = torch_recurrent_gated_delta_rule(
            q[:, lo:hi], k[:, lo:hi], v[:, lo:hi], g=g[:, lo:hi], beta=beta[:, lo:hi],
            initial_state=None if initial_state is None else initial_state[i : i + 1],
            output_final_state=True, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel)
        outs.append(out)
        finals.append(final)
    return torch.cat(outs, dim=1), torch.cat(finals)


@pytest.fixture
def fake_fla(monkeypatch):
    """A module ``fla.ops.gated_delta_rule`` holding :func:`stand_in_fla`."""
    import sys
    import types

    module = types.ModuleType("fla.ops.gated_delta_rule")
    module.chunk_gated_delta_rule = stand_in_fla
    for name in ("fla", "fla.ops"):
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    monkeypatch.setitem(sys.modules, "fla.ops.gated_delta_rule", module)


def test_the_kernel_choice_and_the_fla_path(fake_fla):
    # fla on CUDA only; the same rounds through the fla path give the torch path's result
    assert delta_rule_kernel(torch.device("cpu")) == "torch"
    assert delta_rule_kernel(torch.device("cuda")) == "fla"
    torch.manual_seed(0)
    segments, n = packed_segments(ROW), len(ROW)
    query, key = (torch.randn(1, n, 2, 8) for _ in range(2))
    inputs = (query, key, torch.randn(1, n, 2, 5), -torch.rand(1, n, 2) * 0.3, torch.rand(1, n, 2))
    torch.testing.assert_close(segment_gated_delta_rule(*inputs, segments, kernel="fla"),
                               segment_gated_delta_rule(*inputs, segments, kernel="torch"), rtol=1e-6, atol=1e-6)
    with pytest.raises(ValueError, match="choose one of"):
        segment_gated_delta_rule(*inputs, segments, kernel="triton")


def test_without_fla_cuda_runs_the_torch_kernel(monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "fla", None)  # import fla -> ImportError
    assert delta_rule_kernel(torch.device("cuda")) == "torch"


def test_segments_that_do_not_tile_the_row_are_an_error():
    x = torch.zeros(1, 2, 6)
    with pytest.raises(ValueError, match="the segments cover 5 tokens, the row has 6"):
        segment_causal_conv1d(x, torch.zeros(2, 4), [Segment(0, 5)])
    with pytest.raises(ValueError, match="no earlier trunk"):
        segment_causal_conv1d(x, torch.zeros(2, 4), [Segment(0, 2), Segment(2, 4, prefix=3, trunk_start=0)])


# ------------------------------------------------------------------------------------------------
# Tiny random Qwen3.5 models


def text_config(cls=Qwen3_5TextConfig, **changes):
    """Three gated-DeltaNet layers, then one gated full-attention layer; 2 key heads repeated to 4
    value heads (the repeat_interleave path); kernel 4; float32-sized for a fast CPU test."""
    values = dict(
        vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
        layer_types=["linear_attention", "linear_attention", "linear_attention", "full_attention"],
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, linear_num_key_heads=2,
        linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16, linear_conv_kernel_dim=4,
        initializer_range=0.1,
    )
    return cls(**{**values, **changes})


def make_pair(cls, config):
    """(transformers' model with SDPA, unmodified: the reference; the same weights loaded with
    easyvlm's varlen attention and segment-aware linear attention). Decays exp(g) of about 0.55-0.98
    and a non-trivial gated norm, so state carried across a boundary shows."""
    register_varlen_attention()
    torch.manual_seed(0)
    reference = cls._from_config(config, dtype=torch.float32, attn_implementation="sdpa")
    with torch.no_grad():
        for name, param in reference.named_parameters():
            if name.endswith(".A_log"):
                param.copy_(torch.empty_like(param).uniform_(0.05, 0.5).log())
            elif name.endswith(".dt_bias"):
                param.normal_(0.0, 0.5)
            elif name.endswith("linear_attn.norm.weight"):
                param.uniform_(0.5, 1.5)
    composite = hasattr(config, "text_config")
    varlen = {"": "sdpa", "text_config": VARLEN_ATTENTION, "vision_config": "sdpa"} if composite else VARLEN_ATTENTION
    packed = cls._from_config(config, dtype=torch.float32, attn_implementation=varlen)
    packed.load_state_dict(reference.state_dict())
    assert segment_linear_attention(packed) == 3
    return reference, packed


@pytest.fixture(scope="module")
def dense_pair():
    return make_pair(Qwen3_5ForCausalLM, text_config())


def packed_forward(model, sequences: list[torch.Tensor], row: list[int]):
    """log-softmax (N, V) of the packed row of ``sequences`` (token ids) at text positions ``row``."""
    ids = torch.cat(sequences)[None]
    position_ids = torch.tensor(row)[None]
    out = model(input_ids=ids, position_ids=position_ids, use_cache=False,
                **{SEGMENTS_KWARG: packed_segments(position_ids)})
    return out.logits[0].log_softmax(-1)


def reference_forward(model, ids: torch.Tensor):
    """log-softmax (L, V) of one sequence through transformers' own model."""
    return model(input_ids=ids[None], use_cache=False).logits[0].log_softmax(-1)


def backward_token_loss(*log_probs: torch.Tensor) -> None:
    """Backward of a policy-gradient-like loss on each of the (T, V) log-prob tensors: sum over
    tokens of a random weight times the log-prob of a random target token (the same on each side)."""
    targets = torch.randint(0, log_probs[0].shape[1], (log_probs[0].shape[0], 1))
    weights = torch.randn(log_probs[0].shape[0])
    for lp in log_probs:
        (lp.gather(1, targets)[:, 0] * weights).sum().backward()


def assert_same_gradients(reference, packed):
    """Every parameter's gradient (same names on both sides) within GRAD_RTOL / GRAD_ATOL; the first
    linear-attention layer's decay, dt bias and conv weight actually receive one."""
    got = dict(packed.named_parameters())
    assert list(got) == [name for name, _ in reference.named_parameters()]
    for name, param in reference.named_parameters():
        if param.grad is None:
            assert got[name].grad is None, name
            continue
        scale = float(param.grad.abs().max())
        torch.testing.assert_close(got[name].grad, param.grad, rtol=GRAD_RTOL, atol=GRAD_ATOL * scale, msg=name)
    first = next(name[: -len("A_log")] for name in got if name.endswith("layers.0.linear_attn.A_log"))
    assert all(got[first + p].grad.abs().sum() > 0 for p in ("A_log", "dt_bias", "conv1d.weight"))


def check_packing(reference, packed, lengths: list[int]):
    """Independent sequences in one row == each through the reference: log-probs, and the gradients
    of :func:`backward_token_loss` (on the reference side, summed over the sequences)."""
    for model in (reference, packed):
        model.zero_grad()
    torch.manual_seed(1)
    sequences = [torch.randint(0, 300, (length,)) for length in lengths]
    got = packed_forward(packed, sequences, positions(*((0, length) for length in lengths)))
    expected = torch.cat([reference_forward(reference, ids) for ids in sequences])
    backward_token_loss(got, expected)
    torch.testing.assert_close(got, expected, **TOL)
    assert_same_gradients(reference, packed)


def test_the_replacement_keeps_names_and_parameters(dense_pair):
    reference, packed = dense_pair
    assert list(packed.state_dict()) == list(reference.state_dict())
    assert [type(layer.linear_attn) for layer in packed.model.layers[:3]] == [SegmentedGatedDeltaNet] * 3
    layer = packed.model.layers[0].linear_attn
    assert [name for name, _ in layer.named_parameters()] == [
        "dt_bias", "A_log", "conv1d.weight", "norm.weight", "out_proj.weight", "in_proj_qkv.weight",
        "in_proj_z.weight", "in_proj_b.weight", "in_proj_a.weight",
    ]
    assert segment_linear_attention(packed) == 0  # nothing left to replace


@pytest.mark.parametrize(
    "lengths", [[1, 4, 3, 1], [70, 5, 150, 1]], ids=["short", "longer-than-a-chunk"])
def test_a_packed_row_is_each_sequence_alone(dense_pair, lengths):
    check_packing(*dense_pair, lengths)


def check_shared_prompts(reference, packed, prompt_lengths: list[int], response_lengths: list[list[int]]):
    """Groups of a prompt and its responses, packed as trunk (prompt + first response) then branches
    (the other responses at positions P..) == each prompt + response through the reference: the
    log-probs at the response tokens and every gradient (the loss is on response tokens only, so the
    prompt's gradient is the sum over its responses, as unshared)."""
    for model in (reference, packed):
        model.zero_grad()
    torch.manual_seed(2)
    sequences, row, expected_parts, packed_rows = [], [], [], []
    for prompt_length, responses in zip(prompt_lengths, response_lengths):
        prompt = torch.randint(0, 300, (prompt_length,))
        for i, length in enumerate(responses):
            response = torch.randint(0, 300, (length,))
            tokens = response if i else torch.cat([prompt, response])
            packed_rows.extend(range(len(row) + (0 if i else prompt_length), len(row) + len(tokens)))
            row.extend(range(0 if i == 0 else prompt_length, prompt_length + length))
            sequences.append(tokens)
            expected_parts.append(reference_forward(reference, torch.cat([prompt, response]))[prompt_length:])
    got = packed_forward(packed, sequences, row)[packed_rows]  # the response tokens, group by group
    expected = torch.cat(expected_parts)
    backward_token_loss(got, expected)
    torch.testing.assert_close(got, expected, **TOL)
    assert_same_gradients(reference, packed)


@pytest.mark.parametrize(
    "prompts,responses",
    [
        ([2, 6], [[3, 4, 1], [5, 2]]),  # a prompt shorter than K - 1: zeros in the branches' conv context
        ([70], [[20, 66, 3]]),  # a prompt longer than a chunk; a response crossing the next chunk boundary
    ],
    ids=["short-prompts", "long-prompt"],
)
def test_shared_prompts_are_the_unshared_forwards(dense_pair, prompts, responses):
    check_shared_prompts(*dense_pair, prompts, responses)


# ------------------------------------------------------------------------------------------------
# The keyword's way down, the padded path, the other model classes


def record_segments(model) -> list:
    """Forward pre-hooks that record what each replaced layer receives as SEGMENTS_KWARG."""
    seen: list = []
    for module in model.modules():
        if isinstance(module, SegmentedGatedDeltaNet):
            module.register_forward_pre_hook(lambda m, args, kwargs: seen.append(kwargs.get(SEGMENTS_KWARG)),
                                             with_kwargs=True)
    return seen


def test_the_keyword_reaches_every_linear_layer_of_the_moe_model():
    config = text_config(Qwen3_5MoeTextConfig, moe_intermediate_size=32, shared_expert_intermediate_size=32,
                         num_experts=4, num_experts_per_tok=2)
    reference, packed = make_pair(Qwen3_5MoeForCausalLM, config)
    seen = record_segments(packed)
    check_packing(reference, packed, [5, 1, 7])
    assert seen == [packed_segments(positions((0, 5), (0, 1), (0, 7)))] * 3


def vlm_config():
    """A composite Qwen3.5 (vision tower of one block, 4 x 4-pixel patches) around the tiny decoder."""
    vision = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, patch_size=4, temporal_patch_size=2,
                  spatial_merge_size=2, out_hidden_size=64, num_position_embeddings=16)
    return Qwen3_5Config(text_config=text_config().to_dict(), vision_config=vision, image_token_id=290,
                         video_token_id=291, vision_start_token_id=288, vision_end_token_id=289)


def test_the_keyword_reaches_the_decoder_of_the_vlm_and_the_tower_ignores_it():
    reference, packed = make_pair(Qwen3_5ForConditionalGeneration, vlm_config())
    seen = record_segments(packed)
    check_packing(reference, packed, [3, 6])
    assert seen == [packed_segments(positions((0, 3), (0, 6)))] * 3
    # one image (1 x 4 x 4 patches, merged 2 x 2 into 4 tokens) and the keyword: the tower and the full
    # attention ignore it, the linear layers run one trunk: the result is the forward without it
    torch.manual_seed(3)
    ids = torch.tensor([[5, 288, 290, 290, 290, 290, 289, 7, 9]])
    image = dict(pixel_values=torch.randn(16, 3 * 2 * 4 * 4), image_grid_thw=torch.tensor([[1, 4, 4]]),
                 mm_token_type_ids=(ids == 290).int())
    with torch.no_grad():
        with_kwarg = packed(input_ids=ids, use_cache=False, **image, **{SEGMENTS_KWARG: [Segment(0, 9)]}).logits
        without = reference(input_ids=ids, use_cache=False, **image).logits
    torch.testing.assert_close(with_kwarg, without, **TOL)
    assert seen[-3:] == [[Segment(0, 9)]] * 3


def test_without_the_keyword_it_is_transformers_forward(dense_pair):
    # a left-padded batch with its mask (transformers zeroes the pad tokens' inputs of the linear
    # layers) and greedy decoding with the cache: bitwise what the unreplaced model gives
    reference, packed = dense_pair
    unreplaced = Qwen3_5ForCausalLM._from_config(packed.config, dtype=torch.float32, attn_implementation=VARLEN_ATTENTION)
    unreplaced.load_state_dict(reference.state_dict())
    torch.manual_seed(4)
    ids = torch.randint(0, 300, (3, 9))
    mask = torch.ones(3, 9, dtype=torch.long)
    mask[0, :4] = mask[1, :1] = 0
    with torch.no_grad():
        logits = [m(input_ids=ids, attention_mask=mask).logits for m in (unreplaced, packed)]
        generated = [m.generate(input_ids=ids, attention_mask=mask, max_new_tokens=4, do_sample=False,
                                output_scores=True, return_dict_in_generate=True, pad_token_id=0)
                     for m in (unreplaced, packed)]
    torch.testing.assert_close(logits[1], logits[0], rtol=0, atol=0)
    assert torch.equal(generated[1].sequences, generated[0].sequences)
    for got, want in zip(generated[1].scores, generated[0].scores):
        torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_the_segment_path_refuses_a_batch_a_mask_or_a_cache(dense_pair):
    _, packed = dense_pair
    layer = packed.model.layers[0].linear_attn
    hidden = torch.zeros(2, 3, 64)
    with pytest.raises(ValueError, match="batch 2"):
        layer(hidden, **{SEGMENTS_KWARG: [Segment(0, 3)]})
    with pytest.raises(ValueError, match="mask True"):
        layer(hidden[:1], attention_mask=torch.ones(1, 3), **{SEGMENTS_KWARG: [Segment(0, 3)]})
    with pytest.raises(ValueError, match="pass use_cache=False"):
        packed(input_ids=torch.zeros(1, 3, dtype=torch.long), **{SEGMENTS_KWARG: [Segment(0, 3)]})


def test_has_linear_attention():
    assert has_linear_attention(text_config())
    assert has_linear_attention(vlm_config())  # reads the text config of a composite one
    assert not has_linear_attention(text_config(layer_types=["full_attention"], num_hidden_layers=1))
    assert not has_linear_attention(Qwen2Config())
