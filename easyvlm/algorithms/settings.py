"""The algorithms' settings, each declared once with its type, default and meaning; the config schema
composes them into its sections as flat keys (``easyvlm.utils.compose``). The ``algorithm`` section
itself is declared here too (`AlgorithmConfig`: the KL penalty's, online filtering's and distillation's
keys spliced in, the rollout correction a section of it). Torch-free (the config check imports it). A
new loss hyperparameter is a field here plus its use in ``policy_losses.py``."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Literal, Optional

from easyvlm.algorithms.rollout_correction_settings import RolloutCorrectionConfig
from easyvlm.utils.compose import fields_of

LossAvgMode = Literal["token", "seq", "seq-mean-token-sum", "seq-mean-token-sum-norm", "token-sum"]
KLPenalty = Literal["kl", "abs", "mse", "low_var_kl", "full"]
KLType = Literal["fixed", "adaptive"]

LOSS_AVG_MODES: tuple[str, ...] = ("token", "seq", "seq-mean-token-sum", "seq-mean-token-sum-norm", "token-sum")
"""Canonical aggregation mode names."""

LOSS_AVG_MODE_ALIASES: dict[str, str] = {"token-mean": "token", "seq-mean-token-mean": "seq"}
"""verl-style long names accepted for the two EasyR1 modes."""


def canonical_loss_avg_mode(mode: str) -> str:
    """Map an accepted mode name (incl. aliases) to its canonical name; raise for anything else."""
    mode = LOSS_AVG_MODE_ALIASES.get(mode, mode)
    if mode not in LOSS_AVG_MODES:
        valid = list(LOSS_AVG_MODES) + list(LOSS_AVG_MODE_ALIASES)
        raise ValueError(f"unknown loss_avg_mode {mode!r} (worker.actor.loss_avg_mode); valid: {valid}")
    return mode


@dataclass(frozen=True)
class PolicyLossSettings:
    """The policy loss (``worker.actor.loss_type``) and its hyperparameters: the keys
    ``worker.actor.clip_ratio_low`` ... ``off_policy_mask_threshold``. Every loss gets them whole in
    ``PolicyLossInputs.settings``; the token gate (``token_filters.py``) reads the last two."""

    clip_ratio_low: float = 0.2
    """PPO clip: the ratio is clipped below at 1 - clip_ratio_low."""
    clip_ratio_high: float = 0.3
    """PPO clip: the ratio is clipped above at 1 + clip_ratio_high (DAPO's clip-higher)."""
    clip_ratio_dual: float = 3.0
    """Dual-clip PPO's constant c (arXiv:1912.09729): for negative advantages the loss is at most
    c times the advantage's magnitude. Must be > 1."""
    loss_avg_mode: LossAvgMode = "token"
    """How token losses become one number: token (mean over all tokens of the mini-batch), seq
    (mean over tokens of each sequence, then over sequences), seq-mean-token-sum (sum over tokens,
    mean over sequences), seq-mean-token-sum-norm (sum over tokens divided by the longest possible
    response, Dr. GRPO), token-sum (sum over every token of the mini-batch, no division; verl's)."""
    loss_type: str = "default"
    """Policy loss: default (PPO clip with clip-higher and dual-clip), gspo, gspo_token, cispo, sapo,
    geo_mean (GMPO), clip_cov, kl_cov (Clip-Cov / KL-Cov), gpg (plain policy gradient), or your own
    as `path/to/file.py:func`."""
    tau_positive: float = 1.0
    """SAPO (arXiv:2511.20347): temperature of the soft gate for tokens with a non-negative
    advantage (loss_type=sapo only)."""
    tau_negative: float = 1.05
    """SAPO: temperature of the soft gate for tokens with a negative advantage (loss_type=sapo only)."""
    clip_cov_ratio: float = 0.0002
    """easyvlm extra (verl's key and default). Clip-Cov (loss_type=clip_cov, arXiv:2505.22617):
    fraction of the valid tokens whose gradient is detached, drawn at random among those whose
    covariance of advantage and log-prob lies in (clip_cov_lb, clip_cov_ub)."""
    clip_cov_lb: float = 1.0
    """easyvlm extra (verl's key and default). Clip-Cov: lower end of the covariance band."""
    clip_cov_ub: float = 5.0
    """easyvlm extra (verl's key and default). Clip-Cov: upper end of the covariance band."""
    kl_cov_ratio: float = 0.0002
    """easyvlm extra (verl's key and default). KL-Cov (loss_type=kl_cov): fraction of the valid
    tokens, those with the largest covariance, that get the penalty ppo_kl_coef * |log ratio| (the
    paper uses 0.002 for 7B models and 0.0002 for 32B)."""
    ppo_kl_coef: float = 1.0
    """easyvlm extra (verl's key and default). KL-Cov: weight of the |log ratio| penalty on the
    selected tokens."""
    top_entropy_quantile: float = 1.0
    """easyvlm extra (TRL's key). "Beyond the 80/20 rule" (arXiv:2506.01939): only the tokens whose
    entropy is in the top fraction rho of the micro-batch carry the policy gradient (0.2 in the
    paper); 1.0 = all tokens. The others still count in the loss's normaliser."""
    off_policy_mask_threshold: Optional[float] = None
    """easyvlm extra (TRL's key). DeepSeek-V3.2's off-policy sequence masking (arXiv:2512.02556
    eqn. 9): a sequence with a negative advantage whose mean log(pi_sampler / pi_theta) over its
    tokens exceeds this (e.g. 0.5) carries no policy gradient. None = off."""

    def __post_init__(self) -> None:
        # the config check reported these rules by key; a loss built in Python is checked here
        found = PolicyLossSettings.problems(self)
        if found:
            raise ValueError("; ".join(f"worker.actor.{key} {message}" for key, message in found))
        canonical_loss_avg_mode(self.loss_avg_mode)

    @staticmethod
    def problems(s: Any) -> list[tuple[str, str]]:
        """(key under ``worker.actor``, message) for each range rule these values break: ``s`` is this
        class or the config section that composes it (the values need not be valid)."""
        found = []
        for key in ("clip_ratio_low", "clip_ratio_high"):
            if not (_finite(getattr(s, key)) and getattr(s, key) >= 0):
                found.append((key, f"must be a finite number >= 0, got {getattr(s, key)}"))
        if not (_finite(s.clip_ratio_dual) and s.clip_ratio_dual > 1):
            found.append(("clip_ratio_dual", f"must be > 1 (dual-clip PPO bounds the loss by c x |advantage|), got "
                          f"{s.clip_ratio_dual}"))
        for key in ("tau_positive", "tau_negative"):  # the gate 4/tau * sigmoid(tau (r - 1)) divides by tau
            if not (_finite(getattr(s, key)) and getattr(s, key) > 0):
                found.append((key, f"must be a finite number > 0 (SAPO's gate temperature), got {getattr(s, key)}"))
        for key in ("clip_cov_ratio", "kl_cov_ratio"):
            if not (_finite(getattr(s, key)) and 0 < getattr(s, key) <= 1):
                found.append((key, f"must be a fraction of the tokens in (0, 1], got {getattr(s, key)} (verl's default "
                              "is 0.0002)"))
        low, high = s.clip_cov_lb, s.clip_cov_ub
        if not (_finite(low) and _finite(high) and low < high):
            found.append(("clip_cov_lb", f"({low}) must be below worker.actor.clip_cov_ub ({high}): Clip-Cov picks "
                          "tokens whose covariance lies between them"))
        if not (_finite(s.ppo_kl_coef) and s.ppo_kl_coef >= 0):
            found.append(("ppo_kl_coef", f"must be a finite number >= 0, got {s.ppo_kl_coef}"))
        if not (_finite(s.top_entropy_quantile) and 0 <= s.top_entropy_quantile <= 1):
            found.append(("top_entropy_quantile", "must be in [0, 1] (the share of tokens, by entropy, that keep the "
                          f"policy gradient; 0.2 in the paper, 1 = all), got {s.top_entropy_quantile}"))
        threshold = s.off_policy_mask_threshold
        if threshold is not None and not (_finite(threshold) and threshold >= 0):
            found.append(("off_policy_mask_threshold", f"must be a number >= 0 (the paper's delta, e.g. 0.5) or null, "
                          f"got {threshold}"))
        return found


@dataclass(frozen=True)
class ValueLossSettings:
    """The critic's clipped value loss (``value_losses.py``): the keys ``worker.critic.cliprange_value``
    and ``loss_avg_mode``. The critic gets them whole (``CriticSpec.value_loss``)."""

    cliprange_value: float = 0.5
    """Clip range of the value loss: new values stay within old values +- this."""
    loss_avg_mode: LossAvgMode = "token"
    """How token value losses become one number (see `worker.actor.loss_avg_mode`)."""


def _finite(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


@dataclass(frozen=True)
class EntropySettings:
    """The entropy bonus of the actor loss and its adaptive controller
    (``entropy.AdaptiveEntropyController``): the keys ``worker.actor.entropy_coeff`` ...
    ``entropy_coeff_max``."""

    entropy_coeff: float = 0.0
    """easyvlm extra. Weight of the entropy bonus in the actor loss (loss -= entropy_coeff *
    entropy); 0 = none. With use_adaptive_entropy: the controller's initial coefficient."""
    use_adaptive_entropy: bool = False
    """easyvlm extra (TRL's key). Adaptive entropy control (Skywork-OR1, arXiv:2505.22312; TRL's use_adaptive_entropy): after
    each step the coefficient moves by entropy_coeff_delta towards more bonus while the step's
    token-mean entropy is <= entropy_target, less otherwise, within [entropy_coeff_min,
    entropy_coeff_max]; the bonus acts only in a step that follows one with entropy <=
    entropy_target (so not in the first step, as in TRL). Logs actor/entropy_coeff (the
    coefficient applied) and actor/entropy (the measurement). See docs/algorithms.md."""
    entropy_target: float = 0.2
    """easyvlm extra (TRL's key). Adaptive entropy control: the target token-mean entropy in nats (TRL's key and default)."""
    entropy_coeff_delta: float = 0.005
    """easyvlm extra. Adaptive entropy control: the coefficient's step per trainer step (TRL spells it
    entropy_coef_delta; TRL's default)."""
    entropy_coeff_min: float = 0.0
    """easyvlm extra. Adaptive entropy control: the coefficient's lower bound (TRL: entropy_coef_min; its default)."""
    entropy_coeff_max: float = 1.0
    """easyvlm extra. Adaptive entropy control: the coefficient's upper bound (TRL: entropy_coef_max; its default)."""

@dataclass(frozen=True)
class KLSettings:
    """The KL penalty to the reference model: where it goes (the reward or the actor loss), its
    estimator (``kl.py``) and its coefficient's controller: the keys ``algorithm.disable_kl`` ...
    ``use_bias_correction_kl``. Whether it acts, and where, the plan derives (``Derived``)."""

    disable_kl: bool = False
    """Turn the KL penalty off entirely; no reference model is built."""
    use_kl_loss: bool = False
    """False: the KL penalty is subtracted from the token rewards. True: it is a term of the actor
    loss (GRPO's way)."""
    kl_penalty: KLPenalty = "kl"
    """KL estimator: kl (k1), abs, mse (k2), low_var_kl (k3), full."""
    kl_coef: float = 1e-3
    """KL coefficient (the initial one with the adaptive controller)."""
    kl_type: KLType = "fixed"
    """KL controller for the KL-in-reward coefficient: fixed or adaptive."""
    kl_horizon: float = 10000.0
    """Horizon of the adaptive KL controller."""
    kl_target: float = 0.1
    """Target KL of the adaptive KL controller."""
    use_bias_correction_kl: bool = False
    """easyvlm extra (TRL's key). With use_kl_loss, multiply each token's KL estimate by pi_theta / pi_old, the
    importance-weighted (unbiased) estimator of the DeepSeek-V3.2 report (arXiv:2512.02556)."""

@dataclass(frozen=True)
class OnlineFilterSettings:
    """DAPO's dynamic sampling (arXiv:2503.14476): which prompt groups a training step keeps, by the
    mean of a reward key over each group's samples: the keys ``algorithm.online_filtering`` ...
    ``filter_high``. The driver's sampler applies them (``easyvlm.service.rounds``)."""

    online_filtering: bool = False
    """DAPO's dynamic sampling: drop prompts whose mean `filter_key` over their samples is not in
    (`filter_low`, `filter_high`), and generate more until `data.rollout_batch_size` prompts are
    kept."""
    filter_key: str = "overall"
    """Reward key that online filtering looks at (`overall` or another key the reward returns)."""
    filter_low: float = 0.01
    """Online filtering keeps prompts whose mean `filter_key` is above this ..."""
    filter_high: float = 0.99
    """... and below this."""


@dataclass(frozen=True)
class DistillSettings:
    """On-policy distillation (GKD, arXiv:2306.13649): the student samples, the teacher
    (``worker.teacher``) gives its log-probs on those samples, and the student is pulled towards the
    teacher by the reverse KL KL(pi_student || pi_teacher) per token (``distill.py``): the keys
    ``algorithm.distill_coef`` ... ``distill_only``."""

    distill_coef: float = 0.0
    """easyvlm extra. Weight of the distillation signal; 0 = off (and worker.teacher must be off).
    As a loss (default): the actor loss adds distill_coef times the reverse KL to the teacher,
    aggregated like the policy loss. With distill_as_reward: each token's advantage gets
    distill_coef * (teacher log-prob - student log-prob)."""
    distill_full_kl: bool = False
    """easyvlm extra. The distillation loss is the exact reverse KL over the vocabulary at each
    sampled position (the teacher's whole distribution, as kl_penalty=full computes it) instead of
    the one-sample estimate log pi_student - log pi_teacher of the sampled token."""
    distill_as_reward: bool = False
    """easyvlm extra. The teacher's log-prob advantage as the per-token advantage (no baseline:
    distill_coef * (log pi_teacher - log pi_student) of each sampled token, added to the estimator's
    advantage), optimised by the policy loss, instead of a loss term (the Thinking Machines /
    verl-recipe form). Needs the old log-probs pass (the student's log-probs before the update)."""
    distill_only: bool = False
    """easyvlm extra. Pure distillation: no policy gradient from the reward; the update is the
    distillation alone (the reward function still scores the samples, for the reward/* metrics and
    validation). Not with gae, remax, online filtering or the KL in the reward (they act through
    the reward's advantage)."""


@dataclass(frozen=True)
@fields_of(DistillSettings, after="multi_objective_aggregation", read_as="distill")
@fields_of(OnlineFilterSettings, after="use_bias_correction_kl", read_as="online_filter")
@fields_of(KLSettings, after="adv_estimator", read_as="kl")
class AlgorithmConfig:
    gamma: float = 1.0
    """Discount factor (GAE, REINFORCE++; GiGPO's per step, 0.95 in verl-agent's examples)."""
    lam: float = 1.0
    """GAE's lambda."""
    adv_estimator: str = "grpo"
    """Advantage estimator: gae, grpo, grpo_passk, rloo, reinforce_plus_plus,
    reinforce_plus_plus_baseline, remax, gpg, gigpo, or your own as `path/to/file.py:func`. gae
    needs the critic (a value model); gigpo (step-level credit) needs `worker.rollout.environment`."""
    # here: the KL penalty's keys, disable_kl ... use_bias_correction_kl (KLSettings)
    # here: online filtering's keys, online_filtering ... filter_high (OnlineFilterSettings)
    norm_adv_by_std_in_grpo: bool = True
    """easyvlm extra. GRPO divides advantages by the group's standard deviation (GiGPO: its
    episode and step groups'); False gives Dr. GRPO (arXiv:2503.20783), which does not."""
    multi_objective_aggregation: Literal["sum_then_normalize", "normalize_then_sum"] = "sum_then_normalize"
    """easyvlm extra (TRL's key), for several `worker.reward.reward_functions`. sum_then_normalize:
    the estimator gets their weighted sum (`overall`). normalize_then_sum (GDPO, arXiv:2601.05242):
    each function's score is normalised within its group, weighted and summed, and the sum
    normalised over the batch; that replaces the score of an outcome estimator, and with grpo it is
    the advantage itself (TRL's). Needs two or more reward functions; not with gae or remax; with
    grpo, not with the KL in the reward or norm_adv_by_std_in_grpo=false (docs/algorithms.md)."""
    # here: on-policy distillation's keys, distill_coef ... distill_only (DistillSettings)
    rollout_correction: RolloutCorrectionConfig = field(default_factory=RolloutCorrectionConfig)
    """verl's rollout correction: truncated / masked importance sampling against the sampler."""
