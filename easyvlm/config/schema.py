"""The typed configuration of a training run: one frozen dataclass per YAML section.

Field names, meanings and defaults are EasyR1's (see docs/config.md, generated from the docstrings
below), so an EasyR1 YAML loads as is. Where easyvlm's default differs, the field's docstring says
why. Extras that EasyR1 lacks are marked "easyvlm extra".

The ``worker`` section's classes are in ``easyvlm.config.worker_schema``, the names that string keys
accept in ``easyvlm.config.names``. The dataclasses are frozen: a run's config is built once (``easyvlm.config.loader``), checked once
(``easyvlm.config.validate``), and values that follow from it are computed once
(``easyvlm.config.derived``). Nothing writes to it afterwards; use ``dataclasses.replace`` to make a
changed copy. This module imports neither torch nor vllm.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, Optional

from easyvlm.config.names import KLPenalty, KLType, LoggerName
from easyvlm.config.worker_schema import WorkerConfig

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
    # EasyR1's defaults, so its configs mean the same here (worker.judge and the reward-model trainer
    # have their own, each saying why)
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
    use_bias_correction_kl: bool = False
    """easyvlm extra (TRL's key). With use_kl_loss, multiply each token's KL estimate by pi_theta / pi_old, the
    importance-weighted (unbiased) estimator of the DeepSeek-V3.2 report (arXiv:2512.02556)."""
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
    multi_objective_aggregation: Literal["sum_then_normalize", "normalize_then_sum"] = "sum_then_normalize"
    """easyvlm extra (TRL's key), for several `worker.reward.reward_functions`. sum_then_normalize:
    the estimator gets their weighted sum (`overall`). normalize_then_sum (GDPO, arXiv:2601.05242):
    each function's score is normalised within its group, weighted and summed, and the sum
    normalised over the batch; that replaces the score of an outcome estimator, and with grpo it is
    the advantage itself (TRL's). Needs two or more reward functions; not with gae or remax; with
    grpo, not with the KL in the reward or norm_adv_by_std_in_grpo=false (docs/algorithms.md)."""
    rollout_correction: RolloutCorrectionConfig = field(default_factory=RolloutCorrectionConfig)
    """verl's rollout correction: truncated / masked importance sampling against the sampler."""


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
