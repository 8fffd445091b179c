"""Forward passes shared by the actor, reference and critic: model inputs from a Batch (padded or
packed), outputs at the positions that predict response tokens, log-probs, micro-batching.

Indexing. A row is ``prompt (P, left padded) + response (T, right padded)``, L = P + T. The output
at position P - 1 + t predicts response token t, so the log-prob of ``responses[:, t]`` (and the
critic's value of the state before it) is read at position P - 1 + t. Response positions whose
token or predecessor is not attended (padding) are "invalid" and get 0.

Blocked tokens. The rollout never samples the ids of ``easyvlm.rollout.tokens.blocked_token_ids``
(vision placeholders, padded LM-head rows): it samples from softmax over the other ids, and
reports those log-probs. The actor and the reference model compute the same distribution: the
logits of the blocked ids are -inf before the log-softmax (and the entropy), so old, current and
rollout log-probs describe one policy. The ids come from the model's config and tokenizer.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import torch
from torch import Tensor, nn

from easyvlm.data.batch import Batch
from easyvlm.data.collate import concat_multi_modal_inputs
from easyvlm.models.padding_free import pack_inputs

MULTI_MODAL_KEY = "multi_modal_inputs"

logger = logging.getLogger(__name__)


# ------------------------------------------------------------------------------------------------
# Vision-tower dummy. Under FSDP2 each vision block all-gathers its parameters in its forward (and
# reduce-scatters gradients in the backward): if one rank's micro-batch has images and another's
# has none, their collectives go out of step and the job hangs. So a vision-language model always
# runs its vision tower; a micro-batch without images gets one dummy image in an extra row. The
# extra row attends only to itself and has no response position, so no output or loss depends on
# it; its parameters get zero gradients (AdamW then still applies its momentum and weight decay,
# as it does for every parameter that FSDP gives a gradient).


@dataclass(frozen=True)
class DummyImage:
    """The smallest image the vision tower takes: one (1, m, m) grid = m*m patches = 1 image token."""

    image_token_id: int
    pixel_values: Tensor  # (m*m, C * temporal_patch * patch * patch)
    image_grid_thw: Tensor  # (1, 3)


def dummy_image_for(hf_config: Any) -> DummyImage | None:
    """A DummyImage for Qwen2-VL / Qwen2.5-VL configs, None for text-only models."""
    vision = getattr(hf_config, "vision_config", None)
    image_token_id = getattr(hf_config, "image_token_id", None)
    if vision is None or image_token_id is None:
        return None
    m = vision.spatial_merge_size
    channels = getattr(vision, "in_channels", getattr(vision, "in_chans", 3))
    dim = channels * vision.temporal_patch_size * vision.patch_size**2
    return DummyImage(
        image_token_id=int(image_token_id),
        pixel_values=torch.zeros(m * m, dim),
        image_grid_thw=torch.tensor([[1, m, m]]),
    )


def has_images(batch: Batch) -> bool:
    """Whether any sample of ``batch`` has ``pixel_values``."""
    items = batch.get(MULTI_MODAL_KEY) or []
    return any(item and item.get("pixel_values") is not None for item in items)


def check_no_videos(batch: Batch) -> None:
    items = batch.get(MULTI_MODAL_KEY) or []
    for i, item in enumerate(items):
        if item and item.get("pixel_values_videos") is not None:
            raise NotImplementedError(
                f"sample {i} has video inputs (pixel_values_videos); the FSDP workers train on images only for now"
            )


def with_dummy_image(batch: Batch, dummy: DummyImage) -> Batch:
    """The forward keys of ``batch`` (B rows) plus row B: only its last token is attended, and it is
    the image token of ``dummy``. Its predecessor is padding, so row B has no valid response
    position (no output is read from it), and it attends only to itself."""
    B, L = batch["input_ids"].shape
    tensors = {}
    for key in ("input_ids", "attention_mask", "position_ids", "responses"):
        value = batch[key]
        extra = torch.zeros((1,) + tuple(value.shape[1:]), dtype=value.dtype, device=value.device)
        tensors[key] = torch.cat([value, extra], dim=0)
    tensors["input_ids"][B, L - 1] = dummy.image_token_id
    tensors["attention_mask"][B, L - 1] = True
    items = list(batch.get(MULTI_MODAL_KEY) or [{}] * B)
    items.append({"pixel_values": dummy.pixel_values, "image_grid_thw": dummy.image_grid_thw})
    return Batch(tensors, {MULTI_MODAL_KEY: items})


def response_valid_mask(attention_mask: Tensor, response_length: int) -> Tensor:
    """(B, L) -> (B, T) bool: response token t and its predecessor are both attended."""
    L = attention_mask.shape[1]
    P = L - response_length
    mask = attention_mask.bool()
    return mask[:, P:] & mask[:, P - 1 : L - 1]


def _same_item(a: dict | None, b: dict | None) -> bool:
    """Whether two samples' multi-modal inputs are identical (same keys, equal tensors)."""
    a, b = a or {}, b or {}
    if a.keys() != b.keys():
        return False
    for key in a:
        x, y = a[key], b[key]
        if isinstance(x, Tensor) or isinstance(y, Tensor):
            if not (isinstance(x, Tensor) and isinstance(y, Tensor) and x.shape == y.shape and torch.equal(x, y)):
                return False
        elif x != y:
            return False
    return True


