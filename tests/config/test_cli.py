"""parse_and_validate() as the trainer's entry point runs it: in a subprocess, exit codes, stderr."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]

VALID = [
    "data.train_files=builtin:synthetic@train",
    "data.val_files=builtin:synthetic@val",
    "data.rollout_batch_size=8",
    "worker.actor.global_batch_size=4",
    "worker.actor.micro_batch_size_per_device_for_update=2",
    "worker.actor.model.model_path=builtin:tiny-qwen2.5-vl",
    "worker.rollout.n=4",
    "worker.reward.reward_function=./reward.py:score",
    "trainer.n_gpus_per_node=1",
]


def run_cli(args: list[str], cwd: Path) -> subprocess.CompletedProcess:
    code = (
        "import sys; from easyvlm.config.cli import parse_and_validate; "
        "cfg = parse_and_validate(sys.argv[1:]); print('OK', cfg.worker.rollout.n)"
    )
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.run([sys.executable, "-c", code, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=120)


@pytest.fixture
def workdir(tmp_path: Path) -> Path:
    (tmp_path / "reward.py").write_text("def score(reward_inputs):\n    return [{'overall': 0.0} for _ in reward_inputs]\n")
    return tmp_path


def test_unknown_key_exits_2_without_traceback(workdir):
    result = run_cli(VALID + ["worker.actor.bogus_key=1"], workdir)
    assert result.returncode == 2
    assert result.stdout == ""
    lines = result.stderr.splitlines()
    assert lines[0] == "easyvlm: config error:"
    assert len(lines) == 2 and lines[1].startswith("  - worker.actor.bogus_key: unknown key in worker.actor;")
    assert "did you mean" not in result.stderr
    assert "Traceback" not in result.stderr


def test_all_problems_of_load_and_validation_together(workdir):
    bad = ["algorithm.adv_estimator=grpoo", "data.rollout_batch_size=10", "worker.rollout.temprature=1"]
    result = run_cli(VALID + bad, workdir)
    assert result.returncode == 2
    assert "Traceback" not in result.stderr
    problems = [line for line in result.stderr.splitlines() if line.startswith("  - ")]
    assert len(problems) == 3, result.stderr
    assert any("worker.rollout.temprature: unknown key" in p and "worker.rollout.temperature" in p for p in problems)
    valid_names = "gae, grpo, grpo_passk, rloo, reinforce_plus_plus"
    assert any(p.startswith("  - algorithm.adv_estimator:") and valid_names in p for p in problems)
    divisibility = "  - data.rollout_batch_size: (10) must be a multiple of worker.actor.global_batch_size (4)"
    assert any(p.startswith(divisibility) for p in problems)


def test_missing_reward_file_is_a_config_error(tmp_path):
    result = run_cli(VALID, tmp_path)  # no reward.py here
    assert result.returncode == 2
    assert "worker.reward.reward_function: file './reward.py' not found" in result.stderr


def test_valid_config_returns(workdir):
    result = run_cli(VALID, workdir)
    assert (result.returncode, result.stdout, result.stderr) == (0, "OK 4\n", "")


@pytest.mark.parametrize("flag", ["print_config=true", "--print-config"])
def test_print_config(workdir, flag):
    result = run_cli(VALID + [flag, "worker.rollout.temperature=0.7"], workdir)
    assert result.returncode == 0, result.stderr
    printed = yaml.safe_load(result.stdout)  # the resolved YAML, and nothing after it
    assert printed["worker"]["rollout"]["temperature"] == 0.7
    assert printed["worker"]["rollout"]["n"] == 4
    assert printed["trainer"]["logger"] == ["console", "file", "tensorboard"]
