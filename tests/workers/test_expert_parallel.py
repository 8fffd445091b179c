"""Expert parallelism (``worker.actor.expert_parallel_size``) on 2 gloo ranks equals the experts
FSDP-sharded over the same 2 ranks (expert_parallel_size 1): old log-probs, the routing each token
took (R2's record), every gradient the optimizer sees, the load-balancing loss and the update's
metrics, on packed rows whose samples share their prompts (2 samples per prompt). Then the sharded
checkpoint round trip (into expert_parallel_size 2 and into 1) and the HF export.

Why within float rounding and not bitwise: each rank's experts run over the rows it receives from both
ranks, so a grouped product sees other row counts than with every expert local, and a CPU matrix
product's rounding depends on its row count (docs/benchmarks.md, issue 47). The tolerances below are
those of float32 sums of a few hundred terms (relative 1e-5), far below what one token sent to the
wrong rank or one missing routing weight changes (checked: both break every comparison below).
"""

from __future__ import annotations

import pytest
import torch
import torch.multiprocessing as mp
from workers_testing import PROMPTS, actor_spec, make_rl_batch, training_keys

from easyvlm.data.batch import ROUTED_EXPERTS_KEY
from easyvlm.workers.dist import find_free_port

MODELS = ["tiny-qwen3-vl-moe", "tiny-qwen3.5-moe"]
# 4 prompts x 2 samples: rank r trains rows [4 r, 4 r + 4), two groups of shared prompts each
GROUPS = [PROMPTS[0], PROMPTS[2], PROMPTS[1], PROMPTS[3]]
RESPONSES = [5, 9, 3, 7, 6, 2, 8, 4]
ACTOR = dict(
    global_batch_size=4,  # one mini-batch of 4 prompts x 2 samples: 4 samples per rank
    micro_batch_size_per_device_for_update=4,  # one packed micro-batch per rank, prompts shared
    micro_batch_size_per_device_for_experience=4,
    dynamic_batching=False,
    padding_free=True,
    share_prompts=True,
    enable_gradient_checkpointing=True,  # the checkpointed layers' recompute all-to-alls again
    router_replay="R2",  # the old pass records each token's experts; the update replays them
    router_aux_loss_coef=0.01,
    lr=1e-3,
    n=2,
)


