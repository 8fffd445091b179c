"""``python -m easyvlm.eval``: sample k answers per validation prompt, score them, report mean@k
and pass@k (``metrics.py``: pure functions; ``run.py``: the command)."""
