"""bench/moe_cost_model.py against values derived by hand on a toy MoE, and its Qwen3-VL-30B-A3B
parameter counts against transformers' own model."""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

from moe_cost_model import (  # noqa: E402
    EASYR1_30B, H800, QWEN3_VL_30B_A3B, Hardware, Layout, MoEShape, Recipe, all_to_all_seconds, easyr1_baseline,
    main, memory_per_gpu, param_counts, pass_cost, step_cost)

# A toy MoE: 2 layers, 4 experts, top-2, hidden 8, experts of 4, 2 query heads and 1 KV head of 4,
# vocabulary 10, no vision tower.
TOY = MoEShape(hidden=8, layers=2, experts=4, top_k=2, expert_intermediate=4, heads=2, kv_heads=1, head_dim=4, vocab=10)
# 8 prompts x 2 samples of 4 tokens = 64 tokens per step; mini-batches of 4 prompts (2 optimizer steps);
# a micro-batch holds micro x (3 + 1) tokens: 1 sequence in the update, 2 in the log-prob passes.
# fp32 parameters and gradients, two fp32 Adam states, a bf16 reference, nothing offloaded.
TOY_RECIPE = Recipe("toy", prompts=8, n=2, mini_batch_prompts=4, micro_update=1, micro_experience=2, max_prompt=3,
                    max_response=1, mean_tokens=4, patches_per_sample=0, gradient_checkpointing=True, param_bytes=4,
                    grad_bytes=4, optimizer_bytes=8, ref_param_bytes=2)
# round numbers: 1000 FLOP/s, NVLink 1000 B/s, InfiniBand 100 B/s, 2 GPUs per node, PCIe 10 B/s
TOY_HW = Hardware("toy", peak_flops=1000.0, hbm_bytes=10_000.0, nvlink_busbw=1000.0, ib_busbw=100.0, gpus_per_node=2,
                  pcie_bytes_per_s=10.0)


def test_toy_parameter_counts_by_hand():
    p = param_counts(TOY)
    # attention per layer: q 8x8 + k 8x4 + v 8x4 + o 8x8 = 192, x 2 layers
    assert p.attention == 384
    # experts: 2 layers x 4 experts x (gate, up, down) 3 x 8 x 4
    assert p.experts == 768
    assert p.router == 2 * 4 * 8 == 64
    # per layer 2 RMSNorms of 8 and q/k norms of 4, then the final norm: 2 x (16 + 8) + 8
    assert p.norms == 56
    assert (p.embedding, p.lm_head, p.vision) == (80, 80, 0)
    assert p.total == 1432 and p.non_expert == 664


def test_fsdp_alone_gathers_every_parameter_in_every_forward_and_backward():
    # W = 2, e = 1. 32 tokens per GPU. Update: 16 per optimizer step in micro-batches of one 4-token
    # sequence: 4 per optimizer step, 8 in all. Log-probs: micro-batches of 2 sequences, 8 tokens: 4.
    update = pass_cost(TOY, TOY_RECIPE, TOY_HW, 2, Layout(1), "update", mfu=0.5)
    old = pass_cost(TOY, TOY_RECIPE, TOY_HW, 2, Layout(1), "old", mfu=0.5)
    assert (update.micro_batches, update.tokens_per_micro_batch) == (8, 4)
    assert (old.micro_batches, old.tokens_per_micro_batch) == (4, 8)
    # one all-gather of all 1432 parameters in bf16 (2864 bytes) over 2 ranks: each receives half, 1432 B.
    # Update: a forward and a backward per micro-batch, 16 gathers = 22,912 B, at 1000 B/s 22.912 s
    assert update.bytes["param_all_gather"] == 16 * 1432 == 22912
    assert update.seconds["param_all_gather"] == pytest.approx(22.912)
    # reduce-scatter of the fp32 gradients (5728 B) after each of the 8 micro-batches: half each, 2864 B
    assert update.bytes["grad_sync"] == 8 * 2864 == 22912
    assert update.bytes["token_all_to_all"] == 0 and update.bytes["pcie"] == 0
    # log-probs: one gather per micro-batch, no gradients
    assert (old.bytes["param_all_gather"], old.bytes["grad_sync"]) == (4 * 1432, 0)
    # each expert multiplies 4 tokens x top-2 / 4 experts = 2 rows per update micro-batch
    assert update.rows_per_expert_product == 2


