"""Qwen3.5's linear-attention (gated DeltaNet) layers exact on packed and shared-prompt rows: the short
convolution and the recurrent state restart at each trunk and fork for each branch, where transformers would
carry them across sequences. docs/models.md, "Qwen3.5: linear attention on packed rows"."""

from __future__ import annotations

import inspect

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from easyvlm.models.segments import Segment

SEGMENTS_KWARG = "easyvlm_linear_segments"
"""The model-forward keyword carrying the packed row's segments (a list of ``Segment``) to the
linear-attention layers; without it they run transformers' forward unchanged."""

# transformers' linear-attention classes this module replaces (their forward is the same in both)
REPLACED_CLASSES = frozenset({"Qwen3_5GatedDeltaNet", "Qwen3_5MoeGatedDeltaNet"})

DELTA_RULE_KERNELS = ("fla", "torch")
"""flash-linear-attention's varlen chunked kernel (CUDA), transformers' torch chunked reference."""


# ------------------------------------------------------------------------------------------------
# Pure functions


def segment_causal_conv1d(
    x: Tensor, weight: Tensor, segments: list[Segment], activation: str | None = None, bias: Tensor | None = None
) -> Tensor:
    """transformers' ``causal_conv1d_fn`` per segment of a packed row, in one call: x (1, C, N), weight (C, K)
    depthwise -> (1, C, N). A trunk sees zeros before its start, a branch its trunk's K-1 inputs before ``prefix``."""
    _, channels, n = x.shape
    k = weight.shape[-1]
    _check_segments(segments, n)
    source, token_at = _conv_index(segments, k, n, x.device)
    extended = torch.cat([x.to(weight.dtype), x.new_zeros(1, channels, 1, dtype=weight.dtype)], dim=2)
    row = extended.index_select(2, source)  # (1, C, N + S * (K - 1))
    out = F.conv1d(row, weight.unsqueeze(1), bias, padding=0, groups=channels).index_select(2, token_at)
    if activation is not None:
        from transformers.activations import ACT2FN

        out = ACT2FN[activation](out)
    return out.to(x.dtype)


def _conv_index(segments: list[Segment], k: int, n: int, device: torch.device) -> tuple[Tensor, Tensor]:
    """``source`` (N + S * (K-1),): the column of [x, zero] each column of the long row copies
    (index ``n`` is the zero column); ``token_at`` (N,): the output column of each packed token."""
    context: list[int] = []  # (S * (K - 1),) the context columns' sources, segment by segment
    for seg in segments:
        first = seg.prefix - (k - 1)  # trunk-relative position of the first context column
        for j in range(k - 1):
            inside = seg.prefix > 0 and first + j >= 0
            context.append(seg.trunk_start + first + j if inside else n)
    seg_id = torch.repeat_interleave(
        torch.arange(len(segments), device=device),
        torch.tensor([seg.length for seg in segments], device=device),
        output_size=n,
    )
    token_long = torch.arange(n, device=device) + (k - 1) * (seg_id + 1)  # each token's column in the long row
    context_long = _ranges([seg.start + i * (k - 1) for i, seg in enumerate(segments)], [k - 1] * len(segments), device)
    source = torch.empty(n + len(segments) * (k - 1), dtype=torch.long, device=device)
    source[token_long] = torch.arange(n, device=device)
    source[context_long] = torch.tensor(context, dtype=torch.long, device=device)
    return source, token_long - (k - 1)


def segment_gated_delta_rule(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    g: Tensor,
    beta: Tensor,
    segments: list[Segment],
    *,
    use_qk_l2norm_in_kernel: bool = True,
    chunk_size: int = 64,
    kernel: str | None = None,
) -> Tensor:
    """The gated delta rule per segment of a packed row. query/key (1, N, H, Dk), value (1, N, H, Dv), g/beta
    (1, N, H) -> (1, N, H, Dv). Trunks start from zero, branches from their trunk's state after ``prefix``
    tokens (:func:`_delta_rule_rounds`); ``kernel`` None picks one."""
    n = query.shape[1]
    _check_segments(segments, n)
    if kernel is None:
        kernel = delta_rule_kernel(query.device)
    elif kernel not in DELTA_RULE_KERNELS:
        raise ValueError(f"delta-rule kernel {kernel!r}: choose one of {DELTA_RULE_KERNELS}")
    run = _fla_pieces if kernel == "fla" else _torch_pieces
    outputs: list[Tensor] = []  # (tokens of the round, H, Dv) per round
    rows: list[Tensor] = []  # the packed-row index of those tokens
    states: Tensor | None = None  # the previous round's final states
    for pieces in _delta_rule_rounds(segments):
        starts, lengths, parents = (list(column) for column in zip(*pieces))
        initial = None if states is None else states.index_select(0, torch.tensor(parents, device=query.device))
        out, states = run(query, key, value, g, beta, starts, lengths, initial, use_qk_l2norm_in_kernel, chunk_size)
        outputs.append(out)
        rows.append(_ranges(starts, lengths, query.device))
    order = torch.cat(rows)
    out = torch.cat(outputs)
    if order.numel() != n:
        raise AssertionError(f"the rounds cover {order.numel()} of the row's {n} tokens")  # a bug, not an input error
    return out.new_zeros(n, *out.shape[1:]).index_copy(0, order, out).unsqueeze(0)


