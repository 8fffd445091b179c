"""The settings of the trained roles' machinery, declared once: the optimizer and its schedule
(``optim.py``), FSDP2 sharding and mixed precision (``fsdp.py``, ``sharded.py``) and CPU offloading
while idle (``update.py``). The config schema composes them as the sections ``worker.<role>.optim``,
``.fsdp`` and ``.offload``; the plan hands each worker its own. Torch-free: the config check imports
this module.
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
