"""LoRA adapters served unmerged (worker.actor.model.lora.merge_for_rollout): the hybrid worker sends
the engine the base weights once and then the adapters alone, and the engine's log-probs are the
actor's, as with merged weights; the plan and the config check decide where it can be.

The tiny Qwen2.5-VL's adapters at rank 8 (all-linear), counted by hand (rank x (in + out) each):
- a decoder layer (hidden 128, 2 key/value heads of 32, MLP 256): q 8x(128+128) = 2048, k and v
  8x(128+64) = 1536 each, o 2048, gate and up 8x(128+256) = 3072 each, down 3072: 16384; 2 layers: 32768;
- a vision block (hidden 64, MLP 128): qkv 8x(64+192) = 2048, proj 8x(64+64) = 1024, gate, up and down
  8x(64+128) = 1536 each: 7680; 2 blocks: 15360; the merger (4 x 64 = 256 in, 128 out): mlp.0
  8x(256+256) = 4096, mlp.2 8x(256+128) = 3072: 7168. The tower: 22528.
float32: 4 x (32768 + 22528) = 221184 bytes with the tower, 4 x 32768 = 131072 without.
"""

from __future__ import annotations

import logging

import pytest
import torch
from rollout_helpers import rollout_plan, with_sampling

from easyvlm.config.errors import ConfigError

KEY = "worker.actor.model.lora.merge_for_rollout"
ADAPTER_BYTES = 221184  # the module docstring's count
LM_ADAPTER_BYTES = 131072  # the same without the (frozen) tower's adapters
LORA = ("worker.actor.model.lora.rank=8", "worker.actor.model.lora.alpha=16")
ENGINE = ("worker.rollout.max_num_seqs=32", "worker.rollout.disable_tqdm=true", "worker.rollout.gpu_memory_utilization=0.1")
# float32 on both sides: the engine's log-probs of its own samples against the actor's forward. Measured
# <= 1e-6 for the unmerged adapters and for merged weights alike (vLLM and transformers engines); an
# engine that misses the adapters is off by > 0.05 (the stale check below).
ATOL = 1e-5

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def lora_plan(model_path: str, *overrides: str):
    return rollout_plan(model_path, 12, *LORA, *ENGINE, *overrides)


def hybrid_worker(model_path: str, engine: str, merge: str):
    from easyvlm.workers.hybrid import HybridWorker

    plan = lora_plan(model_path, f"worker.rollout.name={engine}", f"{KEY}={merge}")
    return HybridWorker(plan.actor, None, plan.rollout)


