"""The actor: the policy model under FSDP2; old log-probs, PPO-style updates, weight sync, checkpoints.

Update (``update_policy``), per ``ppo_epochs`` pass over the rank's samples, per mini-batch of
``global_batch_size * rollout_n / world_size`` samples per rank:

1. N = the loss normaliser of the whole mini-batch (``algorithms.aggregation.loss_normalizer`` on
   this rank's share, summed over ranks).
2. per micro-batch: loss = policy loss [+ kl_coef * KL loss] [- entropy_coeff * entropy], each
   aggregated with N; backward of ``loss * world_size`` (FSDP averages gradients over ranks; this
   makes the result the global sum), gradients accumulate over micro-batches.
3. clip the gradient norm; if any rank's loss or the global norm is not finite, skip the step
   (counted in ``actor/skipped_steps``); AdamW step.

The learning-rate scheduler advances once per ``update_policy`` call (one trainer step).

On-policy updates (``update_is_on_policy``: one PPO epoch, one mini-batch per step) may leave
``old_logprobs`` out of the batch: the policy that samples is then the policy of the update's only
forward pass, so the actor takes that pass's log-probs, detached, as the old ones (every ratio is 1
at the start, as in TRL's GRPOTrainer) and the trainer saves a forward pass over the whole batch.
"""

from __future__ import annotations

import logging
import os
from collections import defaultdict
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch
import torch.distributed as dist
from torch import Tensor

from easyvlm.algorithms.aggregation import aggregate_loss, loss_normalizer
from easyvlm.algorithms.kl import kl_loss
from easyvlm.algorithms.policy_losses import PolicyLossInputs, get_policy_loss
from easyvlm.data.batch import Batch
from easyvlm.models.loading import is_vision_language_config, load_model, load_tokenizer_and_processor, resolve_paths
from easyvlm.workers.dist import worker_device
from easyvlm.workers.forward import dummy_image_for, micro_batches, policy_logprobs, policy_logprobs_for_batch
from easyvlm.workers.fsdp import (
    apply_fsdp,
    gather_full_state_dict,
    load_model_to,
    load_optimizer_to,
    offload_model,
    offload_optimizer,
)
from easyvlm.workers.optim import build_optimizer, build_scheduler, step_scheduler
from easyvlm.workers.training import (
    all_reduce_sums,
    check_same_batch_size,
    check_supported,
    check_worker_group,
    clip_and_step,
    equalize_micro_batches,
    load_sharded_checkpoint,
    model_dtype,
    per_rank_batch_size,
    save_sharded_checkpoint,
    token_budget,
)

logger = logging.getLogger(__name__)

UPDATE_KEYS = ("input_ids", "attention_mask", "position_ids", "responses", "response_mask", "advantages")


def update_is_on_policy(optimizer_steps_per_step: int, kl_in_reward: bool) -> bool:
    """Whether a trainer step may skip computing ``old_logprobs`` (a forward pass over the batch).

    True when the actor takes one optimizer step per trainer step (``ppo_epochs == 1`` and one
    mini-batch: ``Derived.actor.optimizer_steps_per_step == 1``), so its only forward pass runs with
    the weights that sampled the batch, and nothing reads ``old_logprobs`` before the update (the KL
    penalty in the reward does: ``Derived.kl_in_reward``).
    """
    return optimizer_steps_per_step == 1 and not kl_in_reward


