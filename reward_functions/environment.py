"""Reward for runs with an environment (``worker.rollout.environment``; e.g. the GUI environment with
builtin:synthetic-gui): the episode's return, as the environment scored its steps.

Returned keys, per sample:
  overall   the episode's return: the sum of its step rewards (``environment_reward``). With the
            GUI environment: 2 for a solved task (1 of progress + 1 for success), the progress made
            (below 1) otherwise.
  accuracy  1 if the environment said the task was solved (``success`` in the info of its last
            step, ``environment_info``), else 0; always 0 with an environment that never says.

Each step's own reward also reaches the step-level estimator (algorithm.adv_estimator=gigpo)
beside this score. A single-turn run has no environment: its inputs are refused.
"""

REWARD_NAME = "environment"
REWARD_TYPE = "batch"


def compute_score(reward_inputs: list[dict]) -> list[dict[str, float]]:
    scores = []
    for item in reward_inputs:
        if "environment_reward" not in item:
            raise ValueError("reward_functions/environment.py scores episodes of an environment, but this input has no "
                             "environment_reward; set worker.rollout.environment (e.g. "
                             "examples/environments/gui.py:GuiEnvironment), or use another reward function")
        success = bool(item["environment_info"].get("success", False))
        scores.append({"overall": float(item["environment_reward"]), "accuracy": float(success)})
    return scores
