"""The settings of the trained roles' machinery, declared once: the optimizer and its schedule
(``optim.py``), FSDP2 sharding and mixed precision (``fsdp.py``, ``sharded.py``), CPU offloading
while idle and the update's epochs and gradient clipping (``update.py``), and how a role runs its
model over a batch (``forward.py``). The config schema composes the first three as the sections
``worker.<role>.optim``, ``.fsdp`` and ``.offload``, and splices the update's and the forward keys
into ``worker.actor`` and ``worker.critic``; the plan hands each worker its own. The sections of the
frozen roles are declared here too: ``worker.ref`` (`RefConfig`), ``worker.teacher``
(`TeacherConfig`) and ``worker.reward_model`` (`RewardModelConfig`), and the trained roles' sections,
``worker.actor`` (`ActorConfig`) and ``worker.critic`` (`CriticConfig`), composed of the update's and
forward keys above, the losses' keys (``easyvlm.algorithms.settings``) and the model section
(``easyvlm.models.settings``). Torch-free: the config check imports this module.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal, Optional

from easyvlm.algorithms.settings import EntropySettings, PolicyLossSettings, ValueLossSettings
from easyvlm.models.settings import ModelConfig
from easyvlm.utils.compose import fields_of
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


@dataclass(frozen=True)
class RefConfig:
    strategy: Literal["fsdp"] = "fsdp"
    """Backend of the reference model (the actor's initial weights, for the KL penalty).
    Micro-batch size, padding-free, Ulysses and torch.compile follow `worker.actor`."""
    fsdp: FSDPConfig = field(default_factory=FSDPConfig)
    """FSDP settings of the reference model."""
    offload: OffloadConfig = field(default_factory=OffloadConfig)
    """CPU offloading of the reference model while idle."""


@dataclass(frozen=True)
class TeacherModelConfig:
    model_path: Optional[str] = None
    """The teacher: `builtin:tiny-qwen2.5-vl-teacher`, a local directory in Hugging Face format or a
    hub id. It scores the student's tokens as they are, so it must share the student's tokenizer
    and image processor (checked before start); it may be larger, have more (padding) output rows,
    or be the MoE / dense sibling of the student's generation (qwen3_vl_moe for qwen3_vl ...)."""
    override_config: dict[str, Any] = field(default_factory=dict)
    """Values that override the teacher's `config.json` when it is loaded."""
    trust_remote_code: bool = False
    """Allow running Python code shipped in the teacher's repository."""
    attn_implementation: Literal["sdpa", "eager", "flash_attention_2", "flash_attention_3"] = "sdpa"
    """Attention kernel of the teacher (see `worker.actor.model.attn_implementation`)."""


@dataclass(frozen=True)
class TeacherConfig:
    enable: bool = False
    """easyvlm extra. On-policy distillation's teacher: a frozen model that gives its log-probs on the
    student's samples in the same packed rows as the reference model (`algorithm.distill_coef`).
    Micro-batch size, padding-free, shared prompts, Ulysses and torch.compile follow `worker.actor`."""
    model: TeacherModelConfig = field(default_factory=TeacherModelConfig)
    """The teacher model."""
    fsdp: FSDPConfig = field(default_factory=FSDPConfig)
    """FSDP settings of the teacher (`fsdp.torch_dtype`: its dtype; None = bf16 on GPUs, as the
    reference model)."""
    offload: OffloadConfig = field(default_factory=OffloadConfig)
    """CPU offloading of the teacher while idle."""


@dataclass(frozen=True)
class RewardModelModelConfig:
    model_path: Optional[str] = None
    """The reward model: the `huggingface/` directory `python -m easyvlm.rm` exports, or any
    scalar sequence-classification model (`...ForSequenceClassification`, `num_labels=1`) that
    shares the policy's tokenizer; a local directory or a hub id."""
    override_config: dict[str, Any] = field(default_factory=dict)
    """Values that override the reward model's `config.json` when it is loaded."""
    trust_remote_code: bool = False
    """Allow running Python code shipped in the reward model's repository."""
    attn_implementation: Literal["sdpa", "eager", "flash_attention_2", "flash_attention_3"] = "sdpa"
    """Attention kernel of the reward model (see `worker.actor.model.attn_implementation`)."""


@dataclass(frozen=True)
class RewardModelConfig:
    enable: bool = False
    """easyvlm extra (verl's `reward_model.enable`). Score every response with a trained reward
    model in its own worker group. Its score reaches reward functions as `reward_model_score`;
    `reward_functions/reward_model.py:compute_score` returns it as the reward, alone or weighted
    with rule rewards in `worker.reward.reward_functions`."""
    model: RewardModelModelConfig = field(default_factory=RewardModelModelConfig)
    """The reward model's files."""
    micro_batch_size_per_device: int = 16
    """Sequences per forward pass on one device (verl's `micro_batch_size_per_gpu`)."""
    padding_free: bool = True
    """Pack sequences without padding; the samples of one prompt share its pass."""
    normalize: Literal["none", "running"] = "none"
    """`running`: standardise each score by the running mean and standard deviation of all scores
    seen so far in training (kept in checkpoints; validation uses them without updating them). The
    reward's scale stops depending on the reward model's, at the price of a moving target early on."""
    fsdp: FSDPConfig = field(default_factory=FSDPConfig)
    """FSDP settings of the reward model."""


@dataclass(frozen=True)
@fields_of(EntropySettings, after="use_torch_compile", read_as="entropy")
@fields_of(PolicyLossSettings, after="max_grad_norm", read_as="policy_loss")
@fields_of(ForwardSettings, after="ppo_epochs", read_as="forward")
@fields_of(UpdateSettings, after="micro_batch_size_per_device_for_experience", read_as="update")
class ActorConfig:
    strategy: Literal["fsdp"] = "fsdp"
    """Training backend (FSDP2)."""
    global_batch_size: int = 256
    """PPO mini-batch in prompts (verl's `ppo_mini_batch_size`): one optimizer step per
    `global_batch_size * worker.rollout.n` samples."""
    micro_batch_size_per_device_for_update: int = 4
    """Samples per forward/backward pass on one device during the update (gradients accumulate
    over micro-batches)."""
    micro_batch_size_per_device_for_experience: int = 16
    """Samples per forward pass on one device when computing old log-probs (and ref log-probs)."""
    # here: the update's keys max_grad_norm, ppo_epochs (UpdateSettings; spliced first, below the other
    # splices), and between them the policy loss's keys, clip_ratio_low ... off_policy_mask_threshold
    # (PolicyLossSettings, spliced after max_grad_norm)
    # here: the forward keys, padding_free ... expert_parallel_size (ForwardSettings)
    use_torch_compile: bool = True
    """torch.compile the log-prob and entropy kernels."""
    # here: the entropy bonus's keys, entropy_coeff ... entropy_coeff_max (EntropySettings)
    max_token_len_per_device: Optional[int] = None
    """easyvlm extra (verl's ppo_max_token_len_per_gpu). Dynamic batching's token budget per
    micro-batch. None = EasyR1's: the micro-batch size times data.max_prompt_length +
    data.max_response_length (a micro-batch of EasyR1's padded rows)."""
    vision_cache_mb: Optional[int] = None
    """easyvlm extra. With a frozen vision tower (`model.freeze_vision_tower=true`): each image goes
    through the tower once, alone, and its embeddings are kept on the device, up to this many MiB
    (least recently used out first), for every later pass that shows the model the image: the old
    log-probs, the update's micro-batches and epochs, the next steps. Exact: the log-probs and
    gradients are those of encoding each image by itself. The reference model shares the actor's
    entries when its tower's weights are the actor's, else keeps its own (the teacher too); with
    `offload.offload_params` the entries are dropped at each offload. None = 1024 with a frozen
    tower, else off; 0 = off. A value with a tower that trains is refused."""
    router_replay: Literal["disabled", "R2", "R3"] = "disabled"
    """easyvlm extra (verl's router_replay.mode values). MoE models (Qwen3.5-MoE, Qwen3-VL-MoE): which
    experts the training passes route each token to. disabled: the router's own choice in every pass;
    R2: the update replays the experts chosen in the old-log-prob pass; R3 (Rollout Routing Replay,
    arXiv:2510.11370): the sampler (either engine) records its experts and the old, reference and
    update passes replay them (single-turn rollouts, no partial_rollout; vLLM on the CPU needs
    worker.rollout.enforce_eager=true). The routing weights stay the current router's probabilities of
    the replayed experts, so the router still trains. Refused for dense models."""
    router_aux_loss_coef: Optional[float] = None
    """easyvlm extra. MoE models: weight of the router's load-balancing loss (the model's own, Switch
    Transformer style) added to the actor loss; logged as actor/moe/aux_loss with
    actor/moe/expert_load_{max,min}. None = the model config's router_aux_loss_coef (0.001 for the
    Qwen3.5-MoE and Qwen3-VL-MoE families); 0 = off. A value is refused for dense models."""
    model: ModelConfig = field(default_factory=ModelConfig)
    """The policy model."""
    optim: OptimConfig = field(default_factory=OptimConfig)
    """The actor's optimizer."""
    fsdp: FSDPConfig = field(default_factory=FSDPConfig)
    """FSDP settings of the actor."""
    offload: OffloadConfig = field(default_factory=OffloadConfig)
    """CPU offloading of the actor while idle."""


@dataclass(frozen=True)
@fields_of(ForwardSettings, after="ppo_epochs", read_as="forward", defaults={"padding_free": False}, docs={
    "padding_free": "Pack sequences without padding in the forward pass.",
    "share_prompts": """easyvlm extra. With padding_free: one pass over each prompt shared by its samples (see
    `worker.actor.share_prompts`).""",
    "expert_parallel_size": "easyvlm extra. MoE value models: expert parallelism (see `worker.actor.expert_parallel_size`); 1 = off.",
})
@fields_of(ValueLossSettings, after="max_grad_norm", read_as="value_loss")
@fields_of(UpdateSettings, after="micro_batch_size_per_device_for_experience", read_as="update")
class CriticConfig:
    strategy: Literal["fsdp"] = "fsdp"
    """Training backend (FSDP2)."""
    global_batch_size: int = 256
    """Value-update mini-batch in prompts (times `worker.rollout.n` in samples)."""
    micro_batch_size_per_device_for_update: int = 4
    """Samples per forward/backward pass on one device during the value update."""
    micro_batch_size_per_device_for_experience: int = 16
    """Samples per forward pass on one device when computing values."""
    # here: the update's keys max_grad_norm, ppo_epochs (UpdateSettings; spliced first), and between
    # them the value loss's keys cliprange_value, loss_avg_mode (ValueLossSettings)
    # here: the forward keys, padding_free ... expert_parallel_size (ForwardSettings, the critic's own
    # padding_free default and docs above)
    model: ModelConfig = field(default_factory=ModelConfig)
    """The value model (a token-classification head on the policy's architecture); used by
    gae only."""
    optim: OptimConfig = field(default_factory=OptimConfig)
    """The critic's optimizer."""
    fsdp: FSDPConfig = field(default_factory=FSDPConfig)
    """FSDP settings of the critic."""
    offload: OffloadConfig = field(default_factory=OffloadConfig)
    """CPU offloading of the critic while idle."""
