"""The names that string keys of the config accept (estimators, losses, shipped tools, loggers, KL
penalties, dtypes), as tables and ``Literal`` types, and the one spelling of a dtype. The schema's
sections use them; so do the check and the layers above that must agree with the config."""

from __future__ import annotations

from typing import Literal

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
    "gpg",
)
# Estimators whose baseline is computed from the other samples of the same prompt.
GROUP_ADV_ESTIMATORS: tuple[str, ...] = ("grpo", "grpo_passk", "rloo", "reinforce_plus_plus_baseline", "gpg")
POLICY_LOSSES: tuple[str, ...] = (
    "default", "gspo", "gspo_token", "cispo", "sapo", "geo_mean", "clip_cov", "kl_cov", "gpg",
)
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
LossAvgMode = Literal["token", "seq", "seq-mean-token-sum", "seq-mean-token-sum-norm", "token-sum"]
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
