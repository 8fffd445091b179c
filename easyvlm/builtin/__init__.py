"""Assets easyvlm builds itself, offline and deterministically, for tests and the embedded default:
the tiny Qwen-VL models (``models.py``), the synthetic visual task (``synthetic.py``) and the tiny
model's supervised warm start on it (``warm_start.py``). ``builtin:<name>`` in a config names them.
"""
