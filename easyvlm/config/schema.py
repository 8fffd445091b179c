"""The typed configuration of a training run: one frozen dataclass per YAML section.

Field names, meanings and defaults are EasyR1's (see docs/config.md, generated from the docstrings
below), so an EasyR1 YAML loads as is. Where easyvlm's default differs, the field's docstring says
why. Extras that EasyR1 lacks are marked "easyvlm extra".

The dataclasses are frozen: a run's config is built once (``easyvlm.config.loader``), checked once
(``easyvlm.config.validate``), and values that follow from it are computed once
(``easyvlm.config.derived``). Nothing writes to it afterwards; use ``dataclasses.replace`` to make a
changed copy. This module imports neither torch nor vllm.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal, Optional

# Names accepted by string fields that also take a user plug-in ("path/to/file.py:func").
# They mirror the registries in easyvlm.algorithms, which this module must not import (config/ stays
# free of torch); a test in the algorithms suite should check that the two lists agree.
ADV_ESTIMATORS: tuple[str, ...] = (
    "gae",
    "grpo",
    "grpo_passk",
    "rloo",
    "reinforce_plus_plus",
    "reinforce_plus_plus_baseline",
    "remax",
)
# Estimators whose baseline is computed from the other samples of the same prompt.
GROUP_ADV_ESTIMATORS: tuple[str, ...] = ("grpo", "grpo_passk", "rloo", "reinforce_plus_plus_baseline")
POLICY_LOSSES: tuple[str, ...] = ("default", "gspo", "gspo_token", "cispo", "sapo")
SHIPPED_TOOLS: tuple[str, ...] = ("image_zoom", "calculator")
"""The tools easyvlm ships (easyvlm.agents.shipped), by the names ``worker.rollout.tools`` takes."""
# trainer.logger -> (module it imports, pip requirement that provides it); console and file need nothing
LOGGER_PACKAGES: dict[str, tuple[str, str]] = {
    "tensorboard": ("tensorboard", "tensorboard"),
    "wandb": ("wandb", "wandb"),
    "swanlab": ("swanlab", "swanlab"),
    "mlflow": ("mlflow", "mlflow-skinny"),  # the full `mlflow` package provides the module too
}

KLPenalty = Literal["kl", "abs", "mse", "low_var_kl", "full"]
KLType = Literal["fixed", "adaptive"]
LoggerName = Literal["console", "file", "tensorboard", "wandb", "mlflow", "swanlab"]
LossAvgMode = Literal["token", "seq", "seq-mean-token-sum", "seq-mean-token-sum-norm"]
# Both spellings EasyR1 accepts; canonical_dtype() maps them to one.
DType = Literal["bf16", "bfloat16", "fp16", "float16", "fp32", "float32"]

_CANONICAL_DTYPES = {
    "bf16": "bf16",
    "bfloat16": "bf16",
    "fp16": "fp16",
    "float16": "fp16",
    "fp32": "fp32",
    "float32": "fp32",
}


def canonical_dtype(name: str) -> Literal["bf16", "fp16", "fp32"]:
    """``"bfloat16"`` -> ``"bf16"`` etc., so that workers compare a single spelling."""
    try:
        return _CANONICAL_DTYPES[name]  # type: ignore[return-value]
    except KeyError:
        raise ValueError(f"unknown dtype {name!r}; known: {sorted(_CANONICAL_DTYPES)}") from None


# --------------------------------------------------------------------------------------------- data
@dataclass(frozen=True)
class DataConfig:
    train_files: str = ""
    """Training prompts: a hub data set id, a local file (JSON, JSONL, Parquet) or directory, or
    `builtin:synthetic`. `path@split` selects a split (default `train`)."""
    val_files: str = ""
    """Validation prompts, same forms as `train_files`. Empty: no validation data (then validation
    must be off: `trainer.val_freq=-1`, `trainer.val_before_train=false`)."""
    prompt_key: str = "prompt"
    """Column holding the prompt text; `<image>` / `<video>` in it mark where the media go."""
    answer_key: str = "answer"
    """Column holding the answer; it reaches the reward function as `ground_truth`."""
    image_key: str = "images"
    """Column holding the images of a row (paths, bytes or dicts); absent or empty = text only."""
    video_key: str = "videos"
    """Column holding the videos of a row."""
    image_dir: Optional[str] = None
    """Directory that relative image and video paths in the data are relative to. None: the data
    file's directory, then the working directory (EasyR1: the working directory only), so that a
    data set directory can be moved as a whole and EasyR1's working-directory paths still work."""
    video_fps: float = 2.0
    """Frames per second sampled from video files (qwen-vl-utils' rule: at least 4 frames, an even
    count); a row's list of frame images is taken as sampled at this rate."""
    video_max_frames: int = 768
    """easyvlm extra. Most frames kept of one video (qwen-vl-utils' `max_frames`, which EasyR1
    leaves at 768): a file is sampled at fewer frames, a longer frame list is a bad row."""
    max_prompt_length: int = 512
    """Longest prompt in tokens (image tokens included), P."""
    max_response_length: int = 512
    """Most tokens generated per response, T."""
    rollout_batch_size: int = 512
    """Prompts per training step (verl's `data.train_batch_size`). Each is sampled
    `worker.rollout.n` times."""
    mini_rollout_batch_size: Optional[int] = None
    """Prompts per generation round (verl's `data.gen_batch_size`). None: one round of
    `rollout_batch_size`. With online filtering, rounds repeat until `rollout_batch_size` prompts
    survive the filter."""
    val_batch_size: int = -1
    """Prompts per validation generation call; -1 = the whole validation set at once."""
    format_prompt: Optional[str] = None
    """Jinja file that wraps each prompt (rendered with `content` = the prompt text). None: the
    prompt is used as is."""
    override_chat_template: Optional[str] = None
    """A Jinja chat template that replaces the tokenizer's own. None: use the tokenizer's."""
    shuffle: bool = True
    """Shuffle the training prompts each epoch."""
    seed: int = 1
    """Seed of the training data shuffle."""
    min_pixels: Optional[int] = 262144
    """Images smaller than this many pixels are upscaled (aspect kept, sides truncated, as EasyR1's
    `process_image`); the model processor's own limits then round the sides to its patch grid, so
    the final pixel count can fall slightly outside. None: no lower limit."""
    max_pixels: Optional[int] = 4194304
    """Images larger than this many pixels are downscaled (as `min_pixels`). None: no upper limit."""
    filter_overlong_prompts: bool = True
    """Drop prompts longer than `max_prompt_length` tokens when the data set is loaded."""
    filter_overlong_prompts_workers: int = 16
    """Processes used to tokenize prompts for `filter_overlong_prompts`."""
    prompt_truncation: Literal["error", "left", "right"] = "error"
    """easyvlm extra. What to do with a prompt longer than `max_prompt_length` that was not
    filtered: `error` stops with the row's index; `left` / `right` cut tokens from that side."""
    system_prompt: Optional[str] = None
    """easyvlm extra. A system message put before every prompt. None: none (the chat template's
    default, if any, applies)."""
    on_bad_row: Literal["raise", "skip"] = "raise"
    """easyvlm extra. A row that cannot be read (missing column, unreadable image): `raise` stops
    with the row's index; `skip` drops it and counts it in the logs."""


