"""bench/gpu_step.py: the real models' shapes, the work and MFU arithmetic (by hand), the in-memory
EOS-free edit (against bench_support's file edit), and a --tiny run on the CPU end to end."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "bench"))

import gpu_step  # noqa: E402
from bench_support import ModelParams, eos_free_model  # noqa: E402

from easyvlm.data.batch import Batch  # noqa: E402


# ------------------------------------------------------------------------------------ arithmetic
def test_mfu_arithmetic_by_hand():
    # 2 prompts x 4 samples: 300 prompt tokens (one image of 1024 patches) and 200 response tokens each
    params = ModelParams(total=3_700_000_000, decoder=3_000_000_000, vision=600_000_000)
    work = gpu_step.Work(samples=8, prompt_tokens=2400, response_tokens=1600, patches=8192, group_prompt_tokens=600,
                         group_patches=2048)
    # update, shared prompts: 6 x (3e9 x (600 + 1600) + 6e8 x 2048) = 6 x 7.8288e12 = 4.69728e13 FLOPs;
    # in 0.25 s on a 989 TFLOP/s chip: 4.69728e13 / 0.25 / 9.89e14 = 0.189981...
    update = gpu_step.model_flops(params, work, passes=3, shared=True)
    assert update == 4.69728e13
    assert gpu_step.mfu(update, 0.25, 989e12) == pytest.approx(0.18998099, abs=1e-8)
    # every sample's own prompt: 6 x (3e9 x (2400 + 1600) + 6e8 x 8192) = 6 x 1.69152e13 = 1.014912e14;
    # 1.014912e14 / 0.25 / 9.89e14 = 0.410480...
    per_sample = gpu_step.model_flops(params, work, passes=3, shared=False)
    assert per_sample == 1.014912e14
    assert gpu_step.mfu(per_sample, 0.25, 989e12) == pytest.approx(0.41048008, abs=1e-8)
    # a forward (log-probs): 2 x 7.8288e12 = 1.56576e13 FLOPs in 0.1 s: 1.56576e14 / 9.89e14 = 0.158317...
    assert gpu_step.mfu(gpu_step.model_flops(params, work, passes=1, shared=True), 0.1, 989e12) == pytest.approx(
        0.15831749, abs=1e-8)


def test_the_chips_peak_by_device_name():
    # dense bf16: H100 SXM and H200 989 TFLOP/s (the PCIe H100 756); an unknown chip needs --peak-tflops
    assert gpu_step.gpu_peak("NVIDIA H100 80GB HBM3") == 989e12
    assert gpu_step.gpu_peak("NVIDIA H200") == 989e12
    assert gpu_step.gpu_peak("NVIDIA H100 PCIe") == 756e12
    assert gpu_step.gpu_peak("NVIDIA H20") == 148e12
    assert gpu_step.gpu_peak("Some Accelerator") is None


def test_count_work_of_a_batch_by_hand():
    # prompts "a" (3 tokens after 1 pad, one image of 1 x 4 x 4 patches) and "b" (4 tokens, images of
    # 1 x 2 x 2 and 1 x 4 x 6), 2 samples each with 3, 2, 1 and 3 response tokens
    prompt_mask = torch.tensor([[0, 1, 1, 1]] * 2 + [[1, 1, 1, 1]] * 2, dtype=torch.bool)
    response_mask = torch.tensor([[1, 1, 1], [1, 1, 0], [1, 0, 0], [1, 1, 1]], dtype=torch.bool)
    image_a = {"image_grid_thw": torch.tensor([[1, 4, 4]])}
    images_b = {"image_grid_thw": torch.tensor([[1, 2, 2], [1, 4, 6]])}
    batch = Batch({"prompts": torch.zeros(4, 4, dtype=torch.long), "attention_mask": torch.cat([prompt_mask, response_mask], 1),
                   "response_mask": response_mask},
                  {"uid": ["a", "a", "b", "b"], "multi_modal_inputs": [image_a, image_a, images_b, images_b]})
    assert gpu_step.count_work(batch) == gpu_step.Work(
        samples=4, prompt_tokens=3 + 3 + 4 + 4, response_tokens=3 + 2 + 1 + 3, patches=16 + 16 + 28 + 28,
        group_prompt_tokens=3 + 4, group_patches=16 + 28)


# ------------------------------------------------------------------------------------ the models
# the text decoder's parameters without the embedding table and lm_head: the Qwen2.5 and Qwen3 technical
# reports' "non-embedding parameters" of the language models inside these VLMs (Qwen2.5-3B 2.77 B,
# Qwen2.5-7B 6.53 B, Qwen3-8B 6.95 B); the vision towers: the published totals (3.75 B, 8.29 B, 8.77 B)
# less the language models' (3.09 B, 7.61 B, 8.19 B)
PUBLISHED = {"qwen2.5-vl-3b": (2.77e9, 0.67e9), "qwen2.5-vl-7b": (6.53e9, 0.68e9), "qwen3-vl-8b": (6.95e9, 0.58e9)}


@pytest.mark.parametrize("shape", sorted(PUBLISHED))
def test_the_shapes_have_the_published_parameter_counts(shape):
    import transformers

    from easyvlm.builtin.families import FAMILIES, model_config
    from easyvlm.builtin.models import SPECIAL_TOKENS, build_tokenizer

    spec = gpu_step.shapes()[shape].spec
    tokenizer = build_tokenizer()
    config = model_config(spec, {t: tokenizer.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS}, len(tokenizer))
    with torch.device("meta"):
        model = getattr(transformers, FAMILIES[spec.family][1])._from_config(config)
    counts = {"decoder": 0, "vision": 0}
    for name, p in model.named_parameters():
        if "visual" in name:
            counts["vision"] += p.numel()
        elif not name.endswith(("embed_tokens.weight", "lm_head.weight")):
            counts["decoder"] += p.numel()
    decoder, vision = PUBLISHED[shape]
    assert counts["decoder"] == pytest.approx(decoder, abs=0.005e9)  # the reports round to 0.01 B
    assert counts["vision"] == pytest.approx(vision, abs=0.01e9)


def test_the_moe_shape_has_qwen3_30b_a3bs_published_counts():
    """Qwen3-30B-A3B's model card: 29.9 B non-embedding parameters, 3.3 B activated (8 of 128 experts
    per token, embeddings and lm_head included); the decoder inside Qwen3-VL-30B-A3B is that model."""
    import transformers

    from easyvlm.builtin.families import FAMILIES, model_config
    from easyvlm.builtin.models import SPECIAL_TOKENS, build_tokenizer

    spec = gpu_step.shapes()["qwen3-vl-30b-a3b"].spec
    tokenizer = build_tokenizer()
    config = model_config(spec, {t: tokenizer.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS}, len(tokenizer))
    with torch.device("meta"):
        model = getattr(transformers, FAMILIES[spec.family][1])._from_config(config)
    decoder = sum(p.numel() for n, p in model.named_parameters()
                  if "visual" not in n and not n.endswith(("embed_tokens.weight", "lm_head.weight")))
    experts = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)
    assert decoder == pytest.approx(29.9e9, abs=0.05e9)
    embeddings = 2 * 151936 * 2048  # the real vocabulary's embedding table and lm_head (untied)
    active = decoder - experts * (128 - 8) / 128 + embeddings
    assert active == pytest.approx(3.3e9, abs=0.06e9)  # 3.35 B by this count; the card gives one decimal


def test_the_qwen3_5_shape_is_the_hybrid_decoder():
    from transformers import Qwen3_5Config

    spec = gpu_step.shapes()["qwen3.5-9b"].spec
    default = Qwen3_5Config().text_config  # transformers' defaults are Qwen3.5-9B's
    assert list(spec.layer_types) == default.layer_types  # 3 linear-attention layers, then 1 full, x 8
    assert (spec.hidden_size, spec.num_hidden_layers, spec.head_dim, spec.linear_key_heads, spec.linear_value_heads,
            spec.linear_head_dim) == (default.hidden_size, default.num_hidden_layers, default.head_dim,
                                      default.linear_num_key_heads, default.linear_num_value_heads,
                                      default.linear_key_head_dim)


def test_the_in_memory_eos_free_edit_is_bench_supports_file_edit(tiny_model_path, tmp_path):
    from transformers import AutoModelForImageTextToText, AutoTokenizer

    reference = AutoModelForImageTextToText.from_pretrained(eos_free_model(tiny_model_path, out_root=tmp_path))
    model = AutoModelForImageTextToText.from_pretrained(tiny_model_path)
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_path)
    eos_ids = [tokenizer.convert_tokens_to_ids(t) for t in ("<|im_end|>", "<|endoftext|>")]
    before = {k: v.clone() for k, v in model.state_dict().items()}
    gpu_step.make_eos_free(model, eos_ids)
    expected, got = reference.state_dict(), model.state_dict()
    assert expected.keys() == got.keys()
    assert [k for k in got if not torch.equal(expected[k], got[k])] == []
    # and it is an edit: the embeddings, every o_proj / down_proj (tiny: 2 layers) and lm_head (the
    # final norm's weight on the channel is 1 already, as in every freshly initialised RMSNorm)
    edited = [k for k in got if not torch.equal(before[k], got[k])]
    assert len(edited) == 1 + 2 * 2 + 1, edited
    assert got["lm_head.weight"][eos_ids, 0].tolist() == [-200.0, -200.0]


def test_the_written_model_is_the_builtin_one_made_eos_free(tiny_model_path, tmp_path):
    from bench_support import model_params
    from transformers import AutoModelForImageTextToText, AutoTokenizer

    written = gpu_step.write_random_model(gpu_step.shapes()["tiny"].spec, tmp_path, "cpu", torch.float32)
    assert model_params(str(written)) == model_params(tiny_model_path)  # builtin:tiny-qwen2.5-vl's shapes
    model = AutoModelForImageTextToText.from_pretrained(written)
    tokenizer = AutoTokenizer.from_pretrained(written)
    eos_ids = [tokenizer.convert_tokens_to_ids(t) for t in ("<|im_end|>", "<|endoftext|>")]
    assert len(tokenizer) == model.config.text_config.vocab_size  # the builtin tokenizer, all of it
    assert model.lm_head.weight[eos_ids, 0].tolist() == [-200.0, -200.0]  # EOS can never be sampled


@pytest.mark.parametrize("shape", ["qwen2.5-vl-3b", "qwen2.5-vl-7b"])
def test_the_gpu_runs_plan_has_the_recipes_settings(shape, tiny_model_path, tmp_path):
    """The plan a GPU run builds (with the tiny model's files in place of the shape's: the settings do
    not depend on them): the GPU recipes' base on one device, one PPO mini-batch per step."""
    from bench_support import bench_plan

    args = gpu_step.parse_args(["--shape", shape, "--prompts", "4"])
    prompts = gpu_step.write_prompts(tmp_path, 4, 448, 64)
    plan = bench_plan(gpu_step.plan_args(args, Path(tiny_model_path), prompts, tmp_path, "hf"), total_steps=2)
    actor = plan.actor
    assert plan.device == "cuda" and plan.launch.world_size == 1
    assert plan.driver.records.loggers == ("console",)  # nothing a GPU machine may lack (tensorboard)
    # fp32 master weights (torch_dtype None: the actor's default), bf16 compute, checkpointing, packed, shared
    assert (actor.fsdp.torch_dtype, actor.fsdp.mp_param_dtype, actor.fsdp.mp_reduce_dtype) == (None, "bf16", "fp32")
    assert actor.model.gradient_checkpointing
    assert actor.forward.settings.padding_free and actor.forward.settings.share_prompts
    assert actor.model.attn_implementation == "sdpa"  # no flash-attn here
    assert actor.update.optimizer_steps_per_step == 1 and plan.ref is not None  # on-policy; KL loss
    assert (plan.rollout.engine.generation.name, plan.rollout.sampling.n, plan.rollout.sampling.max_tokens) == ("hf", 8, 256)
    # the shape's recipe: 3B trains without offloading, micro-batches of 4 / 16; 7B with EasyR1's 7B
    # memory settings (parameters and optimizer offloaded while generating, micro-batches of 1 / 2)
    micro = (actor.update.micro.micro_batch_size, actor.forward.experience.micro_batch_size)
    offload = (actor.offload.offload_params, actor.offload.offload_optimizer)
    assert (micro, offload) == (((4, 16), (False, False)) if shape == "qwen2.5-vl-3b" else ((1, 2), (True, True)))


