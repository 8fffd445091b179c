"""Two-rank (gloo) programs for the FSDP and optimizer tests. Each ``*_main(rank, world_size, port,
..., out_file)`` runs in a process of ``torch.multiprocessing.spawn``; rank 0 saves what the test
checks to ``out_file``. Checks on per-rank data are made in the ranks and sent to rank 0 as plain
values, so a failure names the rank and the tensor."""

from __future__ import annotations

import dataclasses
import os

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from easyvlm.workers.dist import find_free_port


def spawn(main, *args) -> None:
    """Run ``main(rank, 2, port, *args)`` on 2 processes and wait for both."""
    mp.spawn(main, args=(2, find_free_port(), *args), nprocs=2, join=True)


def _init(rank: int, world_size: int, port: int) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    from easyvlm.workers.dist import init_distributed

    init_distributed("gloo")


def _finish(rank: int, result: dict, out_file: str) -> None:
    """Gather the ranks' results to rank 0's ``out_file``, close the group and end the process.

    Ends with ``os._exit(0)``, skipping the interpreter's finalization: gloo's worker threads can
    still be torn down there, and one that is destroyed while joinable aborts the process ("terminate
    called without an active exception", SIGABRT: seen twice in full test runs, never alone; see
    pytorch/pytorch#179291), which mp.spawn reports as the test's failure although every result is
    saved. Nothing may follow this call."""
    import sys

    per_rank = [None] * dist.get_world_size()
    dist.all_gather_object(per_rank, result)
    if rank == 0:
        torch.save(per_rank, out_file)
    dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def local(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t


# ------------------------------------------------------------------------------------------------
# AdamWBF16 on FSDP2 DTensors, and its checkpoint round trip


class SmallNet(torch.nn.Module):
    """Two blocks whose row counts (6 and 3) do not all split evenly over 2 ranks."""

    def __init__(self):
        super().__init__()
        self.first = torch.nn.Linear(5, 6)
        self.second = torch.nn.Linear(6, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, 5) -> (B, 3)
        return self.second(torch.tanh(self.first(x)))


def _train_steps(model: torch.nn.Module, optimizer: torch.optim.Optimizer, steps: int, seed: int) -> None:
    """``steps`` updates on the same data on every rank: FSDP's average of equal gradients is
    exactly the one-process gradient, so sharded and unsharded runs can be compared bit for bit."""
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        x = torch.randn(4, 5, generator=gen)
        model(x).square().sum().backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)


def optimizer_main(rank: int, world_size: int, port: int, ckpt_dir: str, out_file: str) -> None:
    from torch.distributed.fsdp import fully_shard

    from easyvlm.workers.settings import OptimConfig
    from easyvlm.workers.optim import build_optimizer, build_scheduler
    from easyvlm.workers.training import load_sharded_checkpoint, save_sharded_checkpoint

    _init(rank, world_size, port)
    optim = OptimConfig(strategy="adamw_bf16", lr=1e-2, weight_decay=0.1)

    def build() -> tuple[torch.nn.Module, torch.nn.Module, torch.optim.Optimizer, torch.optim.Optimizer]:
        torch.manual_seed(0)
        reference = SmallNet()  # unsharded, in this process
        sharded = SmallNet()
        sharded.load_state_dict(reference.state_dict())
        fully_shard(sharded.first)
        fully_shard(sharded.second)
        fully_shard(sharded)
        ref_opt, opt = build_optimizer(reference.parameters(), optim), build_optimizer(sharded.parameters(), optim)
        return reference, sharded, ref_opt, opt

    reference, sharded, ref_opt, opt = build()
    scheduler = build_scheduler(opt, optim, total_steps=10)
    _train_steps(reference, ref_opt, 3, seed=1)
    _train_steps(sharded, opt, 3, seed=1)
    result: dict = {"after_3": _compare(reference, ref_opt, sharded, opt)}

    save_sharded_checkpoint(ckpt_dir, sharded, opt, scheduler, rank)
    _, restored, _, restored_opt = build()  # fresh weights and empty optimizer state
    load_sharded_checkpoint(ckpt_dir, restored, restored_opt, build_scheduler(restored_opt, optim, 10), rank)
    result["restored"] = _compare(reference, ref_opt, restored, restored_opt)
    # one more step each: the restored run continues exactly as the reference
    _train_steps(reference, ref_opt, 1, seed=2)
    _train_steps(restored, restored_opt, 1, seed=2)
    result["after_restore_step"] = _compare(reference, ref_opt, restored, restored_opt)
    _finish(rank, result, out_file)