# ---------------------------------------------------------------------------------------- algorithm
@dataclass(frozen=True)
class RolloutCorrectionConfig:
    """verl's rollout correction (docs/algorithms.md, "Rollout correction"): importance weights and
    rejection of tokens where the sampler's log-probs (pi_rollout) differ from the trainer's (pi_old).
    Same key names and meanings as verl's `algorithm.rollout_correction`; easyvlm always keeps the
    sampler's log-probs (verl's `calculate_log_probs`). The mismatch metrics
    (actor/rollout_mismatch/*) are logged every step whatever is set here."""

    rollout_is: Optional[Literal["token", "sequence"]] = None
    """Importance weights pi_old / pi_rollout multiplying each token's policy loss: `token` (one
    per token), `sequence` (the product over the sequence), null = none. Needs the trainer's
    log-probs, so the step computes them (one forward pass) even when the update is on-policy."""
    rollout_is_threshold: str = "2.0"
    """A number u: truncated IS, weights above u become u. A string `l_u` (e.g. `0.5_2.0`): IcePop,
    weights outside [l, u] become 0."""
    rollout_is_batch_normalize: bool = False
    """Divide the weights by their mean over the step's batch (after truncation)."""
    rollout_rs: Optional[str] = None
    """Rejection sampling: comma-separated criteria that drop tokens (token_k1/k2/k3) or whole
    sequences (seq_sum_k1/k2/k3, seq_mean_k1/k2/k3, seq_max_k2/k3) from the loss, k1 = -log r,
    k2 = (log r)^2 / 2, k3 = r - 1 - log r with r = pi_old / pi_rollout. null = none."""
    rollout_rs_threshold: Optional[str] = None
    """Bounds of `rollout_rs`, comma-separated, one per criterion or one for all: k2/k3 an upper
    bound; k1 `l_u` (a single u means `1/u_u`), kept when pi_rollout / pi_old lies in [l, u] (verl's)."""
    bypass_mode: bool = False
    """True: the sampler's log-probs are PPO's old log-probs (pi_old = pi_rollout; verl's bypass
    mode): no trainer forward pass for them, and the PPO ratio pi_theta / pi_rollout is the
    correction. Not combinable with rollout_is / rollout_rs here."""
    loss_type: str = "ppo_clip"
    """verl's bypass-mode loss. Only `ppo_clip` (the configured worker.actor.loss_type with the
    rollout as pi_old); verl's `reinforce` is refused."""

    @property
    def active(self) -> bool:
        """Whether the policy loss changes (weights or rejection); else only metrics are logged."""
        return self.rollout_is is not None or self.rollout_rs is not None


