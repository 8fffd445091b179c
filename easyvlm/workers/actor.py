"""The actor: the policy model under FSDP2; old log-probs, PPO-style updates, weight sync, checkpoints.
Micro-batch loss: policy loss [+ kl_coef * KL loss] [- entropy_coeff * entropy]."""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any, Callable, Iterator, NamedTuple

import torch
import torch.distributed as dist
from torch import Tensor

from easyvlm.algorithms.aggregation import aggregate_loss, loss_normalizer
from easyvlm.algorithms.distill import distill_loss, distill_metrics, off_policy_weights
from easyvlm.algorithms.kl import kl_loss
from easyvlm.algorithms.masked import masked_mean
from easyvlm.algorithms.policy_losses import PolicyLossInputs, get_policy_loss
from easyvlm.algorithms.rollout_mismatch import rollout_mismatch
from easyvlm.algorithms.token_filters import high_entropy_gate, off_policy_sequence_gate
from easyvlm.data.batch import POLICY_UPDATE_KEYS, ROUTED_EXPERTS_KEY, Batch
from easyvlm.models.loading import is_vision_language_config
from easyvlm.models.moe_routing import routing_state
from easyvlm.models.ulysses import UlyssesGroup, loss_scale, new_ulysses_group
from easyvlm.models.specs import ModelBundle
from easyvlm.workers.specs import ActorSpec, PolicyLossSpec
from easyvlm.workers.dist import worker_device
from easyvlm.workers.forward import ForwardSetup, micro_batches, policy_logprobs_for_batch, policy_token_outputs
from easyvlm.workers.vision_dummy import dummy_image_for
from easyvlm.models.vision_cache import CachedTower
from easyvlm.workers.fsdp import gather_full_state_dict, iter_full_state_dict
from easyvlm.workers.routing import aux_loss, concat_routing, routing_metrics
from easyvlm.workers.sharded import build_sharded_model
from easyvlm.workers.training import check_worker_group, equalize_micro_batches, model_dtype, token_budget
from easyvlm.workers.update import MicroLoss, TrainedModel

logger = logging.getLogger(__name__)


def update_is_on_policy(optimizer_steps_per_step: int, kl_in_reward: bool) -> bool:
    """Whether a step may skip ``old_logprobs``: with one optimizer step per step the update's detached
    log-probs are the old ones (ratio 1, as in TRL's GRPOTrainer); not with the KL penalty in the reward."""
    return optimizer_steps_per_step == 1 and not kl_in_reward


