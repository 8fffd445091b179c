"""Where metrics go: console (progress bar), a JSONL file, TensorBoard, and optional online trackers.

``file`` writes ``<save_checkpoint_path>/experiment_log.jsonl``: one JSON object per step, ``step`` plus
every metric; a resumed run appends to it (rows of steps after the resumed checkpoint are dropped
first, so the log never holds two rows for one step).
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any, Mapping, Sequence

from tqdm import tqdm

# the few metrics shown beside the progress bar
CONSOLE_KEYS = ("reward/overall", "val/reward_score", "response_length/mean", "actor/pg_loss", "timing_s/step")


class JsonlBackend:
    def __init__(self, path: Path, resume_step: int):
        self.path = path
        path.parent.mkdir(parents=True, exist_ok=True)
        if path.exists():  # keep rows up to the checkpoint we resume from
            kept = [line for line in path.read_text().splitlines() if line.strip() and json.loads(line).get("step", 0) <= resume_step]
            path.write_text("".join(line + "\n" for line in kept))
        self.file = path.open("a")

    def log(self, step: int, metrics: Mapping[str, Any]) -> None:
        row = {"step": step, **{k: _jsonable(v) for k, v in metrics.items()}}
        self.file.write(json.dumps(row) + "\n")
        self.file.flush()
        os.fsync(self.file.fileno())

    def close(self) -> None:
        self.file.close()


# Set (to anything but "" or "0") to write <save_checkpoint_path>/data_order.jsonl: one row per step,
# {"step": N, "uids": [...]}, the uids of the prompts the data loader handed out for the step. For
# checking that a resumed run sees the same data as an uninterrupted one.
DATA_ORDER_ENV = "EASYVLM_LOG_DATA_ORDER"


def data_order_log(save_dir: Path, resume_step: int) -> JsonlBackend | None:
    """The data-order log if ``$EASYVLM_LOG_DATA_ORDER`` asks for it (log with ``{"uids": [...]}``)."""
    if os.environ.get(DATA_ORDER_ENV, "") in ("", "0"):
        return None
    return JsonlBackend(save_dir / "data_order.jsonl", resume_step)


class TensorboardBackend:
    def __init__(self, log_dir: Path):
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(str(log_dir))

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        for key, value in metrics.items():
            self.writer.add_scalar(key, value, step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


class WandbBackend:
    def __init__(self, project: str, name: str, config: dict):
        import wandb  # optional: pip install wandb

        self.run = wandb.init(project=project, name=name, config=config)

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        self.run.log(dict(metrics), step=step)

    def close(self) -> None:
        self.run.finish()


class ConsoleBackend:
    """A progress bar over steps with ETA and a few key metrics; validation metrics printed in full."""

    def __init__(self, total_steps: int, start_step: int):
        self.bar = tqdm(total=total_steps, initial=start_step, desc="easyvlm", unit="step", dynamic_ncols=True)

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        shown = {k.split("/")[-1] if k != "val/reward_score" else "val": f"{metrics[k]:.3g}" for k in CONSOLE_KEYS if k in metrics}
        self.bar.set_postfix(shown, refresh=False)
        self.bar.n = step
        self.bar.refresh()
        if any(k.startswith("val/") for k in metrics):
            vals = ", ".join(f"{k}={v:.4f}" for k, v in sorted(metrics.items()) if k.startswith("val/"))
            self.bar.write(f"step {step}: {vals}")

    def close(self) -> None:
        self.bar.close()


class Tracker:
    """Fans one ``log(step, metrics)`` out to the configured backends."""

    def __init__(
        self,
        loggers: Sequence[str],
        save_dir: Path,
        project: str,
        experiment: str,
        config: dict[str, Any],
        total_steps: int,
        start_step: int = 0,
    ):
        self.backends: list[Any] = []
        for name in loggers:
            if name == "console":
                self.backends.append(ConsoleBackend(total_steps, start_step))
            elif name == "file":
                self.backends.append(JsonlBackend(save_dir / "experiment_log.jsonl", start_step))
            elif name == "tensorboard":
                self.backends.append(TensorboardBackend(save_dir / "tensorboard"))
            elif name == "wandb":
                self.backends.append(WandbBackend(project, experiment, config))
            else:  # mlflow / swanlab: accepted for EasyR1 configs; not wired yet
                raise NotImplementedError(f"trainer.logger {name!r} is not supported yet; use console, file, tensorboard or wandb")

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        for backend in self.backends:
            backend.log(step, metrics)

    def close(self) -> None:
        for backend in self.backends:
            backend.close()


def _jsonable(value: Any) -> Any:
    value = float(value) if hasattr(value, "__float__") else value
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)  # JSON has no NaN/inf; keep them visible
    return value