@dataclass(frozen=True)
class AlgorithmConfig:
    gamma: float = 1.0
    """Discount factor (GAE, REINFORCE++)."""
    lam: float = 1.0
    """GAE's lambda."""
    adv_estimator: str = "grpo"
    """Advantage estimator: gae, grpo, grpo_passk, rloo, reinforce_plus_plus,
    reinforce_plus_plus_baseline, remax, or your own as `path/to/file.py:func`. gae needs the
    critic (a value model)."""
    disable_kl: bool = False
    """Turn the KL penalty off entirely; no reference model is built."""
    use_kl_loss: bool = False
    """False: the KL penalty is subtracted from the token rewards. True: it is a term of the actor
    loss (GRPO's way)."""
    kl_penalty: KLPenalty = "kl"
    """KL estimator: kl (k1), abs, mse (k2), low_var_kl (k3), full."""
    kl_coef: float = 1e-3
    """KL coefficient (the initial one with the adaptive controller)."""
    kl_type: KLType = "fixed"
    """KL controller for the KL-in-reward coefficient: fixed or adaptive."""
    kl_horizon: float = 10000.0
    """Horizon of the adaptive KL controller."""
    kl_target: float = 0.1
    """Target KL of the adaptive KL controller."""
    online_filtering: bool = False
    """DAPO's dynamic sampling: drop prompts whose mean `filter_key` over their samples is not in
    (`filter_low`, `filter_high`), and generate more until `data.rollout_batch_size` prompts are
    kept."""
    filter_key: str = "overall"
    """Reward key that online filtering looks at (`overall` or another key the reward returns)."""
    filter_low: float = 0.01
    """Online filtering keeps prompts whose mean `filter_key` is above this ..."""
    filter_high: float = 0.99
    """... and below this."""
    norm_adv_by_std_in_grpo: bool = True
    """easyvlm extra. GRPO divides advantages by the group's standard deviation; False gives
    Dr. GRPO (arXiv:2503.20783), which does not."""
    rollout_correction: RolloutCorrectionConfig = field(default_factory=RolloutCorrectionConfig)
    """verl's rollout correction: truncated / masked importance sampling against the sampler."""


# ------------------------------------------------------------------------------------------- worker
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
    response, Dr. GRPO)."""
    loss_type: str = "default"
    """Policy loss: default (PPO clip with clip-higher and dual-clip), gspo, gspo_token, cispo, sapo,
    or your own as `path/to/file.py:func`."""
    tau_positive: float = 1.0
    """SAPO (arXiv:2511.20347): temperature of the soft gate for tokens with a non-negative
    advantage (loss_type=sapo only)."""
    tau_negative: float = 1.05
    """SAPO: temperature of the soft gate for tokens with a negative advantage (loss_type=sapo only)."""
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
    entropy); 0 = none."""
    max_token_len_per_device: Optional[int] = None
    """easyvlm extra. Dynamic batching's token budget per micro-batch. None = the micro-batch
    size times the batch's padded sequence length."""
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
    """Disable CUDA graphs in vLLM (slower, less memory). vLLM on the CPU needs true."""
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


