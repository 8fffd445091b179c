"""The benchmarks build their workers and engines from run plans, as the trainer does."""

from __future__ import annotations

import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "bench"))

from bench_support import bench_plan, example_args  # noqa: E402


def test_bench_plan_is_the_demo_config_from_any_directory(tiny_model_path, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # the demo config's relative paths would not resolve here
    plan = bench_plan(example_args(f"worker.actor.model.model_path={tiny_model_path}", "data.max_response_length=16"),
                      total_steps=7)
    assert plan.data.format_prompt == str(REPO / "format_prompts" / "synthetic.jinja")
    assert plan.actor.update.total_steps == 7  # the trainer sets it from the data; benchmarks choose it
    # the demo's settings reach the specs: vLLM, 8 samples at temperature 1, KL loss with a reference
    assert (plan.rollout.engine.generation.name, plan.rollout.sampling.n, plan.rollout.sampling.temperature) == ("vllm", 8, 1.0)
    assert plan.rollout.sampling.max_tokens == 16 and plan.ref is not None and plan.actor.kl_loss.kl_coef == 0.1


def test_both_frameworks_of_vs_trl_read_the_same_prompts(monkeypatch):
    import vs_trl

    from easyvlm.config.cli import parse_and_validate
    from easyvlm.builtin.synthetic import dataset_cache_dir

    monkeypatch.chdir(REPO)  # vs_trl runs the trainer from the repository
    overrides = vs_trl.easyvlm_overrides(vs_trl.TINY, 16, 8, 8, 3, 1e-5, 16, "/tmp/unused")
    spec = parse_and_validate(overrides).data.train_files
    name, _, split = spec.removeprefix("builtin:").partition("@")
    # trl_grpo.py reads materialize_dataset("train"): the "synthetic" set, train split, default size
    assert dataset_cache_dir(split, None, name, None) == dataset_cache_dir("train", None, "synthetic", None)