def shared_prompt_sources(batch: Batch, prompt_length: int) -> Tensor:
    """(B,) long: for each row, the first row of its run of consecutive rows with the same prompt
    (tokens, attention mask and positions in columns ``0 .. prompt_length - 1``, and images).
    GRPO's n samples of a prompt are such a run. [p, p, q, p] -> [0, 0, 2, 3]."""
    ids, mask, pos = batch["input_ids"], batch["attention_mask"].bool(), batch["position_ids"]
    B = ids.shape[0]
    P = prompt_length
    same = (mask[1:, :P] == mask[:-1, :P]).all(-1)
    same &= ((ids[1:, :P] == ids[:-1, :P]) | ~mask[1:, :P]).all(-1)
    same &= (pos[1:, ..., :P] == pos[:-1, ..., :P]).flatten(1).all(-1)
    items = batch.get(MULTI_MODAL_KEY) or [None] * B
    sources = list(range(B))
    for b, equal in enumerate(same.tolist(), start=1):
        if equal and _same_item(items[b], items[b - 1]):
            sources[b] = sources[b - 1]
    return torch.tensor(sources, dtype=torch.long)


def response_outputs(
    model: nn.Module,
    batch: Batch,
    *,
    padding_free: bool,
    device: torch.device,
    lm_head: bool = True,
    share_prompts: bool = False,
) -> tuple[Tensor, Tensor]:
    """Model outputs at the positions predicting the valid response tokens.

    batch: ``input_ids``, ``attention_mask`` (B, L), ``position_ids`` (B, L) or (B, R, L),
    ``responses`` (B, T), optionally object ``multi_modal_inputs``. Returns ``(outputs (K, C),
    valid (B, T))``: K = valid.sum(), rows in row-major order of ``valid``; C = V (logits) or 1 (values).
    ``lm_head``: the model takes ``logits_to_keep`` (causal LMs), so the head runs on K positions only.
    ``share_prompts`` (padding-free only): consecutive rows with the same prompt and images run the
    prompt (and its images) once; the outputs are the same (see ``easyvlm.models.padding_free``).
    """
    input_ids = batch["input_ids"].to(device)
    attention_mask = batch["attention_mask"].to(device).bool()
    position_ids = batch["position_ids"].to(device)
    B, L = input_ids.shape
    T = batch["responses"].shape[1]
    P = L - T
    if P < 1:
        raise ValueError(f"batch has input_ids of length {L} and responses of length {T}: no prompt token")
    valid = response_valid_mask(attention_mask, T)  # (B, T)
    items = list(batch.get(MULTI_MODAL_KEY) or [])
    sources = None
    if padding_free and share_prompts and B > 1:
        sources = shared_prompt_sources(batch, P)
        if items:  # a reused prompt's image tokens are not in the packed row: nor are its images
            items = [item for b, item in enumerate(items) if int(sources[b]) == b]
    extra: dict[str, Any] = {k: v.to(device) for k, v in concat_multi_modal_inputs(items).items()}
    extra["use_cache"] = False

    if padding_free:
        packed = pack_inputs(
            input_ids, attention_mask, position_ids, prompt_length=P,
            prompt_source=None if sources is None else sources.to(device),
        )
        index = packed.padded_to_packed[:, P - 1 : L - 1][valid]  # (K,) packed positions
        if lm_head:
            extra["logits_to_keep"] = index
        out = model(input_ids=packed.input_ids, position_ids=packed.position_ids, **extra).logits  # (1, K|N, C)
        return (out[0] if lm_head else out[0, index]), valid
    if lm_head:
        extra["logits_to_keep"] = T + 1  # positions P-1 .. L-1; the last one predicts nothing
    # transformers' mRoPE models take the rows first: (B, R, L) -> (R, B, L)
    model_position_ids = position_ids.transpose(0, 1) if position_ids.dim() == 3 else position_ids
    out = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=model_position_ids, **extra).logits
    return out[:, -(T + 1) : -1][valid], valid  # (K, C)


