"""easyvlm.config.compose: a component's settings spliced into a config section as flat keys (in
their place, with their types, defaults and documentation) and given back whole; slices filled by
name from config sections."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Optional

import pytest

from easyvlm.algorithms.settings import KLSettings, PolicyLossSettings
from easyvlm.config.compose import fields_of, settings_of
from easyvlm.config.introspect import field_docs, field_types
from easyvlm.config.loader import load_config
from easyvlm.config.worker_schema import ActorConfig


@dataclass(frozen=True)
class Knobs:
    gain: float = 2.0
    """How much."""
    label: Optional[str] = None
    """Which."""


@dataclass(frozen=True)
@fields_of(Knobs, after="first", read_as="knobs")
class Section:
    first: int = 1
    """The first key."""
    last: bool = True
    """The last key."""


def test_fields_are_spliced_in_place_with_their_types_defaults_and_docs():
    assert [f.name for f in dataclasses.fields(Section)] == ["first", "gain", "label", "last"]
    assert Section() == Section(first=1, gain=2.0, label=None, last=True)
    assert field_types(Section) == {"first": int, "gain": float, "label": Optional[str], "last": bool}
    assert field_docs(Section) == {"first": "The first key.", "gain": "How much.", "label": "Which.",
                                   "last": "The last key."}
    assert Section(gain=3.0, label="x").knobs == Knobs(gain=3.0, label="x")


def test_a_splice_needs_its_anchor_and_no_clash():
    with pytest.raises(TypeError, match="no field 'missing'"):
        fields_of(Knobs, after="missing", read_as="knobs")(type("S", (), {"__annotations__": {"first": int}}))
    with pytest.raises(TypeError, match=r"\['gain'\]"):
        fields_of(Knobs, after="first", read_as="knobs")(type("S", (), {"__annotations__": {"first": int, "gain": int}}))


def test_settings_of_copies_by_name_and_asks_when_two_sections_have_a_field():
    @dataclass(frozen=True)
    class Other:
        gain: float = 5.0

    assert settings_of(Knobs, Other()) == Knobs(gain=5.0)  # label: no section has it, the default stays
    assert settings_of(Knobs, Other(), label="y") == Knobs(gain=5.0, label="y")
    assert settings_of(Knobs, Other(), gain=1.0) == Knobs(gain=1.0)  # given wins
    with pytest.raises(TypeError, match="give it explicitly"):
        settings_of(Knobs, Other(), Section())


def test_the_actor_section_gives_the_policy_loss_its_settings_whole():
    cfg = load_config(["worker.actor.clip_ratio_low=0.1", "worker.actor.loss_type=sapo", "algorithm.kl_coef=0.05"])
    loss = cfg.worker.actor.policy_loss
    assert isinstance(loss, PolicyLossSettings) and (loss.clip_ratio_low, loss.loss_type) == (0.1, "sapo")
    assert cfg.algorithm.kl == KLSettings(kl_coef=0.05)
    # the keys stay flat, in EasyR1's place among the actor's keys
    names = [f.name for f in dataclasses.fields(ActorConfig)]
    assert names[names.index("max_grad_norm") + 1] == "clip_ratio_low"
    assert names[names.index("off_policy_mask_threshold") + 1] == "ppo_epochs"
