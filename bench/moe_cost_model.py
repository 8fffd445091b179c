"""A cost model of the training passes of MoE VLM RL (old log-probs, reference log-probs, update) on
W GPUs, with FSDP alone and with expert parallelism (``worker.actor.expert_parallel_size`` e): bytes
moved per GPU by kind, FLOPs, memory per GPU and predicted seconds. It measures nothing: every
figure follows from the inputs below, and each input says where it comes from (published, derived
or assumed). docs/cluster_model.md ("MoE at scale") has the table and what it leaves out.

    python bench/moe_cost_model.py [--gpus 8] [--ep 2 4 8] [--gpu h800|h100] [--recipe easyr1|easyvlm]
        [--mfu 0.3] [--expert-grad-sync optimizer-step|micro-batch] [--log-probs-all-experts|--no-...]
        [--passes] [--json out.json]

The design modelled (easyvlm's, issue 54; written for exactly this):
- non-expert parameters (attention, vision tower, embeddings, routers, norms, lm_head) are FSDP2-sharded
  over all W ranks: all-gathered (bf16) in each forward and again in each backward (full resharding),
  gradients reduce-scattered (fp32). The recompute of gradient checkpointing runs inside the backward
  of its FSDP unit and reuses that backward's gathered parameters (no third all-gather);
- the experts of each MoE layer are split across an expert-parallel group of e consecutive ranks
  (E/e whole experts each). Layout ``replicated`` (the first version): the W/e groups each hold a
  full copy of the experts (expert data parallelism, as DeepSpeed-MoE), expert gradients all-reduced
  across the W/e groups. Layout ``sharded`` (the variant torchtitan and prime-rl use): the experts are
  in addition FSDP-sharded across the W/e groups (all-gathered within them, gradients reduce-scattered).
  With e = 1 both are FSDP alone: the experts are sharded like everything else, and every forward and
  backward of every micro-batch all-gathers all 31 B parameters;
- each token's hidden state goes to its k experts' ranks and the outputs come back by all-to-all
  (dispatch + combine), per MoE layer, in the forward and again in the backward; with gradient
  checkpointing the forward, and its all-to-alls, runs twice. Tokens are sent once per chosen expert
  (no de-duplication per destination rank, as DeepEP does) and routing is assumed uniform.
- what FSDP shards has its gradients reduce-scattered after every micro-batch (FSDP2's default without
  ``set_requires_gradient_sync(False)``, what easyvlm and EasyR1 do today; skipping it would keep the
  unsharded gradients in memory). Replicated experts accumulate theirs locally and all-reduce them
  once per optimizer step (the default here, and what easyvlm.models.expert_parallel's
  reduce_expert_grads does, called by easyvlm.workers.training.clip_and_step) or, with
  ``--expert-grad-sync micro-batch``, after every micro-batch (a per-backward hook).

Inputs and their sources:
- Qwen3-VL-30B-A3B's shapes (``QWEN3_VL_30B_A3B``): text hidden 2048, 48 layers, 128 experts of 768,
  top-8, 32 query / 4 KV heads of 128, vocabulary 151,936, untied lm_head: the Qwen3-30B-A3B decoder
  written out in slime's scripts/models/qwen3-vl-30B-A3B.sh (--model-name Qwen3-VL-30B-A3B-Instruct;
  seen in the slime fork haod0ng/Agentic-MLLM-RL) and in bench/gpu_step.py's shape. Vision tower: 27
  blocks, hidden 1152, MLP 4304, patch 16, temporal patch 2, merge 2, 2304 position embeddings: the
  defaults of transformers' Qwen3VLMoeVisionConfig (5.19.0), which are this tower's; 3 DeepStack
  mergers and out_hidden_size = the text hidden (Qwen3-VL's config). The counts below reproduce
  transformers' model exactly: 31,070,754,032 parameters (tests/bench/test_moe_cost_model.py builds
  it on the meta device), the hub's "31.1B"; the decoder's 29.9 B non-embedding and 3.3 B activated
  parameters are Qwen3-30B-A3B's model card's.
- EasyR1's Qwen3-VL-30B-A3B recipe (``EASYR1_30B``): hiyouga/EasyR1 examples/qwen3_vl_30b_geo3k_grpo.sh
  over examples/config.yaml: 512 prompts x n = 5 per step, PPO mini-batch 128 prompts (4 optimizer
  steps), micro-batches 1 (update) / 2 (log-probs) with dynamic batching (a micro-batch holds up to
  micro x (max prompt 2048 + max response 2048) tokens: dp_actor.py), gradient checkpointing, bf16
  parameters (``fsdp.torch_dtype=bf16``) and ``adamw_bf16`` (AnyPrecisionAdamW: momentum, variance and
  a Kahan buffer in bf16: 6 bytes per parameter), fp32 gradient reduction (mp_reduce_dtype),
  actor parameters and optimizer offloaded to CPU between phases, the reference under FSDP's
  CPUOffload (its parameters live in CPU memory and cross PCIe at every forward).
- EasyR1's published baseline (assets/baselines.md, EasyR1 PR #528, 2025-10-11): Qwen3-VL-30B-A3B
  on geometry3k, 8 x H800 80GB, 80 tokens/s per GPU, 4,600 s per step, actor MFU 1.8 %. Derived from
  it: 80 x 8 x 4,600 = 2.94 M tokens per step, 1,150 tokens per sample (prompt with image +
  response). Assumed: 1,024 vision patches per sample (256 image tokens: geometry3k's images brought
  up to min_pixels = 512 x 512, 32 pixels per merged token).
- GPUs: dense bf16 peak 989 TFLOP/s for H100 SXM and H800 (NVIDIA's H100 datasheet, 1,979 with
  sparsity; EasyR1's flops_counter uses 989e12 for both), 80 GB HBM3. NVLink: H100's 450 GB/s per
  direction gives NCCL ~370 GB/s bus bandwidth for all-gather, reduce-scatter and all-to-all on 8
  GPUs (NCCL maintainer, NVIDIA/nccl-tests issue 212; all-reduce with NVLink SHARP reaches ~480,
  not used here). H800: ~160 GB/s NVLink, measured 153 / 158 GB/s for DeepEP's intranode EP-8
  dispatch / combine (DeepEP README, "Normal kernels"); 155 GB/s used for every collective.
  InfiniBand: CX7 400 Gb/s per GPU, ~50 GB/s; DeepEP measured 43-58 GB/s internode; 45 GB/s used for
  any collective whose group spans nodes (8 GPUs per node). PCIe host <-> GPU: Gen5 x16 is 64 GB/s
  per direction; 25 GB/s assumed per GPU for offload copies (pageable buffers, two GPUs per PCIe
  switch uplink on HGX boards).
- Compute: seconds = FLOPs / (peak x an assumed MFU); ``--mfu`` (default 0.30) stands for the whole
  pass, grouped expert products included. FLOPs: 2 per active matmul parameter per token per forward,
  4 per backward (6 for forward + backward, 8 with the recomputed forward), the vision tower's per
  patch (mergers per merged token), and causal attention scores at the mean length.
  ``log_probs_all_experts``: transformers 4.57's Qwen3VLMoeTextExperts runs, in eval mode, every token
  through all 128 experts (a dense bmm weighted by the routing), and EasyR1 computes log-probs in eval
  mode (dp_actor.py: ``actor_module.eval()``). EasyR1 pins transformers >= 4.54, < 5 and Qwen3-VL-MoE
  arrived in 4.57, so its baseline ran this path (inferred: the baseline names no transformers
  version). On by default for the EasyR1 recipe; transformers 5.x loops over the routed experts in
  both modes.

Left out (the model says nothing about them): generation by vLLM, which expert parallelism of the
trainer does not change, the weight sync to the engine, validation, checkpoint saving and reward;
routing imbalance, launch and Python overheads beyond the MFU assumption, activations, logits and
vLLM's memory; NVLink SHARP, hierarchical all-to-alls and de-duplicated dispatch.

From Python: ``step_cost(shape, recipe, hw, gpus, Layout(e, sharded), mfu)`` -> ``StepCost``,
``memory_per_gpu(...)`` -> ``Memory``, ``param_counts(shape)``, ``easyr1_baseline(...)``.
Tests: tests/bench/test_moe_cost_model.py.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
from dataclasses import dataclass

GB = 1e9  # decimal gigabytes (bandwidths are quoted in GB/s)


# ----------------------------------------------------------------------------------- the model's shapes
@dataclass(frozen=True)
class MoEShape:
    """A Qwen3-VL-MoE-style model: a MoE text decoder (every layer MoE) and a ViT with mergers."""

    hidden: int
    layers: int
    experts: int
    top_k: int
    expert_intermediate: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    vision_depth: int = 0  # 0: no vision tower
    vision_hidden: int = 0
    vision_intermediate: int = 0
    patch: int = 16
    temporal_patch: int = 2
    merge: int = 2
    vision_position_embeddings: int = 0
    deepstack_mergers: int = 0


QWEN3_VL_30B_A3B = MoEShape(
    hidden=2048, layers=48, experts=128, top_k=8, expert_intermediate=768, heads=32, kv_heads=4, head_dim=128,
    vocab=151936, vision_depth=27, vision_hidden=1152, vision_intermediate=4304, patch=16, temporal_patch=2,
    merge=2, vision_position_embeddings=2304, deepstack_mergers=3)


@dataclass(frozen=True)
class ParamCounts:
    attention: int  # q, k, v, o of every layer
    experts: int  # gate, up and down of every expert of every layer
    router: int
    norms: int  # RMSNorm weights of the decoder (layers, q/k norms, final)
    embedding: int
    lm_head: int
    vision_per_patch: int  # patch embedding and blocks: run once per patch
    vision_per_merged_token: int  # the merger and the DeepStack mergers: once per 2 x 2 patches
    vision_other: int  # position embeddings (interpolated, not multiplied)

    @property
    def vision(self) -> int:
        return self.vision_per_patch + self.vision_per_merged_token + self.vision_other

    @property
    def total(self) -> int:
        return self.attention + self.experts + self.router + self.norms + self.embedding + self.lm_head + self.vision

    @property
    def non_expert(self) -> int:
        return self.total - self.experts


def param_counts(shape: MoEShape) -> ParamCounts:
    """Every parameter of ``shape`` by group (no biases in the decoder; the vision tower's linears
    and LayerNorms have biases), as transformers' Qwen3VLMoeForConditionalGeneration builds it."""
    h, hd = shape.hidden, shape.head_dim
    attention = shape.layers * h * hd * (2 * shape.heads + 2 * shape.kv_heads)
    experts = shape.layers * shape.experts * 3 * h * shape.expert_intermediate
    router = shape.layers * shape.experts * h
    norms = shape.layers * (2 * h + 2 * hd) + h
    vh, vi = shape.vision_hidden, shape.vision_intermediate
    vision_per_patch = vision_per_merged = vision_other = 0
    if shape.vision_depth:
        patch_embed = vh * 3 * shape.temporal_patch * shape.patch**2 + vh
        block = (2 * 2 * vh  # two LayerNorms
                 + 3 * vh * vh + 3 * vh + vh * vh + vh  # qkv and proj
                 + 2 * vi * vh + vi + vh)  # fc1 and fc2
        vision_per_patch = patch_embed + shape.vision_depth * block
        merged = vh * shape.merge**2
        mlp = merged * merged + merged + h * merged + h
        # the merger normalises before the 2 x 2 shuffle (1152 wide), the DeepStack ones after (4608)
        vision_per_merged = (2 * vh + mlp) + shape.deepstack_mergers * (2 * merged + mlp)
        vision_other = shape.vision_position_embeddings * vh
    return ParamCounts(attention, experts, router, norms, shape.vocab * h, shape.vocab * h, vision_per_patch,
                       vision_per_merged, vision_other)


