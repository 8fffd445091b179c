"""The typed configuration of a training run: one frozen dataclass per YAML section.

Field names, meanings and defaults are EasyR1's (see docs/config.md, generated from the docstrings
below), so an EasyR1 YAML loads as is. Where easyvlm's default differs, the field's docstring says
why. Extras that EasyR1 lacks are marked "easyvlm extra".

The ``worker`` section's classes are in ``easyvlm.config.worker_schema``, the names that string keys
accept in ``easyvlm.config.names``. The settings a component reads are declared once, with the
component, and composed (``easyvlm.utils.compose``): here the whole sections ``data``
(``easyvlm.data.settings``) and ``algorithm`` (``easyvlm.algorithms.settings``, which splices in the
KL penalty's, online filtering's and distillation's keys and holds ``algorithm.rollout_correction``
from ``easyvlm.algorithms.rollout_correction_settings``); ``trainer`` is declared here. The dataclasses are
frozen: a run's config is built once (``easyvlm.config.loader``), checked once
(``easyvlm.config.validate``), and values that follow from it are computed once
(``easyvlm.config.derived``). Nothing writes to it afterwards; use ``dataclasses.replace`` to make a
changed copy. This module imports neither torch nor vllm (nor do the settings modules it composes).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, Optional

from easyvlm.algorithms.settings import AlgorithmConfig
from easyvlm.config.names import LoggerName
from easyvlm.data.settings import DataConfig
from easyvlm.config.worker_schema import WorkerConfig

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
