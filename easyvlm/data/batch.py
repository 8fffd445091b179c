"""`Batch`: the one container that crosses role boundaries: ``tensors`` (first dimension the batch
B), ``objects`` (per-sample lists of length B) and ``meta`` (batch-wide values, never
hyperparameters), so Ray pickles it cheaply. Keys (the constants below; P prompt, T response tokens):
``input_ids``, ``attention_mask``, ``position_ids`` (B, P+T) (mRoPE: (B, R, P+T)), prompt left padded
and response right padded; ``prompts`` (B, P); ``responses``, ``response_mask`` and per-token floats
(log-probs, values, advantages, ...) (B, T); ``seq_rewards``, ``group_ids`` (B,; same id = same
prompt). docs/data.md, "The prompt batch"; docs/rollout.md, "What goes in and what comes out"."""

from __future__ import annotations

import copy
from typing import Any, Iterable, Sequence

import torch
from torch import Tensor


# The tensors of a prompt batch (data/collate.py) that a rollout batch extends over the response.
PROMPT_TENSOR_KEYS = ("input_ids", "attention_mask", "position_ids")
# What a prompt batch must hold for generation (raw_prompt_ids: one vision placeholder per image).
PROMPT_KEYS = (*PROMPT_TENSOR_KEYS, "raw_prompt_ids")
# The per-sample objects of a prompt batch (data/collate.py).
PROMPT_OBJECT_KEYS = (
    "raw_prompt_ids", "images", "original_image_sizes", "videos", "multi_modal_inputs", "ground_truth", "uid",
    "prompt_text", "question", "extra",
)
# Optional object key of a prompt Batch when the run has tools: per sample, a loader of the row's
# images at full resolution (easyvlm.data.images.LazyImages) for tools such as image_zoom.
ORIGINAL_IMAGES_KEY = "original_images"
# MoE models (worker.actor.router_replay): the experts each token was routed to, (B, L, layers, k)
# int16 aligned with input_ids (easyvlm.workers.routing).
ROUTED_EXPERTS_KEY = "routed_experts"
# What a model forward reads (actor, reference, critic): everything else stays in the driver.
MODEL_INPUT_KEYS = (
    "input_ids", "attention_mask", "position_ids", "responses", "response_mask", "multi_modal_inputs",
    ROUTED_EXPERTS_KEY,
)
# What the actor and critic updates read, when present.
UPDATE_INPUT_KEYS = (
    *MODEL_INPUT_KEYS, "old_logprobs", "ref_logprobs", "teacher_logprobs", "advantages", "returns", "values", "rollout_logprobs",
    "rollout_is_weights",
)
# What the actor's update always needs (plus old_logprobs off-policy, ref_logprobs with a KL loss).
POLICY_UPDATE_KEYS = ("input_ids", "attention_mask", "position_ids", "responses", "response_mask", "advantages")