def active_matmul_params(shape: MoEShape) -> float:
    """Decoder parameters multiplied per token: attention, router, k of E experts, lm_head (the input
    embedding is a lookup; norms are negligible)."""
    p = param_counts(shape)
    return p.attention + p.router + p.experts * shape.top_k / shape.experts + p.lm_head


# ----------------------------------------------------------------------------------- hardware
@dataclass(frozen=True)
class Hardware:
    name: str
    peak_flops: float  # dense bf16
    hbm_bytes: float
    nvlink_busbw: float  # NCCL bus bandwidth of all-gather / reduce-scatter / all-to-all within a node
    ib_busbw: float  # per GPU, for a collective whose group spans nodes
    gpus_per_node: int
    pcie_bytes_per_s: float  # host <-> GPU, per GPU (assumed)


# published peaks and NVLink / InfiniBand rates, an assumed PCIe rate (module docstring: the sources)
H100 = Hardware("H100 SXM", 989e12, 80 * GB, 370 * GB, 45 * GB, 8, 25 * GB)
H800 = Hardware("H800 SXM", 989e12, 80 * GB, 155 * GB, 45 * GB, 8, 25 * GB)
HARDWARE = {"h100": H100, "h800": H800}


# ----------------------------------------------------------------------------------- the recipe
@dataclass(frozen=True)
class Recipe:
    """One RL step's work and the trainer's settings."""

    name: str
    prompts: int
    n: int
    mini_batch_prompts: int  # PPO mini-batch: prompts / mini_batch_prompts optimizer steps per step
    micro_update: int
    micro_experience: int
    max_prompt: int
    max_response: int
    mean_tokens: float  # prompt (image tokens included) + response, per sample
    patches_per_sample: int
    gradient_checkpointing: bool
    param_bytes: int  # the actor's sharded parameters
    grad_bytes: int
    optimizer_bytes: int  # per parameter, all states
    ref_param_bytes: int
    compute_bytes: int = 2  # gathered parameters and tokens on the wire (bf16)
    reduce_bytes: int = 4  # gradient reduction (fp32)
    actor_offload: bool = False  # the actor's parameter shard goes to CPU between phases and comes back
    optimizer_offload: bool = False  # the optimizer states likewise, around the update
    ref_offload: str = "none"  # "between-phases", or "every-forward" (FSDP's CPUOffload) or "none"
    log_probs_all_experts: bool = False  # transformers 4.57's eval path: every token through every expert

    @property
    def samples(self) -> int:
        return self.prompts * self.n

    @property
    def tokens(self) -> float:
        return self.samples * self.mean_tokens

    @property
    def optimizer_steps(self) -> int:
        return self.prompts // self.mini_batch_prompts