def scatter_response(values: Tensor, valid: Tensor) -> Tensor:
    """(K,) values at the True positions of ``valid`` (B, T) -> (B, T), 0 elsewhere (keeps grad)."""
    out = torch.zeros(valid.shape, dtype=values.dtype, device=values.device)
    out[valid] = values
    return out


def sampling_logits(logits: Tensor, temperature: float, blocked_token_ids: Sequence[int]) -> Tensor:
    """The rollout's sampling distribution as logits: (K, V) -> (K, V) float32, logits / temperature
    with the columns ``blocked_token_ids`` at -inf. A new tensor; differentiable."""
    scaled = logits.float() / temperature  # always a new tensor, so filling it in place is safe
    if len(blocked_token_ids):
        ids = torch.as_tensor(list(blocked_token_ids), dtype=torch.long, device=logits.device)
        scaled.index_fill_(-1, ids, float("-inf"))  # in place: one (K, V) copy, not two
    return scaled


def logprobs_from_logits(logits: Tensor, labels: Tensor) -> Tensor:
    """log softmax(logits)[label]. logits (K, V) float, labels (K,) -> (K,)."""
    return logits.gather(-1, labels.unsqueeze(-1)).squeeze(-1) - torch.logsumexp(logits, dim=-1)


_BLOCKED_CACHE: dict[tuple[str, int], tuple[int, ...]] = {}
# files of a saved tokenizer: transformers 5 builds an EMPTY tokenizer from a directory without them
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "tokenizer.model")


def model_blocked_token_ids(model: nn.Module) -> tuple[int, ...]:
    """The ids the rollout blocks for ``model`` (``easyvlm.rollout.tokens.blocked_token_ids``),
    from its config and the tokenizer saved beside it (``model.name_or_path``); cached per model
    directory. If that directory has no tokenizer (``model.tokenizer_path`` elsewhere), only the
    vision placeholder ids of the config are blocked, with a warning: pass ``blocked_token_ids``
    to :func:`policy_logprobs` explicitly then."""
    from easyvlm.rollout.tokens import VISION_TOKEN_ID_FIELDS, blocked_token_ids, model_vocab_size

    config = model.config
    path = str(getattr(model, "name_or_path", "") or getattr(config, "_name_or_path", ""))
    vocab_size = model_vocab_size(config)
    key = (path, vocab_size)
    if key in _BLOCKED_CACHE:
        return _BLOCKED_CACHE[key]
    tokenizer = _tokenizer_beside(path)
    if tokenizer is None:
        logger.warning(
            "no tokenizer beside the model at %r: the actor/reference log-probs mask only the vision token ids "
            "of the model config, not the padded LM-head rows the rollout also blocks", path,
        )
        ids = tuple(sorted({int(getattr(config, f)) for f in VISION_TOKEN_ID_FIELDS if getattr(config, f, None) is not None}))
    else:
        ids = tuple(blocked_token_ids(tokenizer, config))  # raises if the tokenizer does not fit the model
    _BLOCKED_CACHE[key] = ids
    return ids


def _tokenizer_beside(path: str) -> Any | None:
    """The tokenizer saved at ``path`` (a local directory or hub id), None if there is none."""
    from transformers import AutoTokenizer

    if not path or (Path(path).is_dir() and not any((Path(path) / f).exists() for f in _TOKENIZER_FILES)):
        return None
    try:
        return AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError):
        return None


