"""The trained reward model's score as the reward (needs worker.reward_model.enable=true).

The trainer scores every response with the reward model (easyvlm.workers.reward_model) before the
reward functions run and puts the score in each input as ``reward_model_score`` (standardised with
worker.reward_model.normalize=running; the raw one is ``reward_model_raw_score``). This file
returns it, so it can stand alone (worker.reward.reward_function) or be weighted with rule rewards
(worker.reward.reward_functions; a rule reward with weight 0 is logged but not trained on, the
way examples/rlhf.yaml watches the true accuracy). To shape the score, copy this file.

Returned keys, per sample:
  overall       the reward model's score.
  reward_model  the same (logged as reward/reward_model).
"""

from __future__ import annotations

REWARD_NAME = "reward_model"
REWARD_TYPE = "batch"


def compute_score(reward_inputs: list[dict]) -> list[dict[str, float]]:
    missing = [i for i, item in enumerate(reward_inputs) if item.get("reward_model_score") is None]
    if missing:
        raise ValueError(f"sample {missing[0]} has no reward_model_score: set worker.reward_model.enable=true and "
                         "worker.reward_model.model.model_path")
    return [{"overall": float(item["reward_model_score"]), "reward_model": float(item["reward_model_score"])}
            for item in reward_inputs]