# EasyR1's examples/qwen3_vl_30b_geo3k_grpo.sh over examples/config.yaml (module docstring); the mean
# sample length derived from its baseline (80 tokens/s/GPU x 8 GPUs x 4,600 s / 2,560 samples), the
# vision patches assumed
EASYR1_30B = Recipe(
    "EasyR1 qwen3_vl_30b_geo3k_grpo.sh", prompts=512, n=5, mini_batch_prompts=128, micro_update=1,
    micro_experience=2, max_prompt=2048, max_response=2048, mean_tokens=80 * 8 * 4600 / (512 * 5),
    patches_per_sample=1024, gradient_checkpointing=True, param_bytes=2, grad_bytes=2, optimizer_bytes=6,
    ref_param_bytes=2, actor_offload=True, optimizer_offload=True, ref_offload="every-forward", log_probs_all_experts=True)
# easyvlm's examples/qwen3_vl_30b_a3b_geo3k_grpo.sh over examples/qwen2_5_vl_gpu.yaml: the same batch,
# fp32 master weights and fp32 AdamW, actor, optimizer and reference offloaded between phases
EASYVLM_30B = dataclasses.replace(
    EASYR1_30B, name="easyvlm qwen3_vl_30b_a3b_geo3k_grpo.sh", param_bytes=4, grad_bytes=4, optimizer_bytes=8,
    ref_offload="between-phases", log_probs_all_experts=False)
