"""The settings of the trained roles' machinery, declared once: the optimizer and its schedule
(``optim.py``), FSDP2 sharding and mixed precision (``fsdp.py``, ``sharded.py``), CPU offloading
while idle and the update's epochs and gradient clipping (``update.py``), and how a role runs its
model over a batch (``forward.py``). The config schema composes the first three as the sections
``worker.<role>.optim``, ``.fsdp`` and ``.offload``, and splices the update's and the forward keys
into ``worker.actor`` and ``worker.critic``; the plan hands each worker its own. Torch-free: the
config check imports this module.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Optional

from easyvlm.utils.dtypes import DType


@dataclass(frozen=True)
class OptimConfig:
    lr: float = 1e-6
    """Peak learning rate."""
    betas: tuple[float, float] = (0.9, 0.999)
    """Adam's betas."""
    weight_decay: float = 1e-2
    """Decoupled weight decay (AdamW)."""
    strategy: Literal["adamw", "adamw_bf16"] = "adamw"
    """Optimizer: adamw, or adamw_bf16 (optimizer states in bf16 to save memory)."""
    lr_warmup_ratio: float = 0.0
    """Fraction of the training steps used for linear warm-up (ignored if `lr_warmup_steps` is
    set)."""
    lr_warmup_steps: Optional[int] = None
    """Warm-up steps; None = `lr_warmup_ratio` times the training steps."""
    min_lr_ratio: Optional[float] = None
    """Cosine schedule: the final learning rate as a fraction of `lr`. None = 0."""
    lr_scheduler_type: Literal["constant", "cosine"] = "constant"
    """Learning-rate schedule after warm-up."""


@dataclass(frozen=True)
class FSDPConfig:
    enable_full_shard: bool = True
    """Shard parameters, gradients and optimizer states (ZeRO-3); False shards only gradients and
    optimizer states."""
    enable_cpu_offload: bool = False
    """Let FSDP keep parameters on the CPU between uses (GPU runs)."""
    enable_rank0_init: bool = True
    """Load weights on rank 0 only and broadcast them: less host memory on big models."""
    use_orig_params: bool = False
    """FSDP1's use_orig_params; kept for EasyR1 configs, FSDP2 always keeps the original
    parameters."""
    torch_dtype: Optional[DType] = None
    """Dtype the model weights are loaded in. None = the worker's choice (EasyR1: fp32 for the
    actor and critic, bf16 for the reference model)."""
    fsdp_size: int = -1
    """Devices per FSDP shard group (hybrid sharding); -1 = all devices."""
    mp_param_dtype: DType = "bf16"
    """Mixed precision: dtype of parameters in forward and backward."""
    mp_reduce_dtype: DType = "fp32"
    """Mixed precision: dtype of the gradient reduction."""
    mp_buffer_dtype: DType = "fp32"
    """Mixed precision: dtype of buffers."""


@dataclass(frozen=True)
class OffloadConfig:
    offload_params: bool = False
    """Move the parameters to CPU memory while the role is idle (e.g. during generation)."""
    offload_optimizer: bool = False
    """Move the optimizer states to CPU memory while the role is idle."""


@dataclass(frozen=True)
class ForwardSettings:
    """How a role runs its model over a batch: the keys ``worker.actor.padding_free`` ...
    ``expert_parallel_size``, and the critic's of the same names (its own ``padding_free`` default
    and some of its own documentation, in ``easyvlm.config.worker_schema``). The reference model and
    the teacher follow the actor's. The plan hands them whole to each role's ``ForwardSpec``."""

    padding_free: bool = True
    """Pack sequences without padding in the forward pass (varlen attention: flash-attn on GPUs,
    SDPA per sequence elsewhere)."""
    share_prompts: bool = True
    """easyvlm extra. With padding_free: the samples of one prompt that share a micro-batch run the
    prompt and its images through the model once, and every response attends to that one copy.
    Exact (the log-probs and gradients are the unshared ones); it saves (n - 1) / n of the prompt
    work per group. The reference model follows this setting too."""
    dynamic_batching: bool = True
    """Form micro-batches by a token budget instead of a fixed sample count."""
    ulysses_size: int = 1
    """Ulysses sequence-parallel degree; 1 = off."""
    expert_parallel_size: int = 1
    """easyvlm extra. MoE models: the ranks each MoE layer's experts are split over (expert
    parallelism: each rank of a group of this many holds num_experts / expert_parallel_size whole
    experts, and tokens go to their experts' ranks and back by all-to-all); 1 = off (every expert
    FSDP-sharded over all ranks and gathered in each pass). Must divide the number of devices and the
    model's experts. The reference model and the teacher follow it where they are MoE (docs/models.md)."""


@dataclass(frozen=True)
class UpdateSettings:
    """How a trained role steps on a training step's samples: the keys ``worker.actor.max_grad_norm``
    and ``ppo_epochs``, and the critic's of the same names. In the config they frame the role's loss
    keys (the actor's ``clip_ratio_low`` ... ``off_policy_mask_threshold``, the critic's
    ``cliprange_value`` and ``loss_avg_mode``), which ``easyvlm.config.worker_schema`` splices after
    ``max_grad_norm``. The plan hands them whole to each role's ``UpdateSpec``."""

    max_grad_norm: float = 1.0
    """Clip the gradient norm to this."""
    ppo_epochs: int = 1
    """Passes over each step's samples."""
