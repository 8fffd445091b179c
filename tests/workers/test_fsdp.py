"""Every FSDPConfig key acts: the plan (pure, the CUDA choices checked on the CPU), buffer casting,
and on 2 gloo ranks rank-0 init (equal to loading on every rank, rank 1 reads no file) and hybrid
sharding (fsdp_size=1: whole parameters on each rank, the same step as fsdp_size=-1)."""

from __future__ import annotations

import pytest
import torch
from fsdp_testing import RANK0_CASES, build_tied_text_model, fsdp_main, spawn

from easyvlm.workers.settings import FSDPConfig
from easyvlm.workers.fsdp import FSDPPlan, cast_buffers, fsdp_plan, fully_shard_kwargs


# ------------------------------------------------------------------------------------------ plans
def test_default_plan_on_the_cpu_is_float32_over_all_ranks():
    assert fsdp_plan(FSDPConfig(), 2, "cpu") == FSDPPlan(
        mesh_shape=(2,), mesh_dim_names=("shard",), param_dtype=None, reduce_dtype=None, buffer_dtype=None,
        reshard_after_forward=True, cpu_offload=False, rank0_init=True,
    )


def test_cpu_ignores_mixed_precision_and_offload():
    fsdp = FSDPConfig(mp_param_dtype="bf16", mp_reduce_dtype="bf16", mp_buffer_dtype="bf16", enable_cpu_offload=True)
    plan = fsdp_plan(fsdp, 4, "cpu")
    assert (plan.param_dtype, plan.reduce_dtype, plan.buffer_dtype, plan.cpu_offload) == (None, None, None, False)
    kwargs = fully_shard_kwargs(plan)
    assert (kwargs["mp_policy"].param_dtype, kwargs["mp_policy"].reduce_dtype) == (None, None)
    assert type(kwargs["offload_policy"]).__name__ == "OffloadPolicy"


def test_cuda_plan_takes_every_precision_key():
    fsdp = FSDPConfig(
        mp_param_dtype="bfloat16", mp_reduce_dtype="fp32", mp_buffer_dtype="fp16", enable_full_shard=False
    )
    plan = fsdp_plan(fsdp, 8, "cuda")
    assert (plan.param_dtype, plan.reduce_dtype, plan.buffer_dtype) == (torch.bfloat16, torch.float32, torch.float16)
    assert plan.reshard_after_forward is False  # enable_full_shard=False: ZeRO-2
    assert plan.cpu_offload is False
    kwargs = fully_shard_kwargs(plan)
    assert (kwargs["mp_policy"].param_dtype, kwargs["mp_policy"].reduce_dtype) == (torch.bfloat16, torch.float32)
    assert kwargs["reshard_after_forward"] is False


def test_cuda_cpu_offload_is_fsdp2s_policy():
    from torch.distributed.fsdp import CPUOffloadPolicy

    plan = fsdp_plan(FSDPConfig(enable_cpu_offload=True), 8, "cuda")
    assert plan.cpu_offload
    assert isinstance(fully_shard_kwargs(plan)["offload_policy"], CPUOffloadPolicy)
    assert not isinstance(fully_shard_kwargs(fsdp_plan(FSDPConfig(), 8, "cuda"))["offload_policy"], CPUOffloadPolicy)


@pytest.mark.parametrize(
    ("fsdp_size", "world", "shape", "names"),
    [
        (-1, 8, (8,), ("shard",)),
        (8, 8, (8,), ("shard",)),  # == world size: plain FSDP
        (2, 8, (4, 2), ("replicate", "shard")),  # 4 replicas of 2 shards
        (1, 2, (2, 1), ("replicate", "shard")),  # pure replication (DDP-like)
    ],
)
def test_fsdp_size_gives_the_mesh(fsdp_size, world, shape, names):
    plan = fsdp_plan(FSDPConfig(fsdp_size=fsdp_size), world, "cuda")
    assert (plan.mesh_shape, plan.mesh_dim_names) == (shape, names)


@pytest.mark.parametrize(("fsdp_size", "world"), [(3, 8), (16, 8), (0, 8), (-2, 8)])
def test_fsdp_size_that_does_not_divide_the_world_is_refused(fsdp_size, world):
    match = rf"^worker\.critic\.fsdp\.fsdp_size={fsdp_size} with {world} ranks: .* a divisor"
    with pytest.raises(ValueError, match=match):
        fsdp_plan(FSDPConfig(fsdp_size=fsdp_size), world, "cuda", key="worker.critic.fsdp")