def _delta_rule_rounds(segments: list[Segment]) -> list[list[tuple[int, int, int]]]:
    """The pieces of :func:`segment_gated_delta_rule` by round: (start, length, parent), parent the piece of the
    previous round whose final state starts this one (-1 in round 0: zero state). A trunk with branches at
    p_1 < ... < p_k is cut at the p_j; its piece j and its branches at p_j run in round j (one state per round)."""
    cuts: dict[int, list[int]] = {}
    for seg in segments:
        if seg.prefix:
            cuts.setdefault(seg.trunk_start, []).append(seg.prefix)
    rounds: list[list[tuple[int, int, int]]] = []
    placed: dict[int, list[int]] = {}  # trunk start -> index of its piece j in round j
    for seg in segments:
        if seg.prefix:
            continue
        bounds = [0, *sorted(set(cuts.get(seg.start, ()))), seg.length]
        placed[seg.start] = []
        for j, (lo, hi) in enumerate(zip(bounds[:-1], bounds[1:])):
            if hi == lo:  # a branch at the trunk's very end: nothing after it
                continue
            if len(rounds) == j:
                rounds.append([])
            rounds[j].append((seg.start + lo, hi - lo, placed[seg.start][j - 1] if j else -1))
            placed[seg.start].append(len(rounds[j]) - 1)
    for seg in segments:
        if seg.prefix:
            j = sorted(set(cuts[seg.trunk_start])).index(seg.prefix) + 1
            if len(rounds) == j:
                rounds.append([])
            rounds[j].append((seg.start, seg.length, placed[seg.trunk_start][j - 1]))
    return rounds


def delta_rule_kernel(device: torch.device) -> str:
    """The delta-rule kernel for ``device`` (one of ``DELTA_RULE_KERNELS``): ``fla``'s varlen kernel
    on CUDA when installed (checked on a GPU only), else transformers' torch reference."""
    if device.type != "cuda":
        return "torch"
    try:
        import fla.ops.gated_delta_rule  # noqa: F401
    except ImportError:
        return "torch"
    return "fla"


def _torch_pieces(
    query: Tensor, key: Tensor, value: Tensor, g: Tensor, beta: Tensor, starts: list[int], lengths: list[int],
    initial: Tensor | None, l2norm: bool, chunk_size: int,
) -> tuple[Tensor, Tensor]:
    """One round on ``torch_chunk_gated_delta_rule``, pieces right-padded (a zero step keeps the state) -> (tokens
    (T, H, Dv), final states (P, H, Dk, Dv)). Undecorated: transformers' wrapper would call ``fla`` even on the CPU."""
    from transformers.models.qwen3_5.modeling_qwen3_5 import torch_chunk_gated_delta_rule

    n, longest = query.shape[1], max(lengths)
    steps = torch.arange(longest, device=query.device)
    index = torch.tensor(starts, device=query.device)[:, None] + steps
    index = index.masked_fill(steps >= torch.tensor(lengths, device=query.device)[:, None], n)  # n: a zero row

    def padded(t: Tensor) -> Tensor:  # (1, N, ...) -> (P, longest, ...)
        return torch.cat([t[0], t.new_zeros(1, *t.shape[2:])])[index]

    chunked = inspect.unwrap(torch_chunk_gated_delta_rule)
    out, final = chunked(
        padded(query), padded(key), padded(value), g=padded(g), beta=padded(beta), chunk_size=chunk_size,
        initial_state=initial, output_final_state=True, use_qk_l2norm_in_kernel=l2norm,
    )
    valid = _ranges([p * longest for p in range(len(starts))], lengths, query.device)
    return out.flatten(0, 1).index_select(0, valid), final


def _fla_pieces(
    query: Tensor, key: Tensor, value: Tensor, g: Tensor, beta: Tensor, starts: list[int], lengths: list[int],
    initial: Tensor | None, l2norm: bool, chunk_size: int,
) -> tuple[Tensor, Tensor]:
    """One round on ``fla``'s chunked kernel (CUDA only, untested here); returns as :func:`_torch_pieces`."""
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule

    index = _ranges(starts, lengths, query.device)
    bounds = [0]
    for length in lengths:
        bounds.append(bounds[-1] + length)
    cu_seqlens = torch.tensor(bounds, dtype=torch.long, device=query.device)
    q, k, v, g_, b_ = (t.index_select(1, index) for t in (query, key, value, g, beta))
    out, final = chunk_gated_delta_rule(
        q, k, v, g=g_, beta=b_, initial_state=initial, output_final_state=True, cu_seqlens=cu_seqlens,
        use_qk_l2norm_in_kernel=l2norm,
    )
    return out[0], final


