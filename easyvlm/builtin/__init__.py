"""Assets easyvlm builds offline and deterministically (tiny Qwen-VL models, synthetic tasks, warm starts), named
``builtin:<name>``. ``register()`` hands their builders over; every command calls it first, workers never do."""


def register() -> None:
    """Make ``builtin:<name>`` resolvable as a model path and as a data set (idempotent)."""
    from easyvlm.builtin import models, synthetic
    from easyvlm.data.loading import register_dataset_scheme

    models.register()
    register_dataset_scheme(models.BUILTIN_PREFIX, lambda spec: str(synthetic.resolve_builtin_dataset(spec)))
