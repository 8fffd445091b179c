"""KL divergence to the reference policy: per-token estimators, controllers, reward penalty, loss.

Estimators (``algorithm.kl_penalty``), with d = logprobs - ref_logprobs (log pi - log pi_ref),
tokens sampled from pi; see J. Schulman, "Approximating KL divergence" (2020),
http://joschu.net/blog/kl-approx.html:

    kl          k1 = d                              unbiased, can be negative
    abs         |d|
    mse         k2 = d^2 / 2                        low variance, biased
    low_var_kl  k3 = exp(-d) + d - 1 >= 0           unbiased, low variance; clamped (below)
    full        sum_v pi(v) (log pi(v) - log pi_ref(v))   exact, from full (B, T, V) log-distributions

Three ways to use it (EasyR1's config): ``disable_kl=True`` (no reference model: nothing here is
called); KL in the reward (``use_kl_loss=False``): :func:`apply_kl_penalty` with a coefficient from
a :class:`FixedKLController` or :class:`AdaptiveKLController`; KL as a loss term
(``use_kl_loss=True``): :func:`kl_loss`, aggregated like the policy loss, added as
``kl_coef * kl_loss``.

Departures: low_var_kl clamps the log-ratio to [-20, 20] and the result to at most 10 (as
EasyR1/verl do, to survive a few wildly off-policy tokens). The adaptive controller uses the
horizon form of Ziegler et al.'s update (see :class:`AdaptiveKLController`).
For a KL *loss*, prefer low_var_kl: the gradient of k1 is zero in expectation.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import Tensor

from easyvlm.algorithms.aggregation import aggregate_loss
from easyvlm.algorithms.masked import check_mask, masked_mean, zero_masked

KLEstimator = Callable[[Tensor, Tensor], Tensor]
_KL_ESTIMATORS: dict[str, KLEstimator] = {}


def _register(name: str) -> Callable[[KLEstimator], KLEstimator]:
    def decorator(fn: KLEstimator) -> KLEstimator:
        _KL_ESTIMATORS[name] = fn
        return fn

    return decorator


def kl_names() -> tuple[str, ...]:
    """Valid values of ``algorithm.kl_penalty``."""
    return tuple(_KL_ESTIMATORS)


@_register("kl")
def kl_k1(logprobs: Tensor, ref_logprobs: Tensor) -> Tensor:
    """k1 = log pi - log pi_ref. (B, T) -> (B, T)."""
    return logprobs - ref_logprobs


@_register("abs")
def kl_abs(logprobs: Tensor, ref_logprobs: Tensor) -> Tensor:
    """|log pi - log pi_ref|. (B, T) -> (B, T)."""
    return (logprobs - ref_logprobs).abs()


@_register("mse")
def kl_k2(logprobs: Tensor, ref_logprobs: Tensor) -> Tensor:
    """k2 = (log pi - log pi_ref)^2 / 2. (B, T) -> (B, T)."""
    return 0.5 * (logprobs - ref_logprobs).square()


@_register("low_var_kl")
def kl_k3(logprobs: Tensor, ref_logprobs: Tensor) -> Tensor:
    """k3 = exp(x) - x - 1 with x = log pi_ref - log pi clamped to [-20, 20]; result clamped to <= 10."""
    log_ratio = (ref_logprobs - logprobs).clamp(-20.0, 20.0)
    return (torch.exp(log_ratio) - log_ratio - 1.0).clamp(min=-10.0, max=10.0)


@_register("full")
def kl_full(logprobs: Tensor, ref_logprobs: Tensor) -> Tensor:
    """KL(pi || pi_ref) = sum_v pi(v) (log pi(v) - log pi_ref(v)). (B, T, V) log-distributions -> (B, T).

    Entries with pi(v) = 0 contribute 0 (so -inf log-probs of masked vocabulary are fine).
    """
    if logprobs.dim() != 3 or logprobs.shape != ref_logprobs.shape:
        raise ValueError(
            "kl_penalty 'full' needs full log-distributions of shape (B, T, V) for both models, got "
            f"{tuple(logprobs.shape)} and {tuple(ref_logprobs.shape)}"
        )
    probs = torch.exp(logprobs)
    # where() before the product: -inf - -inf = nan at removed ids must not reach the gradient
    # (a where() after it would still send 0 * nan = nan back through the product)
    difference = torch.where(probs > 0, logprobs - ref_logprobs, torch.zeros_like(probs))
    return (probs * difference).sum(-1)


def kl_full_shared_rows(logprobs: Tensor, other_logprobs: Tensor) -> Tensor:
    """:func:`kl_full` of two (B, T, V) / (B, T, V') log-distributions over their first min(V, V')
    ids: models of one tokenizer whose output layers are padded past it to different sizes
    (Qwen2.5-VL-7B has 152,064 rows and 3B 151,936 for the same 151,665 tokens; on-policy
    distillation's teacher, ``algorithm.distill_full_kl``). Of equal widths: ``kl_full`` itself.

    The rows past the tokenizer hold no token, and sampling blocks them (-inf, rollout/tokens.py
    ``blocked_token_ids``), so each side has all its mass on the shared rows and this is the KL of
    the two distributions. Each side is renormalised over the shared rows all the same (a no-op,
    up to rounding, where the rows cut are blocked), so that mass left on a cut row cannot make the
    result something other than a KL between two distributions."""
    if logprobs.shape[-1] == other_logprobs.shape[-1]:
        return kl_full(logprobs, other_logprobs)
    shared = min(logprobs.shape[-1], other_logprobs.shape[-1])
    return kl_full(torch.log_softmax(logprobs[..., :shared], dim=-1), torch.log_softmax(other_logprobs[..., :shared], dim=-1))


def kl_penalty(logprobs: Tensor, ref_logprobs: Tensor, kind: str) -> Tensor:
    """Per-token KL estimate of the given kind (see module doc). (B, T) [or (B, T, V) for full] -> (B, T).

    Computed in float32 at least. Values at padding positions are meaningless: mask them.
    """
    if kind not in _KL_ESTIMATORS:
        raise ValueError(f"unknown kl_penalty {kind!r} (algorithm.kl_penalty); valid: {list(_KL_ESTIMATORS)}")
    if kind != "full" and logprobs.shape != ref_logprobs.shape:
        raise ValueError(f"logprobs {tuple(logprobs.shape)} and ref_logprobs {tuple(ref_logprobs.shape)} differ")
    dtype = torch.promote_types(logprobs.dtype, torch.float32)
    return _KL_ESTIMATORS[kind](logprobs.to(dtype), ref_logprobs.to(dtype))


class FixedKLController:
    """A constant KL coefficient (``algorithm.kl_type: fixed``)."""

    def __init__(self, kl_coef: float):
        self.value = float(kl_coef)

    def update(self, current_kl: float, n_steps: int) -> None:
        """No-op (same signature as the adaptive controller)."""

    def state_dict(self) -> dict[str, float]:
        return {"value": self.value}

    def load_state_dict(self, state: dict[str, float]) -> None:
        self.value = float(state["value"])


class AdaptiveKLController:
    """Adaptive KL coefficient. Ziegler et al., arXiv:1909.08593, sec. 2.2.

    After each step: e = clip(current_kl / target - 1, -0.2, 0.2), value *= 1 + e * n_steps / horizon.
    The paper writes beta *= 1 + K_beta * e per step; the horizon form (as in TRL/verl) makes the
    adaptation speed per sample: K_beta = n_steps / horizon, n_steps = samples in the batch.
    """

    def __init__(self, init_kl_coef: float, target: float, horizon: float):
        if target <= 0 or horizon <= 0:
            raise ValueError(
                f"adaptive KL needs algorithm.kl_target > 0 and algorithm.kl_horizon > 0, got {target} and {horizon}"
            )
        self.value = float(init_kl_coef)
        self.target = float(target)
        self.horizon = float(horizon)

    def update(self, current_kl: float, n_steps: int) -> None:
        proportional_error = min(max(current_kl / self.target - 1.0, -0.2), 0.2)
        self.value *= 1.0 + proportional_error * n_steps / self.horizon

    def state_dict(self) -> dict[str, float]:
        return {"value": self.value}

    def load_state_dict(self, state: dict[str, float]) -> None:
        self.value = float(state["value"])


def build_kl_controller(
    kl_type: str, kl_coef: float, kl_target: float = 0.1, kl_horizon: float = 10000.0
) -> FixedKLController | AdaptiveKLController:
    """The controller for ``algorithm.kl_type`` ("fixed" | "adaptive")."""
    if kl_type == "fixed":
        return FixedKLController(kl_coef)
    if kl_type == "adaptive":
        return AdaptiveKLController(kl_coef, kl_target, kl_horizon)
    raise ValueError(f"unknown kl_type {kl_type!r} (algorithm.kl_type); valid: ['fixed', 'adaptive']")


def apply_kl_penalty(
    token_rewards: Tensor, kl: Tensor, kl_coef: float, response_mask: Tensor
) -> tuple[Tensor, dict[str, float]]:
    """KL in the reward: r'_t = r_t - kl_coef * kl_t at valid tokens (masked positions: 0).

    token_rewards, kl: (B, T) float (kl from :func:`kl_penalty` with old and ref log-probs).
    response_mask: (B, T) bool. Returns the new (B, T) rewards and metrics ``kl`` (mean over
    sequences of the per-sequence mean KL, EasyR1's ``critic/kl``; feed it to the controller's
    ``update(kl, n_steps=B)``) and ``kl_coef``.
    """
    check_mask(response_mask, token_rewards)
    kl = zero_masked(kl, response_mask)
    new_rewards = zero_masked(token_rewards - kl_coef * kl, response_mask)
    seq_kl = masked_mean(kl, response_mask, dim=-1)  # (B,)
    has_tokens = response_mask.any(dim=-1)
    current_kl = masked_mean(seq_kl, has_tokens).item()
    return new_rewards, {"kl": current_kl, "kl_coef": float(kl_coef)}


def kl_loss(
    logprobs: Tensor,
    ref_logprobs: Tensor,
    response_mask: Tensor,
    kind: str = "low_var_kl",
    loss_avg_mode: str = "token",
    normalizer: float | None = None,
    old_logprobs: Tensor | None = None,
) -> Tensor:
    """KL as a loss term: ``aggregate_loss(kl_penalty(logprobs, ref_logprobs, kind))`` (0-d, with grad).

    logprobs (with grad), ref_logprobs: (B, T) [(B, T, V) for "full"]. response_mask: (B, T) bool.
    Use the same ``loss_avg_mode`` and ``normalizer`` as the policy loss; the actor adds
    ``kl_coef * kl_loss(...)`` and logs the unscaled value as ``actor/kl_loss``.

    old_logprobs (B, T), given: the importance-weighted estimator of DeepSeek-V3.2
    (arXiv:2512.02556; TRL's ``use_bias_correction_kl``): each token's estimate is
    multiplied by r_t = pi_theta / pi_old = exp(logprobs - old_logprobs) (log-ratio clamped to
    [-20, 20]), with the gradient flowing through r_t too. The tokens were sampled from pi_old, so
    E_old[r_t k(t)] = E_theta[k(t)]: k3 becomes an unbiased estimate of KL(pi_theta || pi_ref) and its
    gradient the KL's gradient, also after the first update of a step. Not for "full" (exact).
    """
    mask_like = logprobs if kind != "full" else logprobs[..., 0]
    check_mask(response_mask, mask_like)
    # padding may hold garbage (even NaN); keep it out of the values and the gradient
    token_mask = response_mask if kind != "full" else response_mask.unsqueeze(-1)
    logprobs = zero_masked(logprobs, token_mask)
    ref_logprobs = zero_masked(ref_logprobs, token_mask)
    kl = kl_penalty(logprobs, ref_logprobs, kind)
    if old_logprobs is not None:
        if kind == "full":
            raise ValueError("the importance-weighted KL (algorithm.use_bias_correction_kl) needs a sampled estimator, "
                             "not kl_penalty 'full'")
        log_ratio = (logprobs - zero_masked(old_logprobs, token_mask)).clamp(-20.0, 20.0)
        kl = kl * torch.exp(log_ratio.to(kl.dtype))
    return aggregate_loss(kl, response_mask, loss_avg_mode, normalizer)
