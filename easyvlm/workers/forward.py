"""Forward passes shared by the actor, reference and critic: outputs at the positions predicting
response tokens (padded or packed), log-probs of the rollout's sampling distribution, micro-batching.
Under Ulysses every rank returns the same (B, T) tensors as without it."""

from __future__ import annotations

import functools

from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch
from torch import Tensor, nn

from easyvlm.data.batch import Batch
from easyvlm.data.collate import concat_multi_modal_inputs
from easyvlm.workers.routing import routed_forward
from easyvlm.workers.shared_prompts import shared_prompt_sources, split_prompt_images
from easyvlm.workers.vision_dummy import MULTI_MODAL_KEY, DummyImage, with_dummy_image
from easyvlm.workers.specs import ForwardSpec
from easyvlm.models.linear_attention import SEGMENTS_KWARG, has_linear_attention
from easyvlm.models.moe_routing import RoutingState
from easyvlm.models.padding_free import VARLEN_ATTENTION, PackedInputs, pack_inputs
from easyvlm.models.segments import packed_segments
from easyvlm.models.vision_cache import VisionEmbeddingCache, model_inputs_with_cache
from easyvlm.models.ulysses import (
    ULYSSES_KWARG,
    UlyssesAttention,
    UlyssesGroup,
    decoder_sees_slice,
    pad_packed_row,
    sum_over_group,
    ulysses_problem,
)

PerToken = Callable[[Tensor, Tensor], Tensor]
"""(outputs (k, C), rows (k,) indices into the K valid response positions) -> (k, M)."""


def response_valid_mask(attention_mask: Tensor, response_length: int) -> Tensor:
    """(B, L) -> (B, T) bool: response token t and its predecessor are both attended."""
    L = attention_mask.shape[1]
    P = L - response_length
    mask = attention_mask.bool()
    return mask[:, P:] & mask[:, P - 1 : L - 1]


@dataclass(frozen=True)
class ForwardSetup:
    """How a worker runs its model, fixed for the worker's life (built from its ForwardSpec)."""

    device: torch.device
    padding_free: bool
    blocked_token_ids: tuple[int, ...] = ()
    """The ids the rollout never samples (policy roles), at -inf in the sampling distribution."""
    temperature: float = 1.0
    share_prompts: bool = False
    """Padding-free only: consecutive rows with the same prompt and images run the prompt once."""
    dummy_image: DummyImage | None = None
    ulysses: UlyssesGroup | None = None
    """This rank's sequence-parallel group (padding-free only), or None."""
    use_torch_compile: bool = False
    routing: RoutingState | None = None
    """MoE models: the routers' shared state; None for dense models."""
    router_replay: str = "disabled"
    keep_router_logits: bool = False
    vision_cache: VisionEmbeddingCache | None = None
    """The frozen tower's outputs by image (its hook installed): pixels stay on the host behind keys."""


    @classmethod
    def of(
        cls, spec: ForwardSpec, device: torch.device, dummy_image: DummyImage | None, ulysses: UlyssesGroup | None,
        routing: RoutingState | None = None, keep_router_logits: bool = False,
        vision_cache: VisionEmbeddingCache | None = None,
    ) -> "ForwardSetup":
        """A worker's setup from its ForwardSpec plus what the worker built."""
        return cls(
            device=device, padding_free=spec.settings.padding_free, blocked_token_ids=tuple(spec.blocked_token_ids),
            temperature=spec.temperature, share_prompts=spec.settings.share_prompts, dummy_image=dummy_image,
            ulysses=ulysses, use_torch_compile=spec.use_torch_compile, routing=routing,
            router_replay=spec.router_replay, keep_router_logits=keep_router_logits, vision_cache=vision_cache,
        )