def test_rank0_init_plan():
    plan = fsdp_plan(FSDPConfig(enable_rank0_init=True), 4, "cuda")
    assert plan.rank0_init and [plan.loads_weights(r) for r in range(4)] == [True, False, False, False]
    off = fsdp_plan(FSDPConfig(enable_rank0_init=False), 4, "cuda")
    assert [off.loads_weights(r) for r in range(4)] == [True] * 4
    # one rank: nothing to broadcast
    assert not fsdp_plan(FSDPConfig(enable_rank0_init=True), 1, "cpu").rank0_init


def test_use_orig_params_changes_nothing():
    # FSDP2 always keeps the original parameters: both values give the same plan
    assert fsdp_plan(FSDPConfig(use_orig_params=True), 8, "cuda") == fsdp_plan(FSDPConfig(), 8, "cuda")


@pytest.mark.parametrize("use_orig_params", [False, True])
def test_fsdp2_keeps_the_original_parameters_either_way(process_group, use_orig_params):
    # FSDP1's use_orig_params=False flattened parameters into one FlatParameter per unit; FSDP2 keeps
    # one DTensor per original parameter, with its name, shape and values, whatever the key says
    from fsdp_testing import SmallNet
    from torch.distributed.tensor import DTensor

    from easyvlm.workers.fsdp import apply_fsdp

    torch.manual_seed(0)
    model = SmallNet()
    original = {n: p.detach().clone() for n, p in model.named_parameters()}
    apply_fsdp(model, FSDPConfig(use_orig_params=use_orig_params), torch.device("cpu"))
    params = dict(model.named_parameters())
    assert params.keys() == original.keys()
    assert all(isinstance(p, DTensor) and torch.equal(p.full_tensor(), original[n]) for n, p in params.items())