def test_the_flops_by_hand():
    # multiplied per token: attention 384 + router 64 + 2 of 4 experts 384 + lm_head 80 = 912; causal
    # attention scores at the mean length: 2 x 4 tokens x 2 heads x 4 x 2 layers = 128. A forward over
    # the GPU's 32 tokens: 2 x (912 + 128) x 32 = 66,560 FLOPs
    old = pass_cost(TOY, TOY_RECIPE, TOY_HW, 2, Layout(1), "old", mfu=0.5)
    assert old.flops == old.model_flops == 66560
    assert old.seconds["compute"] == pytest.approx(66560 / (1000 * 0.5))
    # the update: forward, recomputed forward, backward (2 forwards): 4 x 66,560; MFU counts 6 x, not 8 x
    update = pass_cost(TOY, TOY_RECIPE, TOY_HW, 2, Layout(1), "update", mfu=0.5)
    assert (update.flops, update.model_flops) == (4 * 66560, 3 * 66560)
    # transformers 4.57's eval path: all 4 experts per token, 768 / 2 = 384 more: 2 x (1296 + 128) x 32
    dense = dataclasses.replace(TOY_RECIPE, log_probs_all_experts=True)
    assert pass_cost(TOY, dense, TOY_HW, 2, Layout(1), "old", mfu=0.5).flops == 91136
    assert pass_cost(TOY, dense, TOY_HW, 2, Layout(1), "update", mfu=0.5).flops == 4 * 66560  # training: routed only


def test_expert_parallelism_gathers_only_the_rest_and_sends_tokens_by_all_to_all():
    # W = 2, e = 2: one expert-parallel group holds all the experts (no copies, nothing to all-reduce)
    update = pass_cost(TOY, TOY_RECIPE, TOY_HW, 2, Layout(2), "update", mfu=0.5)
    old = pass_cost(TOY, TOY_RECIPE, TOY_HW, 2, Layout(2), "old", mfu=0.5)
    # the 664 non-expert parameters: 664 x 2 B / 2 per gather, 16 gathers; 664 x 4 B / 2 per reduce-scatter, 8
    assert update.bytes["param_all_gather"] == 16 * 664 == 10624
    assert update.bytes["grad_sync"] == 8 * 1328 == 10624
    # one all-to-all of a 4-token micro-batch: 4 tokens x 2 experts x 8 x 2 B, half of it to the other
    # rank: 64 B. Per micro-batch: dispatch + combine x 2 layers x (forward, recomputed forward, backward)
    # = 12, 768 B; 8 micro-batches: 6,144 B
    assert update.bytes["token_all_to_all"] == 8 * 12 * 64 == 6144
    # log-probs: 8-token micro-batches, 128 B each, 2 x 2 layers x 1 forward, 4 micro-batches
    assert old.bytes["token_all_to_all"] == 4 * 4 * 128 == 2048
    assert update.rows_per_expert_product == 4  # 4 tokens x 2 / 4 experts, from both ranks


