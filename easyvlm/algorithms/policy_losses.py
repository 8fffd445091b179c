"""Policy losses: ``PolicyLossInputs -> (loss, metrics)``, registered by name.

Every loss computes per-token losses (B, T), multiplies them by the rollout correction's
importance weights when there are any (:func:`weighted`), and aggregates them with
:func:`easyvlm.algorithms.aggregation.aggregate_loss` using ``loss_avg_mode`` and the mini-batch
normaliser (see that module for how the actor passes it). Get one with
``get_policy_loss(name_or_spec)``; ``policy_loss_names()`` lists the built-in ones.

Metrics (floats, token means over this micro-batch's valid tokens; the actor averages them):
``pg_clipfrac_higher`` (A > 0 and the ratio above 1 + clip_ratio_high, the clipped branch is
active), ``pg_clipfrac_lower`` (A < 0 and the ratio below 1 - clip_ratio_low), ``pg_clipfrac_dual``
(A < 0 and the dual clip active), ``ppo_kl`` (k1 estimate of KL(old || new), mean of
old_logprobs - logprobs) and ``entropy_loss`` (mean of -logprobs, a one-sample estimate of the
entropy; the exact entropy comes from logits, see ``entropy.py``). sapo reports no
``pg_clipfrac_*`` but ``sapo_grad_scale`` (see :func:`sapo_loss`).

Departures from the papers and from EasyR1:
- EasyR1's ``pg_clipfrac_higher`` counts both sides of the ordinary clip and its
  ``pg_clipfrac_lower`` counts the dual clip; here the three are reported separately.
- The log-ratio is clamped to [-20, 20] before exp (no inf ratio, no NaN gradient).
- gspo / gspo_token: no dual clip (the paper has none); the configured ``loss_avg_mode`` is used
  (the paper's is "seq"); the paper's clip ranges are ~3e-4 / 4e-4, far smaller than PPO's, so
  set ``clip_ratio_low`` / ``clip_ratio_high`` accordingly. The sequence ratio uses the per-token
  advantage (identical to the paper's when the estimator gives one advantage per sequence).
- cispo: the clip bounds are ``1 - clip_ratio_low`` and ``1 + clip_ratio_high`` (the paper
  effectively uses no lower bound: set clip_ratio_low >= 1 for that). Its loss *value* is
  -w * A * logprob, not comparable with PPO's; its gradient is what matters.
- sapo: EasyR1's form (per-token soft gate, configured aggregation), which agrees with the paper
  (Gao et al., arXiv:2511.20347, the SAPO objective with the soft gate f_it(x) = 4/tau_it *
  sigmoid(tau_it (x - 1))) on the gate and on the per-token ratio. Differences: tokens with A = 0
  get tau_positive (the paper: tau_neg when A <= 0), which changes nothing since their loss and
  gradient are 0 either way; the paper averages per sequence (1/G sum_i 1/|y_i| sum_t, i.e.
  loss_avg_mode "seq"), easyvlm and EasyR1 use the configured ``loss_avg_mode`` (default "token");
  the ratio comes from the clamped log-ratio like every loss here. No clip_ratio_* is used and no
  pg_clipfrac_* is reported (nothing is clipped); ``sapo_grad_scale`` reports the soft attenuation.
- clip_cov / kl_cov (Cui et al., "The Entropy Mechanism of Reinforcement Learning for Reasoning
  Language Models", arXiv:2505.22617, sec. 5): they act on the tokens whose log-prob moves with the
  advantage. The policy entropy falls fastest where the centred log-prob and the centred advantage
  are large together; per valid token t of the micro-batch

      Cov_t = (A_t - mean(A)) * (log pi(y_t) - mean(log pi))           (means over the valid tokens)

  (the paper's token-wise centred cross-product, detached). Clip-Cov detaches the gradient of a
  few such tokens, KL-Cov puts a penalty on them: verl's loss modes ``clip_cov`` / ``kl_cov`` (keys
  ``clip_cov_ratio``, ``clip_cov_lb``, ``clip_cov_ub``, ``kl_cov_ratio``, ``ppo_kl_coef``, same
  defaults). As in verl, the means and the token counts are those of the micro-batch the loss sees
  (on one rank), so the selection depends on how a mini-batch is cut into micro-batches; the loss
  is then aggregated with the mini-batch normaliser like every other loss. Departures from verl:
  padding never enters the centring means (verl's ``masked_mean`` agrees); the metric
  ``pg_cov_frac`` (the fraction of valid tokens selected) replaces verl's ``pg_clipfrac`` for
  Clip-Cov, and KL-Cov reports ``ppo_kl`` as the k1 mean like every loss here (verl reports mean
  |log r| under that name).
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any, Callable

import torch
from torch import Tensor

from easyvlm.algorithms.aggregation import aggregate_loss
from easyvlm.algorithms.masked import check_mask, masked_mean, masked_sum, zero_masked
from easyvlm.algorithms.registry import Registry
from easyvlm.algorithms.settings import PolicyLossSettings

LOG_RATIO_CLAMP = 20.0


@dataclass(frozen=True)
class PolicyLossInputs:
    """Inputs of every policy loss: one micro-batch's tensors and the loss's settings. All (B, T)
    tensors share the response_mask's shape."""

    logprobs: Tensor
    """(B, T) float, with grad: log pi_theta(y_t) under the current policy."""
    old_logprobs: Tensor
    """(B, T) float: log-probs of the policy that sampled (or of the last update), no grad."""
    advantages: Tensor
    """(B, T) float."""
    response_mask: Tensor
    """(B, T) bool: True = the token counts in the loss."""
    settings: PolicyLossSettings = field(default_factory=PolicyLossSettings)
    """The loss's hyperparameters (``worker.actor.clip_ratio_low`` ..., declared and checked in
    ``settings.py``). A loss reads ``inputs.settings.clip_ratio_low``; ``inputs.settings.clip_ratio_low``
    reads the same (plug-in losses written against the flat inputs keep working)."""
    normalizer: float | None = None
    """N of the whole mini-batch from ``loss_normalizer``; None = this batch is the mini-batch."""
    rollout_is_weights: Tensor | None = None
    """(B, T) detached importance weights of the rollout correction (``algorithm.rollout_correction``,
    see ``rollout_correction.py``) that multiply each token's loss, as verl does; None = all 1.
    Every built-in loss applies them (:func:`weighted`); plug-in losses are refused with them."""
    token_gate: Tensor | None = None
    """(B, T) bool: the tokens that carry the policy gradient (``token_filters.py``: the high-entropy
    tokens of ``top_entropy_quantile``, the sequences ``off_policy_mask_threshold`` keeps); the
    others' loss is 0 but they still count in the normaliser, as in TRL. None = all tokens.
    Every built-in loss applies it; plug-in losses are refused with it."""

    def __post_init__(self) -> None:
        check_mask(self.response_mask, self.logprobs)
        for name in ("logprobs", "old_logprobs", "advantages", "rollout_is_weights", "token_gate"):
            if getattr(self, name) is None:
                continue
            shape = tuple(getattr(self, name).shape)
            if shape != tuple(self.response_mask.shape):
                expected = tuple(self.response_mask.shape)
                raise ValueError(f"PolicyLossInputs.{name} has shape {shape}, expected {expected} (response_mask)")

    def __getattr__(self, name: str) -> Any:
        # called only for a name the inputs lack: a field of the settings reads as the inputs' own
        settings = self.__dict__.get("settings")
        if settings is not None and name in _SETTINGS_FIELDS:
            return getattr(settings, name)
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")


