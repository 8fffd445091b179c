"""Generate -> score -> capture: the one pipeline behind validation and ``python -m easyvlm.eval`` (same numbers)."""