def token_lengths(batch: Batch) -> list[int]:
    """Attended tokens per sample (what a padding-free micro-batch costs)."""
    return batch["attention_mask"].bool().sum(-1).tolist()


def split_by_token_budget(lengths: list[int], budget: int) -> list[list[int]]:
    """Consecutive groups of sample indices whose lengths sum to at most ``budget`` (a sample
    longer than the budget gets a group of its own). Order is kept: [3, 4, 2, 5], 7 -> [[0, 1], [2, 3]]."""
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
    """Fixed-size micro-batches, or (``token_budget`` given) consecutive ones of at most that many
    attended tokens. Sample order is kept either way."""
    if token_budget is None:
        return batch.split(micro_batch_size)
    return [batch.index(group) for group in split_by_token_budget(token_lengths(batch), token_budget)]


# ------------------------------------------------------------------------------------------------
# Policy log-probs (actor and reference)


def outputs_with_vision(
    model: nn.Module,
    batch: Batch,
    *,
    padding_free: bool,
    device: torch.device,
    dummy_image: DummyImage | None,
    lm_head: bool = True,
    share_prompts: bool = False,
) -> tuple[Tensor, Tensor]:
    """:func:`response_outputs`, after adding ``dummy_image`` to a micro-batch without images
    (vision-language models: every rank runs the vision tower). Returns ((K, C), valid (B, T))."""
    B = len(batch)
    check_no_videos(batch)
    if dummy_image is not None and not has_images(batch):
        batch = with_dummy_image(batch, dummy_image)
    out, valid = response_outputs(
        model, batch, padding_free=padding_free, device=device, lm_head=lm_head, share_prompts=share_prompts
    )
    return out, valid[:B]


def policy_logprobs(
    model: nn.Module,
    batch: Batch,
    *,
    temperature: float,
    with_entropy: bool,
    padding_free: bool,
    device: torch.device,
    dummy_image: DummyImage | None,
    blocked_token_ids: Sequence[int] | None = None,
    share_prompts: bool = False,
) -> tuple[Tensor, Tensor | None]:
    """(B, T) log-probs of ``responses`` under softmax(logits / temperature) over the ids the
    rollout may sample, 0 at padding, and, if asked, the (B, T) entropies of those distributions.
    Differentiable. blocked_token_ids: None = :func:`model_blocked_token_ids` of ``model``."""
    from easyvlm.algorithms.entropy import entropy_from_logits

    if blocked_token_ids is None:
        blocked_token_ids = model_blocked_token_ids(model)
    logits, valid = outputs_with_vision(
        model, batch, padding_free=padding_free, device=device, dummy_image=dummy_image, share_prompts=share_prompts
    )  # (K, V)
    logits = sampling_logits(logits, temperature, blocked_token_ids)  # (K, V) float32
    labels = batch["responses"].to(device)[valid]  # (K,)
    logprobs = scatter_response(logprobs_from_logits(logits, labels), valid)
    if not with_entropy:
        return logprobs, None
    return logprobs, scatter_response(entropy_from_logits(logits), valid)


@torch.no_grad()
def policy_logprobs_for_batch(
    model: nn.Module,
    batch: Batch,
    *,
    micro_batch_size: int,
    budget: int | None,
    temperature: float,
    with_entropy: bool,
    padding_free: bool,
    device: torch.device,
    dummy_image: DummyImage | None,
    blocked_token_ids: Sequence[int] | None = None,
    share_prompts: bool = False,
) -> tuple[Tensor, Tensor | None]:
    """:func:`policy_logprobs` over micro-batches (as many on every rank), concatenated, on the CPU."""
    from easyvlm.workers.training import equalize_micro_batches

    model.eval()
    logprobs, entropies = [], []
    for micro, is_dummy in equalize_micro_batches(micro_batches(batch, micro_batch_size, budget), device):
        lp, ent = policy_logprobs(
            model, micro, temperature=temperature, with_entropy=with_entropy,
            padding_free=padding_free, device=device, dummy_image=dummy_image, blocked_token_ids=blocked_token_ids,
            share_prompts=share_prompts,
        )
        if not is_dummy:  # a dummy pass only keeps FSDP's collectives in step
            logprobs.append(lp.cpu())
            entropies.append(ent.cpu() if ent is not None else None)
    return torch.cat(logprobs), (torch.cat(entropies) if with_entropy else None)
