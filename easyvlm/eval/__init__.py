"""``python -m easyvlm.eval``: mean@k and pass@k of k sampled answers per validation prompt (docs/eval.md)."""
