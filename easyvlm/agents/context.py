"""A multi-turn sample's response while it is generated, and the image budget
(``max_images_in_context``): older returned images become ``IMAGE_PLACEHOLDER``, and model turns
sampled before a removal leave the loss, since a token is trained only in the context it was sampled in."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Union

from easyvlm.agents.render import Segment, TurnRenderer, without_images


@dataclass
class ModelTurn:
    ids: list[int]
    logprobs: list[float]
    index: int  # the turn's number, from 0
    trained: bool = True  # False: out of the loss (its sample failed, or its context changed after it)
    version: int = -1  # the policy version that sampled it, when the engine tags one (partial rollouts)


@dataclass
class Answer:
    """What answered a model turn, rendered, with what re-renders it when the image budget removes images."""

    segment: Segment
    messages: list[dict]  # the chat messages before any removal: one {"type": "image"} per image
    images: list  # the images as returned, in order
    eos_text: str | None  # the model's end-of-turn text before it (TurnRenderer.render)
    removed: int = 0  # its first `removed` images are shown as the placeholder
    record_images: list = field(default_factory=list)  # what the trajectory keeps: every image, as first shown

    @property
    def shown(self) -> int:
        return len(self.images) - self.removed


Piece = Union[ModelTurn, Answer]


@dataclass
class Response:
    """A sample's response so far, as pieces; the flat lists the engine and the trainer read."""

    pieces: list[Piece] = field(default_factory=list)

    def __len__(self) -> int:
        return sum(len(p.ids) if isinstance(p, ModelTurn) else len(p.segment.input_ids) for p in self.pieces)

    def ids(self) -> list[int]:
        """Vision placeholders expanded (what the training forward sees)."""
        return [t for p in self.pieces for t in (p.ids if isinstance(p, ModelTurn) else p.segment.input_ids)]

    def raw_ids(self) -> list[int]:
        """One placeholder per image (what vLLM gets, with the images)."""
        return [t for p in self.pieces for t in (p.ids if isinstance(p, ModelTurn) else p.segment.raw_ids)]

    def turns(self) -> list[ModelTurn]:
        return [p for p in self.pieces if isinstance(p, ModelTurn)]

    def answers(self) -> list[Answer]:
        return [p for p in self.pieces if isinstance(p, Answer)]

    def images(self) -> list:
        """The images the model sees, fitted, in sequence order."""
        return [image for a in self.answers() for image in a.segment.images]

    def multi_modal_inputs(self) -> list[dict]:
        return [a.segment.multi_modal_inputs for a in self.answers() if a.segment.multi_modal_inputs]

    def trained_mask(self) -> list[bool]:
        """Per token: sampled by the model and trained."""
        return [isinstance(p, ModelTurn) and p.trained for p in self.pieces for _ in self._ids_of(p)]

    def turn_index(self) -> list[int]:
        """Per token: the model turn of a trained token, -1 elsewhere (untrained steps join no GiGPO group)."""
        return [p.index if isinstance(p, ModelTurn) and p.trained else -1 for p in self.pieces for _ in self._ids_of(p)]

    def versions(self) -> list[int]:
        """Per token: the version that sampled a model token, -1 elsewhere."""
        return [p.version if isinstance(p, ModelTurn) else -1 for p in self.pieces for _ in self._ids_of(p)]

    def logprobs(self) -> list[float]:
        return [lp for p in self.pieces for lp in (p.logprobs if isinstance(p, ModelTurn) else [0.0] * len(p.segment.input_ids))]

    def untrain(self, start: int = 0) -> None:
        """Take the model turns from piece ``start`` on out of the loss."""
        for p in self.pieces[start:]:
            if isinstance(p, ModelTurn):
                p.trained = False

    @staticmethod
    def _ids_of(p: Piece) -> list[int]:
        return p.ids if isinstance(p, ModelTurn) else p.segment.input_ids


def remove_oldest(response: Response, count: int, renderer: TurnRenderer) -> dict[int, Answer]:
    """By piece index, the answers that lose an image when the ``count`` oldest shown ones are removed,
    rendered again; ``response`` is not changed."""
    changes: dict[int, Answer] = {}
    for i, piece in enumerate(response.pieces):
        if count <= 0:
            break
        if not isinstance(piece, Answer) or piece.shown == 0:
            continue
        removed = piece.removed + min(count, piece.shown)
        count -= removed - piece.removed
        segment = renderer.render(without_images(piece.messages, removed), piece.images[removed:], piece.eos_text)
        changes[i] = dataclasses.replace(piece, segment=segment, removed=removed)
    return changes


def apply_removal(response: Response, changes: dict[int, Answer]) -> None:
    """Put the re-rendered answers in place; the model turns after the first of them leave the loss."""
    for i, answer in changes.items():
        response.pieces[i] = answer
    if changes:
        response.untrain(min(changes) + 1)
