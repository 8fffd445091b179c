"""The FLOP count behind bench/vs_trl.py's efficiency, against numbers derived by hand."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

import torch  # noqa: E402
from bench_support import ModelParams, essential_flops  # noqa: E402


def test_essential_flops_by_hand():
    # decoder 10, vision 3 parameters; prompts of 4 tokens (16 patches) and 6 tokens (no image);
    # n = 2 samples of 5 tokens each
    flops = essential_flops(ModelParams(total=0, decoder=10, vision=3), [4, 6], [16, 0], n=2, response_length=5)
    # prefill: 2*10*4 + 2*3*16 + 2*10*6 = 80 + 96 + 120
    assert flops["prefill"] == 296
    # decode: 2*10 per token x 2 samples x 5 tokens x 2 prompts
    assert flops["decode"] == 400
    # train: 6*10*2*(4+5) + 6*3*2*16 + 6*10*2*(6+5) = 1080 + 576 + 1320
    assert flops["train"] == 2976
    assert flops["total"] == 296 + 400 + 2976
    # shared prompts: each prompt once per group: 6*10*(4+2*5) + 6*3*16 + 6*10*(6+2*5) = 840 + 288 + 960
    assert flops["train_shared_prompts"] == 2088


def test_repeated_runs_combine_into_the_median_run_and_the_spread():
    import vs_trl

    runs = [{"s_per_step": s, "peak_rss_gib": m, "gen_tokens_per_s": g, "timing_s": {"gen": t}}
            for s, m, g, t in ((33.0, 5.0, 1.0, 9.5), (30.0, 5.2, 3.0, 9.0), (31.0, 5.1, 2.0, 9.2))]
    row = vs_trl.combine_runs(runs)
    # sorted by s/step: 30, 31, 33 -> the median run is the 31 s one (its other figures come along)
    assert row["s_per_step"] == 31.0 and row["gen_tokens_per_s"] == 2.0
    assert row["s_per_step_runs"] == [33.0, 30.0, 31.0]  # in run order
    assert row["step_spread"] == 1.1  # 33 / 30
    assert row["peak_rss_gib_runs"] == [5.0, 5.2, 5.1] and row["gen_s_runs"] == [9.5, 9.0, 9.2]
    # four runs: 30, 31, 33, 34 -> the faster middle run (31 s), its s/step and its other figures
    # together (not 32, the mean of the middle two, beside the 31 s run's tokens/s)
    row = vs_trl.combine_runs([*runs, {"s_per_step": 34.0, "peak_rss_gib": 5.3, "gen_tokens_per_s": 0.5, "timing_s": {"gen": 9.9}}])
    assert row["s_per_step"] == 31.0 and row["gen_tokens_per_s"] == 2.0 and row["step_spread"] == round(34 / 30, 3)


def test_the_tree_sampler_without_pss_reads_only_rss(monkeypatch):
    import subprocess
    import time

    import process_tree_memory

    def no_smaps(pid):  # reading PSS is what slows a measured run: it must not happen at all
        raise AssertionError("smaps_rollup read with pss_every=0")

    monkeypatch.setattr(process_tree_memory, "read_memory", no_smaps)
    child = subprocess.Popen([sys.executable, "-c", "import time; x = bytearray(64 * 2**20); time.sleep(1.5)"])
    try:
        with process_tree_memory.TreeSampler(child.pid, 0.05, pss_every=0) as sampler:
            time.sleep(1.0)
    finally:
        child.wait()
    assert sampler.samples > 5 and sampler.peak_pss_sum == 0
    # the child's 64 MiB buffer is resident (bytearray zero-fills it), so RSS was read
    assert sampler.peak_rss_sum > 64 * 2**20


def test_a_run_over_its_time_leaves_no_process_behind(tmp_path):
    """A training left running after vs_trl gave up on it would slow every later measurement."""
    import subprocess
    import time

    import pytest
    import vs_trl

    marker = f"sleep_marker_{time.time_ns()}"  # names the grandchild for pgrep
    grandchild = f"import time; {marker} = 1; time.sleep(60)"
    child = f"import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', {grandchild!r}]); time.sleep(60)"
    with pytest.raises(RuntimeError, match="ran over 2 s"):
        vs_trl._watch([sys.executable, "-c", child], 1, tmp_path / "run.log", timeout=2)
    time.sleep(0.5)  # the kill is asynchronous
    assert subprocess.run(["pgrep", "-f", marker], capture_output=True, text=True).stdout == ""


def test_the_benchmarks_resolve_builtin_models_in_their_own_process():
    # bench/vs_trl.py resolves builtin:bench-qwen2.5-vl in its own process (eos_free_model): without
    # easyvlm.builtin.register() that raised "no model scheme 'builtin:' is known" (issue 34 made the
    # registration explicit; the test process registers in conftest, so a fresh process checks it)
    import subprocess

    code = ("import sys; sys.path.insert(0, 'bench'); import bench_support; "
            "from easyvlm.models import paths; print(sorted(paths._SCHEMES))")
    out = subprocess.run([sys.executable, "-c", code], cwd=Path(__file__).resolve().parents[2],
                         capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.split("\n")[-2] == "['builtin:']"


def test_cpu_description_names_the_model_generation_isa_and_caps(tmp_path, monkeypatch):
    from bench_support import cpu_description

    # two processors of a Zen 3 EPYC (family 25 model 1): AVX2, no AVX-512; only the first is read
    zen3 = ("processor\t: 0\ncpu family\t: 25\nmodel\t\t: 1\nmodel name\t: AMD EPYC 7B13\n"
            "flags\t\t: fpu sse2 avx avx2 fma\n\nprocessor\t: 1\ncpu family\t: 26\n")
    (tmp_path / "zen3").write_text(zen3)
    for name in ("ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA", "MKL_ENABLE_INSTRUCTIONS", "MKL_DEBUG_CPU_TYPE"):
        monkeypatch.delenv(name, raising=False)
    assert cpu_description(tmp_path / "zen3") == "AMD EPYC 7B13; family 25 model 1; AVX2, no AVX-512"
    # a Zen 4 (family 25 model 17) held to AVX2 by both libraries' caps, as issue 36's stand-in
    zen4 = ("cpu family\t: 25\nmodel\t\t: 17\nmodel name\t: AMD EPYC\n"
            "flags\t\t: avx2 avx512f avx512_bf16 avx512bw\n")
    (tmp_path / "zen4").write_text(zen4)
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX2")
    monkeypatch.setenv("MKL_ENABLE_INSTRUCTIONS", "AVX2")
    assert cpu_description(tmp_path / "zen4") == (
        "AMD EPYC; family 25 model 17; AVX-512 (avx512_bf16); "
        "capped by ONEDNN_MAX_CPU_ISA=AVX2 MKL_ENABLE_INSTRUCTIONS=AVX2")


def test_model_params_count_an_moe_layers_active_experts(easyvlm_cache_dir):
    """builtin:tiny-qwen3-vl-moe: 4 experts of 48, top-2, hidden 128, 2 layers. Each layer's fused
    experts hold 4 x (2 x 48 x 128 + 128 x 48) = 73,728 parameters, of which a token multiplies with
    2 of 4: 36,864. The decoder's per-token count is the dense sum minus the other half."""
    from bench_support import model_params
    from safetensors import safe_open

    from easyvlm.builtin.models import materialize_model

    model_dir = materialize_model("tiny-qwen3-vl-moe", cache_dir=easyvlm_cache_dir)
    params = model_params(str(model_dir))
    with safe_open(str(model_dir / "model.safetensors"), "pt") as f:
        sizes = {name: f.get_slice(name).get_shape() for name in f.keys()}
    experts = sum(s[0] * s[1] * s[2] for name, s in sizes.items() if ".experts." in name)
    assert experts == 2 * 4 * (2 * 48 * 128 + 128 * 48) == 147_456
    dense = sum(int(torch.tensor(s).prod()) for name, s in sizes.items()
                if "visual" not in name and not name.endswith("embed_tokens.weight"))
    assert params.decoder == dense - experts // 2
    assert params.total == sum(int(torch.tensor(s).prod()) for s in sizes.values())
