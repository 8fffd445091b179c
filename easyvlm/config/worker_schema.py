"""The typed ``worker`` section of the configuration: the actor, critic and reference model (their
model, optimizer, FSDP and offload settings), the rewards (functions, reward model, judge) and the
rollout. Same conventions as ``easyvlm.config.schema``, which holds the other sections. Composed
here from the components' declarations (``easyvlm.utils.compose``): the actor's, critic's,
reference model's, teacher's and reward model's sections (``easyvlm.workers.settings``, which
composes the actor's and critic's of the model, optimizer, FSDP and offload sections and the losses'
keys), the rollout's multi-turn keys (``easyvlm.agents.settings``) and its placement and asynchrony
keys (``easyvlm.rollout.settings``), the reward and judge sections (``easyvlm.rewards.settings``);
only the rollout's own keys and ``worker`` itself are declared here."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal, Optional

from easyvlm.agents.settings import AgentSettings
from easyvlm.rewards.settings import JudgeConfig, RewardConfig
from easyvlm.rollout.settings import PlacementSettings
from easyvlm.utils.compose import fields_of
from easyvlm.utils.dtypes import DType
from easyvlm.workers.settings import ActorConfig, CriticConfig, RefConfig, RewardModelConfig, TeacherConfig

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