def response_outputs(
    model: nn.Module,
    batch: Batch,
    setup: ForwardSetup,
    *,
    lm_head: bool = True,
    per_token: PerToken | None = None,
    at_last_token: bool = False,
) -> tuple[Tensor, Tensor]:
    """Model outputs at the positions predicting the valid response tokens: ``(outputs (K, M), valid
    (B, T))``, K = valid.sum() in row-major order. ``per_token`` maps the model's (K, C) to M columns;
    under ``setup.ulysses`` the (K, M) results are summed over the group, so reduce there first.
    ``at_last_token`` (a scalar head): each row's last attended token instead, K = B."""
    device, padding_free, ulysses = setup.device, setup.padding_free, setup.ulysses
    input_ids = batch["input_ids"].to(device)
    attention_mask = batch["attention_mask"].to(device).bool()
    position_ids = batch["position_ids"].to(device)
    B, L = input_ids.shape
    T = batch["responses"].shape[1]
    P = L - T
    if P < 1:
        raise ValueError(f"batch has input_ids of length {L} and responses of length {T}: no prompt token")
    if ulysses is not None and not padding_free:
        role = _role_key(lm_head)
        raise ValueError(f"sequence parallelism ({role}.ulysses_size > 1) needs {role}.padding_free=true")
    valid = response_valid_mask(attention_mask, T)  # (B, T)
    rows = torch.arange(B, device=device)
    last = None
    if at_last_token:
        assert not lm_head, "at_last_token reads a scalar head's outputs"
        last = (attention_mask.long() * torch.arange(L, device=device)).argmax(-1)  # (B,) last attended column
        valid = torch.ones(B, 1, dtype=torch.bool, device=device)
    sources, extra = _prompt_sources_and_images(model, batch, setup, P)

    if padding_free:
        packed = pack_inputs(
            input_ids, attention_mask, position_ids, prompt_length=P,
            prompt_source=None if sources is None else sources.to(device),
        )
        if last is None:
            index = packed.padded_to_packed[:, P - 1 : L - 1][valid]  # (K,) packed positions
        else:
            index = packed.padded_to_packed[rows, last]  # (B,)
        if ulysses is not None:
            return _ulysses_outputs(model, packed, index, extra, lm_head, ulysses, per_token), valid
        if lm_head:
            extra["logits_to_keep"] = index
        if has_linear_attention(model.config):  # a recurrent state per sequence (models/linear_attention.py)
            extra[SEGMENTS_KWARG] = packed_segments(packed.position_ids[0] if packed.position_ids.dim() == 3
                                                    else packed.position_ids)
        with routed_forward(setup, batch, packed.token_index, packed.padded_to_packed):
            out = model(input_ids=packed.input_ids, position_ids=packed.position_ids, **extra).logits  # (1, K|N, C)
        out = out[0] if lm_head else out[0, index]
    else:
        if lm_head:
            extra["logits_to_keep"] = T + 1  # positions P-1 .. L-1; the last one predicts nothing
        # transformers' mRoPE models take the rows first: (B, R, L) -> (R, B, L)
        model_position_ids = position_ids.transpose(0, 1) if position_ids.dim() == 3 else position_ids
        with routed_forward(setup, batch, None, None):
            out = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=model_position_ids, **extra).logits
        out = out[:, -(T + 1) : -1][valid] if last is None else out[rows, last]  # (K, C)
    if per_token is None:
        return out, valid
    return per_token(out, torch.arange(out.shape[0], device=out.device)), valid


def _prompt_sources_and_images(model: nn.Module, batch: Batch, setup: ForwardSetup, P: int) -> tuple[Tensor | None, dict]:
    """(each row's prompt source or None, the model's extra inputs: the running prompts' images, no KV cache)."""
    items = list(batch.get(MULTI_MODAL_KEY) or [])
    sources = None
    if setup.padding_free and setup.share_prompts and len(batch) > 1:
        image_token_id = getattr(model.config, "image_token_id", None)
        sources = shared_prompt_sources(batch, P, image_token_id)
        if items:  # a reused prompt's image tokens are not in the packed row: nor are its images (its tools' are)
            items = [
                item if int(sources[b]) == b
                else split_prompt_images(item, batch["input_ids"][b], batch["attention_mask"][b], P, image_token_id)[1]
                for b, item in enumerate(items)
            ]
    vision = concat_multi_modal_inputs(items)
    if setup.vision_cache is not None:  # the pixels stay on the host unless the cache misses them
        extra = model_inputs_with_cache(vision, setup.device)
    else:
        extra = {k: v.to(setup.device) for k, v in vision.items()}
    extra["use_cache"] = False
    return sources, extra


def _ulysses_outputs(
    model: nn.Module,
    packed: PackedInputs,
    index: Tensor,
    extra: dict[str, Any],
    lm_head: bool,
    sp: UlyssesGroup,
    per_token: PerToken | None,
) -> Tensor:
    """:func:`response_outputs` of a packed row under Ulysses: (K, M) on every rank of ``sp``."""
    text_config = model.config.get_text_config()
    problem = ulysses_problem(text_config, sp.size, key=f"{_role_key(lm_head)}.ulysses_size")
    if problem:
        raise ValueError(problem)
    if text_config._attn_implementation != VARLEN_ATTENTION:  # any other attention would ignore the group
        raise ValueError(
            f"sequence parallelism needs the text decoder loaded with attn_implementation={VARLEN_ATTENTION!r} "
            f"(the padding-free model); it has {text_config._attn_implementation!r}"
        )
    input_ids, position_ids = pad_packed_row(packed.input_ids, packed.position_ids, sp.size)  # (1, N_pad)
    n = input_ids.shape[1] // sp.size
    start = sp.rank * n
    text_positions = position_ids[0] if position_ids.dim() == 3 else position_ids  # (1, N_pad)
    attention = UlyssesAttention(sp=sp, segments=packed_segments(text_positions))  # one host sync per forward
    rows = torch.nonzero((index >= start) & (index < start + n)).reshape(-1)  # (k,) of the K
    local = index[rows] - start  # (k,) positions in this rank's slice
    if lm_head:
        extra["logits_to_keep"] = local
    with decoder_sees_slice(model, start, n):
        out = model(input_ids=input_ids, position_ids=position_ids, **{ULYSSES_KWARG: attention}, **extra).logits
    out = out[0] if lm_head else out[0, local]  # (k, C)
    values = per_token(out, rows) if per_token is not None else out  # (k, M)
    # every response position is in exactly one rank's slice: the sum over the group gathers them
    mine = values.new_zeros(index.shape[0], values.shape[-1]).index_copy(0, rows, values)  # (K, M)
    return sum_over_group(mine, sp)


