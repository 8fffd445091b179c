"""Token entropy of the policy, and the entropy bonus loss term.

H_t = -sum_v p(v) log p(v) with log p = log_softmax(logits) (stable for large logits). Entries with
p = 0 (e.g. -inf logits of masked vocabulary) contribute exactly 0, with a finite gradient, where
the textbook formula gives 0 * -inf = NaN.

Entropy regularisation as in PPO, arXiv:1707.06347 eqn. 9 (the ``c2 S[pi]`` term); its coefficient
fixed (``worker.actor.entropy_coeff``) or stepped by :class:`AdaptiveEntropyController`
(``worker.actor.use_adaptive_entropy``, Skywork-OR1), which the driver keeps.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from easyvlm.algorithms.aggregation import aggregate_loss


def entropy_from_logits(logits: Tensor) -> Tensor:
    """Entropy of softmax(logits) over the last dim. (B, T, V) -> (B, T), in float32 at least.

    Differentiable. Memory: one extra (B, T, V) float32 tensor; call it per micro-batch.
    """
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
    logp = torch.log_softmax(logits, dim=-1)
    # where p == 0, logp is -inf: replace it before the product (0 * -inf = NaN)
    safe_logp = torch.where(torch.isfinite(logp), logp, torch.zeros_like(logp))
    return -(logp.exp() * safe_logp).sum(-1)


def entropy_bonus_loss(
    entropy: Tensor,
    response_mask: Tensor,
    entropy_coeff: float,
    loss_avg_mode: str = "token",
    normalizer: float | None = None,
) -> Tensor:
    """The term to ADD to the actor loss: ``-entropy_coeff * aggregate(entropy)`` (0-d).

    entropy: (B, T) from :func:`entropy_from_logits` (with grad). response_mask: (B, T) bool.
    Same ``loss_avg_mode`` / ``normalizer`` as the policy loss. A positive coefficient rewards
    entropy (``worker.actor.entropy_coeff``).
    """
    return -entropy_coeff * aggregate_loss(entropy, response_mask, loss_avg_mode, normalizer)


class AdaptiveEntropyController:
    """Adaptive entropy coefficient. Skywork-OR1, arXiv:2505.22312, "Adaptive Entropy Control" of its
    MAGIC loss (sec. 3.2.5), in the form of TRL's ``use_adaptive_entropy`` (``GRPOTrainer``).

    After each update with measured token-mean entropy H (:meth:`update`)::

        c <- min(c + delta, c_max)   if H <= target
        c <- max(c - delta, c_min)   otherwise

    The next update's loss carries ``-bonus_coeff * entropy``, where ``bonus_coeff`` is c when the
    last measured H <= target and 0 otherwise (the bonus only acts while the entropy is below the
    target; the paper's ``c_k * 1[H_k <= tgt]``). As in TRL (``_last_world_entropy = inf`` at the
    start), the first update, before any measurement, gets 0: the initial ``value`` is the starting
    point of the steps, not a coefficient any update applies as such.

    value: c (``worker.actor.entropy_coeff`` at the start). last_entropy: the last H (inf before
    any). A non-finite H is taken as TRL takes it: NaN <= target is false, so c steps down and the
    next update gets no bonus.
    """

    def __init__(self, init_coeff: float, target: float, delta: float, coeff_min: float, coeff_max: float):
        if not (coeff_min <= init_coeff <= coeff_max) or delta <= 0 or target < 0:
            raise ValueError(
                "adaptive entropy needs entropy_coeff_min <= entropy_coeff <= entropy_coeff_max, "
                f"entropy_coeff_delta > 0 and entropy_target >= 0, got {coeff_min} <= {init_coeff} <= {coeff_max}, "
                f"{delta}, {target}"
            )
        self.value = float(init_coeff)
        self.target, self.delta = float(target), float(delta)
        self.coeff_min, self.coeff_max = float(coeff_min), float(coeff_max)
        self.last_entropy = math.inf

    @property
    def bonus_coeff(self) -> float:
        """The entropy coefficient the next update applies: c if the last H <= target, else 0."""
        return self.value if self.last_entropy <= self.target else 0.0

    def update(self, entropy: float) -> None:
        """Step c on the measured token-mean entropy H of the update that just ran."""
        entropy = float(entropy)
        if entropy <= self.target:
            self.value = min(self.value + self.delta, self.coeff_max)
        else:
            self.value = max(self.value - self.delta, self.coeff_min)
        self.last_entropy = entropy

    def state_dict(self) -> dict[str, float]:
        return {"value": self.value, "last_entropy": self.last_entropy}

    def load_state_dict(self, state: dict[str, float]) -> None:
        self.value = float(state["value"])
        self.last_entropy = float(state["last_entropy"])
