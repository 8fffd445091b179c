"""The GPU recipes (examples/*.sh) are valid configs, checked the way the trainer checks them.

Each script runs for real under bash, with a stub ``python3`` first on PATH that records its
arguments and working directory instead of training. So the check sees exactly what the shell
would pass (variables, quoting, line continuations, ``cd``). Then the arguments go through what
``easyvlm.trainer.main.main`` does before Ray starts: ``parse_and_validate`` (loader + every
validation rule + local files exist), ``derive``, ``resolve_paths`` and the reward-file check.
Hub ids (model, data) are not resolved by validation, so nothing touches the network.
"""

from __future__ import annotations

import os
import re
import stat
import subprocess
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]
RECIPES = sorted((REPO_ROOT / "examples").glob("*.sh"))

STUB = """#!/usr/bin/env bash
pwd > "$EASYVLM_RECIPE_OUT/cwd"
printf '%s\\0' "$@" > "$EASYVLM_RECIPE_OUT/argv"
"""


def recipe_call(script: Path, tmp_path: Path, *args: str) -> tuple[list[str], Path]:
    """(arguments after ``python3``, working directory) of the script's trainer call."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    stub = bin_dir / "python3"
    stub.write_text(STUB)
    stub.chmod(stub.stat().st_mode | stat.S_IXUSR)
    env = {k: v for k, v in os.environ.items() if k != "MODEL_PATH"}
    env.update(PATH=f"{bin_dir}{os.pathsep}{env['PATH']}", EASYVLM_RECIPE_OUT=str(tmp_path))
    # run from elsewhere: the script must find the repository by itself
    subprocess.run(["bash", str(script), *args], cwd=tmp_path, env=env, check=True, timeout=60)
    argv = (tmp_path / "argv").read_bytes().split(b"\0")[:-1]
    return [a.decode() for a in argv], Path((tmp_path / "cwd").read_text().strip())


def test_there_are_recipes_for_each_model_data_set_and_algorithm():
    names = [p.stem for p in RECIPES]
    for part in ("3b", "7b", "geo3k", "clevr", "grpo", "dapo", "gspo"):
        assert any(f"_{part}_" in f"_{name}_" for name in names), f"no recipe with {part!r}: {names}"
    for family in ("qwen2_5_vl_", "qwen3_vl_", "qwen3_5_"):
        assert any(name.startswith(family) for name in names), f"no {family} recipe: {names}"
    assert any("_a3b_" in name for name in names), f"no MoE recipe: {names}"


@pytest.mark.parametrize("script", RECIPES, ids=[p.stem for p in RECIPES])
def test_recipe_passes_the_trainers_checks(script, tmp_path, monkeypatch, capsys):
    from easyvlm.config.cli import parse_and_validate
    from easyvlm.config.derived import derive
    from easyvlm.plan.build import resolve_paths, reward_settings

    argv, cwd = recipe_call(script, tmp_path)
    assert argv[:2] == ["-m", "easyvlm.trainer.main"], argv[:2]
    assert cwd == REPO_ROOT
    monkeypatch.chdir(cwd)  # relative paths in the recipe are relative to where it runs
    try:
        cfg = parse_and_validate(argv[2:])
    except SystemExit:
        pytest.fail(f"{script.name}: the trainer would refuse this config:\n{capsys.readouterr().err}")
    derive(cfg)
    reward_settings(resolve_paths(cfg))  # every reward file loads, its function fits (else ConfigError)

    # GPU settings
    assert cfg.trainer.n_gpus_per_node == 8 and cfg.trainer.device == "cuda"
    assert cfg.worker.rollout.name == "vllm" and cfg.worker.rollout.dtype == "bf16"
    assert cfg.worker.actor.fsdp.mp_param_dtype == "bf16"
    # flash-attn is optional: the packed decoder uses it when installed (the check refuses an explicit
    # flash_attention_2 without it)
    assert cfg.worker.actor.model.attn_implementation == "sdpa"
    assert 0 < cfg.worker.rollout.gpu_memory_utilization < 1

    # what the file name promises
    name = script.stem
    family = next(f for prefix, f in (("qwen3_vl_", "Qwen3-VL"), ("qwen3_5_", "Qwen3.5"), ("qwen2_5_vl_", "Qwen2.5-VL"))
                  if name.startswith(prefix))
    size = re.search(r"_(\d+)b_", name).group(1)
    active = "-A3B" if "_a3b_" in name else ""  # an MoE: total and active parameters
    instruct = "" if family == "Qwen3.5" else "-Instruct"  # Qwen3.5's released names have no suffix
    assert cfg.worker.actor.model.model_path == f"Qwen/{family}-{size}B{active}{instruct}"
    if "_geo3k_" in name:
        assert cfg.data.train_files == "hiyouga/geometry3k@train"
        assert cfg.worker.reward.reward_function.startswith("./reward_functions/math.py:")
    if "_clevr_" in name:
        assert cfg.data.train_files.startswith("BUAADreamer/clevr_count_70k@")
        assert cfg.worker.reward.reward_function.startswith("./reward_functions/r1v.py:")
    a, actor = cfg.algorithm, cfg.worker.actor
    if active:  # the MoE recipe replays the old pass's routing in the update, the tower frozen
        assert actor.router_replay == "R2" and actor.model.freeze_vision_tower
    if name.endswith("_grpo"):
        assert a.adv_estimator == "grpo" and actor.loss_type == "default" and not a.online_filtering
    if name.endswith("_dapo"):
        assert a.online_filtering and a.disable_kl and actor.loss_avg_mode == "token"
        assert actor.clip_ratio_high > actor.clip_ratio_low  # clip-higher
    if name.endswith("_gspo"):
        assert actor.loss_type == "gspo" and actor.loss_avg_mode == "seq" and a.disable_kl
    assert cfg.trainer.experiment_name == name


def test_extra_arguments_reach_the_trainer(tmp_path):
    argv, _ = recipe_call(REPO_ROOT / "examples" / "qwen2_5_vl_7b_geo3k_grpo.sh", tmp_path, "trainer.max_steps=3")
    assert argv[-1] == "trainer.max_steps=3"  # last, so it overrides the recipe's own settings