class Batch:
    def __init__(
        self,
        tensors: dict[str, Tensor] | None = None,
        objects: dict[str, list] | None = None,
        meta: dict[str, Any] | None = None,
    ):
        self.tensors: dict[str, Tensor] = dict(tensors or {})
        self.objects: dict[str, list] = {k: list(v) for k, v in (objects or {}).items()}
        self.meta: dict[str, Any] = dict(meta or {})
        self._check()

    # ----------------------------------------------------------------- basics
    def _check(self) -> None:
        sizes = {f"tensor {k!r}": v.shape[0] if v.dim() > 0 else None for k, v in self.tensors.items()}
        sizes.update({f"objects {k!r}": len(v) for k, v in self.objects.items()})
        for name, size in sizes.items():
            if size is None:
                raise ValueError(f"Batch: {name} is a 0-d tensor; batch tensors need a leading batch dim")
        if len(set(sizes.values())) > 1:
            raise ValueError(f"Batch: inconsistent batch sizes {sizes}")
        overlap = self.tensors.keys() & self.objects.keys()
        if overlap:
            raise ValueError(f"Batch: keys {sorted(overlap)} are both tensors and objects")

    def __len__(self) -> int:
        for v in self.tensors.values():
            return v.shape[0]
        for v in self.objects.values():
            return len(v)
        return 0

    def keys(self) -> list[str]:
        return list(self.tensors) + list(self.objects)

    def __contains__(self, key: str) -> bool:
        return key in self.tensors or key in self.objects

    def _missing(self, keys: Iterable[str]) -> KeyError:
        return KeyError(f"Batch has no key(s) {sorted(keys)}; present: {sorted(self.keys())}")

    def __getitem__(self, key: str) -> Tensor | list:
        if key in self.tensors:
            return self.tensors[key]
        if key in self.objects:
            return self.objects[key]
        raise self._missing([key])

    def get(self, key: str, default: Any = None) -> Any:
        return self[key] if key in self else default

    def __setitem__(self, key: str, value: Tensor | Sequence) -> None:
        """Add or replace one key; its batch size must match."""
        if len(self.keys()) and len(value) != len(self):
            raise ValueError(f"Batch: {key!r} has batch size {len(value)}, the batch has {len(self)}")
        if isinstance(value, Tensor):
            self.objects.pop(key, None)
            self.tensors[key] = value
        else:
            self.tensors.pop(key, None)
            self.objects[key] = list(value)

    def require(self, *keys: str) -> "Batch":
        missing = [k for k in keys if k not in self]
        if missing:
            raise self._missing(missing)
        return self

    def __repr__(self) -> str:
        tensors = {k: (tuple(v.shape), str(v.dtype).removeprefix("torch.")) for k, v in self.tensors.items()}
        return f"Batch(len={len(self)}, tensors={tensors}, objects={list(self.objects)}, meta={list(self.meta)})"

    # ----------------------------------------------------------------- key operations
    def select(self, *keys: str, meta: bool = True) -> "Batch":
        """A new Batch with only ``keys`` (shared storage); a missing key is an error."""
        self.require(*keys)
        return Batch(
            {k: self.tensors[k] for k in keys if k in self.tensors},
            {k: self.objects[k] for k in keys if k in self.objects},
            self.meta if meta else None,
        )

    def pop(self, *keys: str) -> "Batch":
        """Remove ``keys`` from this batch and return them as a new Batch."""
        out = self.select(*keys)
        for k in keys:
            self.tensors.pop(k, None)
            self.objects.pop(k, None)
        return out

    def union(self, other: "Batch") -> "Batch":
        """A new Batch with the keys of both; a key present in both must hold equal values."""
        if len(self.keys()) and len(other.keys()) and len(self) != len(other):
            raise ValueError(f"Batch.union: batch sizes differ ({len(self)} vs {len(other)})")
        for k in set(self.keys()) & set(other.keys()):
            a, b = self[k], other[k]
            same = torch.equal(a, b) if isinstance(a, Tensor) and isinstance(b, Tensor) else a == b
            if not same:
                raise ValueError(f"Batch.union: key {k!r} is in both batches with different values")
        for k in set(self.meta) & set(other.meta):
            if self.meta[k] != other.meta[k]:
                raise ValueError(f"Batch.union: meta key {k!r} differs ({self.meta[k]!r} vs {other.meta[k]!r})")
        return Batch({**self.tensors, **other.tensors}, {**self.objects, **other.objects}, {**self.meta, **other.meta})

    # ----------------------------------------------------------------- row operations
    def index(self, indices: Sequence[int] | Tensor | slice) -> "Batch":
        """Rows picked by a slice or by integer indices (any order, repeats allowed)."""
        if isinstance(indices, slice):
            return Batch(
                {k: v[indices] for k, v in self.tensors.items()},
                {k: v[indices] for k, v in self.objects.items()},
                self.meta,
            )
        idx = torch.as_tensor(indices, dtype=torch.long)
        rows = idx.tolist()
        return Batch(
            {k: v.index_select(0, idx.to(v.device)) for k, v in self.tensors.items()},
            {k: [v[i] for i in rows] for k, v in self.objects.items()},
            self.meta,
        )

    def reorder(self, indices: Sequence[int] | Tensor) -> "Batch":
        """A permutation of the rows: ``new[i] = old[indices[i]]``."""
        idx = torch.as_tensor(indices, dtype=torch.long)
        if sorted(idx.tolist()) != list(range(len(self))):
            raise ValueError(f"Batch.reorder needs a permutation of range({len(self)})")
        return self.index(idx)

    def split(self, size: int) -> list["Batch"]:
        """Consecutive pieces of ``size`` rows (the last may be shorter)."""
        if size <= 0:
            raise ValueError("Batch.split: size must be positive")
        return [self.index(slice(i, i + size)) for i in range(0, len(self), size)]

    def chunk(self, n: int) -> list["Batch"]:
        """``n`` equal pieces; the batch size must be divisible by ``n`` (see pad_to_divisor)."""
        if n <= 0 or len(self) % n:
            raise ValueError(f"Batch.chunk: {len(self)} rows cannot be cut into {n} equal chunks; pad_to_divisor first")
        return self.split(len(self) // n)

    @staticmethod
    def concat(batches: Sequence["Batch"]) -> "Batch":
        """Rows of all batches in order; keys must match, meta is taken from the first."""
        batches = [b for b in batches if len(b.keys())]
        if not batches:
            return Batch()
        keys = set(batches[0].keys())
        for i, b in enumerate(batches[1:], 1):
            if set(b.keys()) != keys:
                raise ValueError(f"Batch.concat: batch {i} has keys {sorted(b.keys())}, batch 0 has {sorted(keys)}")
        tensors = {k: _cat_rows([b.tensors[k] for b in batches]) for k in batches[0].tensors}
        objects = {k: [x for b in batches for x in b.objects[k]] for k in batches[0].objects}
        return Batch(tensors, objects, batches[0].meta)

    def repeat(self, n: int, interleave: bool = True) -> "Batch":
        """Each row ``n`` times: ``aabb`` (interleave) or ``abab``."""
        rows = torch.arange(len(self))
        idx = rows.repeat_interleave(n) if interleave else rows.repeat(n)
        # copy objects so that per-sample edits of one repeat don't alias the others
        out = self.index(idx)
        out.objects = {k: [copy.copy(x) for x in v] for k, v in out.objects.items()}
        return out

    def pad_to_divisor(self, divisor: int) -> tuple["Batch", int]:
        """Append copies of the first rows so that len is divisible by ``divisor``; returns (batch, pad)."""
        pad = (-len(self)) % divisor
        if pad == 0:
            return self, 0
        idx = torch.cat([torch.arange(len(self)), torch.arange(pad) % len(self)])
        return self.index(idx), pad

    def unpad(self, pad: int) -> "Batch":
        return self if pad == 0 else self.index(slice(0, len(self) - pad))

    # ----------------------------------------------------------------- misc
    def to(self, device: torch.device | str) -> "Batch":
        return Batch({k: v.to(device) for k, v in self.tensors.items()}, self.objects, self.meta)

    def copy(self) -> "Batch":
        """A shallow copy: new dicts, shared tensors and objects."""
        return Batch(dict(self.tensors), dict(self.objects), dict(self.meta))


def _cat_rows(tensors: list[Tensor]) -> Tensor:
    """torch.cat on dim 0; trailing shapes must agree (nothing is padded silently)."""
    shapes = {tuple(t.shape[1:]) for t in tensors}
    if len(shapes) > 1:
        raise ValueError(f"Batch.concat: tensors have different trailing shapes {sorted(shapes)}")
    return torch.cat(tensors, dim=0)