_SETTINGS_FIELDS = frozenset(f.name for f in fields(PolicyLossSettings))


PolicyLossFn = Callable[[PolicyLossInputs], "tuple[Tensor, dict[str, float]]"]
POLICY_LOSSES: Registry[PolicyLossFn] = Registry("policy loss", "worker.actor.loss_type")
register_policy_loss = POLICY_LOSSES.register


def policy_loss_names() -> tuple[str, ...]:
    """Names of the built-in (and Python-registered) policy losses."""
    return POLICY_LOSSES.names()


def get_policy_loss(name_or_spec: str, source: str | None = None) -> PolicyLossFn:
    """The loss for a registered name or a ``path/to/file.py:func`` plug-in (``source``: the
    plug-in's text as the driver read it, so that a worker on another node needs no copy of it).

    A plug-in is called with a :class:`PolicyLossInputs` and must return ``(loss, metrics)``: a
    0-d tensor and a dict of floats; the returned function checks that and names the file.
    """
    fn, is_plugin = POLICY_LOSSES.get(name_or_spec, source)
    if not is_plugin:
        return fn

    def checked(inputs: PolicyLossInputs) -> tuple[Tensor, dict[str, float]]:
        out = fn(inputs)
        if not (isinstance(out, tuple) and len(out) == 2 and isinstance(out[0], Tensor) and isinstance(out[1], dict)):
            raise TypeError(
                f"policy loss {name_or_spec} must return (loss: 0-d tensor, metrics: dict), got {type(out).__name__}"
            )
        if out[0].dim() != 0:
            shape = tuple(out[0].shape)
            raise ValueError(f"policy loss {name_or_spec} returned a loss of shape {shape}; expected a 0-d tensor")
        return out

    return checked


