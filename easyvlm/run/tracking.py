"""Where metrics and run records go: ``trainer.logger`` backends and the run directory's files (docs/tracking.md).
Offline unless told otherwise: ``wandb`` under ``wandb/`` unless ``WANDB_API_KEY``, a netrc login or ``WANDB_MODE``
(``WANDB_DIR`` moves it); ``swanlab`` under ``swanlog/`` unless ``SWANLAB_API_KEY``, a login or ``SWANLAB_MODE``
(``SWANLAB_LOG_DIR`` or EasyR1's ``SWANLAB_DIR`` moves it); ``mlflow`` the file store ``mlruns/`` unless
``MLFLOW_TRACKING_URI``, in the experiment ``MLFLOW_EXPERIMENT_NAME`` or the project name."""

from __future__ import annotations

import json
import math
import netrc
import os
import re
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping, NamedTuple, Sequence
from urllib.parse import urlsplit

from tqdm import tqdm

from easyvlm.utils.loggers import missing_logger_packages

# samples per viewer page sent to wandb and swanlab (each carries an image)
MEDIA_SAMPLES = 16

# the few metrics shown beside the progress bar
CONSOLE_KEYS = ("reward/overall", "val/reward_score", "response_length/mean", "actor/pg_loss", "timing_s/step")

class Generation(NamedTuple):
    """One validation sample, EasyR1's (input, output, label, score)."""

    prompt: str
    response: str
    ground_truth: str
    score: float


@dataclass(frozen=True)
class RunInfo:
    """What a backend needs to open its run."""

    save_dir: Path
    project: str
    experiment: str
    config: Mapping[str, Any]  # the resolved config as a plain (JSON-able) dict
    total_steps: int
    start_step: int


class Backend:
    """A logger: scalar metrics per step, optionally the validation samples, then close."""

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        raise NotImplementedError

    def log_generations(self, step: int, samples: Sequence[Generation]) -> None:
        pass  # loggers without a place for text ignore the samples

    def log_rollouts(self, step: int, split: str, samples: Sequence[Any], root: Path, page: str) -> None:
        pass  # loggers without a place for media ignore the viewer's pages

    def close(self) -> None:
        pass


def _first_image(sample: Any) -> str | None:
    """The relative path of a viewer sample's first image, else its first video frame."""
    if sample.images:
        return sample.images[0]
    return sample.videos[0][0] if sample.videos and sample.videos[0] else None


# ---------------------------------------------------------------------------- files
class JsonlBackend(Backend):
    """One JSON object per ``log`` call (several per step are fine), flushed at once."""

    def __init__(self, path: Path, resume_step: int):
        self.path = path
        path.parent.mkdir(parents=True, exist_ok=True)
        if path.exists():  # keep the rows up to the checkpoint we resume from (none for a new run)
            rows = [line for line in path.read_text().splitlines() if line.strip()] if resume_step > 0 else []
            kept = [line for line in rows if json.loads(line).get("step", 0) <= resume_step]
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


_STEP_LINE = re.compile(r"^\[step\] (\d+)$", re.MULTILINE)


class FileBackend(Backend):
    """``experiment_log.jsonl`` and EasyR1's ``generations.log``."""

    def __init__(self, info: RunInfo):
        self.metrics = JsonlBackend(info.save_dir / "experiment_log.jsonl", info.start_step)
        self.generations_path = info.save_dir / "generations.log"
        text = self.generations_path.read_text() if self.generations_path.exists() and info.start_step > 0 else ""
        # blocks come in step order: cut at the first one after the checkpoint
        later = next((m.start() for m in _STEP_LINE.finditer(text) if int(m.group(1)) > info.start_step), len(text))
        self.generations_path.write_text(text[:later])

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        self.metrics.log(step, metrics)

    def log_generations(self, step: int, samples: Sequence[Generation]) -> None:
        with self.generations_path.open("a") as f:
            for s in samples:
                f.write(f"[step] {step}\n{_sample_text(s)}\n\n")

    def close(self) -> None:
        self.metrics.close()


def _sample_text(s: Generation) -> str:
    return f"[prompt] {s.prompt}\n[output] {s.response}\n[ground_truth] {s.ground_truth}\n[score] {s.score}"


