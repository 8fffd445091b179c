"""The config check of where the rollout engines run and how far ahead they may generate:
``worker.rollout.placement``, ``num_devices``, ``one_step_off``, ``max_staleness`` and
``partial_rollout`` (``easyvlm.config.validate_workers.check_rollout`` runs it)."""

from __future__ import annotations

from easyvlm.config.checks import Checks
from easyvlm.config.worker_schema import RolloutConfig


def check_placement(c: Checks, r: RolloutConfig) -> None:
    """worker.rollout.placement, num_devices, one_step_off, max_staleness, partial_rollout."""
    p = "worker.rollout"
    c.at_least(f"{p}.max_staleness", 0)
    if not r.correct_staleness and not (r.max_staleness > 0 or r.one_step_off):
        c.add(f"{p}.correct_staleness", f"acts only with {p}.max_staleness >= 1 (synchronous samples are never "
              "stale); remove it or set max_staleness")
    if r.placement == "colocated":
        if r.num_devices != 1:
            c.add(f"{p}.num_devices", f"acts only with {p}.placement=separate (colocated engines use the actor's "
                  "devices); set placement=separate or leave num_devices at 1")
        for key, on in (("one_step_off", r.one_step_off), ("max_staleness", r.max_staleness > 0),
                        ("partial_rollout", r.partial_rollout)):
            if on:
                c.add(f"{p}.{key}", f"needs {p}.placement=separate: a colocated engine shares the actor's process, "
                      "so generation cannot overlap training; set placement=separate")
        return
    c.at_least(f"{p}.num_devices", 1)
    if r.tensor_parallel_size != 1:
        c.add(f"{p}.tensor_parallel_size", f"must be 1 with {p}.placement=separate (one engine per device of the "
              "rollout group; tensor-parallel engines there are not implemented), got "
              f"{r.tensor_parallel_size}")
    if r.one_step_off and r.max_staleness not in (0, 1):
        c.add(f"{p}.one_step_off", f"is shorthand for {p}.max_staleness=1, but max_staleness={r.max_staleness} is set "
              "too; keep one of them")
    key = f"{p}.one_step_off" if r.one_step_off and not r.max_staleness else f"{p}.max_staleness"
    if r.one_step_off or r.max_staleness > 0:
        for source in ("reward_model", "judge"):
            if c.get(f"worker.{source}.enable"):
                c.add(key, f"is not supported with worker.{source}.enable=true: the next steps' "
                      f"samples are scored while this step trains, and the {source.replace('_', ' ')} is not safe "
                      "to call from two threads; turn one of them off")
    _check_partial_rollout(c, r)


def _check_partial_rollout(c: Checks, r: RolloutConfig) -> None:
    """worker.rollout.partial_rollout: asynchronous, vLLM, single-turn."""
    p = "worker.rollout"
    if not r.partial_rollout:
        return
    if not (r.max_staleness > 0 or r.one_step_off):
        c.add(f"{p}.partial_rollout", f"needs {p}.max_staleness >= 1: with synchronous rollout the weights never "
              "change during a generation, so there is nothing to resume; set max_staleness (e.g. 2)")
    if r.name != "vllm":
        c.add(f"{p}.partial_rollout", f"needs {p}.name=vllm: pausing a generation between two decoding steps and "
              f"resuming it on new weights uses vLLM's step loop (the transformers engine generates a batch in one "
              "call); set name=vllm or partial_rollout=false")
    if c.get("algorithm.adv_estimator") == "remax":
        c.add(f"{p}.partial_rollout", "is not supported with algorithm.adv_estimator=remax: a streamed batch's groups "
              "come from several prompt draws, and ReMax's greedy baseline regenerates the step's prompts; set "
              "partial_rollout=false (max_staleness alone keeps whole batches)")
    if r.tools or r.environment is not None:
        c.add(f"{p}.partial_rollout", "is not implemented for multi-turn rollouts (tools or an environment) yet; "
              f"set partial_rollout=false ({p}.max_staleness still overlaps whole multi-turn batches with training)")