class ActorWorker:
    """The policy model of one rank.

    Args:
        config: ``ActorConfig`` (``worker.actor``).
        rank, world_size: of the default process group, already initialised by the caller.
        total_steps: training steps, for the learning-rate schedule.
        rollout_n: samples per prompt (``worker.rollout.n``); mini-batches are
            ``global_batch_size * rollout_n`` samples over all ranks.
        temperature: the rollout temperature; logits are divided by it before log_softmax.
        algorithm: ``AlgorithmConfig`` for the KL loss (``use_kl_loss``, ``kl_penalty``,
            ``kl_coef``, ``disable_kl``); None = no KL loss.
        max_response_length: ``data.max_response_length``, the constant of
            loss_avg_mode "seq-mean-token-sum-norm" (None = the batch's T).
        seed: seeds torch before the model is built, so new weights (LoRA) match on all ranks.
        device: default: the current CUDA device under nccl, else the CPU.
        loss_fn: overrides ``get_policy_loss(config.loss_type)`` (tests).
    """

    def __init__(
        self,
        config: Any,
        *,
        rank: int,
        world_size: int,
        total_steps: int,
        rollout_n: int = 1,
        temperature: float = 1.0,
        algorithm: Any = None,
        max_response_length: int | None = None,
        seed: int = 1,
        device: torch.device | None = None,
        loss_fn: Callable[[PolicyLossInputs], tuple[Tensor, dict[str, float]]] | None = None,
    ):
        check_worker_group(rank, world_size)
        check_supported(config, "worker.actor")
        self.config = config
        self.rank, self.world_size = rank, world_size
        self.device = device or worker_device()
        self.temperature = float(temperature)
        self.max_response_length = max_response_length
        self.mini_batch_size = per_rank_batch_size(
            config.global_batch_size, rollout_n, world_size, "worker.actor.global_batch_size"
        )
        self.loss_fn = loss_fn or get_policy_loss(config.loss_type)
        self.use_kl_loss = bool(algorithm is not None and algorithm.use_kl_loss and not algorithm.disable_kl)
        self.kl_coef = float(algorithm.kl_coef) if self.use_kl_loss else 0.0
        self.kl_penalty = algorithm.kl_penalty if self.use_kl_loss else None
        if self.kl_penalty == "full":
            raise ValueError(
                "algorithm.kl_penalty='full' needs full vocabulary distributions of the reference model, "
                "which the actor does not receive; use 'low_var_kl' (or 'kl', 'abs', 'mse') with use_kl_loss"
            )

        torch.manual_seed(seed)
        loaded = load_model(
            config.model,
            role="policy",
            dtype=model_dtype(config.fsdp, self.device, torch.float32),
            padding_free=config.padding_free,
        )
        self.hf_config = loaded.hf_config
        self.model = apply_fsdp(loaded.model, config.fsdp, self.device)
        self.dummy_image = dummy_image_for(self.hf_config)
        self.optimizer = build_optimizer(self.model.parameters(), config.optim)
        self.scheduler = build_scheduler(self.optimizer, config.optim, total_steps)
        self._offloaded = False

    def _forward_kwargs(self) -> dict[str, Any]:
        return dict(
            padding_free=self.config.padding_free, share_prompts=self.config.share_prompts,
            device=self.device, dummy_image=self.dummy_image,
        )

    # ------------------------------------------------------------------ experience
    def compute_logprobs(self, batch: Batch, with_entropy: bool = False) -> Batch:
        """``old_logprobs`` (B, T) of ``responses`` under the current policy (+ ``entropies`` (B, T)).

        batch: input_ids, attention_mask (B, P+T), position_ids, responses (B, T), optionally
        object ``multi_modal_inputs``. Returns a new Batch with only the computed keys.
        """
        batch.require("input_ids", "attention_mask", "position_ids", "responses")
        self._ensure_loaded()
        size = self.config.micro_batch_size_per_device_for_experience
        logprobs, entropies = policy_logprobs_for_batch(
            self.model, batch, micro_batch_size=size, budget=token_budget(self.config, size, batch),
            temperature=self.temperature, with_entropy=with_entropy, **self._forward_kwargs(),
        )
        tensors = {"old_logprobs": logprobs}
        if entropies is not None:
            tensors["entropies"] = entropies
        return Batch(tensors)

    # ------------------------------------------------------------------ update
    def update_policy(self, batch: Batch) -> dict[str, float]:
        """PPO epochs x mini-batches x micro-batches over this rank's samples; returns metrics.

        batch: the compute_logprobs inputs plus ``response_mask`` (B, T) bool, ``advantages`` (B, T),
        ``old_logprobs`` (B, T) (optional for an on-policy update: one PPO epoch, one mini-batch;
        then the detached log-probs of the update's forward pass) and, with the KL loss,
        ``ref_logprobs`` (B, T).
        Metrics (same value on every rank): actor/pg_loss, actor/kl_loss (KL loss on),
        actor/entropy_loss, actor/ppo_kl, actor/pg_clipfrac_higher, actor/pg_clipfrac_lower,
        actor/pg_clipfrac_dual, actor/grad_norm (mean over the steps taken), actor/lr,
        actor/skipped_steps.
        """
        batch.require(*UPDATE_KEYS, *(("ref_logprobs",) if self.use_kl_loss else ()))
        check_same_batch_size(len(batch), self.device, "ActorWorker.update_policy")
        if "old_logprobs" not in batch and (self.config.ppo_epochs > 1 or len(batch) > self.mini_batch_size):
            raise ValueError(
                f"ActorWorker.update_policy: the batch has no 'old_logprobs', which only an on-policy update "
                f"may leave out, but worker.actor.ppo_epochs={self.config.ppo_epochs} and this rank's "
                f"{len(batch)} samples make {-(-len(batch) // self.mini_batch_size)} mini-batches of "
                f"{self.mini_batch_size}; compute them first (ActorWorker.compute_logprobs)"
            )
        self._ensure_loaded()
        self.model.train()
        history: dict[str, list[float]] = defaultdict(list)
        skipped = 0
        for _ in range(self.config.ppo_epochs):
            for mini in batch.split(self.mini_batch_size):
                stats, grad_norm, stepped = self._train_mini_batch(mini)
                for key, value in stats.items():
                    history[key].append(value)
                if stepped:
                    history["actor/grad_norm"].append(grad_norm)
                else:
                    skipped += 1
                    logger.warning("actor: skipped an optimizer step (non-finite loss or grad norm %s)", grad_norm)
        metrics = {key: float(np.mean(values)) for key, values in history.items()}
        metrics.setdefault("actor/grad_norm", float("nan"))
        metrics["actor/lr"] = float(self.scheduler.get_last_lr()[0])
        metrics["actor/skipped_steps"] = float(skipped)
        step_scheduler(self.scheduler)
        return metrics

    def _train_mini_batch(self, mini: Batch) -> tuple[dict[str, float], float, bool]:
        cfg = self.config
        mode = cfg.loss_avg_mode
        local_n = loss_normalizer(mini["response_mask"].bool(), mode, self.max_response_length)
        normalizer = all_reduce_sums({"n": local_n}, self.device)["n"]
        size = cfg.micro_batch_size_per_device_for_update
        micros = equalize_micro_batches(micro_batches(mini, size, token_budget(cfg, size, mini)), self.device)
        acc: dict[str, float] = defaultdict(float, nonfinite=0.0)  # same keys on every rank
        for micro, is_dummy in micros:
            weight = 0.0 if is_dummy else 1.0
            mask = micro["response_mask"].to(self.device).bool()
            logprobs, entropy = policy_logprobs(
                self.model, micro, temperature=self.temperature, with_entropy=True, **self._forward_kwargs()
            )
            # on-policy without old_logprobs: this pass runs with the sampling weights (see update_policy)
            old_logprobs = micro["old_logprobs"].to(self.device) if "old_logprobs" in micro else logprobs.detach()
            inputs = PolicyLossInputs(
                logprobs=logprobs,
                old_logprobs=old_logprobs,
                advantages=micro["advantages"].to(self.device),
                response_mask=mask,
                clip_ratio_low=cfg.clip_ratio_low,
                clip_ratio_high=cfg.clip_ratio_high,
                clip_ratio_dual=cfg.clip_ratio_dual,
                loss_avg_mode=mode,
                normalizer=normalizer,
            )
            pg_loss, pg_metrics = self.loss_fn(inputs)
            loss = pg_loss
            entropy_loss = aggregate_loss(entropy if cfg.entropy_coeff else entropy.detach(), mask, mode, normalizer)
            if cfg.entropy_coeff:
                loss = loss - cfg.entropy_coeff * entropy_loss
            if self.use_kl_loss:
                kl = kl_loss(logprobs, micro["ref_logprobs"].to(self.device), mask, self.kl_penalty, mode, normalizer)
                loss = loss + self.kl_coef * kl
                acc["actor/kl_loss"] += weight * kl.item()
            if not torch.isfinite(loss.detach()):
                acc["nonfinite"] += 1.0
            # every rank runs every backward (FSDP collectives), a dummy one with weight 0
            (loss * (weight * self.world_size)).backward()
            acc["actor/pg_loss"] += weight * pg_loss.item()
            acc["actor/entropy_loss"] += weight * entropy_loss.item()
            tokens = weight * float(mask.sum())
            acc["tokens"] += tokens
            for key, value in pg_metrics.items():
                if key != "entropy_loss":  # the exact entropy above replaces the loss's estimate
                    acc[f"actor/{key}"] += tokens * float(value)
        totals = all_reduce_sums(acc, self.device)
        grad_norm, stepped = clip_and_step(self.model, self.optimizer, cfg.max_grad_norm, totals["nonfinite"] > 0)
        stats = {}
        for key, value in totals.items():
            if key in ("actor/pg_loss", "actor/kl_loss", "actor/entropy_loss"):
                stats[key] = value  # already divided by the global normaliser: the sum is the mini-batch loss
            elif key.startswith("actor/"):
                stats[key] = value / max(totals["tokens"], 1.0)  # token means over the mini-batch
        return stats, grad_norm, stepped

    # ------------------------------------------------------------------ weights
    def state_dict_for_sync(self) -> dict[str, Tensor]:
        """Full weights with in-memory transformers names (LoRA merged), on the CPU, on every rank.

        Collective. Feed to vLLM's ``reload_weights`` (see STACK.md)."""
        self._ensure_loaded()
        return gather_full_state_dict(self.model)

    def save_checkpoint(self, path: str | os.PathLike) -> None:
        """Model + optimizer (sharded, torch.distributed.checkpoint), scheduler and RNG per rank. Collective."""
        self._ensure_loaded()
        save_sharded_checkpoint(path, self.model, self.optimizer, self.scheduler, self.rank)

    def load_checkpoint(self, path: str | os.PathLike) -> None:
        """Restore what :meth:`save_checkpoint` wrote (same world size). Collective."""
        self._ensure_loaded()
        load_sharded_checkpoint(path, self.model, self.optimizer, self.scheduler, self.rank)

    def export_hf(self, path: str | os.PathLike) -> None:
        """Write a Hugging Face model directory (weights, config, tokenizer, processor) that
        transformers' Auto classes and vLLM load. Collective; rank 0 writes."""
        self._ensure_loaded()
        state = gather_full_state_dict(self.model)
        if self.rank == 0:
            export_hf_model(state, self.hf_config, self.config.model, path)
        dist.barrier()

    # ------------------------------------------------------------------ offload (GPU only)
    def offload(self) -> None:
        """Free the GPU between phases as ``worker.actor.offload`` asks (no-op on the CPU)."""
        if self.config.offload.offload_params:
            offload_model(self.model)
        if self.config.offload.offload_optimizer:
            offload_optimizer(self.optimizer)
        self._offloaded = True

    def _ensure_loaded(self) -> None:
        if self._offloaded:
            load_model_to(self.model, self.device)
            load_optimizer_to(self.optimizer, self.device)
            self._offloaded = False


def export_hf_model(state: dict[str, Tensor], hf_config: Any, model_config: Any, path: str | os.PathLike) -> None:
    """Save ``state`` (full, in-memory names) as a transformers model of ``hf_config``'s class,
    plus the tokenizer and processor of ``model_config``."""
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
    model.generation_config = _generation_config(model_config, model.generation_config)
    path = Path(path)
    model.save_pretrained(path)
    tokenizer, processor = load_tokenizer_and_processor(model_config)
    tokenizer.save_pretrained(path)
    if processor is not None:
        processor.save_pretrained(path)


def _generation_config(model_config: Any, default: Any) -> Any:
    """The source checkpoint's generation config (eos ids, sampling defaults vLLM reads), if it has one."""
    from transformers import GenerationConfig

    try:
        return GenerationConfig.from_pretrained(resolve_paths(model_config)[0])
    except OSError:
        return default