def rank_main(rank: int, port: int, model_path: str, out_dir: str) -> None:
    import os

    import torch.distributed as dist

    os.environ.update(RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    from easyvlm.workers.actor import ActorWorker
    from easyvlm.workers.dist import init_distributed
    from easyvlm.workers.fsdp import full_tensor

    init_distributed("gloo")
    full = make_rl_batch(model_path, GROUPS, RESPONSES, n=2)
    noise, advantages = training_keys(full)
    rows = slice(4 * rank, 4 * rank + 4)
    batch = full.index(rows)
    results = {}
    for experts in (1, 2):
        actor = ActorWorker(actor_spec(model_path, total_steps=3, world_size=2, expert_parallel_size=experts, **ACTOR),
                            rank=rank, world_size=2)
        grads: dict[str, torch.Tensor] = {}

        def keep_grads(optimizer, args, kwargs, model=actor.model):  # the gradients the optimizer steps on
            for name, param in model.named_parameters():
                if param.grad is not None:
                    grads[name] = full_tensor(param.grad).clone()

        actor.optimizer.register_step_pre_hook(keep_grads)
        old = actor.compute_logprobs(batch)
        data = batch.copy()
        data["old_logprobs"] = old["old_logprobs"] + noise[rows]
        data["advantages"] = advantages[rows]
        data[ROUTED_EXPERTS_KEY] = old[ROUTED_EXPERTS_KEY]
        metrics = actor.update_policy(data)
        results[experts] = dict(logprobs=old["old_logprobs"], routed=old[ROUTED_EXPERTS_KEY], grads=grads,
                                metrics=metrics, weights=actor.state_dict_for_sync())
        actor.export_hf(f"{out_dir}/hf{experts}")
        if experts == 2:
            actor.save_checkpoint(f"{out_dir}/ckpt")
        del actor
    # the expert-parallel checkpoint restored into both layouts (torch.distributed.checkpoint reshards)
    for experts in (2, 1):
        fresh = ActorWorker(actor_spec(model_path, total_steps=3, world_size=2, expert_parallel_size=experts, **ACTOR),
                            rank=rank, world_size=2)
        fresh.load_checkpoint(f"{out_dir}/ckpt")
        results[f"restored{experts}"] = fresh.state_dict_for_sync()
        del fresh
    torch.save(results, f"{out_dir}/rank{rank}.pt")
    dist.barrier()
    dist.destroy_process_group()
    os._exit(0)  # no interpreter finalization: see fsdp_testing._finish


@pytest.fixture(scope="module", params=MODELS)
def two_rank_results(request, easyvlm_cache_dir, tmp_path_factory):
    from easyvlm.builtin.models import materialize_model

    model_path = str(materialize_model(request.param, cache_dir=easyvlm_cache_dir))
    out_dir = tmp_path_factory.mktemp(request.param)
    mp.spawn(rank_main, args=(find_free_port(), model_path, str(out_dir)), nprocs=2, join=True)
    return model_path, out_dir, [torch.load(out_dir / f"rank{r}.pt", weights_only=False) for r in (0, 1)]


def close(a: torch.Tensor, b: torch.Tensor) -> None:
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.slow
def test_expert_parallel_equals_experts_sharded_by_fsdp(two_rank_results):
    _, _, ranks = two_rank_results
    for rank in ranks:
        one, two = rank[1], rank[2]
        close(one["logprobs"], two["logprobs"])
        # every token of both ranks went to the same experts (R2's record: FREE at padding)
        assert torch.equal(one["routed"], two["routed"])
        assert one["grads"].keys() == two["grads"].keys()
        experts = [name for name in one["grads"] if name.endswith(("experts.gate_up_proj", "experts.down_proj"))]
        assert len(experts) >= 4 and all(one["grads"][name].abs().sum() > 0 for name in experts)
        for name, grad in one["grads"].items():
            torch.testing.assert_close(two["grads"][name], grad, rtol=1e-5, atol=1e-8, msg=name)
        for key in ("actor/pg_loss", "actor/grad_norm", "actor/moe/aux_loss", "actor/moe/expert_load_max",
                    "actor/moe/expert_load_min", "actor/ppo_kl", "actor/entropy_loss"):
            assert two["metrics"][key] == pytest.approx(one["metrics"][key], rel=1e-5, abs=1e-8), key
        # the weights after one AdamW step of lr 1e-3: the step is lr g / (|g| + eps) with eps 1e-8, so
        # where |g| ~ 1e-8 (within the gradients' atol) its rounding moves the step by up to ~0.5 %
        # of lr (seen: 2.1e-6 at one of 49,152 expert weights whose gradient is 1.01e-8 vs 1.00e-8)
        for name, weight in one["weights"].items():
            torch.testing.assert_close(two["weights"][name], weight, rtol=0, atol=5e-6, msg=name)


@pytest.mark.slow
def test_expert_parallel_checkpoint_and_export(two_rank_results):
    from safetensors.torch import load_file
    from transformers import AutoModelForImageTextToText

    model_path, out_dir, ranks = two_rank_results
    saved = ranks[0][2]["weights"]
    for rank in ranks:
        for restored in (rank["restored2"], rank["restored1"]):  # bitwise: the same numbers, other shards
            assert restored.keys() == saved.keys()
            assert all(torch.equal(restored[name], value) for name, value in saved.items())
    # the export holds the released layout of every expert tensor, as with every expert local (the
    # weights after one step: the update's tolerance, see the test above)
    files = {n: {k: v for p in sorted((out_dir / f"hf{n}").glob("*.safetensors")) for k, v in load_file(p).items()}
             for n in (1, 2)}
    assert files[1].keys() == files[2].keys()
    for name, value in files[1].items():
        assert files[2][name].shape == value.shape, name
        torch.testing.assert_close(files[2][name], value, rtol=0, atol=5e-6, msg=name)
    # and transformers loads it back to the trained weights, bit for bit
    loaded = AutoModelForImageTextToText.from_pretrained(out_dir / "hf2", dtype=torch.float32).state_dict()
    assert saved.keys() == loaded.keys()
    for name, value in saved.items():
        assert torch.equal(loaded[name], value), name
