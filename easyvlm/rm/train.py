"""The reward-model trainer: ``python -m easyvlm.rm config=examples/rm.yaml key=value ...``: one process per
device (``torchrun`` on GPUs), FSDP2 as the RL workers; the Bradley-Terry loss over the step's pair count, so
the gradient is the step mean whatever the split; checkpoints as the RL trainer's. docs/rewards.md."""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import sys
import time
from pathlib import Path
from typing import Any, Sequence

import torch
import torch.distributed as dist

from easyvlm.algorithms.preference import bradley_terry_loss
from easyvlm.config.cli import exit_with_problems, parse_and_validate
from easyvlm.config.errors import ConfigError, Problem
from easyvlm.plan.launch import check_environment
from easyvlm.data.batch import Batch
from easyvlm.rm.config import RMConfig, find_problems
from easyvlm.rm.data import PreferenceDataset, collate_pairs
from easyvlm.utils.safe_state import load_state, rng_state, set_rng_state
from easyvlm.workers.fsdp import gather_full_state_dict
from easyvlm.workers.optim import step_scheduler
from easyvlm.workers.reward_model import sequence_scores
from easyvlm.workers.training import (
    all_reduce_max_int,
    all_reduce_sums,
    clip_and_step,
    load_sharded_checkpoint,
    save_sharded_checkpoint,
)

logger = logging.getLogger(__name__)
HF_EXPORT_DIR = "huggingface"
EXIT_ERROR = 2


# ------------------------------------------------------------------------------------------- config
def parse_config(argv: Sequence[str]) -> RMConfig:
    """argv -> a checked RMConfig, or exit 2 listing every problem (environment and config; no traceback)."""
    check_environment()  # a bad EASYVLM_CPU_LINEAR, before the model loads
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    return parse_and_validate(argv, schema=RMConfig, checks=lambda cfg: find_problems(cfg, world_size=world_size))


def resolve(cfg: RMConfig) -> RMConfig:
    """Local paths absolute (as the RL plan does)."""
    from easyvlm.plan.build import abs_if_local

    r = dataclasses.replace
    d = cfg.data
    data = r(d, train_files=abs_if_local(d.train_files), val_files=abs_if_local(d.val_files),
             image_dir=abs_if_local(d.image_dir), format_prompt=abs_if_local(d.format_prompt))
    save = cfg.trainer.save_checkpoint_path or f"checkpoints/{cfg.trainer.project_name}/{cfg.trainer.experiment_name}"
    return r(cfg, data=data, model=r(cfg.model, model_path=abs_if_local(cfg.model.model_path)),
             trainer=r(cfg.trainer, save_checkpoint_path=str(Path(save).resolve())))


