"""The reward-model trainer's config, `RMConfig`: it reuses the RL config's model, optimizer and FSDP
sections; every key acts or is refused by :func:`find_problems` before anything heavy starts."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, Optional

from easyvlm.config.checks import Checks, check_fsdp, check_model, check_optim
from easyvlm.config.errors import Problem
from easyvlm.models.settings import ModelConfig
from easyvlm.workers.settings import FSDPConfig, OptimConfig


@dataclass(frozen=True)
class PreferenceDataConfig:
    train_files: str = "builtin:synthetic-preference@train"
    """Preference pairs: a local file (JSON, JSONL, Parquet) or directory, a hub data set id, or
    `builtin:synthetic-preference`. `path@split` selects a split."""
    val_files: str = "builtin:synthetic-preference@test"
    """Held-out pairs for the pairwise accuracy; empty = no validation."""
    prompt_key: str = "prompt"
    """Column of the prompt text; `<image>` marks where each image goes (as in RL data)."""
    chosen_key: str = "chosen"
    """Column of the preferred response."""
    rejected_key: str = "rejected"
    """Column of the other response."""
    margin_key: Optional[str] = None
    """Column of a per-pair margin m >= 0 (loss -log sigmoid(r_c - r_r - m)); None = no margin."""
    image_key: str = "images"
    """Column of the row's images (paths, bytes or dicts)."""
    image_dir: Optional[str] = None
    """Where relative image paths are looked for; None = the data file's directory, then the
    working directory."""
    format_prompt: Optional[str] = None
    """Jinja template applied to the prompt (`{{ content }}`): use the policy's, so the reward
    model sees prompts exactly as the policy's rollouts carry them."""
    system_prompt: Optional[str] = None
    """A system message before the prompt; use the policy run's."""
    max_prompt_length: int = 512
    """Prompt tokens (image tokens included); longer rows are refused, or dropped with
    `filter_overlong_prompts`."""
    max_response_length: int = 64
    """Response tokens (the end-of-turn token included); longer responses are cut (a cut response
    has no end-of-turn token, as a cut rollout)."""
    filter_overlong_prompts: bool = True
    """Drop rows whose prompt is longer than max_prompt_length (counted), instead of refusing them."""
    # Not RL data's defaults (EasyR1's 262144 / 4194304, kept there for EasyR1 configs): EasyR1 has no
    # reward-model trainer to agree with, so these are the Qwen2-VL image processor's own defaults
    # (56*56 to 28*28*1280 pixels), which keep a pair's two forward passes small.
    min_pixels: Optional[int] = 3136
    """Images with fewer pixels are scaled up (as in RL data)."""
    max_pixels: Optional[int] = 1003520
    """Images with more pixels are scaled down (as in RL data)."""
    on_bad_row: Literal["raise", "skip"] = "raise"
    """A row that cannot be used (missing column, unreadable image): stop naming it, or skip it."""
    batch_size: int = 32
    """Pairs per optimizer step (over all ranks)."""
    shuffle: bool = True
    """Shuffle the pairs every epoch (seeded by trainer.seed)."""


@dataclass(frozen=True)
class RMTrainerConfig:
    total_epochs: int = 1
    """Passes over the training pairs."""
    max_steps: Optional[int] = None
    """Stop after this many optimizer steps; None = all epochs."""
    micro_batch_size_per_device: int = 16
    """Pairs per forward/backward pass on one device."""
    max_grad_norm: float = 1.0
    """Clip the gradient norm to this."""
    padding_free: bool = True
    """Pack the pairs without padding in the forward pass; the two responses of a pair share
    their prompt's pass."""
    val_freq: int = 20
    """Validate every this many steps (and after the last); -1 = only after the last."""
    val_before_train: bool = True
    """Validate once before the first step."""
    save_freq: int = -1
    """Save a resumable checkpoint every this many steps; -1 = only after the last step."""
    save_limit: int = -1
    """Keep only the newest this many checkpoints; -1 = all."""
    save_checkpoint_path: Optional[str] = None
    """Where checkpoints and experiment_log.jsonl go; None = checkpoints/<project>/<experiment>."""
    find_last_checkpoint: bool = True
    """Resume from the newest complete checkpoint under save_checkpoint_path."""
    project_name: str = "easyvlm"
    """Names the default checkpoint directory."""
    experiment_name: str = "reward_model"
    """Names the default checkpoint directory."""
    seed: int = 1
    """Seeds the score head's initial weights and the data order."""
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """auto = cuda when this machine sees a GPU."""