# ----------------------------------------------------------------------------- helpers


@dataclass(frozen=True)
class _Prepared:
    mask: Tensor
    logprobs: Tensor  # (B, T), 0 at masked positions (gradient 0 there)
    advantages: Tensor  # (B, T), 0 at masked positions
    log_ratio: Tensor  # (B, T) clamped log(pi / pi_old), 0 at masked positions


def _prepare(inputs: PolicyLossInputs) -> _Prepared:
    mask = inputs.response_mask
    logprobs = zero_masked(inputs.logprobs, mask)
    old_logprobs = zero_masked(inputs.old_logprobs, mask)
    log_ratio = (logprobs - old_logprobs).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    return _Prepared(mask, logprobs, zero_masked(inputs.advantages, mask), log_ratio)


def weighted(token_losses: Tensor, inputs: PolicyLossInputs) -> Tensor:
    """The (B, T) token losses times the rollout correction's importance weights and the token gate
    (each if any)."""
    if inputs.rollout_is_weights is not None:
        token_losses = token_losses * inputs.rollout_is_weights.detach().to(token_losses.dtype)
    if inputs.token_gate is not None:
        token_losses = token_losses * inputs.token_gate.to(token_losses.dtype)
    return token_losses


def _fraction(flags: Tensor, mask: Tensor) -> float:
    return masked_mean(flags.to(torch.float32), mask).item()


def _base_metrics(p: _Prepared) -> dict[str, float]:
    return {
        "ppo_kl": masked_mean(-p.log_ratio.detach(), p.mask).item(),
        "entropy_loss": masked_mean(-p.logprobs.detach(), p.mask).item(),
    }


def _clip_metrics(clipped: Tensor, p: _Prepared) -> dict[str, float]:
    """pg_clipfrac_higher / _lower: tokens with A > 0 / A < 0 where ``clipped``; no dual clip; base metrics."""
    return {
        "pg_clipfrac_higher": _fraction(clipped & (p.advantages > 0), p.mask),
        "pg_clipfrac_lower": _fraction(clipped & (p.advantages < 0), p.mask),
        "pg_clipfrac_dual": 0.0,
        **_base_metrics(p),
    }


def _clipped_surrogate(ratio: Tensor, advantages: Tensor, inputs: PolicyLossInputs) -> tuple[Tensor, Tensor]:
    """Pessimistic PPO token loss max(-A r, -A clip(r)) and the mask of tokens where clipping is active."""
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1.0 - inputs.settings.clip_ratio_low, 1.0 + inputs.settings.clip_ratio_high)
    return torch.maximum(unclipped, clipped), clipped > unclipped


# ----------------------------------------------------------------------------- losses


@register_policy_loss("default")
def ppo_clip_loss(inputs: PolicyLossInputs) -> tuple[Tensor, dict[str, float]]:
    """PPO clipped surrogate with asymmetric clip and dual clip.

    r = exp(logprobs - old_logprobs); l = max(-A r, -A clip(r, 1 - eps_low, 1 + eps_high))
    (PPO, arXiv:1707.06347 eqn. 7; eps_high > eps_low is DAPO's clip-higher, arXiv:2503.14476);
    for A < 0 also l = min(l, -A c) (dual-clip PPO, arXiv:1912.09729). Shapes: (B, T) in,
    0-d loss out.
    """
    p = _prepare(inputs)
    ratio = torch.exp(p.log_ratio)
    clip_loss, clip_active = _clipped_surrogate(ratio, p.advantages, inputs)
    dual_bound = -p.advantages * inputs.settings.clip_ratio_dual
    negative = p.advantages < 0
    token_losses = torch.where(negative, torch.minimum(clip_loss, dual_bound), clip_loss)
    loss = aggregate_loss(weighted(token_losses, inputs), p.mask, inputs.settings.loss_avg_mode, inputs.normalizer)
    metrics = {
        "pg_clipfrac_higher": _fraction(clip_active & (p.advantages > 0), p.mask),
        "pg_clipfrac_lower": _fraction(clip_active & negative, p.mask),
        "pg_clipfrac_dual": _fraction(negative & (clip_loss > dual_bound), p.mask),
        **_base_metrics(p),
    }
    return loss, metrics


