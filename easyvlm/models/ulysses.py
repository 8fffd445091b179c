"""Ulysses sequence parallelism (DeepSpeed-Ulysses, arXiv:2309.14509) for the padding-free forward: each of
S consecutive ranks runs the decoder on 1/S of the same packed row; attention swaps tokens for heads by
all-to-all. docs/workers.md, "Ulysses sequence parallelism"."""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Iterator

import torch
import torch.distributed as dist
from torch import Tensor, nn

from easyvlm.models.linear_attention import has_linear_attention

if TYPE_CHECKING:
    from transformers import PretrainedConfig

    from easyvlm.models.segments import Segment

ULYSSES_KWARG = "easyvlm_ulysses"
"""The keyword under which the model's forward carries :class:`UlyssesAttention` down to the
attention function (transformers passes a model's extra keyword arguments to every layer)."""


# ------------------------------------------------------------------------------------------------
# Groups


def ulysses_layout(rank: int, world_size: int, ulysses_size: int) -> tuple[list[int], int, int]:
    """(global ranks of ``rank``'s SP group, its DP rank, the DP size). Consecutive ranks form a group:
    world_size 8, ulysses_size 4, rank 5 -> ([4, 5, 6, 7], 1, 2)."""
    if ulysses_size < 1 or world_size % ulysses_size:
        raise ValueError(
            f"worker.actor.ulysses_size={ulysses_size} must be >= 1 and divide the {world_size} ranks "
            f"(trainer.n_gpus_per_node x trainer.nnodes); choose a divisor of {world_size}"
        )
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is not in 0..{world_size - 1}")
    dp_rank = rank // ulysses_size
    return list(range(dp_rank * ulysses_size, (dp_rank + 1) * ulysses_size)), dp_rank, world_size // ulysses_size


@dataclass(frozen=True)
class UlyssesGroup:
    """This rank's sequence-parallel group: ``size`` = S ranks (``rank`` is the index in it) that
    hold the same samples, the ``dp_rank``-th of ``dp_size`` such groups."""

    group: dist.ProcessGroup
    size: int
    rank: int
    dp_rank: int
    dp_size: int


def new_ulysses_group(ulysses_size: int) -> UlyssesGroup | None:
    """This rank's SP group, None for ``ulysses_size`` 1. Collective: every rank calls it, in the same order."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    members, dp_rank, dp_size = ulysses_layout(rank, world_size, ulysses_size)
    if ulysses_size == 1:
        return None
    mine = None
    for first in range(0, world_size, ulysses_size):
        group = dist.new_group(list(range(first, first + ulysses_size)))
        if first == members[0]:
            mine = group
    assert mine is not None
    return UlyssesGroup(group=mine, size=ulysses_size, rank=rank - members[0], dp_rank=dp_rank, dp_size=dp_size)


def ulysses_problem(
    hf_text_config: PretrainedConfig, ulysses_size: int, key: str = "worker.actor.ulysses_size"
) -> str | None:
    """Why the text decoder of ``hf_text_config`` cannot run with ``ulysses_size``, or None if it can:
    S must divide the query and the key/value heads (each rank attends with whole GQA head blocks)."""
    if ulysses_size < 1:
        return f"{key}={ulysses_size} must be >= 1 (1 = no sequence parallelism)"
    if ulysses_size == 1:
        return None
    if has_linear_attention(hf_text_config):  # Qwen3.5's gated DeltaNet: a slice would start from a zero state
        return (f"{key}={ulysses_size}: the model has linear-attention layers, whose recurrent state runs along the "
                f"whole sequence; Ulysses sequence parallelism splits the sequence over ranks: set {key}=1")
    heads = int(hf_text_config.num_attention_heads)
    kv_heads = int(hf_text_config.num_key_value_heads or heads)
    counts = (("num_attention_heads", heads), ("num_key_value_heads", kv_heads))
    bad = [f"{name}={n}" for name, n in counts if n % ulysses_size]
    if not bad:
        return None
    divisors = [d for d in range(1, kv_heads + 1) if heads % d == 0 and kv_heads % d == 0]
    return (
        f"{key}={ulysses_size} does not divide the model's {' and '.join(bad)}: Ulysses sequence parallelism "
        f"gives each rank of a group whole attention heads; choose a ulysses_size in {divisors}"
    )


def loss_scale(world_size: int, ulysses_size: int) -> float:
    """The factor c on a rank's loss before ``backward`` so that FSDP's average over ``world_size`` ranks is the
    global loss's gradient: c = world_size for any S. docs/workers.md, "Ulysses sequence parallelism"."""
    ulysses_layout(0, world_size, ulysses_size)  # checks that S divides world_size
    return float(world_size)


# ------------------------------------------------------------------------------------------------
# Collectives with their adjoints as backward


class _AllToAll(torch.autograd.Function):
    """all_to_all_single with equal splits of dim 0 (chunk j to rank j); its own adjoint."""

    @staticmethod
    def forward(ctx, x: Tensor, group: dist.ProcessGroup) -> Tensor:
        ctx.group = group
        out = torch.empty_like(x, memory_format=torch.contiguous_format)
        dist.all_to_all_single(out, x.contiguous(), group=group)
        return out

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, None]:
        return _AllToAll.apply(grad, ctx.group), None


class _SumOverGroup(torch.autograd.Function):
    """all_reduce SUM. Every rank uses the sum, so the adjoint sums the ranks' gradients too."""

    @staticmethod
    def forward(ctx, x: Tensor, group: dist.ProcessGroup) -> Tensor:
        ctx.group = group
        out = x.clone(memory_format=torch.contiguous_format)
        dist.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, None]:
        return _SumOverGroup.apply(grad, ctx.group), None


