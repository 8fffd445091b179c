"""easyvlm.utils.compose: a component's settings spliced into a config section as flat keys (in
their place, with their types, defaults and documentation) and given back whole; slices filled by
name from config sections."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Optional

import pytest

from easyvlm.algorithms.settings import KLSettings, PolicyLossSettings, ValueLossSettings
from easyvlm.config.introspect import field_docs, field_types
from easyvlm.config.loader import load_config
from easyvlm.utils.compose import fields_of, settings_of
from easyvlm.workers.settings import ActorConfig, CriticConfig, ForwardSettings, UpdateSettings


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


@dataclass(frozen=True)
class Inner:
    mid: int = 0
    """Between."""


@dataclass(frozen=True)
@fields_of(Inner, after="gain", read_as="inner")
@fields_of(Knobs, after="first", read_as="knobs")
class NestedSection:
    first: int = 1
    """The first key."""
    last: bool = True
    """The last key."""


def test_a_later_splice_after_a_spliced_field_lands_inside_the_earlier_run():
    # how the actor's update keys frame its policy-loss keys: Knobs goes in first, Inner after its gain
    assert [f.name for f in dataclasses.fields(NestedSection)] == ["first", "gain", "mid", "label", "last"]
    section = NestedSection(gain=3.0, mid=4, label="x")
    assert (section.knobs, section.inner) == (Knobs(gain=3.0, label="x"), Inner(mid=4))
    assert field_docs(NestedSection) == {"first": "The first key.", "gain": "How much.", "mid": "Between.",
                                         "label": "Which.", "last": "The last key."}


@dataclass(frozen=True)
@fields_of(Inner, after="gain", read_as="inner")
@fields_of(Knobs, after=None, read_as="knobs")
class SplicedSection:
    """No field of its own: Knobs at the start (no anchor), Inner after Knobs' gain."""


@dataclass(frozen=True)
@fields_of(Inner, after=None, read_as="inner")
class LeadSection:
    first: int = 1
    """The first key."""


def test_a_splice_with_no_anchor_starts_the_section():
    # how the rollout's section is made of splices alone (worker.rollout.name first)
    assert [f.name for f in dataclasses.fields(SplicedSection)] == ["gain", "mid", "label"]
    section = SplicedSection(gain=3.0, mid=4)
    assert (section.knobs, section.inner) == (Knobs(gain=3.0, label=None), Inner(mid=4))
    assert field_docs(SplicedSection) == {"gain": "How much.", "mid": "Between.", "label": "Which."}
    # before the section's own fields, not after them
    assert [f.name for f in dataclasses.fields(LeadSection)] == ["mid", "first"]
    assert LeadSection() == LeadSection(mid=0, first=1)


@dataclass(frozen=True)
@fields_of(Knobs, after="first", read_as="knobs", defaults={"gain": 0.5}, docs={"label": """Which one,
    this section's."""})
class OwnSection:
    first: int = 1
    """The first key."""


def test_a_section_may_give_spliced_fields_its_own_defaults_and_docs():
    assert OwnSection() == OwnSection(first=1, gain=0.5, label=None)
    assert OwnSection().knobs == Knobs(gain=0.5, label=None)  # the settings object carries the section's default
    assert OwnSection(gain=4.0).knobs == Knobs(gain=4.0)  # a value given still wins over the section's default
    # label's doc is the section's (whitespace collapsed as for docstrings); gain's still Knobs'
    assert field_docs(OwnSection) == {"first": "The first key.", "gain": "How much.", "label": "Which one, this section's."}
    # the other section that splices Knobs, and Knobs itself, keep Knobs' default and doc
    assert (Section().gain, Knobs().gain, field_docs(Section)["label"]) == (2.0, 2.0, "Which.")
    with pytest.raises(TypeError, match=r"Knobs has no field \['gian', 'lable'\]"):
        fields_of(Knobs, after="first", read_as="knobs", defaults={"gian": 1.0}, docs={"lable": "x"})


def test_actor_and_critic_share_the_forward_keys_with_their_own_defaults():
    cfg = load_config(["worker.critic.ulysses_size=2", "worker.actor.share_prompts=false"])
    # the critic packs no sequences by default, the actor does (EasyR1's defaults)
    assert cfg.worker.critic.forward == ForwardSettings(padding_free=False, ulysses_size=2)
    assert cfg.worker.actor.forward == ForwardSettings(padding_free=True, share_prompts=False)
    names = [f.name for f in dataclasses.fields(CriticConfig)]
    assert names[names.index("ppo_epochs"):names.index("model")] == [
        "ppo_epochs", "padding_free", "share_prompts", "dynamic_batching", "ulysses_size", "expert_parallel_size"]
    assert field_docs(CriticConfig)["padding_free"] == "Pack sequences without padding in the forward pass."
    assert field_docs(ActorConfig)["padding_free"].endswith("(varlen attention: flash-attn on GPUs, SDPA per sequence elsewhere).")


def test_actor_and_critic_share_the_update_keys_around_their_loss_keys():
    cfg = load_config(["worker.actor.ppo_epochs=2", "worker.critic.max_grad_norm=0.5",
                       "worker.critic.cliprange_value=0.2", "worker.critic.loss_avg_mode=seq"])
    assert cfg.worker.actor.update == UpdateSettings(max_grad_norm=1.0, ppo_epochs=2)
    assert cfg.worker.critic.update == UpdateSettings(max_grad_norm=0.5, ppo_epochs=1)
    assert cfg.worker.critic.value_loss == ValueLossSettings(cliprange_value=0.2, loss_avg_mode="seq")
    names = [f.name for f in dataclasses.fields(CriticConfig)]  # EasyR1's order of the critic's keys
    assert names[names.index("micro_batch_size_per_device_for_experience"):names.index("padding_free")] == [
        "micro_batch_size_per_device_for_experience", "max_grad_norm", "cliprange_value", "loss_avg_mode", "ppo_epochs"]
    assert field_docs(CriticConfig)["loss_avg_mode"] == (
        "How token value losses become one number (see `worker.actor.loss_avg_mode`).")


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
    assert names[names.index("micro_batch_size_per_device_for_experience") + 1] == "max_grad_norm"
    assert names[names.index("max_grad_norm") + 1] == "clip_ratio_low"
    assert names[names.index("off_policy_mask_threshold") + 1] == "ppo_epochs"