def _seq_log_ratio(p: _Prepared) -> Tensor:
    """(B,) mean over valid tokens of log(pi / pi_old): log of GSPO's length-normalised ratio s_i."""
    return masked_sum(p.log_ratio, p.mask, dim=-1) / p.mask.sum(dim=-1).clamp(min=1)


def _gspo_from_log_ratio(log_s: Tensor, p: _Prepared, inputs: PolicyLossInputs) -> tuple[Tensor, dict[str, float]]:
    ratio = torch.exp(log_s)
    token_losses, clip_active = _clipped_surrogate(ratio, p.advantages, inputs)
    loss = aggregate_loss(weighted(token_losses, inputs), p.mask, inputs.settings.loss_avg_mode, inputs.normalizer)
    return loss, _clip_metrics(clip_active, p)


@register_policy_loss("gspo")
def gspo_loss(inputs: PolicyLossInputs) -> tuple[Tensor, dict[str, float]]:
    """GSPO: sequence-level ratio s_i = exp(mean_t log(pi / pi_old)). Zheng et al., arXiv:2507.18071.

    Every token of sequence i carries l = max(-A s_i, -A clip(s_i, 1 - eps_low, 1 + eps_high));
    the gradient flows through s_i, i.e. through all tokens of the sequence. Shapes: (B, T) in.
    """
    p = _prepare(inputs)
    log_s = _seq_log_ratio(p).unsqueeze(-1).expand(p.mask.shape)  # (B, T)
    return _gspo_from_log_ratio(log_s, p, inputs)


@register_policy_loss("gspo_token")
def gspo_token_loss(inputs: PolicyLossInputs) -> tuple[Tensor, dict[str, float]]:
    """GSPO-token: s_it = sg[s_i] * pi(y_t) / sg[pi(y_t)]. Zheng et al., arXiv:2507.18071.

    Numerically s_it = s_i (same clipping as gspo), but each token's gradient is its own
    A_it * s_i * grad log pi(y_t): allows per-token advantages. Equals gspo when A is constant
    per sequence and loss_avg_mode is "seq".
    """
    p = _prepare(inputs)
    log_s = p.logprobs - p.logprobs.detach() + _seq_log_ratio(p).detach().unsqueeze(-1)  # (B, T)
    return _gspo_from_log_ratio(log_s, p, inputs)


@register_policy_loss("cispo")
def cispo_loss(inputs: PolicyLossInputs) -> tuple[Tensor, dict[str, float]]:
    """CISPO: l = -sg[clip(r, 1 - eps_low, 1 + eps_high)] * A * logprobs. MiniMax-M1, arXiv:2506.13585.

    The importance weight is clipped and detached instead of the update being dropped, so every
    token keeps a gradient A * w * grad log pi. Shapes: (B, T) in, 0-d loss out.
    """
    p = _prepare(inputs)
    ratio = torch.exp(p.log_ratio).detach()
    weight = ratio.clamp(1.0 - inputs.settings.clip_ratio_low, 1.0 + inputs.settings.clip_ratio_high)
    token_losses = -weight * p.advantages * p.logprobs
    loss = aggregate_loss(weighted(token_losses, inputs), p.mask, inputs.settings.loss_avg_mode, inputs.normalizer)
    metrics = {
        "pg_clipfrac_higher": _fraction(ratio > 1.0 + inputs.settings.clip_ratio_high, p.mask),
        "pg_clipfrac_lower": _fraction(ratio < 1.0 - inputs.settings.clip_ratio_low, p.mask),
        "pg_clipfrac_dual": 0.0,
        **_base_metrics(p),
    }
    return loss, metrics