def sequence_to_heads(x: Tensor, sp: UlyssesGroup) -> Tensor:
    """(1, h, n, D) this rank's n tokens, all h heads -> (1, h / S, S * n, D): the whole row, the
    rank's h / S heads (rank j gets heads j * h / S .. (j + 1) * h / S - 1)."""
    _, h, n, D = x.shape
    S = sp.size
    chunks = x[0].reshape(S, h // S, n, D)  # chunk j: the heads of rank j
    received = _AllToAll.apply(chunks, sp.group)  # chunk i: my heads of rank i's tokens
    return received.transpose(0, 1).reshape(1, h // S, S * n, D)


def heads_to_sequence(x: Tensor, sp: UlyssesGroup) -> Tensor:
    """(1, N, h / S, D) the whole row, this rank's heads -> (1, N / S, h, D): the inverse of
    :func:`sequence_to_heads` in the attention output's layout."""
    _, N, hs, D = x.shape
    S = sp.size
    chunks = x[0].reshape(S, N // S, hs, D)  # chunk j: the tokens of rank j
    received = _AllToAll.apply(chunks, sp.group)  # chunk i: rank i's heads of my tokens
    return received.transpose(0, 1).reshape(1, N // S, S * hs, D)


def sum_over_group(x: Tensor, sp: UlyssesGroup) -> Tensor:
    """The sum of ``x`` over the group's ranks, on every rank; differentiable. Gathers per-token
    results: each rank fills its own rows, zeros elsewhere."""
    return _SumOverGroup.apply(x, sp.group)


# ------------------------------------------------------------------------------------------------
# Slicing the packed row


def padded_length(n: int, ulysses_size: int) -> int:
    """The smallest multiple of ``ulysses_size`` >= n. 7, 2 -> 8."""
    return -(-n // ulysses_size) * ulysses_size


def pad_packed_row(
    input_ids: Tensor, position_ids: Tensor, ulysses_size: int, pad_id: int = 0
) -> tuple[Tensor, Tensor]:
    """Pad a packed row to a multiple of S tokens: input_ids (1, N), position_ids (1, N) or (R, 1, N) -> N_pad. The
    pads are a sequence of their own at the end (positions 0, 1, ...); ``pad_id`` must not be a vision placeholder."""
    N = input_ids.shape[-1]
    extra = padded_length(N, ulysses_size) - N
    if extra == 0:
        return input_ids, position_ids
    ids = torch.cat([input_ids, input_ids.new_full((1, extra), pad_id)], dim=-1)
    pad_positions = torch.arange(extra, dtype=position_ids.dtype, device=position_ids.device)
    pad_positions = pad_positions.expand(*position_ids.shape[:-1], extra)
    return ids, torch.cat([position_ids, pad_positions], dim=-1)


def text_decoder(model: nn.Module) -> nn.Module:
    """The text decoder of ``model`` (``get_decoder()``), through PEFT, FSDP and value-head wrappers."""
    from transformers import PreTrainedModel

    for module in model.modules():
        if isinstance(module, PreTrainedModel):
            return module.get_decoder()
    raise TypeError(f"{type(model).__name__} contains no transformers model; Ulysses needs one")


@contextmanager
def decoder_sees_slice(model: nn.Module, start: int, length: int) -> Iterator[None]:
    """Within the block, the text decoder runs on tokens ``start .. start + length - 1`` of its row
    (embeddings, positions and Qwen3-VL's DeepStack inputs cut). A pre-hook on the decoder, because
    under FSDP2 only the model's own forward can build the whole ``inputs_embeds``."""
    stop = start + length

    def cut(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        if kwargs.get("inputs_embeds") is not None:
            kwargs["inputs_embeds"] = kwargs["inputs_embeds"][:, start:stop]
        elif kwargs.get("input_ids") is not None:
            kwargs["input_ids"] = kwargs["input_ids"][:, start:stop]
        elif args and args[0] is not None:  # e.g. token classification passes input_ids positionally
            args = (args[0][:, start:stop], *args[1:])
        else:
            raise ValueError("Ulysses: the text decoder received neither input_ids nor inputs_embeds")
        if kwargs.get("position_ids") is None:
            raise ValueError("Ulysses: the text decoder needs position_ids (the packed row's)")
        kwargs["position_ids"] = kwargs["position_ids"][..., start:stop]
        masks = kwargs.get("visual_pos_masks")
        if masks is not None:
            # Qwen3-VL's DeepStack: features of the vision tokens of the whole row (rows in token
            # order), added to the hidden states of the first decoder layers at those tokens. Keep
            # the slice's tokens and their rows.
            before, inside = int(masks[:, :start].sum()), int(masks[:, start:stop].sum())
            kwargs["visual_pos_masks"] = masks[:, start:stop]
            if kwargs.get("deepstack_visual_embeds") is not None:
                kwargs["deepstack_visual_embeds"] = [
                    embeds[before : before + inside] for embeds in kwargs["deepstack_visual_embeds"]
                ]
        return args, kwargs

    handle = text_decoder(model).register_forward_pre_hook(cut, with_kwargs=True)
    try:
        yield
    finally:
        handle.remove()


@dataclass(frozen=True)
class UlyssesAttention:
    """What attention needs under SP besides q, k, v: the group and the whole padded row's segments (once per forward)."""

    sp: UlyssesGroup
    segments: list[Segment]