def test_replicated_experts_all_reduce_and_the_sharded_variant_gathers_across_groups():
    # W = 4 (2 nodes of 2), e = 2: two copies of the experts. 16 tokens per GPU: update 2 micro-batches
    # per optimizer step (4), log-probs 2.
    rep = pass_cost(TOY, TOY_RECIPE, TOY_HW, 4, Layout(2), "update", mfu=0.5, expert_grad_sync="micro-batch")
    assert rep.micro_batches == 4
    # non-expert: gather 664 x 2 B x 3/4 = 996 B (8 gathers), reduce-scatter 664 x 4 B x 3/4 = 1992 B (4)
    non_expert_gathers, non_expert_reduce = 8 * 996, 4 * 1992
    assert rep.bytes["param_all_gather"] == non_expert_gathers == 7968
    # a rank's 2 experts: 384 parameters, 1536 B of fp32 gradients; ring all-reduce over the 2 copies:
    # 2 x 1/2 x 1536 = 1536 B, after each of the 4 micro-batches
    assert rep.bytes["grad_sync"] == non_expert_reduce + 4 * 1536 == 14112
    # ... or once per optimizer step (2): the default, as easyvlm's reduce_expert_grads
    per_step = pass_cost(TOY, TOY_RECIPE, TOY_HW, 4, Layout(2), "update", mfu=0.5)
    assert per_step.bytes["grad_sync"] == non_expert_reduce + 2 * 1536 == 11040
    # the FSDP group (4 ranks) and the copies (ranks 2 apart) span both nodes: InfiniBand, 100 B/s; the
    # expert-parallel pair is within a node: NVLink. All-to-alls: 4 micro-batches x 12 x 64 B = 3,072 B
    assert rep.seconds["param_all_gather"] == pytest.approx(79.68)
    assert rep.seconds["grad_sync"] == pytest.approx(141.12)
    assert rep.bytes["token_all_to_all"] == 3072 and rep.seconds["token_all_to_all"] == pytest.approx(3.072)
    # sharded: the rank's 384 expert parameters gathered across the 2 groups, 384 x 2 B / 2 = 384 B per
    # gather (8), reduce-scattered 384 x 4 B / 2 = 768 B (4); no all-reduce
    sharded = pass_cost(TOY, TOY_RECIPE, TOY_HW, 4, Layout(2, sharded=True), "update", mfu=0.5)
    assert sharded.bytes["param_all_gather"] == non_expert_gathers + 8 * 384 == 11040
    assert sharded.bytes["grad_sync"] == non_expert_reduce + 4 * 768 == 11040


def test_an_all_to_all_across_nodes_runs_at_the_slower_link():
    # e = 4 over 2 nodes of 2: of the 3 other ranks, 2 are on the other node: 2/3 of 300 B over
    # InfiniBand (2 s), 1/3 over NVLink (0.1 s) at the same time
    assert all_to_all_seconds(300.0, 4, TOY_HW) == pytest.approx(2.0)
    assert all_to_all_seconds(300.0, 2, TOY_HW) == pytest.approx(0.3)


def test_memory_by_hand():
    # W = 4. FSDP alone: 1432 / 4 = 358 parameters per GPU: 4 B each, gradients 4 B, Adam 8 B, reference 2 B
    fsdp = memory_per_gpu(TOY, TOY_RECIPE, 4, Layout(1))
    assert (fsdp.parameters, fsdp.gradients, fsdp.optimizer, fsdp.reference) == (1432, 1432, 2864, 716)
    # FSDP's buffers: embedding + lm_head (160) in bf16, and two gathered layers in bf16 and one fp32
    # gradient: a layer is (384 + 64 + 56) / 2 = 252 non-expert parameters + 768 / 2 = 384 of experts
    assert fsdp.unsharded_buffers == 160 * 2 + 636 * (2 + 2 + 4) == 5408
    # e = 2, experts replicated: 664 / 4 = 166 + a rank's 2 experts, 384 = 550 parameters
    rep = memory_per_gpu(TOY, TOY_RECIPE, 4, Layout(2))
    assert (rep.parameters, rep.gradients, rep.optimizer, rep.reference) == (2200, 2200, 4400, 1100)
    assert rep.unsharded_buffers == 320 + 252 * 8 == 2336  # the experts are never gathered
    assert rep.resident == 2200 + 2200 + 4400 + 1100 + 2336 == 12236
    # sharded across the 2 groups: 166 + 768 / 4 = 358, as FSDP alone; it gathers half a layer's experts
    sharded = memory_per_gpu(TOY, TOY_RECIPE, 4, Layout(2, sharded=True))
    assert sharded.actor == fsdp.actor == 1432 + 1432 + 2864
    assert sharded.unsharded_buffers == 320 + (252 + 192) * 8 == 3872
    # 12,236 B do not fit the toy's 10,000; the sharded layout's 5728 + 716 + 3872 = 10,316 neither
    assert not step_cost(TOY, TOY_RECIPE, TOY_HW, 4, Layout(2), 0.5).fits
    assert not step_cost(TOY, TOY_RECIPE, TOY_HW, 4, Layout(2, sharded=True), 0.5).fits
    assert step_cost(TOY, TOY_RECIPE, TOY_HW, 8, Layout(1), 0.5).fits  # 716 + 716 + 1432 + 358 + 5408


