"""The config check of adaptive entropy control (worker.actor.use_adaptive_entropy and its keys):
each refusal names its key; the keys alone, without the switch, are refused as meaningless."""

from __future__ import annotations

import pytest
from test_validate import problems

ON = "worker.actor.use_adaptive_entropy=true"


@pytest.mark.parametrize(("overrides", "key", "phrase"), [
    ([ON, "worker.actor.entropy_coeff_min=0.5", "worker.actor.entropy_coeff_max=0.1", "worker.actor.entropy_coeff=0.3"],
     "worker.actor.entropy_coeff_min", "(0.5) is above worker.actor.entropy_coeff_max (0.1)"),
    ([ON, "worker.actor.entropy_coeff=1.5"], "worker.actor.entropy_coeff", "= [0.0, 1.0]"),
    ([ON, "worker.actor.entropy_coeff_min=0.1"], "worker.actor.entropy_coeff", "(0.0) is the adaptive controller's initial"),
    ([ON, "worker.actor.entropy_coeff_delta=0"], "worker.actor.entropy_coeff_delta", "must be a finite number > 0"),
    ([ON, "worker.actor.entropy_coeff_delta=-0.01"], "worker.actor.entropy_coeff_delta", "> 0"),
    ([ON, "worker.actor.entropy_target=-0.1"], "worker.actor.entropy_target", "must be a finite number >= 0"),
    ([ON, "worker.actor.entropy_target=.nan"], "worker.actor.entropy_target", "finite"),
    ([ON, "worker.actor.entropy_coeff_max=.inf"], "worker.actor.entropy_coeff_max", "finite"),
    # the keys without the switch mean nothing
    (["worker.actor.entropy_target=0.3"], "worker.actor.entropy_target", "means nothing unless worker.actor.use_adaptive_entropy=true"),
    (["worker.actor.entropy_coeff_delta=0.01"], "worker.actor.entropy_coeff_delta", "means nothing unless"),
    (["worker.actor.entropy_coeff_min=0.01"], "worker.actor.entropy_coeff_min", "means nothing unless"),
    (["worker.actor.entropy_coeff_max=0.5"], "worker.actor.entropy_coeff_max", "means nothing unless"),
])
def test_adaptive_entropy_rule(overrides, key, phrase):
    found = problems(*overrides)
    assert any(p.key == key and phrase in p.message for p in found), found


@pytest.mark.parametrize("overrides", [
    [ON],  # the defaults: c = entropy_coeff = 0 in [0, 1], target 0.2, delta 0.005
    [ON, "worker.actor.entropy_coeff=0.01", "worker.actor.entropy_target=0.3", "worker.actor.entropy_coeff_delta=0.001",
     "worker.actor.entropy_coeff_min=0.01", "worker.actor.entropy_coeff_max=0.01", "worker.actor.loss_avg_mode=seq"],
    [ON, "worker.actor.entropy_target=0"],
    ["worker.actor.entropy_coeff=0.01"],  # the fixed coefficient needs no switch
])
def test_adaptive_entropy_valid_settings_pass(overrides):
    assert problems(*overrides) == []