def _role_key(lm_head: bool) -> str:
    return "worker.actor" if lm_head else "worker.critic"


def scatter_response(values: Tensor, valid: Tensor) -> Tensor:
    """(K,) values at the True positions of ``valid`` (B, T) -> (B, T), 0 elsewhere (keeps grad)."""
    out = torch.zeros(valid.shape, dtype=values.dtype, device=values.device)
    out[valid] = values
    return out


def sampling_logits(logits: Tensor, temperature: float, blocked_token_ids: Sequence[int]) -> Tensor:
    """(K, V) logits -> a new (K, V) float32 logits / temperature, ``blocked_token_ids`` at -inf."""
    scaled = logits.float() / temperature  # always a new tensor, so filling it in place is safe
    if len(blocked_token_ids):
        ids = torch.as_tensor(list(blocked_token_ids), dtype=torch.long, device=logits.device)
        scaled.index_fill_(-1, ids, float("-inf"))  # in place: one (K, V) copy, not two
    return scaled


def logprobs_from_logits(logits: Tensor, labels: Tensor) -> Tensor:
    """log softmax(logits)[label]. logits (K, V) float, labels (K,) -> (K,)."""
    return logits.gather(-1, labels.unsqueeze(-1)).squeeze(-1) - torch.logsumexp(logits, dim=-1)


def token_logprobs_and_entropies(
    logits: Tensor, labels: Tensor, temperature: float, blocked: Tensor, with_entropy: bool
) -> Tensor:
    """(K, V) logits, (K,) labels -> (K, 1 | 2) [log-prob of the label, entropy] of the sampling
    distribution (:func:`sampling_logits`)."""
    from easyvlm.algorithms.entropy import entropy_from_logits

    scaled = logits.float() / temperature
    if blocked.numel():
        scaled = scaled.index_fill(-1, blocked, float("-inf"))
    logprobs = logprobs_from_logits(scaled, labels)
    if not with_entropy:
        return logprobs.unsqueeze(-1)
    return torch.stack([logprobs, entropy_from_logits(scaled)], dim=-1)


@functools.cache
def token_kernel(compiled: bool) -> Callable[..., Tensor]:
    """:func:`token_logprobs_and_entropies`, compiled (dynamic shapes) when ``compiled``."""
    if not compiled:
        return token_logprobs_and_entropies
    return torch.compile(token_logprobs_and_entropies, dynamic=True)


def token_lengths(batch: Batch) -> list[int]:
    """Attended tokens per sample (what a padding-free micro-batch costs)."""
    return batch["attention_mask"].bool().sum(-1).tolist()


def split_by_token_budget(lengths: list[int], budget: int) -> list[list[int]]:
    """Consecutive groups of indices whose lengths sum to at most ``budget`` (a longer sample alone):
    [3, 4, 2, 5], 7 -> [[0, 1], [2, 3]]."""
    groups: list[list[int]] = []
    current: list[int] = []
    used = 0
    for i, n in enumerate(lengths):
        if current and used + n > budget:
            groups.append(current)
            current, used = [], 0
        current.append(i)
        used += n
    if current:
        groups.append(current)
    return groups


def micro_batches(batch: Batch, micro_batch_size: int, token_budget: int | None = None) -> list[Batch]:
    """Fixed-size micro-batches, or consecutive ones of at most ``token_budget`` attended tokens; order kept."""
    if token_budget is None:
        return batch.split(micro_batch_size)
    return [batch.index(group) for group in split_by_token_budget(token_lengths(batch), token_budget)]


# ------------------------------------------------------------------------------------------------
# Policy log-probs (actor and reference)


