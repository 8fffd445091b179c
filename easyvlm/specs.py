"""Typed slices of the run plan, one per consumer. Plain frozen dataclasses: no torch, no vllm.

Every value here is final: defaults applied, paths resolved, derived numbers computed, choices
validated by ``easyvlm.config.validate``. A consumer asserts what it relies on; it never judges a
user's value (that is ``validate``'s job) and never reads the config. ``easyvlm.plan.build`` makes
them; docs/architecture.md shows which role gets which slice.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

from easyvlm.config.schema import RolloutCorrectionConfig
from easyvlm.config.worker_schema import FSDPConfig, OffloadConfig, OptimConfig



# ------------------------------------------------------------------------------------------ models
@dataclass(frozen=True)
class LoraSpec:
    """LoRA adapters of the policy (``worker.actor.model.lora`` with rank > 0)."""

    rank: int
    alpha: int
    target_modules: str | tuple[str, ...]
    """``"all-linear"``, a regular expression matched against full module names (peft's meaning of a
    string), or module names (EasyR1's comma form ``q_proj,k_proj`` arrives as a tuple)."""
    exclude_modules: Optional[str]
    """Regular expression of modules left without adapters, or None."""


@dataclass(frozen=True)
class ModelSpec:
    """How a worker builds one model; resolved in the driver."""

    model_dir: str
    """A local model directory (``builtin:`` names and hub ids already resolved)."""
    hf_config: Any
    """The transformers config with ``model.override_config`` applied (loaded once, in the driver)."""
    trust_remote_code: bool
    attn_implementation: str
    """As requested (``sdpa``, ``eager``, ``flash_attention_2``/``_3``; flash falls back to sdpa on the CPU)."""
    lora: Optional[LoraSpec]
    """None: no adapters (full fine-tuning, and always for the reference model and the critic)."""
    freeze_vision_tower: bool
    gradient_checkpointing: bool
    model_path: str = ""
    """The model as the config names it (``builtin:<name>``, a hub id or an absolute local
    directory); "" = only ``model_dir`` is known. Workers load
    ``easyvlm.models.paths.local_model_dir(model_dir, model_path)``: this node's copy."""


@dataclass(frozen=True)
class TokenIds:
    """Token ids every role agrees on, read once from the tokenizer and the model config."""

    pad: int
    """Fills prompts on the left and responses after their end."""
    eos: tuple[int, ...]
    """End a response: the tokenizer's EOS plus the generation config's."""
    blocked: tuple[int, ...]
    """Never sampled (vision placeholders, padded LM-head rows): the rollout removes them and the
    actor / reference log-probs are taken over the same reduced vocabulary."""


@dataclass(frozen=True)
class ModelBundle:
    """The policy's files, resolved and loaded once in the driver (``trust_remote_code`` honoured)."""

    policy: ModelSpec
    tokenizer: Any
    processor: Any
    """The multimodal processor, or None for a text-only model."""
    generation_config: Any
    """The model directory's ``generation_config.json`` (EOS ids, what an HF export keeps), or None."""
    tokens: TokenIds
    tokenizer_dir: str
    """Where the tokenizer and processor were loaded from (the model directory unless
    ``tokenizer_path`` names another)."""
    tokenizer_path: str = ""
    """``tokenizer_dir`` as the config names it (see `ModelSpec.model_path`)."""


# ------------------------------------------------------------------------------------- forward passes
@dataclass(frozen=True)
class MicroBatching:
    """How a rank cuts its samples into forward passes."""

    micro_batch_size: int
    """Samples per pass (without dynamic batching), and the unit of the default token budget."""
    dynamic: bool
    """Cut by a token budget instead of a sample count."""
    max_token_len: Optional[int]
    """Dynamic batching's budget of attended tokens (the plan sets EasyR1's default:
    micro_batch_size x (max_prompt_length + max_response_length)); None = micro_batch_size x the
    batch's padded length."""


@dataclass(frozen=True)
class ForwardSpec:
    """How a role runs its model over a batch (actor, reference and critic alike)."""

    padding_free: bool
    share_prompts: bool
    temperature: float
    """Logits are divided by the rollout temperature before log-softmax (policy roles)."""
    blocked_token_ids: tuple[int, ...]
    use_torch_compile: bool
    """torch.compile the log-prob and entropy kernels."""
    ulysses_size: int
    """Ranks of a sequence-parallel group (1 = off)."""
    experience: MicroBatching
    """Micro-batching of the no-grad passes (old / reference log-probs, values)."""
    router_replay: str = "disabled"
    """MoE policies: disabled, R2 (the actor records in its old-log-prob pass, replays in the update)
    or R3 (every pass replays the sampler's experts); ``easyvlm.workers.routing``."""


@dataclass(frozen=True)
class UpdateSpec:
    """One training step of a trained role: epochs x mini-batches x micro-batches, then clip and step."""

    ppo_epochs: int
    mini_batch_per_rank: int
    """Samples of one optimizer step on one data-parallel rank (global_batch_size x n / data-parallel size)."""
    optimizer_steps_per_step: int
    """Optimizer steps per training step (mini-batches per step x ppo_epochs)."""
    micro: MicroBatching
    max_grad_norm: float
    loss_avg_mode: str
    norm_length: int
    """The constant of loss_avg_mode seq-mean-token-sum-norm: data.max_response_length."""
    optim: OptimConfig
    total_steps: int = 0
    """Training steps of the run (the learning-rate schedule's length); set once the data is loaded."""


# ------------------------------------------------------------------------------------------- losses
@dataclass(frozen=True)
class PolicyLossSpec:
    """A policy loss and its hyperparameters (the actor binds them to its tensors)."""

    name: str
    """A registered loss or a resolved ``/abs/path/file.py:func`` plug-in (loaded in the worker)."""
    clip_ratio_low: float
    clip_ratio_high: float
    clip_ratio_dual: float
    tau_positive: float
    tau_negative: float
    loss_avg_mode: str
    clip_cov_ratio: float = 0.0002
    clip_cov_lb: float = 1.0
    clip_cov_ub: float = 5.0
    kl_cov_ratio: float = 0.0002
    ppo_kl_coef: float = 1.0
    top_entropy_quantile: float = 1.0
    """< 1: only the micro-batch's highest-entropy tokens carry the policy gradient (token_filters.py)."""
    off_policy_mask_threshold: Optional[float] = None
    """Set: DeepSeek-V3.2's off-policy sequence mask (token_filters.py)."""
    source: Optional[str] = field(default=None, repr=False)
    """A plug-in's file text, read in the driver: the worker runs it without a copy of the file."""


@dataclass(frozen=True)
class KLLossSpec:
    """The KL term of the actor loss (``algorithm.use_kl_loss`` on, KL not disabled)."""

    coef: float
    penalty: str
    """An estimator of ``easyvlm.algorithms.kl``; ``full`` needs the reference's whole distribution,
    which the hybrid worker computes beside the actor."""
    bias_correction: bool = False
    """Weigh each token's estimate by pi_theta / pi_old (``algorithm.use_bias_correction_kl``)."""


# -------------------------------------------------------------------------------------------- roles
@dataclass(frozen=True)
class ActorSpec:
    model: ModelSpec
    fsdp: FSDPConfig
    offload: OffloadConfig
    forward: ForwardSpec
    update: UpdateSpec
    policy_loss: PolicyLossSpec
    kl_loss: Optional[KLLossSpec]
    entropy_coeff: float
    seed: int
    """Seeds torch before the model is built, so new weights (LoRA) are equal on every rank."""
    files: ModelBundle
    """Tokenizer, processor and generation config written with an HF export."""
    router_aux_loss_coef: float = 0.0
    """MoE policies: the weight of the router's load-balancing loss (resolved: the model's own when
    not configured; 0 = off and for dense models)."""


@dataclass(frozen=True)
class RefSpec:
    model: ModelSpec
    fsdp: FSDPConfig
    offload: OffloadConfig
    forward: ForwardSpec


@dataclass(frozen=True)
class CriticSpec:
    model: ModelSpec
    fsdp: FSDPConfig
    offload: OffloadConfig
    forward: ForwardSpec
    update: UpdateSpec
    cliprange_value: float
    seed: int


@dataclass(frozen=True)
class EngineSpec:
    """Settings of the generation engine itself (what validation shares with training)."""

    name: str
    """``vllm`` or ``hf``."""
    model_dir: str
    hf_config: Any
    hf_config_overrides: dict
    """``worker.actor.model.override_config``: vLLM loads the model directory itself and applies them."""
    tokenizer_dir: str
    """The policy's tokenizer and processor (``worker.actor.model.tokenizer_path``, resolved): vLLM's
    multimodal processor comes from here, as the data pipeline's does."""
    trust_remote_code: bool
    """``worker.actor.model.trust_remote_code``, for the engine's own loading of model and processor."""
    device: str
    """``cpu`` or ``cuda``."""
    dtype: str
    """Canonical: bf16, fp16 or fp32 (the CPU runs fp32 whatever it says)."""
    seed: int
    max_model_len: int
    max_num_batched_tokens: int
    max_num_seqs: int
    """``worker.rollout.max_num_seqs``, or the work's (``Derived.rollout_max_num_seqs``)."""
    gpu_memory_utilization: float
    enforce_eager: bool
    enable_chunked_prefill: bool
    tensor_parallel_size: int
    limit_images: int
    disable_log_stats: bool
    disable_tqdm: bool
    mm_processor_kwargs: dict = field(default_factory=dict)
    """Keeps vLLM's image sizes equal to the data pipeline's (``easyvlm.data.images``)."""
    sequence_tokens: int = 0
    """The longest a request gets, prompt and response (data.max_prompt_length +
    data.max_response_length); the CPU KV cache holds ``max_num_seqs`` of them. 0 = ``max_model_len``."""
    model_path: str = ""
    tokenizer_path: str = ""
    """``model_dir`` and ``tokenizer_dir`` as the config names them (see `ModelSpec.model_path`);
    the engine loads this node's copies (``easyvlm.models.paths.local_model_dir``)."""
    record_routing: bool = False
    """MoE policies with ``worker.actor.router_replay=R3``: the engine returns each token's experts
    (``routed_experts``) with the samples."""


@dataclass(frozen=True)
class Sampling:
    """The sampling settings of one generate() call, resolved in the driver (the run plan holds the
    training and the validation ones; easyvlm.rollout.base checks them and applies overrides)."""

    n: int
    """Samples per prompt (G)."""
    temperature: float
    """0 = greedy."""
    top_p: float
    top_k: int
    """-1 = no top-k."""
    max_tokens: int
    """At most the engine's response length; responses are still padded to it."""
    ignore_eos: bool
    extra: tuple[tuple[str, Any], ...] = ()
    """Further fields of vLLM's ``SamplingParams`` (``worker.rollout.val_override_config``: min_p,
    repetition_penalty, stop, ...), as (name, value) pairs; the transformers engine takes none."""


@dataclass(frozen=True)
class RolloutSpec:
    engine: EngineSpec
    sampling: Sampling
    """Training sampling (worker.rollout.*; max tokens = data.max_response_length)."""
    val_sampling: Sampling
    """Training sampling with ``worker.rollout.val_override_config`` applied."""
    response_length: int
    tokens: TokenIds
    per_request_seed: bool


@dataclass(frozen=True)
class AgentSpec:
    """Multi-turn rollouts (``worker.rollout.tools`` or ``environment``); the driver runs the turns."""

    tools: tuple[str, ...]
    """Shipped tool names and ``file.py:func`` specs (paths absolute), loaded and checked."""
    tool_schemas: tuple[dict, ...]
    """Their JSON schemas, in order: what the chat template shows in every prompt."""
    environment: Optional[str]
    """``file.py:ClassName`` (path absolute), or None."""
    max_turns: int
    max_tokens_per_turn: Optional[int]
    tool_timeout: float


@dataclass(frozen=True)
class RewardModelSpec:
    """The reward model of ``worker.reward_model``: frozen, scoring each sequence at its last token."""

    model: ModelSpec
    """``hf_config`` is a scalar sequence-classification config (checked in the driver)."""
    fsdp: FSDPConfig
    forward: ForwardSpec
    normalize: str
    """``none`` or ``running`` (applied in the driver, which keeps the running statistics)."""


@dataclass(frozen=True)
class JudgeSpec:
    """The generative judge of ``worker.judge`` (easyvlm.rewards.judge)."""

    rollout: RolloutSpec
    """The judge's engine, greedy, ``max_tokens`` long."""
    data: Any
    """A DataConfig that encodes judge prompts (prompt_key ``prompt``, the judge's pixel limits)."""
    tokenizer: Any
    processor: Any
    template: str
    """Absolute path of the Jinja template."""
    parser: str
    """Resolved ``/abs/file.py:func``."""
    num_workers: int
    timeout: float
    on_error: str
    cache_size: int


# ------------------------------------------------------------------------------------------- driver
@dataclass(frozen=True)
class RoundsSpec:
    """How the driver gathers a step's samples (easyvlm.trainer.sampling)."""

    prompt_groups: int
    """Prompt groups a step trains on (``data.rollout_batch_size``)."""
    online_filtering: bool
    """DAPO's dynamic sampling: keep only groups whose mean ``filter_key`` is in (filter_low, filter_high)."""
    filter_key: str
    filter_low: float
    filter_high: float
    max_rounds: int
    """``trainer.max_try_make_batch``: generation rounds a filtered step may take (-1 = no limit)."""
    seed: int
    """``worker.rollout.seed``, the root of the per-request sampling seeds (with ``per_request_seed``)."""
    per_request_seed: bool
    separate: bool
    """The engines run in their own worker group (``worker.rollout.placement=separate``)."""
    rollout_devices: int
    """Devices of that group (``worker.rollout.num_devices``)."""
    one_step_off: bool
    """The next step's generation runs while this step trains."""
    baseline: bool
    """ReMax: one greedy response per prompt gives the baseline reward."""


@dataclass(frozen=True)
class AdvantageSpec:
    """From rewards to advantages, and which passes the step runs before (easyvlm.trainer.loop)."""

    estimator: str
    gamma: float
    lam: float
    norm_by_std: bool
    kl_penalty: str
    kl_type: str
    kl_coef: float
    kl_target: float
    kl_horizon: float
    kl_in_reward: bool
    """The KL to the reference is subtracted from the token rewards (``Derived.kl_in_reward``)."""
    kl_in_loss: bool
    use_reference: bool
    rollout_correction: RolloutCorrectionConfig
    """``algorithm.rollout_correction`` (checked: it parses)."""
    critic_warmup: int
    """Steps that train the critic alone."""
    multi_objective_aggregation: str = "sum_then_normalize"
    """``algorithm.multi_objective_aggregation``: normalize_then_sum = GDPO's score from each reward
    function's own score (easyvlm.algorithms.multi_objective) replaces their weighted sum."""
    reward_weights: tuple[float, ...] = ()
    """The weight of each of ``worker.reward.reward_functions``, in their order (empty for one
    ``reward_function``): GDPO's w_k."""


@dataclass(frozen=True)
class RecordsSpec:
    """What the run writes: metrics, validation generations, rollout pages, checkpoints."""

    run_dir: str
    """Absolute: logs, the learning curve, rollout pages and checkpoints (``Derived.save_checkpoint_path``)."""
    loggers: tuple[str, ...]
    project_name: str
    experiment_name: str
    config_record: dict
    """The whole config as plain values: experiment_config.json and the trackers' run parameters."""
    val_generations_to_log: int
    rollout_log_freq: int
    ray_timeline: Optional[str]
    save_limit: int
    save_model_only: bool
    max_prompt_length: int
    max_response_length: int
    """Of ``data``: the length metrics' clip ratios."""
    skip_special_tokens: bool
    """``worker.reward.skip_special_tokens``: how responses are decoded for rewards and pages."""


@dataclass(frozen=True)
class EntropyControlSpec:
    """Adaptive entropy control (``worker.actor.use_adaptive_entropy``): the driver's controller
    (``easyvlm.algorithms.entropy.AdaptiveEntropyController``) sets the actor's entropy coefficient
    for each update."""

    init_coeff: float
    """``worker.actor.entropy_coeff``: the controller's starting value."""
    target: float
    delta: float
    coeff_min: float
    coeff_max: float


@dataclass(frozen=True)
class DriverSpec:
    """The driver's own settings (easyvlm.trainer): its loop, rounds, advantages and records."""

    val_before_train: bool
    val_only: bool
    val_freq: int
    save_freq: int
    nnodes: int
    reward_num_cpus: int
    """CPUs of the reward actor (``worker.reward.num_cpus``)."""
    rounds: RoundsSpec
    advantage: AdvantageSpec
    records: RecordsSpec
    entropy_control: Optional[EntropyControlSpec] = None
    """Set when ``worker.actor.use_adaptive_entropy`` is on (else the actor keeps ``entropy_coeff``)."""
    stages: tuple[str, ...] = ()
    """The batch stages between sampling and the end of the update, in order
    (``easyvlm.plan.stages.batch_stages``; run by ``easyvlm.trainer.stages``)."""