@register_policy_loss("sapo")
def sapo_loss(inputs: PolicyLossInputs) -> tuple[Tensor, dict[str, float]]:
    """SAPO: l = -A * 4/tau * sigmoid(tau (r - 1)), a soft gate instead of the clip. arXiv:2511.20347.

    r = exp(logprobs - old_logprobs) per token; tau = tau_positive where A >= 0, tau_negative where
    A < 0. d l / d logprob = -A * w * r with w = 4 s (1 - s), s = sigmoid(tau (r - 1)): w = 1 at
    r = 1 (the 4/tau makes the on-policy gradient the plain policy gradient -A for every tau) and
    falls smoothly towards 0 as r leaves 1, faster for a larger tau. Shapes: (B, T) in, 0-d loss out.
    Metric ``sapo_grad_scale``: token mean of w, the soft counterpart of 1 - clip fraction.
    """
    p = _prepare(inputs)
    ratio = torch.exp(p.log_ratio)
    tau = torch.where(p.advantages >= 0, inputs.settings.tau_positive, inputs.settings.tau_negative).to(ratio.dtype)  # (B, T)
    gate_sigmoid = torch.sigmoid(tau * (ratio - 1.0))
    token_losses = -p.advantages * (4.0 / tau) * gate_sigmoid
    loss = aggregate_loss(weighted(token_losses, inputs), p.mask, inputs.settings.loss_avg_mode, inputs.normalizer)
    grad_scale = 4.0 * gate_sigmoid.detach() * (1.0 - gate_sigmoid.detach())
    metrics = {"sapo_grad_scale": masked_mean(grad_scale, p.mask).item(), **_base_metrics(p)}
    return loss, metrics


@register_policy_loss("geo_mean")
def gmpo_loss(inputs: PolicyLossInputs) -> tuple[Tensor, dict[str, float]]:
    """GMPO: the geometric mean of the token ratios per sequence, clipped in log space. Zhao et al.,
    "Geometric-Mean Policy Optimization", arXiv:2507.20673, eqn. 4 (verl's loss mode ``geo_mean``).

    Per token, in log space: d_t = log r_t, and with s = sign(A_t) the pessimistic choice
    d'_t = s * min(s d_t, s clip(d_t, -eps_low, eps_high)). Per sequence i of length |o_i|:
    rho_i = exp(mean_t d'_t), Abar_i = mean_t A_t, loss_i = -Abar_i rho_i, carried by every token
    of i and aggregated as configured (``loss_avg_mode=seq`` is the paper's mean over sequences;
    ``token`` weighs a sequence by its length, as gspo does here). The gradient reaches token t
    through rho_i unless its log-ratio is clipped. Rollout-correction weights enter as their
    geometric mean over the sequence (as verl's); a token the gate turns off counts as ratio 1 (no
    gradient), and a sequence gated off entirely gets no gradient. Metrics: ``pg_clipfrac_higher`` / ``_lower``:
    tokens with A > 0 / A < 0 whose log-ratio lies outside the clip band (verl's count).
    """
    p = _prepare(inputs)
    sign = torch.sign(p.advantages)
    clipped = p.log_ratio.clamp(-inputs.settings.clip_ratio_low, inputs.settings.clip_ratio_high)
    log_ratio = sign * torch.minimum(sign * p.log_ratio, sign * clipped)
    if inputs.token_gate is not None:  # a gated-off token enters the product as ratio 1, with no gradient
        log_ratio = log_ratio * inputs.token_gate.to(log_ratio.dtype)
    lengths = p.mask.sum(dim=-1).clamp(min=1)
    seq_ratio = torch.exp(masked_sum(log_ratio, p.mask, dim=-1) / lengths)  # (B,)
    seq_loss = -(masked_sum(p.advantages, p.mask, dim=-1) / lengths) * seq_ratio
    if inputs.rollout_is_weights is not None:
        log_weights = torch.log(inputs.rollout_is_weights.detach().to(seq_loss.dtype).clamp(min=1e-10))
        seq_loss = seq_loss * torch.exp(masked_sum(log_weights, p.mask, dim=-1) / lengths)
    token_losses = seq_loss.unsqueeze(-1).expand(p.mask.shape)
    loss = aggregate_loss(token_losses, p.mask, inputs.settings.loss_avg_mode, inputs.normalizer)
    return loss, _clip_metrics(p.log_ratio != clipped, p)


@register_policy_loss("gpg")
def gpg_loss(inputs: PolicyLossInputs) -> tuple[Tensor, dict[str, float]]:
    """GPG: the plain policy gradient, l = -A * logprobs, no ratio and no clip. Chu et al., "GPG: A
    Simple and Strong Reinforcement Learning Baseline for Model Reasoning", arXiv:2504.02546, its
    objective without surrogate (verl's loss mode ``gpg``). Pair it with ``algorithm.adv_estimator=gpg`` for the paper's
    advantage (its valid-sample correction alpha lives there). The gradient is -A grad log pi at
    every token whatever ``old_logprobs`` are, so with ppo_epochs > 1 or several mini-batches the
    later updates are not corrected for being off-policy (as in verl and the paper's code).
    """
    p = _prepare(inputs)
    token_losses = -p.advantages * p.logprobs
    loss = aggregate_loss(weighted(token_losses, inputs), p.mask, inputs.settings.loss_avg_mode, inputs.normalizer)
    return loss, _base_metrics(p)


