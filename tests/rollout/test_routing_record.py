"""The transformers engine records each sampled token's experts (router replay R3) on the builtin MoE
models; the reference is transformers' own unmodified model over the finished rows (its routers'
top-2 from ``output_router_logits``), never easyvlm's routing code."""

from __future__ import annotations

import pytest
import torch
from rollout_helpers import default_prompts, reference_experts, rollout_plan, with_sampling
from transformers import AutoConfig, AutoModelForImageTextToText, AutoProcessor

from easyvlm.data.batch import ROUTED_EXPERTS_KEY
from easyvlm.models.moe_routing import FREE
from easyvlm.rollout.factory import build_rollout

T = 10


@pytest.fixture(scope="module", params=["tiny-qwen3.5-moe", "tiny-qwen3-vl-moe"])
def model_dir(request, easyvlm_cache_dir) -> str:
    from easyvlm.builtin.models import materialize_model

    return str(materialize_model(request.param, cache_dir=easyvlm_cache_dir))


def test_the_engine_records_the_experts_of_every_fed_token(model_dir):
    spec = rollout_plan(model_dir, T, "worker.rollout.name=hf", "worker.rollout.max_num_seqs=3",
                        "worker.actor.router_replay=R3").rollout
    assert spec.engine.record_routing
    engine = build_rollout(spec)
    prompts = default_prompts(AutoProcessor.from_pretrained(model_dir), AutoConfig.from_pretrained(model_dir))
    out = engine.generate(prompts, with_sampling(engine, temperature=1.0))  # 2 chunks of rows (max_num_seqs 3)
    routed = out[ROUTED_EXPERTS_KEY]
    B, L = out["input_ids"].shape
    assert routed.shape == (B, L, AutoConfig.from_pretrained(model_dir).get_text_config().num_hidden_layers, 2)
    mask = out["attention_mask"].bool()
    recorded = routed != FREE
    assert torch.equal(recorded.all(-1), recorded.any(-1))  # a token's k entries are all set or all FREE
    recorded = recorded.all(-1).all(-1)  # (B, L)
    assert not (recorded & ~mask).any()  # padding stays FREE
    # every attended token is recorded but a row's last sampled one (it is fed only while other rows run)
    last = out["attention_mask"].long().cumsum(-1).argmax(-1)
    fed = mask.clone()
    fed[torch.arange(B), last] = False
    assert (recorded | ~fed).all()
    expected, _ = reference_experts(AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32).eval(), out)
    assert torch.equal(routed[recorded].long().sort(-1).values, expected[recorded].sort(-1).values)


def test_without_r3_nothing_is_recorded(model_dir):
    engine = build_rollout(rollout_plan(model_dir, T, "worker.rollout.name=hf").rollout)
    prompts = default_prompts(AutoProcessor.from_pretrained(model_dir), AutoConfig.from_pretrained(model_dir))
    assert ROUTED_EXPERTS_KEY not in engine.generate(prompts)
