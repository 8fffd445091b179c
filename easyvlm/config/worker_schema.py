"""The typed ``worker`` section of the configuration: the actor, critic and reference model (their
model, optimizer, FSDP and offload settings), the rewards (functions, reward model, judge) and the
rollout. Same conventions as ``easyvlm.config.schema``, which holds the other sections. Composed
here from the components' declarations (``easyvlm.utils.compose``): the model sections
(``easyvlm.models.settings``), the optimizer, FSDP and offload sections, the actor's and critic's
update and forward keys and the reference model's, the teacher's and the reward model's sections
(``easyvlm.workers.settings``), the actor's policy-loss and entropy keys and the critic's value-loss
keys (``easyvlm.algorithms.settings``), the rollout's multi-turn keys (``easyvlm.agents.settings``)
and its placement and asynchrony keys (``easyvlm.rollout.settings``), the reward and judge sections
(``easyvlm.rewards.settings``)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal, Optional

from easyvlm.agents.settings import AgentSettings
from easyvlm.algorithms.settings import EntropySettings, PolicyLossSettings, ValueLossSettings
from easyvlm.models.settings import ModelConfig
from easyvlm.rewards.settings import JudgeConfig, RewardConfig
from easyvlm.rollout.settings import PlacementSettings
from easyvlm.utils.compose import fields_of
from easyvlm.utils.dtypes import DType
from easyvlm.workers.settings import (
    FSDPConfig,
    ForwardSettings,
    OffloadConfig,
    OptimConfig,
    RefConfig,
    RewardModelConfig,
    TeacherConfig,
    UpdateSettings,
)

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


@dataclass(frozen=True)
@fields_of(PlacementSettings, after="val_override_config", read_as="placement_settings")
@fields_of(AgentSettings, after="disable_tqdm", read_as="agent")
class RolloutConfig:
    name: Literal["vllm", "hf"] = "vllm"
    """Generation engine: vllm, or hf (transformers' generate: slow, for comparison and
    debugging)."""
    n: int = 1
    """Samples per prompt, G (GRPO's group size)."""
    temperature: float = 1.0
    """Sampling temperature; 0 = greedy."""
    top_p: float = 1.0
    """Nucleus sampling threshold; 1 = off."""
    top_k: int = -1
    """Top-k sampling; -1 = off."""
    seed: int = 1
    """Seed of the generation engine."""
    per_request_seed: bool = False
    """easyvlm extra. Seed each sample from (seed, step, prompt, sample), so a resumed run samples
    exactly what an uninterrupted run did. Costs ~6% of vLLM decode throughput on the CPU, likely
    more on GPUs; vLLM on the CPU needs enable_chunked_prefill=false with it."""
    limit_images: int = 0
    """Most images per prompt the engine accepts; 0 = no limit set."""
    dtype: DType = "bf16"
    """Dtype of the generation engine's weights."""
    gpu_memory_utilization: float = 0.6
    """Fraction of GPU memory vLLM may use (weights plus KV cache)."""
    ignore_eos: bool = False
    """Keep generating after EOS up to `data.max_response_length`."""
    enforce_eager: bool = False
    """vLLM without torch.compile and CUDA graphs (slower, less memory, quicker start). On the CPU, false compiles
    the model too (Inductor; no CUDA graphs there): ~45 s more at start, generation 1.0-1.2x (docs/benchmarks.md)."""
    enable_chunked_prefill: bool = False
    """vLLM chunked prefill."""
    tensor_parallel_size: int = 1
    """Devices per vLLM engine. Default differs from EasyR1 (2): 1 runs everywhere, including the
    CPU and single-GPU machines."""
    max_model_len: Optional[int] = None
    """vLLM's context length; None = max_prompt_length + max_response_length."""
    max_num_batched_tokens: int = 8192
    """Most tokens vLLM processes in one scheduler step."""
    max_num_seqs: Optional[int] = None
    """easyvlm extra. Most sequences the engine runs at once (vLLM; transformers' generate: per
    call). None = the most one generation call gives an engine: ceil(prompts per round / devices) x
    `n`, or a validation batch's if larger (the whole validation set counts as 256), at most 256. On
    the CPU the KV cache holds this many sequences of `data.max_prompt_length +
    data.max_response_length` tokens and no more."""
    disable_log_stats: bool = True
    """Silence vLLM's periodic statistics."""
    disable_tqdm: bool = False
    """Hide the generation progress bar."""
    # here: the multi-turn keys, tools ... tool_timeout (AgentSettings)
    val_override_config: dict[str, Any] = field(default_factory=dict)
    """Sampling settings that differ for validation, e.g. `{n: 1, temperature: 0.6}`: any field of
    vLLM's `SamplingParams` (n, temperature, top_p, top_k, min_p, repetition_penalty, seed, stop, ...)
    except those easyvlm sets itself (the check lists them). With `name: hf`, only n, temperature,
    top_p, top_k, max_tokens, ignore_eos."""
    # here: the placement and asynchrony keys, placement ... weight_transfer (PlacementSettings)


@dataclass(frozen=True)
class WorkerConfig:
    hybrid_engine: bool = True
    """Actor, reference model and rollout engine share each device (EasyR1's only mode). false is
    refused: the rollout engines get devices of their own with worker.rollout.placement=separate."""
    actor: ActorConfig = field(default_factory=ActorConfig)
    """The policy being trained."""
    critic: CriticConfig = field(default_factory=CriticConfig)
    """The value model (gae only)."""
    ref: RefConfig = field(default_factory=RefConfig)
    """The reference policy for the KL penalty."""
    teacher: TeacherConfig = field(default_factory=TeacherConfig)
    """easyvlm extra. The teacher of on-policy distillation (`algorithm.distill_coef`)."""
    reward: RewardConfig = field(default_factory=RewardConfig)
    """The reward function(s)."""
    reward_model: RewardModelConfig = field(default_factory=RewardModelConfig)
    """easyvlm extra. A trained reward model whose score the reward functions can use."""
    judge: JudgeConfig = field(default_factory=JudgeConfig)
    """easyvlm extra. A generative judge whose parsed verdict the reward functions can use."""
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    """Generation."""