def test_offload_crosses_pcie_by_hand():
    # EasyR1's flags on the toy, W = 2: the actor's shard (716 parameters, 2864 B) down and up around each
    # pass, the optimizer (5728 B) around the update, the reference (1432 B) at every one of its 4 forwards
    offload = dataclasses.replace(TOY_RECIPE, actor_offload=True, optimizer_offload=True, ref_offload="every-forward")
    cost = {kind: pass_cost(TOY, offload, TOY_HW, 2, Layout(1), kind, 0.5) for kind in ("old", "ref", "update")}
    assert cost["old"].bytes["pcie"] == 2 * 2864
    assert cost["update"].bytes["pcie"] == 2 * (2864 + 5728)
    assert cost["ref"].bytes["pcie"] == 4 * 1432 and cost["ref"].seconds["pcie"] == pytest.approx(572.8)
    # bounds: serial is the sum of everything; overlapped the longest of compute, collectives, PCIe
    old = cost["old"]
    assert old.serial_s == pytest.approx(old.seconds["compute"] + old.network_s + old.seconds["pcie"])
    assert old.overlapped_s == max(old.seconds["compute"], old.network_s, old.seconds["pcie"])


def test_qwen3_vl_30b_counts_are_transformers_model():
    """The written-out shapes give, group by group, the parameters transformers builds for
    Qwen3-VL-30B-A3B's config (31,070,754,032: the hub's 31.1 B)."""
    import torch
    import transformers

    shape = QWEN3_VL_30B_A3B
    config = transformers.Qwen3VLMoeConfig(
        text_config=dict(vocab_size=shape.vocab, hidden_size=shape.hidden, num_hidden_layers=shape.layers,
                         num_attention_heads=shape.heads, num_key_value_heads=shape.kv_heads, head_dim=shape.head_dim,
                         moe_intermediate_size=shape.expert_intermediate, num_experts=shape.experts,
                         num_experts_per_tok=shape.top_k, intermediate_size=6144, decoder_sparse_step=1),
        vision_config=dict(depth=shape.vision_depth, hidden_size=shape.vision_hidden,
                           intermediate_size=shape.vision_intermediate, num_heads=16, patch_size=shape.patch,
                           temporal_patch_size=shape.temporal_patch, spatial_merge_size=shape.merge,
                           out_hidden_size=shape.hidden, num_position_embeddings=shape.vision_position_embeddings,
                           deepstack_visual_indexes=[8, 16, 24]),
        tie_word_embeddings=False)
    with torch.device("meta"):
        model = transformers.Qwen3VLMoeForConditionalGeneration._from_config(config)
    counts = {"vision": 0, "experts": 0, "router": 0, "embedding": 0, "lm_head": 0, "rest": 0}
    for name, param in model.named_parameters():
        group = ("vision" if "visual" in name else "experts" if ".experts." in name else "router" if "mlp.gate." in name
                 else "embedding" if "embed_tokens" in name else "lm_head" if "lm_head" in name else "rest")
        counts[group] += param.numel()
    p = param_counts(shape)
    assert counts == {"vision": p.vision, "experts": p.experts, "router": p.router, "embedding": p.embedding,
                      "lm_head": p.lm_head, "rest": p.attention + p.norms}
    assert p.total == 31_070_754_032
    # Qwen3-30B-A3B's model card: 29.9 B non-embedding parameters in the decoder, 3.3 B activated
    assert p.total - p.vision - p.embedding - p.lm_head == pytest.approx(29.9e9, abs=0.05e9)
    assert p.attention + p.router + p.norms + p.experts / 16 + p.embedding + p.lm_head == pytest.approx(3.3e9, abs=0.06e9)