RECIPES = {"easyr1": EASYR1_30B, "easyvlm": EASYVLM_30B}


@dataclass(frozen=True)
class Layout:
    expert_parallel: int  # e; 1 = FSDP alone
    sharded: bool = False  # experts also FSDP-sharded across the W/e groups (torchtitan's layout)

    @property
    def name(self) -> str:
        if self.expert_parallel == 1:
            return "FSDP alone"
        return "EP, experts sharded" if self.sharded else "EP, experts replicated"


# ----------------------------------------------------------------------------------- work per pass
def micro_batches(tokens_per_gpu: float, budget_tokens: int, mean_tokens: float) -> tuple[int, float]:
    """(micro-batches, mean tokens in each) of dynamic batching: whole sequences of ``mean_tokens``
    packed up to ``budget_tokens`` (at least one), as many micro-batches as the rank's tokens need."""
    capacity = max(1, int(budget_tokens // mean_tokens)) * mean_tokens
    count = math.ceil(tokens_per_gpu / capacity - 1e-9)
    return count, tokens_per_gpu / count


def all_gather_bytes(size_bytes: float, group: int) -> float:
    """Bytes each rank receives gathering ``size_bytes`` over ``group`` ranks; nccl-tests' bus
    bandwidth is defined so that seconds = this / busbw (also for reduce-scatter)."""
    return size_bytes * (group - 1) / group


def all_reduce_bytes(size_bytes: float, group: int) -> float:
    """A ring all-reduce: a reduce-scatter and an all-gather."""
    return 2 * size_bytes * (group - 1) / group


def all_to_all_bytes(tokens: float, shape: MoEShape, e: int, token_bytes: int = 2) -> float:
    """Bytes a rank sends in one all-to-all of one MoE layer: each of its ``tokens`` goes to k experts,
    (e - 1) / e of them on other ranks of its expert-parallel group (uniform routing)."""
    return tokens * shape.top_k * shape.hidden * token_bytes * (e - 1) / e


def spans_nodes(group: int, stride: int, hw: Hardware) -> bool:
    """Whether a group of ``group`` ranks ``stride`` apart (consecutive: 1) leaves its node (groups are
    aligned: ranks r, r + stride, ... with r < stride, W a multiple of the node's GPUs)."""
    return group > 1 and group * stride > hw.gpus_per_node


def collective_seconds(bus_bytes: float, group: int, stride: int, hw: Hardware) -> float:
    return bus_bytes / (hw.ib_busbw if spans_nodes(group, stride, hw) else hw.nvlink_busbw)


def all_to_all_seconds(bus_bytes: float, e: int, hw: Hardware) -> float:
    """An all-to-all over e consecutive ranks: the share to other nodes over InfiniBand, the rest over
    NVLink at the same time."""
    if e <= hw.gpus_per_node:
        return bus_bytes / hw.nvlink_busbw
    off_node = bus_bytes * (e - hw.gpus_per_node) / (e - 1)
    return max(off_node / hw.ib_busbw, (bus_bytes - off_node) / hw.nvlink_busbw)


@dataclass(frozen=True)
class PassCost:
    name: str
    micro_batches: int  # per GPU
    tokens_per_micro_batch: float
    rows_per_expert_product: float  # tokens each local expert multiplies per micro-batch
    flops: float  # executed, per GPU
    model_flops: float  # 6 (update) or 2 (log-probs) x active, per GPU: the numerator of MFU
    bytes: dict  # per GPU by kind: param_all_gather, grad_sync, token_all_to_all, pcie
    seconds: dict  # the same kinds, and compute

    @property
    def network_s(self) -> float:
        """The collectives, which share the GPU's NVLink (or InfiniBand) links."""
        return self.seconds["param_all_gather"] + self.seconds["grad_sync"] + self.seconds["token_all_to_all"]

    @property
    def communication_s(self) -> float:
        return self.network_s + self.seconds["pcie"]

    @property
    def overlapped_s(self) -> float:
        """Lower bound: compute, collectives and PCIe copies all at once, the longest sets the pace."""
        return max(self.seconds["compute"], self.network_s, self.seconds["pcie"])

    @property
    def serial_s(self) -> float:
        """Upper bound: nothing overlapped."""
        return sum(self.seconds.values())


def pass_cost(shape: MoEShape, recipe: Recipe, hw: Hardware, gpus: int, layout: Layout, kind: str, mfu: float,
              expert_grad_sync: str = "optimizer-step") -> PassCost:
    """The per-GPU cost of one pass over the step's batch: ``kind`` "old", "ref" or "update".
    ``expert_grad_sync``: when replicated experts all-reduce their gradients, after every
    "micro-batch" or once per "optimizer-step" (accumulated locally). What FSDP shards is always
    reduce-scattered per micro-batch: skipping it would keep its unsharded gradients in memory."""
    e, w = layout.expert_parallel, gpus
    if w % e or shape.experts % e:
        raise ValueError(f"expert_parallel_size {e} must divide the GPUs ({w}) and the experts ({shape.experts})")
    groups = w // e  # expert-data-parallel degree
    p = param_counts(shape)
    update = kind == "update"
    tokens_gpu = recipe.tokens / w
    seq = recipe.max_prompt + recipe.max_response
    if update:
        count, per_mb = micro_batches(tokens_gpu / recipe.optimizer_steps, recipe.micro_update * seq, recipe.mean_tokens)
        count *= recipe.optimizer_steps
    else:
        count, per_mb = micro_batches(tokens_gpu, recipe.micro_experience * seq, recipe.mean_tokens)
    forwards = (2 if recipe.gradient_checkpointing else 1) if update else 1
    backward = 1 if update else 0
    # FLOPs: 2 per multiplied parameter per token and forward, 4 per backward
    dense_experts = recipe.log_probs_all_experts and not update
    per_token = active_matmul_params(shape) + (p.experts * (1 - shape.top_k / shape.experts) if dense_experts else 0)
    attention_scores = 2 * recipe.mean_tokens * shape.heads * shape.head_dim * shape.layers  # causal, mean length
    patches = recipe.patches_per_sample * recipe.samples / w
    vision = p.vision_per_patch * patches + p.vision_per_merged_token * patches / shape.merge**2
    forward_flops = 2 * (per_token + attention_scores) * tokens_gpu + 2 * vision
    model_flops = (2 + 4 * backward) * ((active_matmul_params(shape) + attention_scores) * tokens_gpu + vision)
    flops = forward_flops * (forwards + 2 * backward)
    # the collectives: (kind, bus bytes per GPU, group size, stride of its ranks, how many per pass).
    # Parameters are gathered in each forward and again in each backward (the recompute reuses the
    # backward's); what FSDP shards has its gradients reduce-scattered after every micro-batch.
    cb, rb = recipe.compute_bytes, recipe.reduce_bytes
    gathers, reductions = count * (1 + backward), count * backward
    fsdp_sharded = p.non_expert + (p.experts if e == 1 else 0)
    collectives = [("param_all_gather", all_gather_bytes(fsdp_sharded * cb, w), w, 1, gathers),
                   ("grad_sync", all_gather_bytes(fsdp_sharded * rb, w), w, 1, reductions)]
    local_experts = p.experts / e  # one rank's E/e experts
    if e > 1 and layout.sharded:  # FSDP within the W/e ranks holding the same experts (stride e)
        collectives += [("param_all_gather", all_gather_bytes(local_experts * cb, groups), groups, e, gathers),
                        ("grad_sync", all_gather_bytes(local_experts * rb, groups), groups, e, reductions)]
    elif e > 1:  # replicated: all-reduced across the W/e copies
        syncs = recipe.optimizer_steps * backward if expert_grad_sync == "optimizer-step" else reductions
        collectives.append(("grad_sync", all_reduce_bytes(local_experts * rb, groups), groups, e, syncs))
    bytes_ = {"param_all_gather": 0.0, "grad_sync": 0.0, "token_all_to_all": 0.0, "pcie": 0.0}
    seconds = {"compute": flops / (hw.peak_flops * mfu), **bytes_}
    for name, bus_bytes, group, stride, times in collectives:
        bytes_[name] += bus_bytes * times
        seconds[name] += collective_seconds(bus_bytes, group, stride, hw) * times
    # token all-to-alls: dispatch and combine per MoE layer, in every forward and every backward
    if e > 1:
        bytes_["token_all_to_all"] = all_to_all_bytes(per_mb, shape, e) * 2 * shape.layers * (forwards + backward) * count
        seconds["token_all_to_all"] = all_to_all_seconds(bytes_["token_all_to_all"], e, hw)
    # PCIe: offloaded shards to the GPU and back (the actor's around each pass, its optimizer around
    # the update; the reference's between phases or, under FSDP's CPUOffload, at every forward)
    memory = memory_per_gpu(shape, recipe, gpus, layout)
    if kind == "ref":
        bytes_["pcie"] = memory.reference * {"every-forward": count, "between-phases": 2, "none": 0}[recipe.ref_offload]
    else:
        bytes_["pcie"] = 2 * (memory.parameters * recipe.actor_offload
                              + memory.optimizer * (recipe.optimizer_offload and update))
    seconds["pcie"] = bytes_["pcie"] / hw.pcie_bytes_per_s
    rows = per_mb * shape.top_k * e / shape.experts
    return PassCost(kind, count, per_mb, rows, flops, model_flops, bytes_, seconds)


@dataclass(frozen=True)
class Memory:
    """Bytes per GPU of the sharded training state (what stays between micro-batches)."""

    parameters: float
    gradients: float
    optimizer: float
    reference: float  # the reference model's bf16 shard
    unsharded_buffers: float  # FSDP's gathered parameters: the root's embedding and lm_head, two layers in
    # bf16 (the one running and the one prefetched) and one layer's fp32 gradient before its reduce-scatter

    @property
    def actor(self) -> float:
        return self.parameters + self.gradients + self.optimizer

    @property
    def resident(self) -> float:
        """Everything on the GPU at once without offload: actor state, reference, gathered buffers."""
        return self.actor + self.reference + self.unsharded_buffers


def memory_per_gpu(shape: MoEShape, recipe: Recipe, gpus: int, layout: Layout) -> Memory:
    """The actor's state per GPU: what FSDP shards over W ranks, plus one rank's E/e experts
    (replicated) or its 1/W of them (FSDP alone, or experts sharded across the groups)."""
    p = param_counts(shape)
    e = layout.expert_parallel
    experts_here = p.experts / gpus if (e == 1 or layout.sharded) else p.experts / e
    state = p.non_expert / gpus + experts_here
    reference = recipe.ref_param_bytes * state
    # one decoder layer as gathered in the forward: its non-expert weights, and the experts FSDP gathers
    layer_non_expert = (p.attention + p.router + p.norms) / shape.layers
    gathered = e == 1 or (layout.sharded and gpus > e)
    layer_experts = p.experts / shape.layers / e if gathered else 0.0
    gathered_layer = layer_non_expert + layer_experts
    # FSDP2 keeps the root's parameters gathered from the forward to the backward
    buffers = (p.embedding + p.lm_head) * recipe.compute_bytes + gathered_layer * (2 * recipe.compute_bytes
                                                                                   + recipe.reduce_bytes)
    return Memory(recipe.param_bytes * state, recipe.grad_bytes * state, recipe.optimizer_bytes * state, reference,
                  buffers)


@dataclass(frozen=True)
class StepCost:
    layout: Layout
    passes: tuple  # PassCost for old, ref, update
    memory: Memory
    hbm_bytes: float

    def total(self, key: str) -> float:
        return sum(getattr(p, key) for p in self.passes)

    def bytes(self, kind: str) -> float:
        return sum(p.bytes[kind] for p in self.passes)

    def seconds(self, kind: str) -> float:
        return sum(p.seconds[kind] for p in self.passes)

    @property
    def fits(self) -> bool:
        return self.memory.resident <= self.hbm_bytes


def step_cost(shape: MoEShape, recipe: Recipe, hw: Hardware, gpus: int, layout: Layout, mfu: float,
              expert_grad_sync: str = "optimizer-step") -> StepCost:
    passes = tuple(pass_cost(shape, recipe, hw, gpus, layout, kind, mfu, expert_grad_sync)
                   for kind in ("old", "ref", "update"))
    return StepCost(layout, passes, memory_per_gpu(shape, recipe, gpus, layout), hw.hbm_bytes)


# ----------------------------------------------------------------------------------- EasyR1's baseline
def easyr1_counted_flops(shape: MoEShape, tokens: float, samples: int, seq_len: float) -> float:
    """The update's FLOPs as EasyR1's flops_counter counts them for perf/mfu_actor (qwen3_vl_moe):
    6 x (k experts + router + attention linears per layer, embedding + lm_head) per token, plus
    12 x sum(seq_len^2) x head_dim x heads x layers; the vision tower is not counted."""
    h, hd = shape.hidden, shape.head_dim
    moe = h * shape.top_k * shape.expert_intermediate * 3 + h * shape.experts
    attn = h * (shape.heads * hd + 2 * shape.kv_heads * hd + shape.heads * hd)
    dense = (moe + attn) * shape.layers + 2 * shape.vocab * h
    return 6 * dense * tokens + 12 * samples * seq_len**2 * hd * shape.heads * shape.layers


def easyr1_baseline(shape: MoEShape = QWEN3_VL_30B_A3B, recipe: Recipe = EASYR1_30B, gpus: int = 8,
                    tokens_per_s_per_gpu: float = 80, step_s: float = 4600, mfu: float = 0.018,
                    peak_flops: float = 989e12) -> dict:
    """What EasyR1's published figures imply: tokens per step, and the update's seconds that its
    actor MFU (EasyR1's own FLOP count over the update's time x peak x GPUs) stands for."""
    tokens = tokens_per_s_per_gpu * gpus * step_s
    update_flops = easyr1_counted_flops(shape, tokens, recipe.samples, tokens / recipe.samples)
    return {"tokens_per_step": tokens, "tokens_per_sample": tokens / recipe.samples,
            "update_s_implied": update_flops / (mfu * peak_flops * gpus), "step_s": step_s}


def easyr1_gap(row: StepCost, base: dict, hw: Hardware) -> dict:
    """The baseline's step against this model's passes (``row``: EasyR1's recipe, FSDP alone, H800).
    ``update_product_mfu``: the MFU the update's executed products must have run at for its implied
    seconds, with the modelled communication hidden (low) or serial (high)."""
    old, ref, update = row.passes
    implied = base["update_s_implied"]
    log_probs = (old.overlapped_s + ref.overlapped_s, old.serial_s + ref.serial_s)
    return {"update_s_implied": implied, "update_s_model": (update.overlapped_s, update.serial_s),
            "update_communication_s": update.communication_s, "log_probs_s_model": log_probs,
            "update_product_mfu": (update.flops / (implied * hw.peak_flops),
                                   update.flops / ((implied - update.communication_s) * hw.peak_flops)),
            "outside_trainer_passes_s": (base["step_s"] - implied - log_probs[1], base["step_s"] - implied - log_probs[0])}


# ----------------------------------------------------------------------------------- the report
def table_rows(shape: MoEShape, recipe: Recipe, hw: Hardware, gpus: int, eps: list[int], mfu: float,
               expert_grad_sync: str = "optimizer-step") -> list[StepCost]:
    layouts = [Layout(1)] + [Layout(e, s) for s in (False, True) for e in eps if 1 < e <= gpus and not gpus % e]
    return [step_cost(shape, recipe, hw, gpus, layout, mfu, expert_grad_sync) for layout in layouts]


def update_mfu(row: StepCost, hw: Hardware) -> tuple[float, float]:
    """The update's MFU (6 x active per token over its seconds x peak), serial and overlapped."""
    update = row.passes[2]
    return (update.model_flops / (update.serial_s * hw.peak_flops),
            update.model_flops / (update.overlapped_s * hw.peak_flops))


def format_table(rows: list[StepCost], hw: Hardware) -> str:
    head = ("| layout | e | all-gather GB/GPU | grad sync GB/GPU | all-to-all GB/GPU | PCIe GB/GPU | TFLOP/GPU | "
            "compute s | communication s | trainer passes s, overlapped - serial | update MFU, serial - overlapped | "
            "rows per expert product (update) | actor params + grads + optimizer GB/GPU | "
            "+ reference + FSDP buffers GB/GPU | fits 80 GB without offload |")
    lines = [head, "|" + "---|" * (head.count(" | ") + 1)]
    for r in rows:
        m, low, high = r.memory, *update_mfu(r, hw)
        room = (hw.hbm_bytes - m.resident) / GB
        fits = f"yes ({room:.0f} GB left)" if room >= 0 else f"**no** ({-room:.0f} GB over)"
        lines.append(
            f"| {r.layout.name} | {r.layout.expert_parallel} | {r.bytes('param_all_gather') / GB:,.0f} | "
            f"{r.bytes('grad_sync') / GB:,.0f} | {r.bytes('token_all_to_all') / GB:,.0f} | {r.bytes('pcie') / GB:,.0f} | "
            f"{r.total('flops') / 1e12:,.0f} | {r.seconds('compute'):,.0f} | {r.total('communication_s'):,.0f} | "
            f"{r.total('overlapped_s'):,.0f} - {r.total('serial_s'):,.0f} | {low:.1%} - {high:.1%} | "
            f"{r.passes[2].rows_per_expert_product:,.0f} | "
            f"{m.parameters / GB:.1f} + {m.gradients / GB:.1f} + {m.optimizer / GB:.1f} = {m.actor / GB:.1f} | "
            f"{m.resident / GB:.1f} | {fits} |")
    return "\n".join(lines)


def format_passes(row: StepCost) -> str:
    lines = ["| pass | micro-batches / GPU | tokens each | compute s | all-gather s | grad sync s | all-to-all s | "
             "PCIe s | overlapped - serial s |", "|---|---|---|---|---|---|---|---|---|"]
    for p in row.passes:
        s = p.seconds
        lines.append(f"| {p.name} | {p.micro_batches} | {p.tokens_per_micro_batch:,.0f} | {s['compute']:,.1f} | "
                     f"{s['param_all_gather']:,.1f} | {s['grad_sync']:,.1f} | {s['token_all_to_all']:,.1f} | "
                     f"{s['pcie']:,.1f} | {p.overlapped_s:,.1f} - {p.serial_s:,.1f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gpus", type=int, default=8)
    ap.add_argument("--ep", type=int, nargs="+", default=[2, 4, 8], help="expert-parallel sizes besides 1")
    ap.add_argument("--gpu", choices=sorted(HARDWARE), default="h800", help="h800: EasyR1's baseline machine")
    ap.add_argument("--recipe", choices=sorted(RECIPES), default="easyr1")
    ap.add_argument("--mfu", type=float, default=0.30, help="assumed achievable MFU of the passes' products")
    ap.add_argument("--expert-grad-sync", choices=["micro-batch", "optimizer-step"], default="optimizer-step",
                    help="when replicated experts all-reduce their gradients")
    ap.add_argument("--log-probs-all-experts", action=argparse.BooleanOptionalAction, default=None,
                    help="log-prob passes through all experts (transformers 4.57's eval path; default: the recipe's)")
    ap.add_argument("--passes", action="store_true", help="also each configuration's passes, one table each")
    ap.add_argument("--json", default=None, help="write the rows here")
    args = ap.parse_args(argv)
    recipe = RECIPES[args.recipe]
    if args.log_probs_all_experts is not None:
        recipe = dataclasses.replace(recipe, log_probs_all_experts=args.log_probs_all_experts)
    hw, shape = HARDWARE[args.gpu], QWEN3_VL_30B_A3B
    p = param_counts(shape)
    print(f"Qwen3-VL-30B-A3B: {p.total / 1e9:.2f} B parameters ({p.experts / 1e9:.2f} B in experts, "
          f"{p.non_expert / 1e9:.2f} B not), {active_matmul_params(shape) / 1e9:.2f} B multiplied per token; "
          f"{recipe.name}: {recipe.samples} samples x {recipe.mean_tokens:,.0f} tokens; {args.gpus} x {hw.name}, "
          f"MFU {args.mfu:.0%} assumed, replicated experts' gradients all-reduced per {args.expert_grad_sync}"
          + (", log-probs through all experts" if recipe.log_probs_all_experts else ""))
    rows = table_rows(shape, recipe, hw, args.gpus, args.ep, args.mfu, args.expert_grad_sync)
    print(format_table(rows, hw))
    for row in rows if args.passes else rows[:1]:
        print(f"\n{row.layout.name}, e = {row.layout.expert_parallel}, by pass:")
        print(format_passes(row))
    base = easyr1_baseline(shape, EASYR1_30B)
    out = {"args": vars(args), "recipe": dataclasses.asdict(recipe), "hardware": dataclasses.asdict(hw),
           "easyr1_baseline": base,
           "rows": [{"layout": r.layout.name, "expert_parallel": r.layout.expert_parallel, "sharded": r.layout.sharded,
                     "memory": dataclasses.asdict(r.memory), "fits": r.fits, "update_mfu": update_mfu(r, hw),
                     "passes": [dataclasses.asdict(p) for p in r.passes]} for r in rows]}
    if recipe == EASYR1_30B and hw == H800 and args.gpus == 8:
        gap = easyr1_gap(rows[0], base, hw)
        out["easyr1_gap"] = gap
        print(f"\nEasyR1's baseline (8 x H800: 80 tokens/s/GPU, 4,600 s/step, actor MFU 1.8 %): "
              f"{base['tokens_per_step'] / 1e6:.2f} M tokens per step, {base['tokens_per_sample']:,.0f} per sample. "
              f"Its MFU implies an update of {gap['update_s_implied']:,.0f} s; this model gives "
              f"{gap['update_s_model'][0]:,.0f} - {gap['update_s_model'][1]:,.0f} s ({gap['update_communication_s']:,.0f} s "
              f"of it communication): for {gap['update_s_implied']:,.0f} s the update's products ran at "
              f"{gap['update_product_mfu'][0]:.1%} - {gap['update_product_mfu'][1]:.1%} of peak, not {args.mfu:.0%}. "
              f"Old + reference log-probs: {gap['log_probs_s_model'][0]:,.0f} - {gap['log_probs_s_model'][1]:,.0f} s. "
              f"Left for what the model leaves out (generation, weight sync, validation, checkpoints): "
              f"{gap['outside_trainer_passes_s'][0]:,.0f} - {gap['outside_trainer_passes_s'][1]:,.0f} s of the 4,600.")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return out


if __name__ == "__main__":
    main()
