"""Seeded sampling makes a resumed run sample what an uninterrupted run sampled.

The hf rollout engine draws from a private RNG stream that checkpoints do not hold, so without
per-request seeds a run resumed from step 2 samples other responses at step 3 than the run that
went on (measured: reward/overall 0.69 vs 0.44, grad norms 1.33 vs 1.71). With them, step 3's log
row of the resumed run equals the uninterrupted run's, metric for metric.
"""

from __future__ import annotations

import json
import shutil

import pytest

TIMING = ("timing_s/", "timing_per_token_ms/", "perf/")


def rows(path) -> dict[int, dict]:
    return {r["step"]: r for r in map(json.loads, (path / "experiment_log.jsonl").read_text().splitlines())}


@pytest.mark.slow
@pytest.mark.usefixtures("e2e_ray")
def test_resumed_run_samples_what_the_uninterrupted_run_sampled(e2e_base_args, tmp_path):
    from easyvlm.trainer.main import main

    argv = [*e2e_base_args, "worker.rollout.name=hf", "worker.rollout.per_request_seed=true", "trainer.max_steps=3", "trainer.save_freq=2"]
    uninterrupted, resumed = tmp_path / "a", tmp_path / "b"
    main([*argv, f"trainer.save_checkpoint_path={uninterrupted}"])
    resumed.mkdir()  # a run that stopped after its step-2 checkpoint
    shutil.copytree(uninterrupted / "global_step_2", resumed / "global_step_2")
    (resumed / "latest_checkpointed_iteration.txt").write_text("2")
    main([*argv, f"trainer.save_checkpoint_path={resumed}"])

    expected, got = rows(uninterrupted)[3], rows(resumed)
    assert sorted(got) == [3]  # it resumed: only step 3 ran
    got = got[3]
    keys = [k for k in expected if not k.startswith(TIMING)]
    assert "reward/overall" in keys and "actor/grad_norm" in keys
    assert {k: got[k] for k in keys} == {k: expected[k] for k in keys}