def outputs_with_vision(
    model: nn.Module,
    batch: Batch,
    setup: ForwardSetup,
    *,
    lm_head: bool = True,
    per_token: PerToken | None = None,
    at_last_token: bool = False,
) -> tuple[Tensor, Tensor]:
    """:func:`response_outputs`, with ``setup.dummy_image`` added to a micro-batch without media (every
    rank runs the vision tower as often)."""
    B = len(batch)
    if setup.dummy_image is not None:
        batch = with_dummy_image(batch, setup.dummy_image)
    out, valid = response_outputs(model, batch, setup, lm_head=lm_head, per_token=per_token, at_last_token=at_last_token)
    if at_last_token:
        out = out[:B]  # the dummy row (appended last) has an output too
    return out, valid[:B]


def policy_token_outputs(
    model: nn.Module,
    batch: Batch,
    setup: ForwardSetup,
    *,
    with_entropy: bool,
    full_kl_to: dict[str, Tensor] | None = None,
) -> dict[str, Tensor]:
    """Per-token outputs of the policy's sampling distribution, (B, T) each, 0 at padding: ``logprobs``,
    ``entropies`` when ``with_entropy``, and for each ``name`` of ``full_kl_to`` (another model's
    (K, V) log-distribution) KL(pi || it) over the vocabulary (``kl.kl_full_shared_rows``)."""
    from easyvlm.algorithms.kl import kl_full_shared_rows

    device, temperature = setup.device, setup.temperature
    responses = batch["responses"].to(device)
    labels = responses[response_valid_mask(batch["attention_mask"].to(device), responses.shape[1])]  # (K,)
    blocked = torch.as_tensor(setup.blocked_token_ids, dtype=torch.long, device=device)
    kernel = token_kernel(setup.use_torch_compile)

    targets = full_kl_to or {}

    def per_token(logits: Tensor, rows: Tensor) -> Tensor:  # (k, V), (k,) -> (k, 1 + entropy + KLs)
        out = kernel(logits, labels[rows], temperature, blocked, with_entropy)
        if not targets:
            return out
        log_dist = torch.log_softmax(sampling_logits(logits, temperature, setup.blocked_token_ids), dim=-1)
        # over the rows both have: a teacher's output layer may be padded past the tokenizer otherwise
        kls = [kl_full_shared_rows(log_dist[None], target[rows].to(log_dist.device)[None])[0] for target in targets.values()]
        return torch.cat([out, torch.stack(kls, dim=-1)], dim=-1)

    out, valid = outputs_with_vision(model, batch, setup, per_token=per_token)  # (K, columns)
    names = ["logprobs", *(["entropies"] if with_entropy else []), *targets]
    return {name: scatter_response(out[:, i], valid) for i, name in enumerate(names)}


def policy_logprobs(model: nn.Module, batch: Batch, setup: ForwardSetup, *, with_entropy: bool) -> tuple[Tensor, Tensor | None]:
    """(B, T) log-probs of ``responses`` and, if asked, (B, T) entropies."""
    out = policy_token_outputs(model, batch, setup, with_entropy=with_entropy)
    return out["logprobs"], out.get("entropies")


def policy_log_distribution(model: nn.Module, batch: Batch, setup: ForwardSetup) -> Tensor:
    """(K, V) log-softmax of the sampling distribution at the K valid response positions (the full KL)."""

    def per_token(logits: Tensor, rows: Tensor) -> Tensor:
        return torch.log_softmax(sampling_logits(logits, setup.temperature, setup.blocked_token_ids), dim=-1)

    out, _ = outputs_with_vision(model, batch, setup, per_token=per_token)
    return out


@torch.no_grad()
def policy_logprobs_for_batch(
    model: nn.Module,
    batch: Batch,
    setup: ForwardSetup,
    *,
    micro_batch_size: int,
    budget: int | None,
    with_entropy: bool,
    after_micro: Callable[[Batch], None] | None = None,
) -> tuple[Tensor, Tensor | None]:
    """:func:`policy_logprobs` over micro-batches (as many on every rank), concatenated on the CPU;
    ``after_micro(micro)`` runs after each real (not padding) micro-batch."""
    from easyvlm.workers.training import equalize_micro_batches

    model.eval()
    logprobs, entropies = [], []
    for micro, is_dummy in equalize_micro_batches(micro_batches(batch, micro_batch_size, budget), setup.device):
        lp, ent = policy_logprobs(model, micro, setup, with_entropy=with_entropy)
        if not is_dummy:  # a dummy pass only keeps FSDP's collectives in step
            logprobs.append(lp.cpu())
            entropies.append(ent.cpu() if ent is not None else None)
            if after_micro is not None:
                after_micro(micro)
    return torch.cat(logprobs), (torch.cat(entropies) if with_entropy else None)
