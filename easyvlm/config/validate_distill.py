"""The config check of on-policy distillation: ``worker.teacher`` and ``algorithm.distill_coef`` ...
``distill_only`` (``easyvlm.config.validate.find_problems`` runs it). The teacher's files (tokenizer
and image processor equal to the student's) are checked in the plan (``plan/roles.py``)."""

from __future__ import annotations

import math

from easyvlm.config.checks import Checks, check_fsdp


def check_distillation(c: Checks) -> None:
    a, teacher = c.cfg.algorithm, c.cfg.worker.teacher
    d = a.distill
    on = d.distill_coef > 0
    if not (math.isfinite(d.distill_coef) and d.distill_coef >= 0):
        c.add("algorithm.distill_coef", f"must be a finite number >= 0 (0 = no distillation), got {d.distill_coef}")
        return
    if teacher.enable and not teacher.model.model_path:
        c.add("worker.teacher.model.model_path", "is unset, but worker.teacher.enable=true: give the teacher model "
              "(e.g. builtin:tiny-qwen2.5-vl-teacher, a local directory or a hub id)")
    if on and not teacher.enable:
        c.add("algorithm.distill_coef", f"is {d.distill_coef}, but there is no teacher: set worker.teacher.enable=true "
              "and worker.teacher.model.model_path")
    if teacher.enable and not on:
        c.add("worker.teacher.enable", "is true, but algorithm.distill_coef is 0: the teacher would be loaded and never "
              "used; set algorithm.distill_coef > 0 (e.g. 1.0), or turn the teacher off")
    for key in ("distill_full_kl", "distill_as_reward", "distill_only"):
        if getattr(d, key) and not on:
            c.add(f"algorithm.{key}", "acts only with distillation on: set algorithm.distill_coef > 0 and "
                  "worker.teacher.enable=true")
    if d.distill_full_kl and d.distill_as_reward:
        c.add("algorithm.distill_full_kl", "cannot be combined with algorithm.distill_as_reward: the teacher's "
              "log-prob advantage is per sampled token, the full KL a loss over the vocabulary; keep one")
    if d.distill_only and on:
        _check_pure_distillation(c)
    if teacher.enable:
        check_fsdp(c, "worker.teacher.fsdp")
        if teacher.offload.offload_optimizer:
            c.add("worker.teacher.offload.offload_optimizer", "is true, but the teacher is never trained and has no "
                  "optimizer; remove the key (worker.teacher.offload.offload_params moves its weights)")


def _check_pure_distillation(c: Checks) -> None:
    """algorithm.distill_only: nothing may rely on the reward's advantage."""
    a = c.cfg.algorithm
    why = "pure distillation (algorithm.distill_only=true) trains on the teacher alone, without the reward's advantage"
    if a.adv_estimator in ("gae", "remax"):
        c.add("algorithm.distill_only", f"is not supported with algorithm.adv_estimator={a.adv_estimator}: {why}, so "
              "there is no value or baseline to learn; use grpo (its advantages are then not computed)")
    if a.online_filtering:
        c.add("algorithm.online_filtering", f"keeps prompt groups by their rewards, but {why}; turn one of them off")
    if not a.kl.disable_kl and not a.kl.use_kl_loss:
        c.add("algorithm.use_kl_loss", f"is false (the KL to the reference in the reward), but {why}, which the KL "
              "would reach through; set use_kl_loss=true or disable_kl=true")
