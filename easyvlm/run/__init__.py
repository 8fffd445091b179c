"""The run directory: what a training run writes and reads back, shared by the trainer, evaluation
and reward-model training.

- ``tracking``: metrics to the console, JSONL, TensorBoard, W&B, SwanLab, MLflow, and generations;
- ``checkpoint``: atomic checkpoints, their manifest, verification and resumption;
- ``convert_checkpoint``: older checkpoints rewritten in the safe format (``python -m easyvlm.run.convert_checkpoint``);
- ``plot``: the learning curve.
"""