# ---------------------------------------------------------------------------- console, tensorboard
class ConsoleBackend(Backend):
    """A progress bar over steps with ETA and a few key metrics; validation metrics printed in full."""

    def __init__(self, info: RunInfo):
        self.bar = tqdm(total=info.total_steps, initial=info.start_step, desc="easyvlm", unit="step", dynamic_ncols=True)

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        shown = {k.split("/")[-1] if k != "val/reward_score" else "val": f"{metrics[k]:.3g}" for k in CONSOLE_KEYS if k in metrics}
        self.bar.set_postfix(shown, refresh=False)
        self.bar.n = step
        self.bar.refresh()
        if any(k.startswith("val/") for k in metrics):
            vals = ", ".join(f"{k}={v:.4f}" for k, v in sorted(metrics.items()) if k.startswith("val/"))
            self.bar.write(f"step {step}: {vals}")

    def log_generations(self, step: int, samples: Sequence[Generation]) -> None:
        for s in samples:
            self.bar.write(f"step {step}:\n{_sample_text(s)}\n")

    def close(self) -> None:
        self.bar.close()


class TensorboardBackend(Backend):
    def __init__(self, info: RunInfo):
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(str(info.save_dir / "tensorboard"))
        self.writer.add_text("config", "```\n" + _config_json(info.config) + "\n```", info.start_step)

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        for key, value in metrics.items():
            self.writer.add_scalar(key, value, step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


# ---------------------------------------------------------------------------- wandb
def wandb_needs_offline(env: Mapping[str, str], netrc_path: Path) -> bool:
    """True when wandb has no way to go online and no mode was chosen: no ``WANDB_API_KEY``, no
    ``WANDB_MODE``, no netrc entry for the host (``WANDB_BASE_URL``); online it would ask for a key."""
    if env.get("WANDB_API_KEY") or env.get("WANDB_MODE"):
        return False
    host = urlsplit(env.get("WANDB_BASE_URL", "https://api.wandb.ai")).netloc
    try:
        return netrc.netrc(str(netrc_path)).authenticators(host) is None
    except (OSError, netrc.NetrcParseError):  # no netrc file, or one wandb could not read either
        return True


def _netrc_path(env: Mapping[str, str]) -> Path:
    return Path(env["NETRC"]) if env.get("NETRC") else Path.home() / ".netrc"


class WandbBackend(Backend):
    COLUMNS = ["step", "prompt", "response", "ground_truth", "score"]

    def __init__(self, info: RunInfo):
        import wandb

        directory = os.environ.get("WANDB_DIR") or str(info.save_dir)
        mode = None  # wandb's own choice (WANDB_MODE, its settings)
        if wandb_needs_offline(os.environ, _netrc_path(os.environ)):
            mode = "offline"
            _say(
                f"wandb: no WANDB_API_KEY, `wandb login` or WANDB_MODE: logging offline under {directory}/wandb "
                f"(upload later with `wandb sync <run dir>`; set WANDB_MODE=online, offline or disabled to choose)"
            )
        self.wandb = wandb
        self.run = wandb.init(project=info.project, name=info.experiment, config=dict(info.config), dir=directory, mode=mode)
        self.rows: list[list[Any]] = []

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        self.run.log(dict(metrics), step=step)

    def log_generations(self, step: int, samples: Sequence[Generation]) -> None:
        # a logged wandb Table cannot grow: log a new one holding every sample so far
        self.rows.extend([step, *s] for s in samples)
        self.run.log({"val/generations": self.wandb.Table(columns=self.COLUMNS, data=self.rows)}, step=step)

    ROLLOUT_COLUMNS = ["step", "uid", "sample", "prompt", "image", "response", "ground_truth", "reward", "advantage", "response_length"]

    def log_rollouts(self, step: int, split: str, samples: Sequence[Any], root: Path, page: str) -> None:
        rows, images = [], []
        for s in samples[:MEDIA_SAMPLES]:
            image = _first_image(s)
            picture = self.wandb.Image(str(root / image), caption=f"{s.uid} #{s.index} reward {s.reward:.3f}: {s.response}"[:500]) if image else None
            rows.append([s.step, s.uid, s.index, s.prompt, picture, s.response, s.ground_truth, s.reward, s.advantage, s.response_length])
            images += [picture] if picture is not None else []
        # no step= here: this thread may log a page after the main thread moved to a later step.
        # Offline runs store a table's images as the word "Image" (wandb#4611), so the images go
        # as a captioned list too, which offline runs keep.
        logged: dict[str, Any] = {f"{split}/rollouts": self.wandb.Table(columns=self.ROLLOUT_COLUMNS, data=rows)}
        if images:
            logged[f"{split}/rollout_images"] = images
        self.run.log(logged)

    def close(self) -> None:
        self.run.finish()
        self.wandb.teardown()  # stops wandb's service process (it outlives finish() otherwise)


# ---------------------------------------------------------------------------- swanlab
class SwanlabBackend(Backend):
    def __init__(self, info: RunInfo):
        import swanlab

        self.swanlab = swanlab
        # swanlab reads SWANLAB_LOG_DIR itself; SWANLAB_DIR is the variable EasyR1 users set
        log_dir = os.environ.get("SWANLAB_LOG_DIR") or os.environ.get("SWANLAB_DIR") or str(info.save_dir / "swanlog")
        mode = None  # swanlab's own choice (SWANLAB_MODE, its settings)
        # swanlab.Settings() holds SWANLAB_API_KEY or the key `swanlab login` saved, if any
        if not os.environ.get("SWANLAB_MODE") and swanlab.Settings().api_key is None:
            mode = "offline"
            _say(
                f"swanlab: no SWANLAB_API_KEY, `swanlab login` or SWANLAB_MODE: logging offline under {log_dir} "
                f"(upload later with `swanlab sync <run dir>`; set SWANLAB_MODE=online, local, offline or disabled to choose)"
            )
        self.run = swanlab.init(project=info.project, name=info.experiment, config=dict(info.config), log_dir=log_dir, mode=mode)

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        self.run.log(dict(metrics), step=step)

    def log_generations(self, step: int, samples: Sequence[Generation]) -> None:
        texts = [self.swanlab.Text(_sample_text(s), caption=f"sample {i + 1}") for i, s in enumerate(samples)]
        self.run.log({"val/generations": texts}, step=step)

    def log_rollouts(self, step: int, split: str, samples: Sequence[Any], root: Path, page: str) -> None:
        images = []
        for s in samples[:MEDIA_SAMPLES]:
            image = _first_image(s)
            if image:
                caption = f"step {s.step} {s.uid} #{s.index} reward {s.reward:.3f}: {s.response}"
                images.append(self.swanlab.Image(str(root / image), caption=caption[:500]))
        if images:
            self.run.log({f"{split}/rollouts": images}, step=step)

    def close(self) -> None:
        self.run.finish()


# ---------------------------------------------------------------------------- mlflow
class MlflowBackend(Backend):
    def __init__(self, info: RunInfo):
        from mlflow import MlflowClient
        from mlflow.entities import Param
        from mlflow.utils.validation import MAX_PARAM_VAL_LENGTH, MAX_PARAMS_TAGS_PER_BATCH

        uri = os.environ.get("MLFLOW_TRACKING_URI")
        if not uri:
            uri = (info.save_dir / "mlruns").resolve().as_uri()
            # `mlflow ui` (mlflow 3) refuses a file store without the variable, as the writer below would
            _say(f"mlflow: no MLFLOW_TRACKING_URI: logging to the file store {uri} (view it with the full mlflow "
                 f"package, mlflow-skinny has no UI: `MLFLOW_ALLOW_FILE_STORE=true mlflow ui --backend-store-uri {uri}`)")
        if urlsplit(uri).scheme in ("", "file"):
            # mlflow 3 refuses its file store unless asked: it is what needs no server and no database
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        self.client = MlflowClient(tracking_uri=uri)
        name = os.environ.get("MLFLOW_EXPERIMENT_NAME") or info.project
        experiment = self.client.get_experiment_by_name(name)
        experiment_id = experiment.experiment_id if experiment else self.client.create_experiment(name)
        self.run_id = self.client.create_run(experiment_id, run_name=info.experiment).info.run_id
        params = [Param(key, str(value)[:MAX_PARAM_VAL_LENGTH]) for key, value in _flatten(info.config).items()]
        for chunk in _chunks(params, MAX_PARAMS_TAGS_PER_BATCH):
            self.client.log_batch(self.run_id, params=chunk)

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        from mlflow.entities import Metric
        from mlflow.utils.validation import MAX_METRICS_PER_BATCH

        now = int(time.time() * 1000)
        rows = [Metric(key, float(value), now, step) for key, value in metrics.items()]
        for chunk in _chunks(rows, MAX_METRICS_PER_BATCH):
            self.client.log_batch(self.run_id, metrics=chunk)

    def log_rollouts(self, step: int, split: str, samples: Sequence[Any], root: Path, page: str) -> None:
        # the page and the media it shows, at the same relative paths, so the HTML works in the store
        for name in (f"{page}.jsonl", f"{page}.html"):
            self.client.log_artifact(self.run_id, str(root / name), "rollouts")
        media = sorted({p for s in samples for p in [*s.images, *(f for v in s.videos for f in v)]})
        for relative in media:
            self.client.log_artifact(self.run_id, str(root / relative), str(Path("rollouts") / Path(relative).parent))

    def close(self) -> None:
        self.client.set_terminated(self.run_id)


# ---------------------------------------------------------------------------- the tracker
LOGGERS: dict[str, Callable[[RunInfo], Backend]] = {
    "console": ConsoleBackend,
    "file": FileBackend,
    "tensorboard": TensorboardBackend,
    "wandb": WandbBackend,
    "swanlab": SwanlabBackend,
    "mlflow": MlflowBackend,
}


class Tracker:
    """Fans ``log(step, metrics)`` and ``log_generations(step, samples)`` out to the loggers."""

    def __init__(
        self,
        loggers: Sequence[str],
        save_dir: Path,
        project: str,
        experiment: str,
        config: Mapping[str, Any],
        total_steps: int,
        start_step: int = 0,
    ):
        unknown = [name for name in loggers if name not in LOGGERS]
        if unknown:
            raise KeyError(f"trainer.logger: unknown logger(s) {unknown}; known: {sorted(LOGGERS)}")
        missing = missing_logger_packages(loggers)
        if missing:
            raise ModuleNotFoundError(
                f"trainer.logger: {sorted(missing)} need packages that are not installed; "
                f"pip install {' '.join(sorted(set(missing.values())))}, or remove them from trainer.logger"
            )
        info = RunInfo(Path(save_dir), project, experiment, config, total_steps, start_step)
        info.save_dir.mkdir(parents=True, exist_ok=True)
        (info.save_dir / "experiment_config.json").write_text(_config_json(config) + "\n")
        self.info = info
        self.generations: JsonlBackend | None = None  # val_generations.jsonl, opened on first use
        self.backends: list[Backend] = []
        # the rollout viewer's thread logs pages while the main thread logs metrics
        self.lock = threading.RLock()
        self.failed_media: set[str] = set()
        try:
            for name in loggers:
                self.backends.append(LOGGERS[name](info))
        except BaseException:
            self.close()
            raise

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        with self.lock:
            for backend in self.backends:
                backend.log(step, metrics)

    def log_rollouts(self, step: int, split: str, samples: Sequence[Any], root: Path, page: str) -> None:
        """Hand a rollout viewer page (``root/<page>.jsonl`` and ``.html``, media relative to
        ``root``) to the backends that show media; one that fails is reported once and skipped."""
        with self.lock:
            for backend in self.backends:
                try:
                    backend.log_rollouts(step, split, samples, Path(root), page)
                except Exception as e:  # noqa: BLE001 - a page is not worth the run
                    name = type(backend).__name__
                    if name not in self.failed_media:
                        self.failed_media.add(name)
                        _say(f"{name}: could not log the rollouts of step {step} ({e!r}); training goes on")

    def log_generations(self, step: int, samples: Sequence[Generation]) -> None:
        """Record validation samples of ``step`` (the caller picks how many: trainer.val_generations_to_log)."""
        if not samples:
            return
        samples = [Generation(str(p), str(r), str(g), float(s)) for p, r, g, s in samples]
        with self.lock:
            self._log_generations(step, samples)

    def _log_generations(self, step: int, samples: Sequence[Generation]) -> None:
        if self.generations is None:
            self.generations = JsonlBackend(self.info.save_dir / "val_generations.jsonl", self.info.start_step)
        for sample in samples:
            self.generations.log(step, sample._asdict())
        for backend in self.backends:
            backend.log_generations(step, samples)

    def close(self) -> None:
        """Close every logger, even if one fails (the first error is raised after)."""
        with self.lock:
            self._close()

    def _close(self) -> None:
        error: BaseException | None = None
        for backend in [*self.backends, *([self.generations] if self.generations else [])]:
            try:
                backend.close()
            except Exception as e:  # noqa: BLE001 - keep closing the others
                error = error or e
        self.backends, self.generations = [], None
        if error is not None:
            raise error


# ---------------------------------------------------------------------------- helpers
def _say(message: str) -> None:
    print(f"easyvlm: {message}", file=sys.stderr, flush=True)


def _config_json(config: Mapping[str, Any]) -> str:
    return json.dumps(config, indent=2, default=str)


def _flatten(config: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """{"a": {"b": 1}} -> {"a.b": 1}; lists stay values."""
    flat: dict[str, Any] = {}
    for key, value in config.items():
        if isinstance(value, Mapping):
            flat.update(_flatten(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def _chunks(items: list, size: int) -> Iterator[list]:
    for start in range(0, len(items), size):
        yield items[start : start + size]


def _jsonable(value: Any) -> Any:
    value = float(value) if hasattr(value, "__float__") else value
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)  # JSON has no NaN/inf; keep them visible
    return value