def _ranges(starts: list[int], lengths: list[int], device: torch.device) -> Tensor:
    """The concatenated ranges ``start .. start + length - 1`` on ``device``, without a host sync."""
    total = sum(lengths)
    lengths_t = torch.tensor(lengths, device=device)
    piece = torch.repeat_interleave(torch.arange(len(lengths), device=device), lengths_t, output_size=total)
    offsets = torch.cumsum(lengths_t, 0) - lengths_t
    return torch.tensor(starts, device=device)[piece] + torch.arange(total, device=device) - offsets[piece]


def _check_segments(segments: list[Segment], n: int) -> None:
    trunks: dict[int, int] = {}
    at = 0
    for seg in segments:
        if seg.start != at or seg.length <= 0:
            raise ValueError(f"the segments must tile the row in order: {seg} found where token {at} starts")
        if not seg.prefix:
            trunks[seg.start] = seg.length
        elif seg.prefix > trunks.get(seg.trunk_start, -1):
            raise ValueError(f"{seg}: no earlier trunk at {seg.trunk_start} with {seg.prefix} tokens to continue")
        at += seg.length
    if at != n:
        raise ValueError(f"the segments cover {at} tokens, the row has {n} (a row sliced for Ulysses is not supported)")


# ------------------------------------------------------------------------------------------------
# The module


class SegmentedGatedDeltaNet(nn.Module):
    """A Qwen3.5 linear-attention layer that also runs packed and shared-prompt rows exactly, taking over the
    original's parameters and submodules by name; without ``SEGMENTS_KWARG`` it runs transformers' forward."""

    def __init__(self, original: nn.Module):
        super().__init__()
        self._transformers_class = type(original)
        for name, value in vars(original).items():
            if not name.startswith("_"):
                setattr(self, name, value)  # training, layer_idx, num_v_heads, head_k_dim, activation, ...
        for name, param in original._parameters.items():
            self.register_parameter(name, param)
        for name, buffer in original._buffers.items():
            self.register_buffer(name, buffer, persistent=name not in original._non_persistent_buffers_set)
        for name, module in original._modules.items():
            self.add_module(name, module)

    def forward(
        self, hidden_states: Tensor, cache_params=None, attention_mask: Tensor | None = None, **kwargs
    ) -> Tensor:
        segments = kwargs.pop(SEGMENTS_KWARG, None)
        if segments is None:
            return self._transformers_class.forward(self, hidden_states, cache_params, attention_mask, **kwargs)
        if hidden_states.shape[0] != 1 or attention_mask is not None or cache_params is not None:
            raise ValueError(
                f"{SEGMENTS_KWARG}: the segment-aware linear attention runs one packed row (batch 1) without an "
                f"attention mask or a cache (got batch {hidden_states.shape[0]}, mask "
                f"{attention_mask is not None}, cache {cache_params is not None}; pass use_cache=False)"
            )
        from transformers.integrations.accelerate import force_accelerate_hooks

        # as transformers' forward: accelerate's offload hook of conv1d fires though only its weight is read
        return force_accelerate_hooks("conv1d")(type(self)._segmented_forward)(self, hidden_states, segments)

    def _segmented_forward(self, hidden_states: Tensor, segments: list[Segment]) -> Tensor:
        """transformers' forward without a cache, with the segment-aware convolution and delta rule."""
        _, n, _ = hidden_states.shape
        mixed_qkv = self.in_proj_qkv(hidden_states).transpose(1, 2)
        z = self.in_proj_z(hidden_states).reshape(1, n, -1, self.head_v_dim)
        b = self.in_proj_b(hidden_states)
        a = self.in_proj_a(hidden_states)
        mixed_qkv = segment_causal_conv1d(
            mixed_qkv, self.conv1d.weight.squeeze(1), segments, self.activation, self.conv1d.bias
        ).transpose(1, 2)
        query, key, value = torch.split(mixed_qkv, [self.key_dim, self.key_dim, self.value_dim], dim=-1)
        query = query.reshape(1, n, -1, self.head_k_dim)
        key = key.reshape(1, n, -1, self.head_k_dim)
        value = value.reshape(1, n, -1, self.head_v_dim)
        beta = b.sigmoid()
        g = -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias)
        if self.num_v_heads // self.num_k_heads > 1:
            query = query.repeat_interleave(self.num_v_heads // self.num_k_heads, dim=2)
            key = key.repeat_interleave(self.num_v_heads // self.num_k_heads, dim=2)
        core = segment_gated_delta_rule(query, key, value, g, beta, segments, use_qk_l2norm_in_kernel=True)
        core = self.norm(core.reshape(-1, self.head_v_dim), z.reshape(-1, self.head_v_dim))
        return self.out_proj(core.reshape(1, n, -1))


def segment_linear_attention(model: nn.Module) -> int:
    """Replace every Qwen3.5(-MoE) linear-attention module by a :class:`SegmentedGatedDeltaNet`;
    returns how many. Call it before ``fully_shard`` and ``torch.compile``."""
    replaced = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child).__name__ in REPLACED_CLASSES:
                setattr(parent, name, SegmentedGatedDeltaNet(child))
                replaced += 1
    return replaced


def has_linear_attention(config) -> bool:
    """Whether the (text) config's decoder has "linear_attention" layers (a packed forward then needs this module)."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    return "linear_attention" in (getattr(text, "layer_types", None) or ())
