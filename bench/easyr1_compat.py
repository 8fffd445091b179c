"""EasyR1 compatibility, checked against a real EasyR1 checkout (not shipped with easyvlm):

    PYTHONPATH=. .venv/bin/python bench/easyr1_compat.py --easyr1 /path/to/EasyR1

1. Recipes: EasyR1's ``examples/config.yaml`` with the arguments of each of its recipe scripts
   (``examples/*.sh``, ``examples/baselines/*.sh``; bash expands them, so quoting is EasyR1's) goes
   through ``python -m easyvlm.trainer.main ... print_config=true`` from the checkout's directory,
   as an EasyR1 user would run it. Exit status 0 expected for every recipe.
2. Reward files: each of EasyR1's ``examples/reward_function/*.py`` is called directly, with the
   inputs EasyR1 builds (``response``, ``response_length``, ``ground_truth``), and through easyvlm's
   RewardManager (its own process pool, its input dicts, the recipe's kwargs): the scores must be
   equal, key for key.

Prints one line per check and a JSON summary as the last line; exit status 1 if anything differs.
tests/config/test_easyr1_recipes.py runs the recipes (as data) in CI.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

# (response, ground truth) pairs that exercise every branch of EasyR1's reward files: right and
# wrong answers, with and without the think/boxed format, equivalent math forms, GUI-task actions
SAMPLES = [
    ("<think>2+2</think> The answer is \\boxed{4}.", "4"),
    ("<think>half</think> \\boxed{\\frac{1}{2}}", "0.5"),
    ("The answer is \\boxed{5}.", "4"),
    ("<think> hmm </think> <answer>3</answer>", "3"),
    ("<think>count</think><answer> 7 </answer>", "7"),
    ("no format at all, 12", "12"),
    ("Answer: 42", "42"),
    ("<think>x</think>\\boxed{x=2}", "2"),
    ('<think>tap</think><answer>{"action": "click", "coordinate": [120, 340]}</answer>', '{"action": "click", "coordinate": [120, 340]}'),
    ("", "1"),
]
# the keyword arguments the recipes bind (qwen3_14b_dapo17k_dapo.sh for dapo.py)
KWARGS = {"dapo": {"max_response_length": 20480, "overlong_buffer_length": 4096, "overlong_penalty_factor": 1.0}}


def recipe_args(script: Path) -> list[str]:
    """The arguments a recipe passes after ``python3 -m verl.trainer.main`` (expanded by bash)."""
    source = script.read_text().replace("python3 -m verl.trainer.main", 'printf "%s\\n"')
    source = source.replace("set -x", "").replace("set -e", "")
    env = {**os.environ, "EXPERIMENT_NAME": script.stem}
    out = subprocess.run(["bash", "-c", source], capture_output=True, text=True, env=env, check=True).stdout
    return [line for line in out.splitlines() if line]


def check_recipes(easyr1: Path) -> dict[str, int]:
    scripts = sorted((easyr1 / "examples").glob("*.sh")) + sorted((easyr1 / "examples" / "baselines").glob("*.sh"))
    results = {}
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    for script in scripts:
        args = recipe_args(script)
        proc = subprocess.run(
            [sys.executable, "-m", "easyvlm.trainer.main", *args, "print_config=true"],
            cwd=easyr1, capture_output=True, text=True, env=env,
        )
        results[script.stem] = proc.returncode
        detail = "" if proc.returncode == 0 else " " + proc.stderr.strip().replace("\n", " | ")[-400:]
        print(f"recipe {script.stem}: exit {proc.returncode}{detail}")
    return results


def direct_scores(path: Path, kwargs: dict) -> list[dict]:
    """The reward file's function called as EasyR1 calls it, in this process."""
    spec = importlib.util.spec_from_file_location(f"easyr1_reward_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    inputs = [{"response": r, "response_length": len(r.split()), "ground_truth": g} for r, g in SAMPLES]
    if getattr(module, "REWARD_TYPE", "batch") == "sequential":
        return [module.compute_score(x, **kwargs) for x in inputs]
    return module.compute_score(inputs, **kwargs)


def manager_scores(path: Path, kwargs: dict) -> list[dict]:
    """The same file through easyvlm's RewardManager (worker processes, easyvlm's input dicts)."""
    from easyvlm.rewards.loader import RewardFunctionSpec
    from easyvlm.rewards.manager import RewardManager, RewardSettings
    from easyvlm.rewards.types import RewardInput

    settings = RewardSettings((RewardFunctionSpec(f"{path}:compute_score", dict(kwargs)),))
    inputs = [RewardInput(response=r, response_length=len(r.split()), ground_truth=g) for r, g in SAMPLES]
    with RewardManager(settings) as manager:
        result = manager.compute(inputs)
    return [{key: values[i] for key, values in result.scores.items()} for i in range(len(SAMPLES))]


def check_rewards(easyr1: Path) -> dict[str, bool]:
    results = {}
    for path in sorted((easyr1 / "examples" / "reward_function").glob("*.py")):
        kwargs = KWARGS.get(path.stem, {})
        direct = [{k: float(v) for k, v in s.items()} for s in direct_scores(path, kwargs)]
        managed = manager_scores(path, kwargs)
        same = direct == managed
        results[path.stem] = same
        overall = [round(s["overall"], 4) for s in direct]
        print(f"reward {path.name}: {'same scores' if same else 'DIFFERENT'}; overall {overall}")
        if not same:
            print(f"  direct:  {direct}\n  easyvlm: {managed}")
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--easyr1", type=Path, required=True, help="an EasyR1 checkout (its examples/ and verl/)")
    args = parser.parse_args()
    recipes = check_recipes(args.easyr1)
    rewards = check_rewards(args.easyr1)
    summary = {
        "recipes": len(recipes),
        "recipes_passing": sum(rc == 0 for rc in recipes.values()),
        "reward_files": len(rewards),
        "reward_files_same": sum(rewards.values()),
    }
    print(json.dumps(summary))
    ok = summary["recipes_passing"] == summary["recipes"] and summary["reward_files_same"] == summary["reward_files"]
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