def test_easyr1_baseline_by_hand():
    # 80 tokens/s x 8 GPUs x 4,600 s = 2,944,000 tokens; / (512 x 5) = 1,150 per sample
    base = easyr1_baseline()
    assert (base["tokens_per_step"], base["tokens_per_sample"]) == (2_944_000, 1150)
    # EasyR1's count: per layer 2048 x 8 x 768 x 3 + 2048 x 128 (experts, router) + 2048 x 9216 (q, k, v, o)
    # = 56,885,248; x 48 + 2 x 151,936 x 2048 = 3,352,821,760; x 6 x 2,944,000 = 5.9224e16, plus
    # 12 x 2560 x 1150^2 x 128 x 32 x 48 = 7.9876e15: 6.7212e16 over 1.8 % x 989e12 x 8 = 471.9 s
    assert base["update_s_implied"] == pytest.approx(6.721187610624e16 / (0.018 * 989e12 * 8), rel=1e-9)
    assert base["update_s_implied"] == pytest.approx(471.94, abs=0.01)


def test_qwen3_vl_30b_on_8_gpus_memory():
    # EasyR1's recipe keeps 2 + 2 + 6 bytes per parameter: FSDP alone, 31,070,754,032 x 10 / 8 = 38.84 GB
    fsdp = memory_per_gpu(QWEN3_VL_30B_A3B, EASYR1_30B, 8, Layout(1))
    assert fsdp.actor == pytest.approx(31_070_754_032 * 10 / 8)
    # replicated experts: each rank holds 28.99 B / e of them; e = 4 needs 2.08 B / 8 + 7.25 B = 7.51 B
    # parameters x 10 B = 75.1 GB of actor state, more than fits beside anything else
    rows = {(e, s): step_cost(QWEN3_VL_30B_A3B, EASYR1_30B, H800, 8, Layout(e, s), 0.3)
            for e in (1, 2, 4, 8) for s in (False, True)}
    assert rows[(4, False)].memory.actor == pytest.approx(75.1e9, rel=1e-3)
    assert [rows[(e, False)].fits for e in (1, 2, 4, 8)] == [True, False, False, True]
    assert all(rows[(e, True)].fits for e in (1, 2, 4, 8))  # sharded: always FSDP alone's state
    # e = 8 on 8 GPUs: one copy of the experts, both layouts the same traffic
    assert rows[(8, False)].bytes("grad_sync") == rows[(8, True)].bytes("grad_sync")


def test_the_cli_writes_every_row(tmp_path, capsys):
    out = main(["--json", str(tmp_path / "rows.json")])
    rows = json.loads((tmp_path / "rows.json").read_text())["rows"]
    assert [(r["expert_parallel"], r["sharded"]) for r in rows] == [
        (1, False), (2, False), (4, False), (8, False), (2, True), (4, True), (8, True)]
    assert out["easyr1_gap"]["update_s_implied"] == pytest.approx(471.94, abs=0.01)
    assert "| FSDP alone | 1 |" in capsys.readouterr().out
