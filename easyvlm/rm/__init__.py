"""Reward-model training (``python -m easyvlm.rm``): a scalar reward model, Bradley-Terry loss on preference
pairs under FSDP2, exported so that ``worker.reward_model`` loads it as is (docs/rewards.md)."""
