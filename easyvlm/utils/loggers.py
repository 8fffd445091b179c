"""The trackers' optional packages and which of them are not installed (nothing is imported), for
the config check and the tracker."""

from __future__ import annotations

import importlib.util
from typing import Sequence

# trainer.logger -> (module it imports, pip requirement that provides it); console and file need nothing
LOGGER_PACKAGES: dict[str, tuple[str, str]] = {
    "tensorboard": ("tensorboard", "tensorboard"),
    "wandb": ("wandb", "wandb"),
    "swanlab": ("swanlab", "swanlab"),
    "mlflow": ("mlflow", "mlflow-skinny"),  # the full `mlflow` package provides the module too
}


def missing_logger_packages(loggers: Sequence[str]) -> dict[str, str]:
    """{logger: pip requirement} for each logger in ``loggers`` whose package is not installed."""
    return {
        name: requirement
        for name, (module, requirement) in LOGGER_PACKAGES.items()
        if name in loggers and importlib.util.find_spec(module) is None
    }
