"""The typed ``worker`` section of the configuration: the actor, critic and reference model (their
model, optimizer, FSDP and offload settings), the rewards (functions, reward model, judge) and the
rollout. Same conventions as ``easyvlm.config.schema``, which holds the other sections."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal, Optional

from easyvlm.config.names import DType, LossAvgMode

@dataclass(frozen=True)
class LoraConfig:
    rank: int = 0
    """LoRA rank; 0 = no LoRA (full fine-tuning), > 0 trains LoRA adapters only."""
    alpha: int = 64
    """LoRA alpha (scale = alpha / rank)."""
    target_modules: str = "all-linear"
    """Modules that get adapters: `all-linear`, or a regular expression matched against full
    module names (peft's meaning of a string)."""
    exclude_modules: Optional[str] = None
    """Regular expression of modules that get no adapter, e.g. `.*visual.*` to leave the vision
    tower alone."""


@dataclass(frozen=True)
class ModelConfig:
    model_path: Optional[str] = None
    """Model to train: `builtin:tiny-qwen2.5-vl`, a local directory in Hugging Face format, or a
    hub id `org/name` (needs a network)."""
    tokenizer_path: Optional[str] = None
    """Tokenizer and processor; None = `model_path`."""
    override_config: dict[str, Any] = field(default_factory=dict)
    """Values that override the model's `config.json` when it is loaded."""
    enable_gradient_checkpointing: bool = True
    """Recompute activations in the backward pass: less memory, about a third more compute."""
    trust_remote_code: bool = False
    """Allow running Python code shipped in the model repository. Default differs from EasyR1
    (True): running code from a model repo is a security decision the user should make
    explicitly; Qwen2.5-VL needs no remote code."""
    freeze_vision_tower: bool = False
    """Train the language model only; the vision encoder's weights stay fixed."""
    lora: LoraConfig = field(default_factory=LoraConfig)
    """LoRA adapters."""
    attn_implementation: Literal["sdpa", "eager", "flash_attention_2", "flash_attention_3"] = "sdpa"
    """easyvlm extra. Attention kernel: sdpa runs everywhere (CPU included); flash_attention_2 is
    the fast choice on GPUs with flash-attn installed."""


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
    max_grad_norm: float = 1.0
    """Clip the gradient norm to this."""
    clip_ratio_low: float = 0.2
    """PPO clip: the ratio is clipped below at 1 - clip_ratio_low."""
    clip_ratio_high: float = 0.3
    """PPO clip: the ratio is clipped above at 1 + clip_ratio_high (DAPO's clip-higher)."""
    clip_ratio_dual: float = 3.0
    """Dual-clip PPO's constant c (arXiv:1912.09729): for negative advantages the loss is at most
    c times the advantage's magnitude. Must be > 1."""
    loss_avg_mode: LossAvgMode = "token"
    """How token losses become one number: token (mean over all tokens of the mini-batch), seq
    (mean over tokens of each sequence, then over sequences), seq-mean-token-sum (sum over tokens,
    mean over sequences), seq-mean-token-sum-norm (sum over tokens divided by the longest possible
    response, Dr. GRPO), token-sum (sum over every token of the mini-batch, no division; verl's)."""
    loss_type: str = "default"
    """Policy loss: default (PPO clip with clip-higher and dual-clip), gspo, gspo_token, cispo, sapo,
    geo_mean (GMPO), clip_cov, kl_cov (Clip-Cov / KL-Cov), gpg (plain policy gradient), or your own
    as `path/to/file.py:func`."""
    tau_positive: float = 1.0
    """SAPO (arXiv:2511.20347): temperature of the soft gate for tokens with a non-negative
    advantage (loss_type=sapo only)."""
    tau_negative: float = 1.05
    """SAPO: temperature of the soft gate for tokens with a negative advantage (loss_type=sapo only)."""
    clip_cov_ratio: float = 0.0002
    """easyvlm extra (verl's key and default). Clip-Cov (loss_type=clip_cov, arXiv:2505.22617):
    fraction of the valid tokens whose gradient is detached, drawn at random among those whose
    covariance of advantage and log-prob lies in (clip_cov_lb, clip_cov_ub)."""
    clip_cov_lb: float = 1.0
    """easyvlm extra (verl's key and default). Clip-Cov: lower end of the covariance band."""
    clip_cov_ub: float = 5.0
    """easyvlm extra (verl's key and default). Clip-Cov: upper end of the covariance band."""
    kl_cov_ratio: float = 0.0002
    """easyvlm extra (verl's key and default). KL-Cov (loss_type=kl_cov): fraction of the valid
    tokens, those with the largest covariance, that get the penalty ppo_kl_coef * |log ratio| (the
    paper uses 0.002 for 7B models and 0.0002 for 32B)."""
    ppo_kl_coef: float = 1.0
    """easyvlm extra (verl's key and default). KL-Cov: weight of the |log ratio| penalty on the
    selected tokens."""
    top_entropy_quantile: float = 1.0
    """easyvlm extra (TRL's key). "Beyond the 80/20 rule" (arXiv:2506.01939): only the tokens whose
    entropy is in the top fraction rho of the micro-batch carry the policy gradient (0.2 in the
    paper); 1.0 = all tokens. The others still count in the loss's normaliser."""
    off_policy_mask_threshold: Optional[float] = None
    """easyvlm extra (TRL's key). DeepSeek-V3.2's off-policy sequence masking (arXiv:2512.02556
    eqn. 9): a sequence with a negative advantage whose mean log(pi_sampler / pi_theta) over its
    tokens exceeds this (e.g. 0.5) carries no policy gradient. None = off."""
    ppo_epochs: int = 1
    """Passes over each step's samples."""
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
    use_torch_compile: bool = True
    """torch.compile the log-prob and entropy kernels."""
    entropy_coeff: float = 0.0
    """easyvlm extra. Weight of the entropy bonus in the actor loss (loss -= entropy_coeff *
    entropy); 0 = none. With use_adaptive_entropy: the controller's initial coefficient."""
    use_adaptive_entropy: bool = False
    """easyvlm extra (TRL's key). Adaptive entropy control (Skywork-OR1, arXiv:2505.22312; TRL's use_adaptive_entropy): after
    each step the coefficient moves by entropy_coeff_delta towards more bonus while the step's
    token-mean entropy is <= entropy_target, less otherwise, within [entropy_coeff_min,
    entropy_coeff_max]; the bonus acts only in a step that follows one with entropy <=
    entropy_target (so not in the first step, as in TRL). Logs actor/entropy_coeff (the
    coefficient applied) and actor/entropy (the measurement). See docs/algorithms.md."""
    entropy_target: float = 0.2
    """easyvlm extra (TRL's key). Adaptive entropy control: the target token-mean entropy in nats (TRL's key and default)."""
    entropy_coeff_delta: float = 0.005
    """easyvlm extra. Adaptive entropy control: the coefficient's step per trainer step (TRL spells it
    entropy_coef_delta; TRL's default)."""
    entropy_coeff_min: float = 0.0
    """easyvlm extra. Adaptive entropy control: the coefficient's lower bound (TRL: entropy_coef_min; its default)."""
    entropy_coeff_max: float = 1.0
    """easyvlm extra. Adaptive entropy control: the coefficient's upper bound (TRL: entropy_coef_max; its default)."""
    max_token_len_per_device: Optional[int] = None
    """easyvlm extra (verl's ppo_max_token_len_per_gpu). Dynamic batching's token budget per
    micro-batch. None = EasyR1's: the micro-batch size times data.max_prompt_length +
    data.max_response_length (a micro-batch of EasyR1's padded rows)."""
    router_replay: Literal["disabled", "R2", "R3"] = "disabled"
    """easyvlm extra (verl's router_replay.mode values). MoE models (Qwen3.5-MoE, Qwen3-VL-MoE): which
    experts the training passes route each token to. disabled: the router's own choice in every pass;
    R2: the update replays the experts chosen in the old-log-prob pass; R3 (Rollout Routing Replay,
    arXiv:2510.11370): the sampler records its experts and the old, reference and update passes replay
    them (worker.rollout.name=hf). The routing weights stay the current router's probabilities of the
    replayed experts, so the router still trains. Refused for dense models."""
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
class CriticConfig:
    strategy: Literal["fsdp"] = "fsdp"
    """Training backend (FSDP2)."""
    global_batch_size: int = 256
    """Value-update mini-batch in prompts (times `worker.rollout.n` in samples)."""
    micro_batch_size_per_device_for_update: int = 4
    """Samples per forward/backward pass on one device during the value update."""
    micro_batch_size_per_device_for_experience: int = 16
    """Samples per forward pass on one device when computing values."""
    max_grad_norm: float = 1.0
    """Clip the gradient norm to this."""
    cliprange_value: float = 0.5
    """Clip range of the value loss: new values stay within old values +- this."""
    loss_avg_mode: LossAvgMode = "token"
    """How token value losses become one number (see `worker.actor.loss_avg_mode`)."""
    ppo_epochs: int = 1
    """Passes over each step's samples."""
    padding_free: bool = False
    """Pack sequences without padding in the forward pass."""
    share_prompts: bool = True
    """easyvlm extra. With padding_free: one pass over each prompt shared by its samples (see
    `worker.actor.share_prompts`)."""
    dynamic_batching: bool = True
    """Form micro-batches by a token budget instead of a fixed sample count."""
    ulysses_size: int = 1
    """Ulysses sequence-parallel degree; 1 = off."""
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
class RefConfig:
    strategy: Literal["fsdp"] = "fsdp"
    """Backend of the reference model (the actor's initial weights, for the KL penalty).
    Micro-batch size, padding-free, Ulysses and torch.compile follow `worker.actor`."""
    fsdp: FSDPConfig = field(default_factory=FSDPConfig)
    """FSDP settings of the reference model."""
    offload: OffloadConfig = field(default_factory=OffloadConfig)
    """CPU offloading of the reference model while idle."""


@dataclass(frozen=True)
class RewardFunctionConfig:
    reward_function: str = ""
    """`path/to/file.py:func` (without `:func` the function is `main`)."""
    reward_function_kwargs: dict[str, Any] = field(default_factory=dict)
    """Keyword arguments bound to the function."""
    weight: float = 1.0
    """Weight of this function's `overall` in the combined `overall`."""


@dataclass(frozen=True)
class RewardConfig:
    reward_type: Optional[Literal["batch", "sequential"]] = None
    """batch: the function gets the list of all samples; sequential: one sample per call. None =
    the file's `REWARD_TYPE` constant, else batch. Default differs from EasyR1 ("batch"): the
    reward file knows how it wants to be called."""
    reward_function: Optional[str] = None
    """`path/to/file.py:func` (relative to the working directory; without `:func` the function is
    `main`)."""
    reward_function_kwargs: dict[str, Any] = field(default_factory=dict)
    """Keyword arguments bound to the reward function."""
    skip_special_tokens: bool = True
    """Decode responses without special tokens before scoring."""
    num_cpus: int = 1
    """CPUs reserved for the reward actor."""
    timeout: float = 300.0
    """easyvlm extra. Seconds a reward call may take before it counts as failed."""
    on_error: Literal["raise", "zero"] = "raise"
    """easyvlm extra. A reward call that raises or times out: `raise` stops training with the
    sample; `zero` scores the sample 0 and counts it in the logs."""
    num_workers: int = 1
    """easyvlm extra. Processes that run a sequential reward function in parallel."""
    reward_functions: list[RewardFunctionConfig] = field(default_factory=list)
    """easyvlm extra. Several reward functions: when non-empty, `overall` is the weighted sum of
    their `overall`s and `reward_function` must be unset."""


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
class JudgeConfig:
    enable: bool = False
    """easyvlm extra. Score every response with a generative judge: a VLM reads the template
    below and writes a verdict, which `parser` turns into a score. It reaches reward functions as
    `judge_score`; `reward_functions/judge.py:compute_score` returns it as the reward."""
    model_path: Optional[str] = None
    """The judge model (a generation model, like the policy's): a local directory, a hub id or a
    `builtin:` model."""
    trust_remote_code: bool = False
    """Allow running Python code shipped in the judge model's repository."""
    engine: Literal["vllm", "hf"] = "vllm"
    """The judge's generation engine (greedy)."""
    template: Optional[str] = None
    """Jinja file of the judge's prompt, with `question` (the row's prompt, `<image>` placeholders:
    the sample's images), `response`, `ground_truth`, `num_images`; e.g.
    format_prompts/judge.jinja."""
    parser: Optional[str] = None
    """`path/to/file.py:func` turning the verdict into a score: `func(verdict: str, sample: dict)
    -> float`; raise for a verdict that does not parse (e.g. reward_functions/judge.py:parse_yes_no)."""
    max_tokens: int = 16
    """Verdict tokens."""
    max_prompt_length: int = 1024
    """Judge prompt tokens (images included); longer prompts fail as a judge error."""
    # None, not data.min_pixels' default: the judge is another model, whose processor knows its own limits
    min_pixels: Optional[int] = None
    """Pixel limits of the judge's images; None = the judge processor's own."""
    max_pixels: Optional[int] = None
    """See `min_pixels`."""
    num_workers: int = 1
    """Judge engines (Ray actors, one CPU or GPU each); the step's samples are split over them."""
    timeout: float = 300.0
    """Seconds one engine may take for its share of a step."""
    on_error: Literal["raise", "zero"] = "raise"
    """A verdict that does not parse, or a timeout: `raise` stops with the sample; `zero` scores it
    0 and counts it (judge/parse_failures, judge/timeouts)."""
    cache_size: int = 10000
    """Verdicts remembered (by judge prompt, images and response); 0 = no cache."""


@dataclass(frozen=True)
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
    tools: list[str] = field(default_factory=list)
    """easyvlm extra. Tools the model may call over several turns: shipped ones by name
    (`image_zoom`, `calculator`) or your functions as `path/file.py:func`; the chat template shows
    their schemas, tool results (text or images) come back as the template's tool messages, and only
    the model's tokens are trained. docs/agents.md."""
    environment: Optional[str] = None
    """easyvlm extra. A stateful environment `path/file.py:ClassName` with `reset(row)` and
    `step(action) -> (observation, done[, reward])`: the model's turns are its actions (instead of
    `tools`). docs/agents.md."""
    max_turns: int = 4
    """easyvlm extra. Most model turns per sample with `tools` or an `environment`."""
    max_tokens_per_turn: Optional[int] = None
    """easyvlm extra. Most tokens the model writes in one turn with `tools` or an `environment`;
    None = what is left of `data.max_response_length`, which bounds the whole trajectory (tool
    tokens included)."""
    tool_timeout: float = 10.0
    """easyvlm extra. Seconds a tool call or environment step may take; a call that takes longer is
    answered with an error message."""
    val_override_config: dict[str, Any] = field(default_factory=dict)
    """Sampling settings that differ for validation, e.g. `{n: 1, temperature: 0.6}`: any field of
    vLLM's `SamplingParams` (n, temperature, top_p, top_k, min_p, repetition_penalty, seed, stop, ...)
    except those easyvlm sets itself (the check lists them). With `name: hf`, only n, temperature,
    top_p, top_k, max_tokens, ignore_eos."""
    placement: Literal["colocated", "separate"] = "colocated"
    """easyvlm extra. `colocated`: the engine shares each actor rank's process and device (the
    hybrid engine; weights copied in memory). `separate`: the engines run in their own worker group
    on `num_devices` more devices (GPUs, or processes on the CPU); the actor's weights are sent to
    them after every update. docs/rollout.md, "Separate placement and one-step-off rollout"."""
    num_devices: int = 1
    """easyvlm extra. Devices of the separate rollout group (one engine each, data-parallel);
    only with `placement: separate`."""
    one_step_off: bool = False
    """easyvlm extra. Asynchronous rollout (verl's one-step-off): the next step's batch is generated
    on the separate rollout group while this step trains, with weights one step old; the staleness is
    logged per step (rollout/staleness_*). Pair it with `algorithm.rollout_correction`. Needs
    `placement: separate`."""


@dataclass(frozen=True)
class WorkerConfig:
    hybrid_engine: bool = True
    """Actor, reference model and rollout engine share each device (EasyR1's only mode). easyvlm
    always colocates them; false (separate rollout devices) is refused until asynchronous rollout
    lands."""
    actor: ActorConfig = field(default_factory=ActorConfig)
    """The policy being trained."""
    critic: CriticConfig = field(default_factory=CriticConfig)
    """The value model (gae only)."""
    ref: RefConfig = field(default_factory=RefConfig)
    """The reference policy for the KL penalty."""
    reward: RewardConfig = field(default_factory=RewardConfig)
    """The reward function(s)."""
    reward_model: RewardModelConfig = field(default_factory=RewardModelConfig)
    """easyvlm extra. A trained reward model whose score the reward functions can use."""
    judge: JudgeConfig = field(default_factory=JudgeConfig)
    """easyvlm extra. A generative judge whose parsed verdict the reward functions can use."""
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    """Generation."""
