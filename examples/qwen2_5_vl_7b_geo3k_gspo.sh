#!/usr/bin/env bash
# GSPO (arXiv:2507.18071) on geometry3k with Qwen2.5-VL-7B-Instruct on 8 GPUs: sequence-level
# importance ratio (loss_type gspo), sequence-mean of token-means (loss_avg_mode seq), the paper's
# small clip range (3e-4 / 4e-4), no KL. 4 PPO mini-batches per step, so the later ones are
# off-policy and the sequence ratio matters. EasyR1: worker.actor.loss_type=gspo.
# docs/recipes.md explains the settings. Extra key=value arguments are passed on.
set -euo pipefail
cd "$(dirname "$0")/.."  # paths below are relative to the repository root
export PYTHONUNBUFFERED=1

MODEL_PATH=${MODEL_PATH:-Qwen/Qwen2.5-VL-7B-Instruct}  # or a local directory

python3 -m easyvlm.trainer.main \
    config=examples/qwen2_5_vl_gpu.yaml \
    data.train_files=hiyouga/geometry3k@train \
    data.val_files=hiyouga/geometry3k@test \
    data.format_prompt=./format_prompts/math.jinja \
    algorithm.disable_kl=true \
    algorithm.use_kl_loss=false \
    worker.actor.model.model_path="${MODEL_PATH}" \
    worker.actor.global_batch_size=128 \
    worker.actor.loss_type=gspo \
    worker.actor.loss_avg_mode=seq \
    worker.actor.clip_ratio_low=3.0e-4 \
    worker.actor.clip_ratio_high=4.0e-4 \
    worker.rollout.n=8 \
    worker.rollout.tensor_parallel_size=2 \
    worker.reward.reward_function=./reward_functions/math.py:compute_score \
    trainer.experiment_name=qwen2_5_vl_7b_geo3k_gspo \
    trainer.n_gpus_per_node=8 \
    "$@"