class _Rotary(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("inv_freq", torch.tensor([1.0, 0.1, 0.01]), persistent=False)
        self.register_buffer("original_inv_freq", torch.tensor([1.0, 0.1, 0.01]), persistent=False)


class _WithBuffers(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.rotary = _Rotary()
        self.register_buffer("scale", torch.tensor([1.0 / 3.0]))
        self.register_buffer("counts", torch.tensor([3]))


def test_cast_buffers_keeps_rotary_frequencies_float32():
    model = _WithBuffers()
    cast_buffers(model, torch.bfloat16)
    assert model.scale.dtype == torch.bfloat16
    # 1/3 = 1.0101010|1010...b x 2^-2, rounded up to 8 significant bits: 1.0101011b x 2^-2
    assert model.scale.item() == 0.333984375
    assert model.counts.dtype == torch.int64  # integers stay
    assert model.rotary.inv_freq.dtype == model.rotary.original_inv_freq.dtype == torch.float32
    assert "scale" in model.state_dict() and "rotary.inv_freq" not in model.state_dict()  # persistence kept


def test_a_meta_model_that_would_receive_no_weights_is_refused(process_group):
    from fsdp_testing import SmallNet

    from easyvlm.workers.fsdp import apply_fsdp

    with torch.device("meta"):
        model = SmallNet()
    # one rank: rank-0 init has nobody to send to, so rank 0 must have loaded the weights itself
    with pytest.raises(ValueError, match=r"rank 0 got a model on the meta device, but with worker\.ref\.fsdp"):
        apply_fsdp(model, FSDPConfig(enable_rank0_init=True), torch.device("cpu"), key="worker.ref.fsdp")


# ---------------------------------------------------------------------------------- two gloo ranks
@pytest.fixture(scope="module")
def two_rank_results(tiny_model_path, tmp_path_factory):
    tied = build_tied_text_model(tmp_path_factory.mktemp("tied"))
    out = str(tmp_path_factory.mktemp("fsdp") / "out.pt")
    spawn(fsdp_main, {"vl": tiny_model_path, "tied": tied}, out)
    return torch.load(out, weights_only=False)


@pytest.fixture(scope="module")
def rank0_results(two_rank_results):
    return [r["rank0"] for r in two_rank_results]


@pytest.fixture(scope="module")
def hsdp_results(two_rank_results):
    return [r["hsdp"] for r in two_rank_results]


@pytest.mark.slow
@pytest.mark.parametrize("case", list(RANK0_CASES))
def test_rank0_init_equals_loading_on_every_rank(rank0_results, case):
    for rank, result in enumerate(rank0_results):
        got = result[case]
        assert got["names_equal"], (rank, case)
        # rank 1 built on the meta device from a directory that does not exist: it read no file,
        # and every parameter shard and buffer now holds rank 0's values
        assert got["param_mismatch"] == [], (rank, case)
        assert got["buffer_mismatch"] == [], (rank, case)
        assert got["requires_grad_mismatch"] == [], (rank, case)
        assert got["meta_left"] == [], (rank, case)
        assert got["outputs_equal"], (rank, case)
        # the non-persistent rotary frequencies (not in the state dict) are among the checked buffers
        assert any(name.endswith("rotary_emb.inv_freq") for name in got["buffers"]), got["buffers"]
        if RANK0_CASES[case]["model"] == "vl":  # and the vision tower's
            assert any(name.endswith("rotary_pos_emb.inv_freq") for name in got["buffers"]), got["buffers"]
        # tied LM head and embeddings (Qwen2.5-VL-3B) stay one parameter on the meta-built rank too
        assert got["tied"] == (case == "tied_embeddings"), (rank, case)


@pytest.mark.slow
def test_rank0_init_keeps_lora_and_the_frozen_tower(rank0_results):
    got = rank0_results[1]["lora_frozen_tower"]  # rank 1: built on meta, weights from rank 0
    assert got["trainable"] and all(".lora_A." in n or ".lora_B." in n for n in got["trainable"])
    # gate_proj is a target, so the vision MLPs have adapters too; the frozen tower keeps them frozen
    vision_adapters = [n for n in got["lora"] if ".visual." in n]
    assert vision_adapters and not set(vision_adapters) & set(got["trainable"])
    assert set(got["trainable"]) == {n for n in got["lora"] if ".visual." not in n}


@pytest.mark.slow
def test_fsdp_size_1_keeps_whole_parameters_on_each_rank(hsdp_results):
    for result in hsdp_results:
        hsdp, full = result[1], result[-1]
        assert hsdp["mesh_shape"] == (2, 1) and hsdp["placements"] == {"(Replicate(), Shard(dim=0))"}
        assert hsdp["local_is_full"]
        assert full["mesh_shape"] == (2,) and full["placements"] == {"(Shard(dim=0),)"}
        assert not full["local_is_full"]  # the control: fsdp_size=-1 splits them


@pytest.mark.slow
def test_fsdp_size_1_steps_like_fsdp_size_minus_1(hsdp_results):
    hsdp, full = hsdp_results[0][1], hsdp_results[0][-1]
    assert hsdp["grads"].keys() == full["grads"].keys() and full["grads"]
    for name, grad in full["grads"].items():
        # both average the 2 ranks' gradients: (g0 + g1) / 2 exactly, whichever collective does it
        torch.testing.assert_close(hsdp["grads"][name], grad, rtol=0, atol=0, msg=name)
    for name, weight in full["weights"].items():
        torch.testing.assert_close(hsdp["weights"][name], weight, rtol=0, atol=0, msg=name)
    # the ranks had different data (else any reduction would give the same gradient)
    assert hsdp_results[0][1]["loss"] != hsdp_results[1][1]["loss"]


def test_torch_dtype_is_the_load_dtype_on_gpus():
    # fsdp.torch_dtype: the dtype the weights are loaded in on GPUs; None = the role's default
    # (actor and critic float32, the reference model bfloat16); the CPU always loads float32
    from easyvlm.workers.training import model_dtype

    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert model_dtype(FSDPConfig(torch_dtype="bf16"), cuda, torch.float32) == torch.bfloat16
    assert model_dtype(FSDPConfig(torch_dtype="float16"), cuda, torch.bfloat16) == torch.float16
    assert model_dtype(FSDPConfig(), cuda, torch.bfloat16) == torch.bfloat16
    assert model_dtype(FSDPConfig(torch_dtype="bf16"), cpu, torch.float32) == torch.float32
