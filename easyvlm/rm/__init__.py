"""Reward-model training: ``python -m easyvlm.rm config=examples/rm.yaml key=value ...``.

A scalar reward model (easyvlm.models.reward_model) trained on preference pairs with the
Bradley-Terry loss (easyvlm.algorithms.preference), under FSDP2, with checkpoints, resume,
validation pairwise accuracy and a Hugging Face export that ``worker.reward_model`` loads as is.
docs/rewards.md has the whole chain.
"""