class ActorWorker:
    """The policy model of one rank, built from the run plan's `ActorSpec` (``update.total_steps`` set)."""

    def __init__(
        self,
        spec: ActorSpec,
        *,
        rank: int,
        world_size: int,
        device: torch.device | None = None,
        ulysses: UlyssesGroup | None = None,
    ):
        check_worker_group(rank, world_size)
        keys = spec.forward.settings  # worker.actor.padding_free ... expert_parallel_size
        # sequence parallelism (worker.actor.ulysses_size > 1): a group made by the caller (shared
        # with the reference model) or made here; collective either way
        self.ulysses = ulysses if ulysses is not None else new_ulysses_group(keys.ulysses_size)
        self.spec = spec
        self.rank, self.world_size = rank, world_size
        self.device = device or worker_device()
        torch.manual_seed(spec.seed)  # new weights (LoRA) come out equal on every rank
        dtype = model_dtype(spec.fsdp, self.device, torch.float32)
        self.model = build_sharded_model(
            spec.model, spec.fsdp, role="policy", dtype=dtype, padding_free=keys.padding_free,
            trainable=True, device=self.device, rank=rank, key="worker.actor.fsdp",
            shard_vision_blocks=not spec.forward.vision_cache_mb, expert_parallel_size=keys.expert_parallel_size,
        )
        # a frozen tower's outputs, once per image (worker.actor.vision_cache_mb; models/vision_cache.py)
        self.vision = CachedTower(self.model, spec.forward.vision_cache_mb, self.device) if spec.forward.vision_cache_mb else None
        self.hf_config = spec.model.hf_config
        # MoE models: the routers' shared state (router replay, load-balancing loss; workers/routing.py)
        self.routing = routing_state(self.model)
        self.setup = ForwardSetup.of(spec.forward, self.device, dummy_image_for(self.hf_config), self.ulysses,
                                     routing=self.routing, keep_router_logits=spec.router_aux_loss_coef > 0,
                                     vision_cache=self.vision.cache if self.vision else None)
        # FSDP averages gradients over ranks: this factor makes them the global sum (models/ulysses.py)
        scale = loss_scale(world_size, keys.ulysses_size)
        self.trained = TrainedModel(self.model, spec.update, spec.offload, self.device, "actor", grad_scale=scale,
                                    loss_avg_mode=spec.policy_loss.settings.loss_avg_mode)
        # the full KL (algorithm.kl_penalty=full) needs the reference's whole distribution on each
        # micro-batch: the hybrid worker, which holds the reference model too, sets this
        self.reference_distribution: Callable[[Batch], Tensor] | None = None
        # likewise the teacher's, for on-policy distillation's full KL (algorithm.distill_full_kl)
        self.teacher_distribution: Callable[[Batch], Tensor] | None = None

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        return self.trained.optimizer

    # ------------------------------------------------------------------ experience
    def compute_logprobs(self, batch: Batch, with_entropy: bool = False) -> Batch:
        """A new Batch of ``old_logprobs`` (B, T) of ``responses`` under the current policy (+ ``entropies``)."""
        batch.require("input_ids", "attention_mask", "position_ids", "responses")
        self.trained.ensure_loaded()
        micro = self.spec.forward.experience
        # R2: this pass records the experts each token went to, for the update to replay
        routed: list[Tensor] = []
        record = self.routing is not None and self.spec.forward.router_replay == "R2"

        def keep_routing(micro_batch: Batch) -> None:
            routed.append(self.routing.batch_routing[: len(micro_batch)].cpu())  # the vision dummy's row last

        logprobs, entropies = policy_logprobs_for_batch(
            self.model, batch, self.setup, micro_batch_size=micro.micro_batch_size, budget=token_budget(micro, batch),
            with_entropy=with_entropy, after_micro=keep_routing if record else None,
        )
        tensors = {"old_logprobs": logprobs}
        if entropies is not None:
            tensors["entropies"] = entropies
        if record:
            tensors[ROUTED_EXPERTS_KEY] = concat_routing(routed, batch["input_ids"].shape[1])
        return Batch(tensors)

    @torch.no_grad()
    def full_kl(self, batch: Batch, reference_distribution: Callable[[Batch], Tensor]) -> Tensor:
        """(B, T) KL(pi || pi_ref) over the vocabulary at each response token, under the current weights
        (``algorithm.kl_penalty=full`` in the reward)."""
        self.trained.ensure_loaded()
        self.model.eval()
        micro = self.spec.forward.experience
        values = []
        for chunk, is_dummy in equalize_micro_batches(micro_batches(batch, micro.micro_batch_size, token_budget(micro, batch)), self.device):
            out = policy_token_outputs(
                self.model, chunk, self.setup, with_entropy=False, full_kl_to={"kl_full": reference_distribution(chunk)}
            )
            if not is_dummy:  # a dummy pass only keeps FSDP's collectives in step
                values.append(out["kl_full"].cpu())
        return torch.cat(values)

    # ------------------------------------------------------------------ update
    def update_policy(self, batch: Batch, entropy_coeff: float | None = None) -> dict[str, float]:
        """One training step over this rank's samples; returns metrics, the same on every rank
        (docs/workers.md, "The update"). batch needs ``response_mask``, ``advantages``, ``old_logprobs``
        (unless :func:`update_is_on_policy`) and, with the KL loss, ``ref_logprobs``. entropy_coeff: the
        adaptive controller's (None: the spec's)."""
        kl, distill = self.spec.kl_loss, self.spec.distill
        batch.require(*POLICY_UPDATE_KEYS, *(("ref_logprobs",) if kl is not None and kl.kl_penalty != "full" else ()),
                      *(("teacher_logprobs",) if distill is not None else ()))
        assert kl is None or kl.kl_penalty != "full" or self.reference_distribution is not None, "full KL: no reference"
        assert distill is None or not distill.distill_full_kl or self.teacher_distribution is not None, "no teacher"

        update = self.spec.update
        # an on-policy step has one mini-batch (per rank: this rank's whole share) and one epoch
        assert "old_logprobs" in batch or (update.settings.ppo_epochs == 1 and len(batch) <= update.mini_batch_per_rank), (
            "update_policy without old_logprobs is only valid for an on-policy update (update_is_on_policy)"
        )
        if entropy_coeff is None:
            metrics = self.trained.update(batch, self._micro_loss)
        else:
            metrics = self.trained.update(batch, lambda micro, n: self._micro_loss(micro, n, entropy_coeff=float(entropy_coeff)))
        # distillation's measurements are the run's, not the actor's (distill/reverse_kl, as when the
        # driver computes them for distill_as_reward)
        return {key.replace("actor/distill/", "distill/", 1): value for key, value in metrics.items()}

    def _micro_loss(self, micro: Batch, normalizer: float, entropy_coeff: float | None = None) -> MicroLoss:
        spec = self.spec
        mode = spec.policy_loss.settings.loss_avg_mode
        mask = micro["response_mask"].to(self.device).bool()
        full_kl = spec.kl_loss is not None and spec.kl_loss.kl_penalty == "full"
        distill_full_kl = spec.distill is not None and spec.distill.distill_full_kl
        outputs = policy_token_outputs(
            self.model, micro, self.setup, with_entropy=True,
            full_kl_to={**({"kl_full": self.reference_distribution(micro)} if full_kl else {}),
                        **({"distill_kl_full": self.teacher_distribution(micro)} if distill_full_kl else {})},
        )
        logprobs, entropy = outputs["logprobs"], outputs["entropies"]
        # on-policy without old_logprobs: this pass runs with the sampling weights (see update_policy)
        old_logprobs = micro["old_logprobs"].to(self.device) if "old_logprobs" in micro else logprobs.detach()
        advantages = micro["advantages"].to(self.device)
        # the rollout correction's weights (algorithm.rollout_correction.rollout_is), made in the driver
        weights = micro["rollout_is_weights"].to(self.device) if "rollout_is_weights" in micro else None
        # the sampler's log-probs where the rollout kept them (they see its numerical mismatch too)
        sampler_logprobs = micro["rollout_logprobs"].to(self.device) if "rollout_logprobs" in micro else old_logprobs
        gate = token_gate(spec.policy_loss, entropy, logprobs, sampler_logprobs, advantages, mask)
        tensors = PolicyLossTensors(logprobs, old_logprobs, advantages, mask, weights, gate)
        if spec.policy_gradient:
            pg_loss, pg_metrics = policy_loss(spec.policy_loss, tensors, normalizer)
            loss, sums = pg_loss, {"pg_loss": pg_loss.item()}
        else:  # pure distillation as a loss: no policy term (algorithm.distill_only)
            loss, sums, pg_metrics = logprobs.new_zeros(()), {}, {}
        coeff = spec.entropy.entropy_coeff if entropy_coeff is None else entropy_coeff  # the driver's, when adaptive
        entropy_loss = aggregate_loss(entropy if coeff else entropy.detach(), mask, mode, normalizer)
        if coeff:
            loss = loss - coeff * entropy_loss
        sums["entropy_loss"] = entropy_loss.item()
        distill_means = {}
        if spec.distill is not None:
            distill, distill_means = self._distill_loss(micro, outputs, mask, normalizer, old_logprobs, weights)
            loss = loss + spec.distill.distill_coef * distill
            sums["distill_loss"] = distill.item()
        if spec.kl_loss is not None:
            if full_kl:  # KL(pi || pi_ref) over the vocabulary, per token
                kl = aggregate_loss(outputs["kl_full"], mask, mode, normalizer)
            else:
                kl = kl_loss(logprobs, micro["ref_logprobs"].to(self.device), mask, spec.kl_loss.kl_penalty, mode, normalizer,
                             old_logprobs=old_logprobs if spec.kl_loss.use_bias_correction_kl else None)
            loss = loss + spec.kl_loss.kl_coef * kl
            sums["kl_loss"] = kl.item()
        # the exact entropy above replaces the loss's one-sample estimate
        means = {k: float(v) for k, v in pg_metrics.items() if k != "entropy_loss"}
        means.update(distill_means)
        if entropy_coeff is not None:  # the adaptive controller's measurement: token-mean entropy
            means["entropy"] = float(masked_mean(entropy.detach(), mask))
        if gate is not None:  # the share of valid tokens that carry the policy gradient
            means["pg_token_frac"] = float(gate.sum()) / max(float(mask.sum()), 1.0)
        if "rollout_logprobs" in micro:  # the sampler against the policy it sampled from (old_logprobs)
            mismatch = rollout_mismatch(old_logprobs, micro["rollout_logprobs"].to(self.device), mask)
            means.update({f"rollout_mismatch/{k}": v for k, v in mismatch.items()})
        if self.routing is not None and self.ulysses is None:  # MoE: expert load, the load-balancing loss
            means.update(routing_metrics(self.routing))
            if spec.router_aux_loss_coef > 0:
                aux = aux_loss(self.routing)
                # weighted by the micro-batch's share of the mini-batch: the sum over micro-batches is a mean
                share = loss_normalizer(mask, mode, spec.update.norm_length) / normalizer
                loss = loss + spec.router_aux_loss_coef * aux * share
                means["moe/aux_loss"] = float(aux.detach())
        return MicroLoss(loss=loss, tokens=float(mask.sum()), sums=sums, token_means=means)

    def _distill_loss(self, micro: Batch, outputs: dict[str, Tensor], mask: Tensor, normalizer: float,
                      old_logprobs: Tensor, rollout_is_weights: Tensor | None) -> tuple[Tensor, dict[str, float]]:
        """On-policy distillation's unscaled micro-batch loss (``easyvlm.algorithms.distill``) and metrics."""
        mode = self.spec.policy_loss.settings.loss_avg_mode
        teacher = micro["teacher_logprobs"].to(self.device)
        if self.spec.distill.distill_full_kl:
            per_token = outputs["distill_kl_full"]
            loss = aggregate_loss(per_token, mask, mode, normalizer)
        else:
            per_token = outputs["logprobs"] - teacher  # the one-sample estimate, for the metric
            # the tokens came from pi_old (exactly 1 on-policy, where old_logprobs is this pass's own);
            # the rollout correction's weights, where made, carry pi_old on to the sampler, as for the
            # policy loss
            weights = off_policy_weights(outputs["logprobs"], old_logprobs, self.spec.distill_weight_cap)
            if rollout_is_weights is not None:
                weights = weights * rollout_is_weights
            loss = distill_loss(outputs["logprobs"], teacher, mask, mode, normalizer, weights=weights)
        return loss, {f"distill/{k}": v for k, v in distill_metrics(per_token, teacher, mask).items()}

    # ------------------------------------------------------------------ weights
    def state_dict_for_sync(self) -> dict[str, Tensor]:
        """Full weights, in-memory transformers names (LoRA merged), on the CPU, on every rank. Collective."""
        self.trained.ensure_loaded()
        return gather_full_state_dict(self.model)

    def iter_weights_for_sync(self, device: torch.device | str) -> Iterator[tuple[str, Tensor]]:
        """:meth:`state_dict_for_sync` a tensor at a time on ``device``. Collective: consume it whole."""
        self.trained.ensure_loaded()
        return iter_full_state_dict(self.model, device)

    def save_checkpoint(self, path: str | os.PathLike) -> None:
        """Model + optimizer (sharded, torch.distributed.checkpoint), scheduler and RNG per rank. Collective."""
        self.trained.save(path, self.rank)

    def load_checkpoint(self, path: str | os.PathLike) -> None:
        """Restore what :meth:`save_checkpoint` wrote (same world size). Collective."""
        self.trained.load(path, self.rank)

    def export_hf(self, path: str | os.PathLike) -> None:
        """Write a model directory that transformers and vLLM load. Collective; rank 0 writes."""
        self.trained.ensure_loaded()
        state = gather_full_state_dict(self.model)
        if self.rank == 0:
            export_hf_model(state, self.hf_config, self.spec.files, path)
        dist.barrier()

    def offload(self) -> None:
        """Free the GPU between phases as ``worker.actor.offload`` asks (no-op on the CPU)."""
        self.trained.offload()
        if self.vision is not None and self.spec.offload.offload_params:
            self.vision.cache.clear()  # the encoded images leave the device with the weights