def set_adapters(hybrid, seed: int) -> None:
    """The "update": B of every adapter drawn at random (PEFT starts them at 0, where merged = base)."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in hybrid.actor.model.named_parameters():
            if ".lora_B." in name:
                local = param.to_local()
                local.copy_(torch.randn(local.shape, generator=generator) * 0.1)


def engine_gap(hybrid, prompts, sync: bool):
    """(max |engine log-prob - actor log-prob| over the sampled tokens, the generate() output)."""
    out = hybrid.generate(prompts, with_sampling(hybrid.rollout, n=2, temperature=1.0), sync_weights=sync)
    actor = hybrid.compute_logprobs(out)["old_logprobs"]
    mask = out["response_mask"]
    return (actor - out["rollout_logprobs"])[mask].abs().max().item(), out


@pytest.mark.slow
@pytest.mark.parametrize(("engine", "family"), [("vllm", "qwen2.5-vl"), ("hf", "qwen2.5-vl"), ("vllm", "qwen3-vl")])
def test_unmerged_adapters_give_the_actors_logprobs_for_fewer_bytes(process_group, tiny_model_path, engine, family):
    from rollout_helpers import default_prompts
    from transformers import AutoConfig, AutoModelForImageTextToText, AutoProcessor

    from easyvlm.builtin.models import materialize_model
    from easyvlm.workers.hybrid import WEIGHT_SYNC_BYTES

    model_path = tiny_model_path if family == "qwen2.5-vl" else str(materialize_model(f"tiny-{family}"))
    prompts = default_prompts(AutoProcessor.from_pretrained(model_path), AutoConfig.from_pretrained(model_path))
    base = AutoModelForImageTextToText.from_pretrained(model_path, dtype=torch.float32)
    model_bytes = 4 * sum(t.numel() for t in base.state_dict().values())  # float32: what a merged sync sends
    merged, unmerged = hybrid_worker(model_path, engine, "true"), hybrid_worker(model_path, engine, "null")
    assert merged.rollout.lora is None and unmerged.rollout.lora is not None
    adapter_bytes = ADAPTER_BYTES  # the hand count (module docstring); Qwen3-VL's: the adapters' float32 bytes
    if family != "qwen2.5-vl":
        adapter_bytes = 4 * sum(p.numel() for n, p in unmerged.actor.model.named_parameters() if ".lora_" in n)
    for step, (seed, expected_bytes) in enumerate([(1, model_bytes + adapter_bytes), (2, adapter_bytes)]):
        for hybrid in (merged, unmerged):
            set_adapters(hybrid, seed)
        if step == 1:  # the engine still holds step 0's adapters: the check can fail
            stale, _ = engine_gap(unmerged, prompts, sync=False)
            assert stale > 0.05, stale
        merged_gap, merged_out = engine_gap(merged, prompts, sync=True)
        unmerged_gap, unmerged_out = engine_gap(unmerged, prompts, sync=True)
        print(f"{engine} step {step}: max |engine - actor| merged {merged_gap:.1e}, unmerged {unmerged_gap:.1e}")
        assert merged_gap <= ATOL and unmerged_gap <= ATOL
        # merged: the whole model every sync; unmerged: the base weights once, then the adapters alone
        assert merged_out.meta[WEIGHT_SYNC_BYTES] == model_bytes
        assert unmerged_out.meta[WEIGHT_SYNC_BYTES] == expected_bytes
    assert adapter_bytes / model_bytes < 0.15  # 9% of the tiny Qwen2.5-VL (~1% for a 7B at rank 64)


def test_frozen_tower_adapters_are_not_sent(process_group, tiny_model_path, prompts):
    # freeze_vision_tower: the tower's adapters never train (B stays 0), so neither vLLM's tower
    # adapters nor their bytes are needed
    from easyvlm.workers.hybrid import WEIGHT_SYNC_BYTES, HybridWorker

    plan = lora_plan(tiny_model_path, "worker.rollout.name=hf", "worker.actor.model.freeze_vision_tower=true")
    assert plan.rollout.engine.lora.tower is False
    hybrid = HybridWorker(plan.actor, None, plan.rollout)
    hybrid.push_weights()  # the base weights and the adapters
    set_adapters(hybrid, 1)
    assert hybrid.push_weights() == LM_ADAPTER_BYTES
    _, out = engine_gap(hybrid, prompts, sync=False)
    assert WEIGHT_SYNC_BYTES not in out.meta  # no sync, no bytes reported


def test_merge_for_rollout_in_the_plan(tiny_model_path, caplog):
    from easyvlm.builtin.models import materialize_model
    from easyvlm.models.specs import LoraSpec
    from easyvlm.rollout.specs import AdapterSpec

    from easyvlm.rollout.vllm import vllm_engine_kwargs

    engine = lora_plan(tiny_model_path, "worker.rollout.name=vllm").rollout.engine  # null: unmerged where served
    assert engine.lora == AdapterSpec(LoraSpec(8, 16, "all-linear", None), max_rank=8, tower=True)
    kwargs = vllm_engine_kwargs(engine)
    assert (kwargs["enable_lora"], kwargs["max_lora_rank"], kwargs["max_loras"], kwargs["enable_tower_connector_lora"]) == \
        (True, 8, 1, True)
    engine = lora_plan(tiny_model_path, "worker.rollout.name=vllm", "worker.actor.model.lora.rank=12",
                       "worker.actor.model.lora.exclude_modules=.*visual.*").rollout.engine
    assert (engine.lora.max_rank, engine.lora.tower) == (16, False)  # vLLM takes 8, 16, 32 ...: the next that holds 12
    kwargs = vllm_engine_kwargs(engine)
    assert kwargs["max_lora_rank"] == 16 and "enable_tower_connector_lora" not in kwargs
    assert lora_plan(tiny_model_path, "worker.rollout.name=vllm", f"{KEY}=true").rollout.engine.lora is None
    # separate engines: synchronous ones serve the adapters too; asynchronous ones take full weights (logged)
    separate = ("worker.rollout.name=vllm", "worker.rollout.placement=separate")
    assert lora_plan(tiny_model_path, *separate, f"{KEY}=false").rollout.engine.lora.max_rank == 8
    with caplog.at_level(logging.WARNING, logger="easyvlm.plan.roles"):
        assert lora_plan(tiny_model_path, *separate, "worker.rollout.max_staleness=1").rollout.engine.lora is None
    assert "asynchronous separate engines take each version's full weights" in caplog.text
    caplog.clear()
    assert rollout_plan(tiny_model_path, 12, "worker.rollout.name=vllm").rollout.engine.lora is None  # no LoRA
    # an MoE model: vLLM's LoRA experts layer needs triton (not on the CPU), so merged, and the reason logged
    moe = str(materialize_model("tiny-qwen3-vl-moe"))
    with caplog.at_level(logging.WARNING, logger="easyvlm.plan.roles"):
        assert lora_plan(moe, "worker.rollout.name=vllm").rollout.engine.lora is None
    assert "merged for rollout" in caplog.text and "'qwen3_vl_moe'" in caplog.text
    assert lora_plan(moe, "worker.rollout.name=hf").rollout.engine.lora is not None  # PEFT serves what PEFT trains
    with pytest.raises(ConfigError) as err:
        lora_plan(moe, "worker.rollout.name=vllm", f"{KEY}=false")
    assert err.value.problems[0].key == KEY and "qwen3_vl_moe" in err.value.problems[0].message


@pytest.mark.parametrize(("overrides", "words"), [
    ((f"{KEY}=false",), "rank is 0"),
    ((f"{KEY}=true",), "rank is 0"),
    ((*LORA, f"{KEY}=false", "worker.rollout.placement=separate", "worker.rollout.max_staleness=1"),
     "asynchronous separate engines"),
    (("worker.actor.model.lora.rank=1024", f"{KEY}=false", "worker.rollout.name=vllm"), "max_lora_rank"),
])
def test_merge_for_rollout_refusals(tiny_model_path, overrides, words):
    from plan_testing import config_for

    with pytest.raises(ConfigError) as err:
        config_for(tiny_model_path, *overrides)
    problems = [p for p in err.value.problems if p.key == KEY]
    assert len(problems) == 1 and words in problems[0].message, err.value.problems
    config_for(tiny_model_path, *[o for o in overrides if not o.startswith(KEY)])  # null: no problem