# ------------------------------------------------------------------------------------------ trainer
@dataclass(frozen=True)
class TrainerConfig:
    total_epochs: int = 15
    """Passes over the training prompts."""
    max_steps: Optional[int] = None
    """Stop after this many training steps; overrides `total_epochs`. None = run all epochs."""
    project_name: str = "easyvlm"
    """Project name (loggers, checkpoint directory). Default differs from EasyR1 ("easy_r1")."""
    experiment_name: str = "demo"
    """Run name (loggers, checkpoint directory)."""
    logger: list[LoggerName] = field(default_factory=lambda: ["console", "file", "tensorboard"])
    """Where metrics go: console, file, tensorboard, wandb, mlflow, swanlab (each works offline:
    wandb and swanlab without an account write their files under the run directory, mlflow a local
    file store unless MLFLOW_TRACKING_URI says otherwise). A logger whose package is missing is
    refused by the config check. Default differs from EasyR1 (console, wandb): these three need no
    extra package."""
    nnodes: int = 1
    """Machines in the Ray cluster."""
    n_gpus_per_node: int = 8
    """Devices per machine: GPUs, or worker processes when running on the CPU."""
    max_try_make_batch: int = 20
    """Online filtering: most generation rounds per step before giving up; -1 = no limit."""
    critic_warmup: int = 0
    """Steps that train the critic only, before the actor starts updating (gae)."""
    val_freq: int = -1
    """Validate every this many steps; -1 = never (except before training, see
    `val_before_train`)."""
    val_before_train: bool = True
    """Validate once before the first step."""
    val_only: bool = False
    """Validate once and stop (no training)."""
    val_generations_to_log: int = 0
    """Validation samples (prompt, response, ground truth, score) logged each validation: to
    `val_generations.jsonl` in the run directory, `generations.log` (file logger), the `val/generations`
    table (wandb, swanlab) and the console."""
    rollout_log_freq: int = -1
    """easyvlm extra. Write the rollout viewer's pages every this many steps, and at every
    validation: `<save_checkpoint_path>/rollouts/step_<N>.jsonl` and `.html` (each prompt's images,
    its n responses with rewards, advantages and tokens shaded by log-prob; filters) and
    `rollouts/index.html` across steps; static files, opened from disk. Written in a background
    thread; trackers that show media (wandb, swanlab, mlflow) get them too. -1 = off."""
    save_freq: int = -1
    """Save a checkpoint every this many steps; -1 = no periodic checkpoints."""
    save_limit: int = -1
    """Keep at most this many checkpoints (oldest removed first); -1 = keep all."""
    save_model_only: bool = False
    """Save only the model (Hugging Face format), no optimizer or data-loader state: smaller, but
    training cannot resume from it (resuming stops with an error saying how to start a new run from
    its weights)."""
    save_checkpoint_path: Optional[str] = None
    """Checkpoint directory; None = `checkpoints/<project_name>/<experiment_name>`."""
    load_checkpoint_path: Optional[str] = None
    """Resume from this checkpoint directory."""
    find_last_checkpoint: bool = True
    """Resume from the newest checkpoint in `save_checkpoint_path`, if any, when
    `load_checkpoint_path` is unset."""
    seed: int = 1
    """easyvlm extra. Seed of model initialisation (LoRA, value head) and of everything random
    outside the data loader and the generation engine."""
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """easyvlm extra. Where models run; auto = cuda when a GPU is visible, else cpu."""
    ray_timeline: Optional[str] = None
    """Write Ray's timeline of the run (a Chrome-trace JSON; open it in chrome://tracing or Perfetto)
    to this file when training ends. None: no timeline."""
    ray_address: Optional[str] = None
    """easyvlm extra. Ray cluster to join (`auto` or `host:port`); None = start a local one."""


@dataclass(frozen=True)
class PPOConfig:
    data: DataConfig = field(default_factory=DataConfig)
    """Data sets and prompt processing."""
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    """Advantages, KL and online filtering."""
    worker: WorkerConfig = field(default_factory=WorkerConfig)
    """The roles: actor, critic, ref, reward, rollout."""
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    """The training loop: length, logging, validation, checkpoints, resources."""