def test_expert_parallel_size_reaches_the_overrides_only_above_1(tmp_path):
    """--expert-parallel-size N > 1 adds the actor's key (the reference follows it) before the
    trailing overrides, which still win; 1 adds nothing."""

    def experts(*argv):
        args = gpu_step.parse_args(["--shape", "qwen3-vl-30b-a3b", *argv])
        return [a for a in gpu_step.plan_args(args, tmp_path, tmp_path / "p.jsonl", tmp_path, "hf")
                if a.split("=")[0].endswith(".expert_parallel_size")]

    assert experts() == experts("--expert-parallel-size", "1") == []
    assert experts("--expert-parallel-size", "4", "worker.actor.expert_parallel_size=2") == [
        "worker.actor.expert_parallel_size=4", "worker.actor.expert_parallel_size=2"]
    assert experts("--cpu", "--expert-parallel-size", "2") == ["worker.actor.expert_parallel_size=2"]


# ------------------------------------------------------------------------------------ end to end
@pytest.mark.slow
def test_tiny_run_ends_with_one_json_line_of_finite_positive_figures():
    env = {**os.environ, "PYTHONPATH": str(REPO), "TOKENIZERS_PARALLELISM": "false"}
    out = subprocess.run([sys.executable, str(REPO / "bench" / "gpu_step.py"), "--tiny", "--steps", "1",
                          "--profile", "update", "generation"], cwd=REPO, env=env, capture_output=True, text=True,
                         timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    lines = out.stdout.strip().splitlines()
    summary = json.loads(lines[-1])
    phases = [f"{p}_s" for p in gpu_step.PHASES] + ["step_s"]
    figures = ["tokens_per_s", "generation_tokens_per_s", "update_mfu", "update_mfu_per_sample", "ref_mfu",
               "ref_mfu_per_sample", "old_mfu", *phases]
    for key in figures:
        assert isinstance(summary[key], float) and math.isfinite(summary[key]) and summary[key] > 0, (key, summary[key])
    assert summary["peak_gpu_memory_gib"] is None and summary["phase_peak_gpu_memory_gib"] is None  # the CPU
    assert "aten::" in out.stdout and summary["profile_top"]  # the profiled update's operator table
    # the phases asked for, each profiled once (generation first: after the update it syncs the weights)
    assert list(summary["profiles"]) == ["generation", "update"]
    assert summary["profiles"]["update"]["top"] == summary["profile_top"]
    assert all(p["wall_s"] > 0 and p["device_busy_s"] is None for p in summary["profiles"].values())  # no kernels
    # the work: 2 prompts x 2 samples, every response the full 8 tokens (the model cannot sample EOS);
    # each prompt's 56 x 56 image is 4 x 4 patches of 14 pixels
    work, n = summary["work"], 2
    assert (work["samples"], work["response_tokens"], work["patches"]) == (4, 4 * 8, 4 * 16)
    assert work["prompt_tokens"] == n * work["group_prompt_tokens"] and work["patches"] == n * work["group_patches"]
    # the figures' arithmetic: the step is its counted phases (on-policy: no old log-probs), tokens/s
    # every sample's prompt and response over it, the update's MFU 6 FLOPs per parameter per token
    # (a group's prompt and image once) over its seconds and the measured peak
    assert summary["counted_phases"] == ["weight_sync", "generation", "ref_logprobs", "update"]
    assert summary["step_s"] == pytest.approx(sum(summary[f"{p}_s"] for p in summary["counted_phases"]), abs=1e-3)
    assert summary["tokens_per_s"] == pytest.approx((work["prompt_tokens"] + 32) / summary["step_s"], rel=1e-3)
    params = summary["params"]
    flops = 6 * (params["decoder"] * (work["group_prompt_tokens"] + 32) + params["vision"] * work["group_patches"])
    assert summary["update_mfu"] == pytest.approx(flops / summary["update_s"] / summary["peak_flops"], rel=1e-3)
    assert summary["ref_mfu"] == pytest.approx(flops / 3 / summary["ref_logprobs_s"] / summary["peak_flops"], rel=1e-3)


@pytest.mark.slow
def test_hf_generate_tiny_compares_the_engine_with_bare_generate():
    # bench/hf_generate.py on the CPU: both sides generate every row to the full length (EOS-free
    # model), and the ratio is the medians' (bare seconds over the engine's)
    env = {**os.environ, "PYTHONPATH": str(REPO), "TOKENIZERS_PARALLELISM": "false"}
    out = subprocess.run([sys.executable, str(REPO / "bench" / "hf_generate.py"), "--tiny", "--repeats", "2"],
                         cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    summary = json.loads(out.stdout.strip().splitlines()[-1])
    # 2 prompts x 2 samples x 8 tokens on each side
    assert (summary["rows"], summary["response_length"], summary["engine_tokens"], summary["bare_tokens"]) == (4, 8, 32, 32)
    assert [len(v) for v in summary["seconds"].values()] == [2, 2]
    for side in ("engine", "bare"):
        assert summary[f"{side}_s"] == pytest.approx(sum(summary["seconds"][side]) / 2, rel=1e-9)  # median of 2
        assert summary[f"{side}_tokens_per_s"] == pytest.approx(32 / summary[f"{side}_s"], rel=1e-9)
    assert summary["engine_vs_bare"] == pytest.approx(summary["bare_s"] / summary["engine_s"], rel=1e-9)