@dataclass(frozen=True)
class RMConfig:
    data: PreferenceDataConfig = field(default_factory=PreferenceDataConfig)
    model: ModelConfig = field(default_factory=lambda: ModelConfig(model_path="builtin:tiny-qwen2.5-vl-synthetic"))
    """The starting model: a policy checkpoint (a new score head is added) or a reward model to
    train further. Same keys as `worker.actor.model` (LoRA is refused)."""
    optim: OptimConfig = field(default_factory=lambda: OptimConfig(lr=1e-4))
    """Same keys as `worker.actor.optim`."""
    fsdp: FSDPConfig = field(default_factory=FSDPConfig)
    """Same keys as `worker.actor.fsdp`."""
    trainer: RMTrainerConfig = field(default_factory=RMTrainerConfig)


def find_problems(cfg: RMConfig, world_size: int = 1) -> list[Problem]:
    """Every problem of ``cfg`` (the rules shared with the RL config run on the shared sections)."""
    c = Checks(cfg, world_size)
    d, t = cfg.data, cfg.trainer
    if not cfg.model.model_path:
        c.add("model.model_path", "is unset: give a policy checkpoint (builtin:tiny-qwen2.5-vl-synthetic, a local "
                                  "directory or a hub id) or a reward model to train further")
    check_model(c, "model")
    if cfg.model.lora.rank > 0:
        c.add("model.lora.rank", "LoRA reward-model training is not supported; set 0 (full fine-tuning)")
    check_optim(c, "optim")
    check_fsdp(c, "fsdp")
    if not d.train_files:
        c.add("data.train_files", "is empty: give a preference data file or builtin:synthetic-preference@train")
    for key in ("prompt_key", "chosen_key", "rejected_key", "image_key"):
        if not getattr(d, key):
            c.add(f"data.{key}", "is empty: name the column")
    if len({d.prompt_key, d.chosen_key, d.rejected_key}) < 3:
        c.add("data.chosen_key", f"prompt_key, chosen_key and rejected_key must be three different columns, got "
                                 f"{d.prompt_key!r}, {d.chosen_key!r}, {d.rejected_key!r}")
    for key in ("max_prompt_length", "max_response_length", "batch_size"):
        c.positive(f"data.{key}")
    c.positive("data.min_pixels")
    c.positive("data.max_pixels")
    if d.min_pixels and d.max_pixels and d.min_pixels > d.max_pixels:
        c.add("data.min_pixels", f"must be <= data.max_pixels ({d.max_pixels}), got {d.min_pixels}")
    if d.batch_size % world_size:
        c.add("data.batch_size", f"must be a multiple of the number of devices ({world_size}), got {d.batch_size}")
    c.positive("trainer.total_epochs")
    c.positive("trainer.max_steps")
    c.positive("trainer.micro_batch_size_per_device")
    c.positive("trainer.max_grad_norm")
    for key in ("val_freq", "save_freq", "save_limit"):
        value = getattr(t, key)
        if value != -1 and value < 1:
            c.add(f"trainer.{key}", f"must be >= 1 or -1, got {value}")
    if not d.val_files and t.val_before_train:
        c.add("trainer.val_before_train", "is true but data.val_files is empty; give held-out pairs or set false")
    if not d.val_files and t.val_freq != -1:
        c.add("trainer.val_freq", "is set but data.val_files is empty; give held-out pairs or set -1")
    from pathlib import Path

    if d.format_prompt and not Path(d.format_prompt).expanduser().is_file():
        c.add("data.format_prompt", f"file {d.format_prompt!r} does not exist (relative paths are from the working "
                                    "directory)")
    if d.image_dir and not Path(d.image_dir).expanduser().is_dir():
        c.add("data.image_dir", f"directory {d.image_dir!r} does not exist")
    return c.problems
