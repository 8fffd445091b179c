"""End-to-end: synchronous separate engines take the actor's weights by a collective broadcast from
its rank 0 (easyvlm/workers/weight_transfer.py), through ``main(argv)`` on the tiny model (CPU, gloo).

vLLM samples from the policy that trains only if every sync reached every engine: with lr 1e-3 an
engine one update behind (or left on the model files' weights after a restart) makes the sampler-
trainer mismatch visible, while fp32 noise keeps k3 < 1e-4 (tests/trainer/test_e2e_separate_rollout.py).
"""

from __future__ import annotations

import logging

import pytest
from test_e2e import assert_finite, read_jsonl, signal_engine_after_step_1


def model_bytes(model_path: str) -> int:
    """The bytes of the model files' tensors: one full sync sends each once (the tiny model ties no weights)."""
    from safetensors import safe_open

    with safe_open(f"{model_path}/model.safetensors", "pt") as weights:
        return sum(weights.get_tensor(k).numel() * weights.get_tensor(k).element_size() for k in weights.keys())


def run(e2e_base_args, tmp_path, engines: int, *extra: str) -> list[dict]:
    from easyvlm.trainer.main import main

    main([*e2e_base_args, "worker.rollout.placement=separate", f"worker.rollout.num_devices={engines}",
          "worker.rollout.name=vllm", "trainer.max_steps=3", "worker.actor.optim.lr=1e-3", *extra,
          f"trainer.save_checkpoint_path={tmp_path}"])
    return read_jsonl(tmp_path / "experiment_log.jsonl")


@pytest.mark.slow
@pytest.mark.usefixtures("e2e_ray")
class TestCollectiveWeightTransfer:
    def test_two_engines_sample_the_current_policy_after_each_broadcast(self, e2e_base_args, tmp_path,
                                                                          tiny_model_path, caplog):
        with caplog.at_level(logging.INFO, logger="easyvlm"):
            rows = run(e2e_base_args, tmp_path, 2)
        assert "take the weights by a collective broadcast" in caplog.text
        assert "did not form" not in caplog.text
        assert [r["step"] for r in rows] == [1, 2, 3]
        for row in rows:  # every step syncs (the weights changed): the whole model once per engine
            assert row["perf/weight_sync_bytes"] == model_bytes(tiny_model_path)
            assert_finite(row, ["timing_s/weight_sync"])
            assert 0.0 <= row["actor/rollout_mismatch/k3"] < 1e-4, row["actor/rollout_mismatch/k3"]

    def test_object_store_sends_the_same_bytes_as_ray_objects(self, e2e_base_args, tmp_path, tiny_model_path, caplog):
        """worker.rollout.weight_transfer=object_store: no group is formed; each engine loads the full state
        dict from a Ray object, the same bytes as the broadcast, and samples the current policy."""
        with caplog.at_level(logging.INFO, logger="easyvlm"):
            rows = run(e2e_base_args, tmp_path, 2, "worker.rollout.weight_transfer=object_store")
        assert "take the weights as Ray objects (worker.rollout.weight_transfer=object_store)" in caplog.text
        assert "weight-transfer group" not in caplog.text  # never tried, so never "did not form"
        assert [r["step"] for r in rows] == [1, 2, 3]
        for row in rows:
            assert row["perf/weight_sync_bytes"] == model_bytes(tiny_model_path)
            assert_finite(row, ["timing_s/weight_sync"])
            assert 0.0 <= row["actor/rollout_mismatch/k3"] < 1e-4, row["actor/rollout_mismatch/k3"]

    @pytest.mark.parametrize("weight_transfer", ["auto", "object_store"])
    def test_unmerged_adapters_reach_separate_engines_the_base_once(self, e2e_base_args, tmp_path, tiny_model_path,
                                                                     weight_transfer):
        """LoRA served unmerged by a separate engine, by the collective (auto) or as Ray objects: the base
        weights at the first sync, then the adapters alone (rank 8 on every linear layer, the tower's
        included: 221 184 bytes, tests/rollout/test_lora_rollout.py), and the engine samples the policy
        that trains (lr 1e-3 on the adapters)."""
        rows = run(e2e_base_args, tmp_path, 1, f"worker.rollout.weight_transfer={weight_transfer}",
                   "worker.actor.model.lora.rank=8", "worker.actor.model.lora.alpha=16",
                   "worker.actor.model.lora.merge_for_rollout=false")
        adapter = 221184
        assert [r["perf/weight_sync_bytes"] for r in rows] == [model_bytes(tiny_model_path) + adapter, adapter, adapter]
        for row in rows:
            assert 0.0 <= row["actor/rollout_mismatch/k3"] < 1e-4, row["actor/rollout_mismatch/k3"]

    def test_an_engine_killed_after_step_1_rejoins_the_group_and_takes_the_weights(self, e2e_base_args, tmp_path):
        """SIGKILL lands during step 2's broadcast or generation; either way the engine is restarted, the
        group formed again with it, and step 2 onwards sample the current weights (k3 at fp32 noise)."""
        import signal

        killed = signal_engine_after_step_1(tmp_path / "experiment_log.jsonl", signal.SIGKILL)
        rows = run(e2e_base_args, tmp_path, 1)
        assert killed and [r["step"] for r in rows] == [1, 2, 3]
        assert rows[-1]["rollout/engine_restarts"] == 1.0
        for row in rows:
            assert 0.0 <= row["actor/rollout_mismatch/k3"] < 1e-4, row["actor/rollout_mismatch/k3"]
