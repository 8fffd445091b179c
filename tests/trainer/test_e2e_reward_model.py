"""End-to-end RLHF: the policy trains on a reward model's score (trained and exported by
``python -m easyvlm.rm``), through ``main``, with GRPO and with PPO + critic (three worker groups
on one device); ``python -m easyvlm.eval`` of the GRPO run's checkpoint scores with the reward
model as the trainer's validation did."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]
# per-request seeds and no chunked prefill: an eval of a checkpoint samples what its validation sampled
EVAL_SEEDS = ["worker.rollout.per_request_seed=true", "worker.rollout.enable_chunked_prefill=false"]


def rlhf_args(rm_path: str) -> list[str]:
    return [
        f"config={REPO_ROOT / 'examples' / 'rlhf.yaml'}", f"worker.reward_model.model.model_path={rm_path}",
        "worker.reward.reward_function=null",
        "worker.reward.reward_functions=[{reward_function: '%s:compute_score', weight: 1.0}, "
        "{reward_function: '%s:compute_score', weight: 0.0}]" % (
            REPO_ROOT / "reward_functions" / "reward_model.py", REPO_ROOT / "reward_functions" / "synthetic.py"),
    ]


@pytest.mark.slow
@pytest.mark.usefixtures("e2e_ray")
class TestRewardModelRuns:
    @pytest.mark.parametrize("estimator", ["grpo", "gae"])
    def test_trains_on_the_reward_model_score(self, estimator, e2e_base_args, exported_reward_model, tmp_path):
        from easyvlm.trainer.main import main

        extra = ["algorithm.adv_estimator=gae", "worker.critic.model.model_path=builtin:tiny-qwen2.5-vl",
                 "worker.critic.global_batch_size=4"] if estimator == "gae" else [*EVAL_SEEDS, "trainer.val_freq=2"]
        main([*e2e_base_args, *rlhf_args(exported_reward_model), f"trainer.save_checkpoint_path={tmp_path}",
              "worker.reward_model.normalize=running", "trainer.save_freq=2", *extra])
        rows = [json.loads(line) for line in (tmp_path / "experiment_log.jsonl").read_text().splitlines()]
        assert [row["step"] for row in rows] == [1, 2]
        for row in rows:
            # the trained reward is the reward model's score, standardised by the running statistics
            # (of 16 samples at step 1: their mean over the step is exactly 0), the rule reward weighs 0
            assert row["reward/overall"] == pytest.approx(row["reward/reward_model/reward_model"], abs=1e-6)
            assert "reward/synthetic/accuracy" in row and row["reward_model/raw_score_std"] > 0
        assert rows[0]["reward/overall"] == pytest.approx(0.0, abs=1e-5)
        assert rows[0]["reward_model/running_mean"] == pytest.approx(rows[0]["reward_model/raw_score_mean"], abs=1e-5)
        # the running statistics are part of the checkpoint: step 2 saw 32 scores
        from easyvlm.utils.safe_state import load_state

        state = load_state(tmp_path / "global_step_2" / "trainer_state.pt")
        assert state["reward_model_scores"]["count"] == 32.0
        if estimator == "grpo":
            self.check_eval_matches_validation(rows[-1], e2e_base_args, exported_reward_model, tmp_path)

    @staticmethod
    def check_eval_matches_validation(last: dict, e2e_base_args, exported_reward_model, run_dir: Path) -> None:
        """The eval of the step-2 checkpoint samples the validation's answers (same seeds) and scores
        them with the same reward model, normalised by the checkpoint's running statistics: the
        trainer's validation metrics at step 2, to the last bit."""
        from easyvlm.eval.run import main as eval_main

        summary = eval_main([*e2e_base_args, *rlhf_args(exported_reward_model), *EVAL_SEEDS,
                             "worker.reward_model.normalize=running",
                             f"worker.actor.model.model_path={run_dir / 'global_step_2'}"])
        rm_key = "val/reward_model/reward_model_reward"
        assert last[rm_key] != 0.0  # normalised by 32 training scores, not by none: a mean away from 0
        assert summary[rm_key] == last[rm_key] and summary["val/reward_score"] == last["val/reward_score"]
        assert summary["val/synthetic/accuracy_reward"] == last["val/synthetic/accuracy_reward"]