def export_hf_model(state: dict[str, Tensor], hf_config: Any, files: ModelBundle, path: str | os.PathLike) -> None:
    """Save ``state`` (full, in-memory names) as a transformers model with the policy's tokenizer files."""
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    auto_cls = AutoModelForImageTextToText if is_vision_language_config(hf_config) else AutoModelForCausalLM
    dtype = next(iter(state.values())).dtype
    with torch.device("meta"):
        model = auto_cls.from_config(hf_config, dtype=dtype)
    missing, unexpected = model.load_state_dict(state, strict=False, assign=True)
    tied = set(getattr(model, "_tied_weights_keys", None) or [])
    missing = [k for k in missing if k not in tied]
    if missing or unexpected:
        raise RuntimeError(f"export_hf: state dict does not fit {type(model).__name__}: missing {missing[:5]}, "
                           f"unexpected {unexpected[:5]}")
    if tied:
        model.tie_weights()
    if files.generation_config is not None:  # the source's EOS ids and sampling defaults, which vLLM reads
        model.generation_config = files.generation_config
    path = Path(path)
    model.save_pretrained(path)
    from easyvlm.models.checkpoint_layout import rewrite_in_checkpoint_layout

    rewrite_in_checkpoint_layout(hf_config, path)  # save_pretrained writes Qwen3-VL-MoE's experts as held in memory
    files.tokenizer.save_pretrained(path)
    if files.processor is not None:
        files.processor.save_pretrained(path)


