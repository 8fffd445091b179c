"""Policy losses ``PolicyLossInputs -> (loss, metrics)`` by name (``worker.actor.loss_type``): token losses weighted
(:func:`weighted`), aggregated by ``aggregate_loss``. Metrics are micro-batch token means: ``pg_clipfrac_*``,
``ppo_kl`` (old - new log-probs), ``entropy_loss`` (-logprobs). docs/algorithms.md, "Policy losses"."""

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
    """One micro-batch's tensors, all of response_mask's (B, T) shape (ValueError otherwise), and the settings."""

    logprobs: Tensor
    """log pi_theta(y_t), with grad."""
    old_logprobs: Tensor
    """Log-probs of the policy that sampled (or of the last update), no grad."""
    advantages: Tensor
    response_mask: Tensor
    """bool: True = the token counts in the loss."""
    settings: PolicyLossSettings = field(default_factory=PolicyLossSettings)
    """``settings.py``'s hyperparameters; ``inputs.clip_ratio_low`` reads ``inputs.settings.clip_ratio_low``."""
    normalizer: float | None = None
    """N of the whole mini-batch (``loss_normalizer``); None = this batch is the mini-batch."""
    rollout_is_weights: Tensor | None = None
    """Detached rollout-correction weight of each token's loss (verl); None = 1. Refused for plug-in losses."""
    token_gate: Tensor | None = None
    """bool: the tokens that keep their gradient (all stay in the normaliser); None = all. Refused for plug-ins."""

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
    return POLICY_LOSSES.names()


def get_policy_loss(name_or_spec: str, source: str | None = None) -> PolicyLossFn:
    """The loss for a registered name or a ``path/to/file.py:func`` plug-in (``source``: its text as the
    driver read it); a plug-in's return value is checked to be ``(0-d tensor, dict)``."""
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
    """The (B, T) token losses times the rollout-correction weights and the token gate, where given."""
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
    """PPO clip (arXiv:1707.06347 eqn. 7) with DAPO's clip-higher and dual clip (arXiv:1912.09729):
    l = max(-A r, -A clip(r, 1 - eps_low, 1 + eps_high)), and min(l, -A c) where A < 0."""
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
    return masked_sum(p.log_ratio, p.mask, dim=-1) / p.mask.sum(dim=-1).clamp(min=1)


def _gspo_from_log_ratio(log_s: Tensor, p: _Prepared, inputs: PolicyLossInputs) -> tuple[Tensor, dict[str, float]]:
    ratio = torch.exp(log_s)
    token_losses, clip_active = _clipped_surrogate(ratio, p.advantages, inputs)
    loss = aggregate_loss(weighted(token_losses, inputs), p.mask, inputs.settings.loss_avg_mode, inputs.normalizer)
    return loss, _clip_metrics(clip_active, p)


@register_policy_loss("gspo")
def gspo_loss(inputs: PolicyLossInputs) -> tuple[Tensor, dict[str, float]]:
    """GSPO (arXiv:2507.18071): PPO clip with s_i = exp(mean_t log r_t) on every token of sequence i; no dual clip."""
    p = _prepare(inputs)
    log_s = _seq_log_ratio(p).unsqueeze(-1).expand(p.mask.shape)  # (B, T)
    return _gspo_from_log_ratio(log_s, p, inputs)


@register_policy_loss("gspo_token")
def gspo_token_loss(inputs: PolicyLossInputs) -> tuple[Tensor, dict[str, float]]:
    """GSPO-token (arXiv:2507.18071): s_it = sg[s_i] pi(y_t) / sg[pi(y_t)], gspo's value with per-token gradients."""
    p = _prepare(inputs)
    log_s = p.logprobs - p.logprobs.detach() + _seq_log_ratio(p).detach().unsqueeze(-1)  # (B, T)
    return _gspo_from_log_ratio(log_s, p, inputs)


@register_policy_loss("cispo")
def cispo_loss(inputs: PolicyLossInputs) -> tuple[Tensor, dict[str, float]]:
    """CISPO (MiniMax-M1, arXiv:2506.13585): l = -sg[clip(r, 1 - eps_low, 1 + eps_high)] * A * logprobs."""
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
    """SAPO (arXiv:2511.20347, EasyR1's form): l = -A 4/tau sigmoid(tau (r - 1)), tau by the sign of A.
    Metric ``sapo_grad_scale``: token mean of the gradient's weight 4 s (1 - s), s the sigmoid."""
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
    """GMPO (arXiv:2507.20673 eqn. 4; verl's ``geo_mean``): -mean_t(A) times the geometric mean of the sequence's
    ratios, each log-ratio clipped pessimistically to [-eps_low, eps_high]; rollout weights as their geometric mean."""
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
    """GPG (arXiv:2504.02546; verl's ``gpg``): l = -A * logprobs, no ratio, no clip (so later epochs are not
    off-policy corrected). Pair it with ``algorithm.adv_estimator=gpg``."""
    p = _prepare(inputs)
    token_losses = -p.advantages * p.logprobs
    loss = aggregate_loss(weighted(token_losses, inputs), p.mask, inputs.settings.loss_avg_mode, inputs.normalizer)
    return loss, _base_metrics(p)


# ----------------------------------------------------------------------------- Clip-Cov and KL-Cov


def token_covariance(advantages: Tensor, logprobs: Tensor, mask: Tensor) -> Tensor:
    """(B, T) detached Cov_t = (A_t - mean A) (log pi_t - mean log pi), 0 at masked positions. The means are
    the micro-batch's, so clip_cov / kl_cov depend on how a mini-batch is cut (as verl)."""
    advantages, logprobs = advantages.detach(), logprobs.detach()
    centred = (advantages - masked_mean(advantages, mask)) * (logprobs - masked_mean(logprobs, mask))
    return torch.where(mask, centred, torch.zeros_like(centred))


def _selected_count(ratio: float, mask: Tensor) -> int:
    """verl's count: max(int(ratio * valid tokens), 1)."""
    return max(int(ratio * int(mask.sum().item())), 1)


@register_policy_loss("clip_cov")
def clip_cov_loss(inputs: PolicyLossInputs) -> tuple[Tensor, dict[str, float]]:
    """Clip-Cov (arXiv:2505.22617 sec. 5; verl's): PPO clip without dual clip; the gradient of ``_selected_count``
    random unclipped tokens with clip_cov_lb < Cov_t < clip_cov_ub is detached. Metric ``pg_cov_frac``."""
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
    """KL-Cov (arXiv:2505.22617 sec. 5; verl's): l = -A r, plus ppo_kl_coef * |log r| on the ``_selected_count``
    tokens with the largest Cov_t. Metric ``pg_cov_frac``."""
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
