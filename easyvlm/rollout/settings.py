"""Where the rollout engines run and how far ahead of the trainer they may generate, declared once:
the keys ``worker.rollout.placement`` ... ``weight_transfer``, which the config schema composes in
their place. Its own range rules are `PlacementSettings.problems`; the config check adds the rules
that involve other sections. Torch-free: the config check imports this module."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from easyvlm.rollout.staleness import StalenessBound

PREFIX = "worker.rollout"


@dataclass(frozen=True)
class PlacementSettings:
    """The rollout's placement and asynchrony; the rollout service (``easyvlm.service.rollout_service``)
    reads them whole, and `staleness_bound` gives its producers the bound."""

    placement: Literal["colocated", "separate"] = "colocated"
    """easyvlm extra. `colocated`: the engine shares each actor rank's process and device (the
    hybrid engine; weights copied in memory). `separate`: the engines run in their own worker group
    on `num_devices` more devices (GPUs, or processes on the CPU); the actor's weights are sent to
    them after every update. docs/rollout.md, "Separate placement and asynchronous rollout"."""
    num_devices: int = 1
    """easyvlm extra. Devices of the separate rollout group (one engine each, data-parallel);
    only with `placement: separate`."""
    one_step_off: bool = False
    """easyvlm extra. verl's one-step-off, kept as shorthand for `max_staleness: 1` (the same code
    path): the next step's batch is generated on the separate rollout group while this step trains.
    Needs `placement: separate`."""
    max_staleness: int = 0
    """easyvlm extra. Asynchronous rollout with bounded staleness: the rollout service keeps
    generating while the trainer updates and never hands out a sample whose oldest token was
    sampled by weights more than this many updates older than those it trains on. 0 = synchronous.
    The integer AReaL's `max_head_offpolicyness`, TRL's `max_staleness` and prime-rl's
    `max_off_policy_steps` bound, each its own way; verl's `staleness_threshold` is another knob
    (a fraction of extra samples per weight sync). Logged per step (rollout/staleness_mean,
    rollout/staleness_max); corrected by default (`correct_staleness`). Needs `placement:
    separate`. docs/rollout.md, "How `max_staleness` compares"."""
    correct_staleness: bool = True
    """easyvlm extra. With `max_staleness` >= 1 (or `one_step_off`) and nothing set in
    `algorithm.rollout_correction`: train the stale samples with the off-policy objective, token-level
    truncated importance weights pi_old / pi_rollout (`rollout_correction.rollout_is=token` at its
    `rollout_is_threshold`; with the old-log-prob pass this turns on, AReaL's decoupled PPO). false:
    train them as if fresh. docs/rollout.md, "The off-policy objective, by default"."""
    partial_rollout: bool = False
    """easyvlm extra. With `max_staleness` >= 1: new weights reach the engines while samples are
    unfinished, which keep their tokens and go on with the new weights, every token remembering the
    version that sampled it (rollout/partial_fraction). Single-turn (vLLM): between two decoding
    steps (KV cache recomputed), and groups are handed to the trainer as they complete. With
    `tools` or an `environment`: each turn starts on the newest weights (a turn in flight ends on
    its own), and the step's batch is handed over whole."""
    weight_transfer: Literal["auto", "collective", "object_store"] = "auto"
    """easyvlm extra. How separate engines get the weights. `collective`: broadcast from the actor's
    rank 0 in buckets through a process group of their own (gloo on the CPU, NCCL on GPUs); needs
    synchronous rollout (`max_staleness: 0`), and a group that does not form stops the run.
    `object_store`: the full state dict as a Ray object. `auto`: `collective` for synchronous
    engines (the Ray objects if the group does not form, said in the log), `object_store` for
    asynchronous ones (each version is published for the producer). Only with `placement: separate`.
    docs/rollout.md, "Weight sync"."""

    @property
    def separate(self) -> bool:
        return self.placement == "separate"

    @property
    def by_collective(self) -> bool:
        """Whether separate engines take the weights by the collective (`weight_transfer`)."""
        return self.separate and self.staleness == 0 and self.weight_transfer != "object_store"

    @property
    def staleness(self) -> int:
        """k: the bound in updates (``one_step_off`` is shorthand for 1); 0 = synchronous."""
        return max(self.max_staleness, int(self.one_step_off))

    def staleness_bound(self, batch_groups: int) -> StalenessBound:
        return StalenessBound(self.staleness, batch_groups)

    @staticmethod
    def problems(s: Any) -> list[tuple[str, str]]:
        """(key under ``worker.rollout``, message) for each rule these keys break among themselves:
        ``s`` is this class or the config section that composes it (the values need not be valid)."""
        p, found = PREFIX, []
        if not (isinstance(s.max_staleness, int) and s.max_staleness >= 0):
            found.append(("max_staleness", f"must be >= 0, got {s.max_staleness}"))
        asynchronous = s.max_staleness > 0 or s.one_step_off
        if not s.correct_staleness and not asynchronous:
            found.append(("correct_staleness", f"acts only with {p}.max_staleness >= 1 (synchronous samples are "
                          "never stale); remove it or set max_staleness"))
        if s.placement == "colocated":
            if s.num_devices != 1:
                found.append(("num_devices", f"acts only with {p}.placement=separate (colocated engines use the "
                              "actor's devices); set placement=separate or leave num_devices at 1"))
            for key, on in (("one_step_off", s.one_step_off), ("max_staleness", s.max_staleness > 0),
                            ("partial_rollout", s.partial_rollout)):
                if on:
                    found.append((key, f"needs {p}.placement=separate: a colocated engine shares the actor's "
                                  "process, so generation cannot overlap training; set placement=separate"))
            if s.weight_transfer != "auto":
                found.append(("weight_transfer", f"acts only with {p}.placement=separate (a colocated engine shares "
                              "the actor's process: the weights are copied in memory, nothing is transferred); "
                              "set placement=separate or leave weight_transfer at auto"))
            return found
        if not s.num_devices >= 1:
            found.append(("num_devices", f"must be >= 1, got {s.num_devices}"))
        if s.one_step_off and s.max_staleness not in (0, 1):
            found.append(("one_step_off", f"is shorthand for {p}.max_staleness=1, but max_staleness={s.max_staleness} "
                          "is set too; keep one of them"))
        if s.weight_transfer == "collective" and asynchronous:
            found.append(("weight_transfer", f"collective needs synchronous rollout ({p}.max_staleness=0, "
                          "one_step_off=false): asynchronous engines take each version's weights as published Ray "
                          "objects; set weight_transfer to auto or object_store"))
        if s.partial_rollout and not asynchronous:
            found.append(("partial_rollout", f"needs {p}.max_staleness >= 1: with synchronous rollout the weights "
                          "never change during a generation, so there is nothing to resume; set max_staleness (e.g. 2)"))
        return found
