"""The run directory, shared by the trainer, evaluation and reward-model training: trackers
(``tracking``), checkpoints (``checkpoint``, ``convert_checkpoint``) and the learning curve (``plot``)."""