def _compare(reference, ref_opt, sharded, opt) -> dict:
    """Per parameter: the full sharded parameter and each state equal the reference's; state dtypes
    and placements."""
    from torch.distributed.tensor import DTensor

    out = {}
    ref_params = dict(reference.named_parameters())
    for name, param in sharded.named_parameters():
        ref_state, state = ref_opt.state[ref_params[name]], opt.state[param]
        out[name] = {
            "param_equal": torch.equal(param.full_tensor(), ref_params[name].detach()),
            "state_dtypes": {k: v.dtype for k, v in state.items() if k != "step"},
            "states_are_dtensors_like_param": all(
                isinstance(v, DTensor) and v.placements == param.placements for k, v in state.items() if k != "step"
            ),
            "states_equal": all(torch.equal(state[k].full_tensor(), ref_state[k]) for k in ("exp_avg", "exp_avg_sq")),
            "step": (float(state["step"]), float(ref_state["step"])),
            "local_rows": local(param).shape[0],
        }
    return out


# ------------------------------------------------------------------------------------------------
# FSDP plans on the tiny Qwen2.5-VL: rank-0 init and hybrid sharding


def _spec(model_path: str, **kw):
    from easyvlm.models.loading import load_hf_config
    from easyvlm.models.specs import ModelSpec

    fields = dict(
        model_dir=model_path, hf_config=load_hf_config(model_path), trust_remote_code=False,
        attn_implementation="sdpa", lora=None, freeze_vision_tower=False, gradient_checkpointing=False,
    )
    fields.update(kw)
    return ModelSpec(**fields)


def _sharded(spec, fsdp, rank: int, role: str = "policy") -> torch.nn.Module:
    """``load_model`` + ``apply_fsdp`` as a worker does; seeded so new weights are equal on all ranks."""
    from easyvlm.models.loading import load_model
    from easyvlm.workers.fsdp import apply_fsdp, fsdp_plan

    plan = fsdp_plan(fsdp, dist.get_world_size(), "cpu")
    torch.manual_seed(0)
    model = load_model(spec, role=role, on_meta=not plan.loads_weights(rank)).model
    return apply_fsdp(model, fsdp, torch.device("cpu"))


def _text_ids(seed: int) -> torch.Tensor:
    return torch.randint(0, 256, (2, 7), generator=torch.Generator().manual_seed(seed))  # (B, L)