class PolicyLossTensors(NamedTuple):
    """The micro-batch's tensors a policy loss reads."""

    logprobs: Tensor
    old_logprobs: Tensor
    advantages: Tensor
    response_mask: Tensor
    rollout_is_weights: Tensor | None
    token_gate: Tensor | None = None


def token_gate(
    spec: PolicyLossSpec, entropies: Tensor, logprobs: Tensor, sampler_logprobs: Tensor, advantages: Tensor, mask: Tensor
) -> Tensor | None:
    """(B, T) bool: the tokens that carry the policy gradient under ``top_entropy_quantile`` and
    ``off_policy_mask_threshold``; None when both are off."""
    gate, settings = None, spec.settings
    if settings.top_entropy_quantile < 1.0:
        gate = high_entropy_gate(entropies.detach(), mask, settings.top_entropy_quantile)
    if settings.off_policy_mask_threshold is not None:
        kept = off_policy_sequence_gate(advantages, logprobs, sampler_logprobs, mask, settings.off_policy_mask_threshold)
        gate = kept if gate is None else gate & kept
    return gate


def policy_loss(spec: PolicyLossSpec, tensors: PolicyLossTensors, normalizer: float) -> tuple[Tensor, dict[str, float]]:
    """The configured policy loss (registered, or a ``file.py:func`` plug-in) over one micro-batch."""
    inputs = PolicyLossInputs(**tensors._asdict(), settings=spec.settings, normalizer=normalizer)
    return get_policy_loss(spec.settings.loss_type, spec.source)(inputs)
