"""RL math as pure functions over tensors: advantages, policy / value losses, KL, entropy, aggregation.

See docs/algorithms.md for the formulas, the papers and how to plug in your own estimator or loss.
"""

from easyvlm.algorithms.advantages import (
    ADVANTAGES,
    AdvantageFn,
    AdvantageInputs,
    AdvantageOutputs,
    advantage_names,
    get_advantage,
    register_advantage,
)
from easyvlm.algorithms.aggregation import (
    LOSS_AVG_MODE_ALIASES,
    LOSS_AVG_MODES,
    aggregate_loss,
    canonical_loss_avg_mode,
    loss_normalizer,
)
from easyvlm.algorithms.entropy import entropy_bonus_loss, entropy_from_logits
from easyvlm.algorithms.kl import (
    AdaptiveKLController,
    FixedKLController,
    apply_kl_penalty,
    build_kl_controller,
    kl_loss,
    kl_names,
    kl_penalty,
)
from easyvlm.algorithms.masked import masked_mean, masked_sum, masked_whiten
from easyvlm.algorithms.policy_losses import (
    POLICY_LOSSES,
    PolicyLossFn,
    PolicyLossInputs,
    get_policy_loss,
    policy_loss_names,
    register_policy_loss,
)
from easyvlm.algorithms.value_loss import value_loss

# registers clip_cov and kl_cov with the policy losses
from easyvlm.algorithms import covariance_losses  # noqa: E402,F401

__all__ = [
    "ADVANTAGES",
    "AdaptiveKLController",
    "AdvantageFn",
    "AdvantageInputs",
    "AdvantageOutputs",
    "FixedKLController",
    "LOSS_AVG_MODES",
    "LOSS_AVG_MODE_ALIASES",
    "POLICY_LOSSES",
    "PolicyLossFn",
    "PolicyLossInputs",
    "advantage_names",
    "aggregate_loss",
    "apply_kl_penalty",
    "build_kl_controller",
    "canonical_loss_avg_mode",
    "entropy_bonus_loss",
    "entropy_from_logits",
    "get_advantage",
    "get_policy_loss",
    "kl_loss",
    "kl_names",
    "kl_penalty",
    "loss_normalizer",
    "masked_mean",
    "masked_sum",
    "masked_whiten",
    "policy_loss_names",
    "register_advantage",
    "register_policy_loss",
    "value_loss",
]
