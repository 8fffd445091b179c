"""Assets easyvlm builds itself, offline and deterministically, for tests and the embedded default:
the tiny Qwen-VL models (``models.py``), the synthetic visual task (``synthetic.py``) and the tiny
model's supervised warm start on it (``warm_start.py``). ``builtin:<name>`` in a config names them.

The layers below (easyvlm.models.paths for models, easyvlm.data.loading for data sets) know no
builder: ``register()`` hands them this package's, and every command calls it first (the plan's
build, eval, reward-model training). Workers never do: they only find what the driver built.
"""


def register() -> None:
    """Make ``builtin:<name>`` resolvable as a model path and as a data set (idempotent)."""
    from easyvlm.builtin import models, synthetic
    from easyvlm.data.loading import register_dataset_scheme

    models.register()
    register_dataset_scheme(models.BUILTIN_PREFIX, lambda spec: str(synthetic.resolve_builtin_dataset(spec)))