# ------------------------------------------------------------------------------------------ trainer
class RewardModelTrainer:
    def __init__(self, cfg: RMConfig):
        from easyvlm.models.reward_model import is_sequence_classifier, reward_model_problem, sequence_classification_config
        from easyvlm.plan.models import load_bundle
        from easyvlm.workers.dist import init_distributed, worker_device
        from easyvlm.workers.forward import ForwardSetup
        from easyvlm.workers.vision_dummy import dummy_image_for
        from easyvlm.workers.optim import build_optimizer, build_scheduler
        from easyvlm.workers.sharded import build_sharded_model
        from easyvlm.workers.training import model_dtype

        self.cfg = cfg
        bundle = load_bundle(cfg.model, key="model")
        hf_config = bundle.policy.hf_config
        if is_sequence_classifier(hf_config):  # train a reward model further: its head must be scalar
            problem = reward_model_problem(hf_config, f"model.model_path ({bundle.policy.model_dir})")
            if problem:
                raise ConfigError([Problem("model.model_path", problem)])
        else:  # a policy checkpoint: the backbone plus a new scalar head
            hf_config = sequence_classification_config(hf_config, bundle.tokens.pad)
        self.bundle, self.hf_config = bundle, hf_config
        self.spec = dataclasses.replace(bundle.policy, hf_config=hf_config)
        self.end_of_turn = bundle.tokenizer.eos_token_id if bundle.tokenizer.eos_token_id is not None else bundle.tokens.eos[0]

        d = cfg.data
        encoder_args = (bundle.tokenizer, bundle.processor, bundle.policy.hf_config, self.end_of_turn)
        self.train_set = PreferenceDataset(d.train_files, d, *encoder_args, key="data.train_files", name="train")
        self.val_set = PreferenceDataset(d.val_files, d, *encoder_args, key="data.val_files", name="val") if d.val_files else None
        self.steps_per_epoch = len(self.train_set) // d.batch_size
        if self.steps_per_epoch == 0:
            raise ConfigError([Problem("data.batch_size", f"is {d.batch_size}, more than the {len(self.train_set)} "
                                       "usable training pairs: lower it")])
        t = cfg.trainer
        self.total_steps = self.steps_per_epoch * t.total_epochs
        if t.max_steps is not None:
            self.total_steps = min(self.total_steps, t.max_steps)

        self.rank, self.world_size = init_distributed()
        self.device = worker_device()
        torch.manual_seed(t.seed)  # the new head gets the same initial weights on every rank
        self.model = build_sharded_model(
            self.spec, cfg.fsdp, role="reward", dtype=model_dtype(cfg.fsdp, self.device, torch.float32),
            padding_free=t.padding_free, trainable=True, device=self.device, rank=self.rank, key="fsdp",
        )
        self.setup = ForwardSetup(device=self.device, padding_free=t.padding_free, share_prompts=t.padding_free,
                                  dummy_image=dummy_image_for(hf_config))
        self.optimizer = build_optimizer(self.model.parameters(), cfg.optim)
        self.scheduler = build_scheduler(self.optimizer, cfg.optim, self.total_steps)
        self.save_dir = Path(t.save_checkpoint_path)
        self.global_step = 0

    # ------------------------------------------------------------------ data
    def _order(self, epoch: int) -> list[int]:
        n = len(self.train_set)
        if not self.cfg.data.shuffle:
            return list(range(n))
        generator = torch.Generator().manual_seed(self.cfg.trainer.seed * 1000003 + epoch)
        return torch.randperm(n, generator=generator).tolist()

    def _pairs(self, step: int) -> list[int]:
        """The pair indices of training step ``step`` (0-based) for this rank."""
        epoch, offset = divmod(step, self.steps_per_epoch)
        size = self.cfg.data.batch_size
        chunk = self._order(epoch)[offset * size : (offset + 1) * size]
        share = size // self.world_size
        return chunk[self.rank * share : (self.rank + 1) * share]

    def _micro_batches(self, indices: list[int], dataset: PreferenceDataset) -> list[tuple[Batch, bool]]:
        size = self.cfg.trainer.micro_batch_size_per_device
        groups = [indices[i : i + size] for i in range(0, len(indices), size)]
        target = all_reduce_max_int(len(groups), self.device)  # as many passes on every rank (FSDP)
        pad, length = self.bundle.tokens.pad, self.cfg.data.max_response_length
        micros = [(collate_pairs([dataset[i] for i in g], pad, length), False) for g in groups]
        if len(micros) < target:
            filler = micros[0][0] if micros else collate_pairs([dataset[0]], pad, length)
            micros += [(filler, True)] * (target - len(micros))
        return micros

    # ------------------------------------------------------------------ steps
    def _pair_scores(self, micro: Batch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        scores = sequence_scores(self.model, micro, self.setup)  # (2N,)
        return scores[0::2], scores[1::2], micro["margin"][0::2].to(self.device)

    def train_step(self) -> dict[str, float]:
        self.model.train()
        indices = self._pairs(self.global_step)
        pairs = float(self.cfg.data.batch_size)
        sums = {"loss": 0.0, "correct": 0.0, "margin": 0.0, "nonfinite": 0.0}
        for micro, is_dummy in self._micro_batches(indices, self.train_set):
            chosen, rejected, margin = self._pair_scores(micro)
            loss, stats = bradley_terry_loss(chosen, rejected, margin if self.cfg.data.margin_key else None, normalizer=pairs)
            weight = 0.0 if is_dummy else 1.0
            if not torch.isfinite(loss.detach()):
                sums["nonfinite"] += 1.0
            (loss * weight * self.world_size).backward()  # FSDP averages gradients over ranks: x world = the sum
            sums["loss"] += weight * loss.item()
            sums["correct"] += weight * stats["correct"]
            sums["margin"] += weight * stats["margin"]
        totals = all_reduce_sums(sums, self.device)
        grad_norm, stepped = clip_and_step(self.model, self.optimizer, self.cfg.trainer.max_grad_norm, totals["nonfinite"] > 0)
        metrics = {
            "rm/loss": totals["loss"], "rm/accuracy": totals["correct"] / pairs, "rm/margin": totals["margin"] / pairs,
            "rm/grad_norm": grad_norm, "rm/lr": float(self.scheduler.get_last_lr()[0]), "rm/skipped_steps": float(not stepped),
        }
        step_scheduler(self.scheduler)
        self.global_step += 1
        return metrics

    @torch.no_grad()
    def validate(self) -> dict[str, float]:
        assert self.val_set is not None
        self.model.eval()
        n = len(self.val_set)
        indices = list(range(self.rank, n, self.world_size))
        sums = {"loss": 0.0, "correct": 0.0, "margin": 0.0}
        for micro, is_dummy in self._micro_batches(indices, self.val_set):
            chosen, rejected, margin = self._pair_scores(micro)
            loss, stats = bradley_terry_loss(chosen, rejected, margin if self.cfg.data.margin_key else None, normalizer=1.0)
            if not is_dummy:
                sums["loss"] += loss.item()
                sums["correct"] += stats["correct"]
                sums["margin"] += stats["margin"]
        totals = all_reduce_sums(sums, self.device)
        return {"val/pairwise_accuracy": totals["correct"] / n, "val/loss": totals["loss"] / n, "val/margin": totals["margin"] / n}

    # ------------------------------------------------------------------ checkpoints
    def save_checkpoint(self, manager: Any) -> Path:
        path = manager.partial_dir(self.global_step) if self.rank == 0 else None
        path = Path(_broadcast_str(str(path) if path else ""))
        save_sharded_checkpoint(path / "reward_model", self.model, self.optimizer, self.scheduler, self.rank)
        self.export_hf(path / HF_EXPORT_DIR)
        if self.rank == 0:
            torch.save({"global_step": self.global_step, "rng": rng_state()}, path / "trainer_state.pt")
            manager.commit(self.global_step)
        dist.barrier()
        return self.save_dir / f"global_step_{self.global_step}"

    def load_checkpoint(self, path: Path) -> None:
        state = load_state(path / "trainer_state.pt")
        load_sharded_checkpoint(path / "reward_model", self.model, self.optimizer, self.scheduler, self.rank)
        self.global_step = int(state["global_step"])
        set_rng_state(state["rng"])

    def export_hf(self, path: Path) -> None:
        """An HF sequence-classification directory (weights, config, tokenizer, processor); collective, rank 0 writes."""
        state = gather_full_state_dict(self.model)
        if self.rank == 0:
            export_reward_model(state, self.hf_config, self.bundle, path)
        dist.barrier()

    # ------------------------------------------------------------------ loop
    def fit(self) -> dict[str, float]:
        from easyvlm.run.checkpoint import CheckpointManager, latest_checkpoint, verify_checkpoint

        t = self.cfg.trainer
        manager = CheckpointManager(self.save_dir, t.save_limit)
        if t.find_last_checkpoint:
            latest = latest_checkpoint(self.save_dir)
            if latest is not None:
                verify_checkpoint(latest)
                self.load_checkpoint(latest)
                self._log(f"resumed from {latest} (step {self.global_step})")
        log = open(self.save_dir / "experiment_log.jsonl", "a") if self.rank == 0 else None
        metrics: dict[str, float] = {}
        if t.val_before_train and self.val_set is not None and self.global_step == 0:
            metrics = self.validate()
            self._record(log, metrics)
        start = time.perf_counter()
        while self.global_step < self.total_steps:
            step_start = time.perf_counter()
            metrics = self.train_step()
            metrics["timing_s/step"] = time.perf_counter() - step_start
            last = self.global_step == self.total_steps
            if self.val_set is not None and (last or (t.val_freq > 0 and self.global_step % t.val_freq == 0)):
                metrics.update(self.validate())
            self._record(log, metrics)
            if last or (t.save_freq > 0 and self.global_step % t.save_freq == 0):
                path = self.save_checkpoint(manager)
                self._log(f"saved {path}")
        self._log(f"done: {self.total_steps} steps in {time.perf_counter() - start:.1f} s")
        if log is not None:
            log.close()
        return metrics

    def _record(self, log: Any, metrics: dict[str, float]) -> None:
        if self.rank != 0:
            return
        row = {"step": self.global_step, **metrics}
        log.write(json.dumps(row) + "\n")
        log.flush()
        shown = ", ".join(f"{k}={v:.4g}" for k, v in metrics.items() if k.startswith(("rm/loss", "rm/acc", "val/")))
        self._log(f"step {self.global_step}/{self.total_steps}: {shown}")

    def _log(self, line: str) -> None:
        if self.rank == 0:
            print(f"easyvlm.rm: {line}", flush=True)


def export_reward_model(state: dict[str, torch.Tensor], hf_config: Any, files: Any, path: str | os.PathLike) -> None:
    """Save ``state`` (a ScalarHeadModel's full state: ``model.*``, ``score.weight``) as the
    transformers sequence-classification model of ``hf_config``, plus the tokenizer and processor."""
    from transformers import AutoModelForSequenceClassification

    from easyvlm.models.reward_model import register_sequence_classification

    register_sequence_classification()
    dtype = next(iter(state.values())).dtype
    with torch.device("meta"):
        model = AutoModelForSequenceClassification.from_config(hf_config, dtype=dtype)
    missing, unexpected = model.load_state_dict(state, strict=False, assign=True)
    if missing or unexpected:
        raise RuntimeError(f"export: state dict does not fit {type(model).__name__}: missing {missing[:5]}, "
                           f"unexpected {unexpected[:5]}")
    path = Path(path)
    model.save_pretrained(path)
    files.tokenizer.save_pretrained(path)
    if files.processor is not None:
        files.processor.save_pretrained(path)


def _broadcast_str(value: str) -> str:
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def main(argv: Sequence[str] | None = None) -> dict[str, float]:
    from easyvlm.data.loading import DataError
    from easyvlm.run.checkpoint import CheckpointError

    cfg = resolve(parse_config(sys.argv[1:] if argv is None else argv))
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    Path(cfg.trainer.save_checkpoint_path).mkdir(parents=True, exist_ok=True)
    try:
        trainer = RewardModelTrainer(cfg)
        metrics = trainer.fit()
    except ConfigError as err:
        exit_with_problems(err.problems)
    except (DataError, CheckpointError) as err:
        sys.stderr.write(f"easyvlm: {'data' if isinstance(err, DataError) else 'checkpoint'} error: {err}\n")
        sys.exit(EXIT_ERROR)
    return metrics
