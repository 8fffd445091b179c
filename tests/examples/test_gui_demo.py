"""examples/gui.yaml (`make demo-gui`) and its GiGPO overlay are valid configs of the GUI demo."""

from __future__ import annotations

from pathlib import Path

from easyvlm.config.loader import load_config
from easyvlm.config.validate import find_problems

REPO = Path(__file__).resolve().parents[2]


def test_the_gui_demo_plays_the_gui_environment_from_its_warm_start(monkeypatch):
    monkeypatch.chdir(REPO)
    cfg = load_config(["config=examples/gui.yaml"])
    assert find_problems(cfg, check_files=True) == []
    assert (cfg.data.train_files, cfg.data.val_files) == ("builtin:synthetic-gui-row-red@train", "builtin:synthetic-gui-row-red@val")
    # the 112x112 screenshots (12544 px) at their size: click(X, Y) is in their pixels
    assert cfg.data.min_pixels <= 112 * 112 <= cfg.data.max_pixels
    rollout = cfg.worker.rollout
    assert rollout.environment == "examples/environments/gui.py:GuiEnvironment"
    assert rollout.max_turns == 7  # the longest step limit: 5 actions + 2
    assert cfg.worker.actor.model.model_path == "builtin:tiny-qwen3-vl-gui"
    assert cfg.worker.reward.reward_function == "./reward_functions/environment.py:compute_score"
    assert cfg.algorithm.adv_estimator == "grpo"


def test_the_gigpo_overlay_changes_the_estimator_and_the_run_name_only(monkeypatch):
    monkeypatch.chdir(REPO)
    grpo = load_config(["config=examples/gui.yaml"])
    gigpo = load_config(["config=examples/gui.yaml", "config=examples/gui_gigpo.yaml"])
    assert find_problems(gigpo, check_files=True) == []
    assert (gigpo.algorithm.adv_estimator, gigpo.algorithm.gamma) == ("gigpo", 0.95)
    assert gigpo.trainer.experiment_name == "tiny_gui_gigpo"
    # everything else is the GRPO run's, so the two curves compare the estimators alone
    assert gigpo.worker == grpo.worker and gigpo.data == grpo.data