def build_tied_text_model(out_dir) -> str:
    """A random 2-layer Qwen2 (hidden 64) whose LM head is its embedding table (tie_word_embeddings,
    as Qwen2.5-VL-3B), with the built-in byte tokenizer."""
    from transformers import AutoModelForCausalLM, Qwen2Config

    from easyvlm.builtin.models import build_tokenizer

    tokenizer = build_tokenizer()
    config = Qwen2Config(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    return str(out_dir)


# model: "vl" = the built-in tiny Qwen2.5-VL, "tied" = build_tied_text_model
RANK0_CASES = {
    "policy": dict(model="vl", role="policy", spec={}, fsdp_size=-1),
    "lora_frozen_tower": dict(model="vl", role="policy", spec=dict(lora=True, freeze_vision_tower=True), fsdp_size=-1),
    "critic": dict(model="vl", role="critic", spec={}, fsdp_size=-1),
    "policy_hsdp": dict(model="vl", role="policy", spec={}, fsdp_size=1),
    "tied_embeddings": dict(model="tied", role="policy", spec={}, fsdp_size=-1),
}


def fsdp_main(rank: int, world_size: int, port: int, model_paths: dict[str, str], out_file: str) -> None:
    """:func:`rank0_init_cases` and :func:`hsdp_cases` in one pair of processes (start-up is the
    slow part); rank 0 saves ``[{"rank0": ..., "hsdp": ...} per rank]``."""
    _init(rank, world_size, port)
    result = {"rank0": rank0_init_cases(rank, model_paths), "hsdp": hsdp_cases(rank, model_paths["vl"])}
    _finish(rank, result, out_file)


def rank0_init_cases(rank: int, model_paths: dict[str, str]) -> dict:
    """Per case: a model that every rank loads vs one that only rank 0 loads (rank 1 gets a model
    directory that does not exist, so any file read fails), both sharded: every local parameter
    shard, every buffer and every requires_grad flag must be equal, and so must the outputs."""
    from easyvlm.workers.settings import FSDPConfig
    from easyvlm.models.specs import LoraSpec

    lora = LoraSpec(rank=4, alpha=8, target_modules=("q_proj", "v_proj", "gate_proj"), exclude_modules=None)
    result = {}
    for case, how in RANK0_CASES.items():
        spec_kw = dict(how["spec"])
        if spec_kw.pop("lora", False):
            spec_kw["lora"] = lora
        spec = _spec(model_paths[how["model"]], **spec_kw)
        everyone = _sharded(spec, FSDPConfig(enable_rank0_init=False, fsdp_size=how["fsdp_size"]), rank, how["role"])
        if rank != 0:
            spec = dataclasses.replace(spec, model_dir="/nonexistent/easyvlm-rank0-init-test")
        from_rank0 = _sharded(spec, FSDPConfig(enable_rank0_init=True, fsdp_size=how["fsdp_size"]), rank, how["role"])
        params_a, params_b = dict(everyone.named_parameters()), dict(from_rank0.named_parameters())
        buffers_a, buffers_b = dict(everyone.named_buffers()), dict(from_rank0.named_buffers())
        ids = _text_ids(seed=rank)
        with torch.no_grad():
            out_a, out_b = everyone(input_ids=ids).logits, from_rank0(input_ids=ids).logits
        result[case] = {
            "names_equal": params_a.keys() == params_b.keys() and buffers_a.keys() == buffers_b.keys(),
            "param_mismatch": [n for n in params_a if not torch.equal(local(params_a[n]), local(params_b[n]))],
            "requires_grad_mismatch": [n for n in params_a if params_a[n].requires_grad != params_b[n].requires_grad],
            "buffer_mismatch": [n for n in buffers_a if not torch.equal(buffers_a[n], buffers_b[n])],
            "buffers": sorted(buffers_a),
            "meta_left": [n for n, t in [*params_b.items(), *buffers_b.items()] if t.is_meta],
            "trainable": sorted(n for n, p in params_b.items() if p.requires_grad),
            "lora": sorted(n for n in params_b if ".lora_" in n),
            "outputs_equal": torch.equal(out_a, out_b),
            "num_params": len(params_a),
            "tied": _is_tied(from_rank0),
        }
    return result


def _is_tied(model: torch.nn.Module) -> bool:
    """The LM head's weight is the embedding table's (one parameter)."""
    head = getattr(model, "lm_head", None)
    return head is not None and head.weight is model.get_input_embeddings().weight


def hsdp_cases(rank: int, model_path: str) -> dict:
    """fsdp_size=1 (2 replicas of 1 shard) vs fsdp_size=-1 (1 group of 2 shards): one AdamW step on
    different data per rank. Saves placements, whether local shards are whole, gradients and the
    updated weights of both (gathered, rank 0)."""
    import torch.nn.functional as F

    from easyvlm.workers.settings import FSDPConfig, OptimConfig
    from easyvlm.workers.fsdp import gather_full_state_dict
    from easyvlm.workers.optim import build_optimizer

    spec = _spec(model_path)
    result = {}
    for fsdp_size in (-1, 1):
        model = _sharded(spec, FSDPConfig(fsdp_size=fsdp_size, enable_rank0_init=False), rank)  # every rank loads
        optimizer = build_optimizer(model.parameters(), OptimConfig(lr=1e-3))
        ids = _text_ids(seed=10 + rank)  # each rank its own data
        logits = model(input_ids=ids).logits  # (B, L, V)
        loss = F.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())
        loss.backward()
        grads = {n: p.grad.full_tensor() for n, p in model.named_parameters() if p.grad is not None}
        optimizer.step()
        params = list(model.named_parameters())
        result[fsdp_size] = {
            "placements": {str(p.placements) for _, p in params},
            "mesh_shape": tuple(params[0][1].device_mesh.shape),
            "local_is_full": all(torch.equal(local(p), p.full_tensor()) for _, p in params),
            "loss": loss.item(),
            "grads": grads,
            "weights": gather_full_state_dict(model),
        }
    return result