# ----------------------------------------------------------------------------- Clip-Cov and KL-Cov


def token_covariance(advantages: Tensor, logprobs: Tensor, mask: Tensor) -> Tensor:
    """(B, T) Cov_t = (A_t - mean A) (log pi_t - mean log pi), means over valid tokens; detached,
    0 at masked positions."""
    advantages, logprobs = advantages.detach(), logprobs.detach()
    centred = (advantages - masked_mean(advantages, mask)) * (logprobs - masked_mean(logprobs, mask))
    return torch.where(mask, centred, torch.zeros_like(centred))


def _selected_count(ratio: float, mask: Tensor) -> int:
    """max(int(ratio * valid tokens), 1): verl's count (at least one token per micro-batch)."""
    return max(int(ratio * int(mask.sum().item())), 1)


@register_policy_loss("clip_cov")
def clip_cov_loss(inputs: PolicyLossInputs) -> tuple[Tensor, dict[str, float]]:
    """Clip-Cov, arXiv:2505.22617 sec. 5: PPO's clipped surrogate (clip-higher, no dual clip, as
    verl), and the gradient of k = max(int(clip_cov_ratio * N), 1) tokens drawn uniformly at random
    (torch's global generator) among the valid, not already clipped tokens with clip_cov_lb < Cov_t
    < clip_cov_ub is detached (their loss is multiplied by 0). N: the micro-batch's valid tokens.
    Metrics: ``pg_cov_frac`` (selected / N) and the PPO clip fractions.
    """
    p = _prepare(inputs)
    ratio = torch.exp(p.log_ratio)
    token_losses, clip_active = _clipped_surrogate(ratio, p.advantages, inputs)
    covariance = token_covariance(p.advantages, p.logprobs, p.mask)
    in_band = p.mask & ~clip_active & (covariance > inputs.settings.clip_cov_lb) & (covariance < inputs.settings.clip_cov_ub)
    candidates = torch.nonzero(in_band)  # (n, 2) row-major
    order = torch.randperm(len(candidates), device=candidates.device)
    chosen = candidates[order[: _selected_count(inputs.settings.clip_cov_ratio, p.mask)]]
    keep = torch.ones_like(token_losses)
    keep[chosen[:, 0], chosen[:, 1]] = 0.0
    loss = aggregate_loss(weighted(token_losses * keep, inputs), p.mask, inputs.settings.loss_avg_mode, inputs.normalizer)
    return loss, {"pg_cov_frac": _fraction(keep == 0, p.mask), **_clip_metrics(clip_active, p)}


@register_policy_loss("kl_cov")
def kl_cov_loss(inputs: PolicyLossInputs) -> tuple[Tensor, dict[str, float]]:
    """KL-Cov, arXiv:2505.22617 sec. 5: no clip; l_t = -A_t r_t, plus ppo_kl_coef * |log r_t| on the
    k = max(int(kl_cov_ratio * N), 1) valid tokens with the largest Cov_t (ties: torch.topk's order).
    N: the micro-batch's valid tokens. Metric ``pg_cov_frac``: k / N.
    """
    p = _prepare(inputs)
    ratio = torch.exp(p.log_ratio)
    token_losses = -p.advantages * ratio
    covariance = token_covariance(p.advantages, p.logprobs, p.mask)
    flat = torch.where(p.mask, covariance, torch.full_like(covariance, -torch.inf)).flatten()
    count = min(_selected_count(inputs.settings.kl_cov_ratio, p.mask), int(p.mask.sum().item()))
    selected = torch.zeros_like(p.mask).flatten()
    selected[torch.topk(flat, count).indices] = True
    selected = selected.view_as(p.mask)
    token_losses = token_losses + inputs.settings.ppo_kl_coef * p.log_ratio.abs() * selected
    loss = aggregate_loss(weighted(token_losses, inputs), p.mask, inputs.settings.loss_avg_mode, inputs.normalizer)
    return loss, {"pg_cov_frac": _fraction(selected, p.mask), **_base_metrics(p)}
