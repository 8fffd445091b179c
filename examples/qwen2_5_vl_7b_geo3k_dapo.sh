#!/usr/bin/env bash
# DAPO (arXiv:2503.14476) on geometry3k with Qwen2.5-VL-7B-Instruct on 8 GPUs:
#   clip-higher (clip_ratio_high 0.28), dynamic sampling (online filtering of prompt groups whose
#   samples are all right or all wrong), token-mean loss, no KL (no reference model).
# EasyR1: algorithm.online_filtering=true + worker.actor.clip_ratio_high=0.28 + disable_kl.
# docs/recipes.md explains the settings and the departures from the paper. Extra key=value
# arguments are passed on.
set -euo pipefail
cd "$(dirname "$0")/.."  # paths below are relative to the repository root
export PYTHONUNBUFFERED=1

MODEL_PATH=${MODEL_PATH:-Qwen/Qwen2.5-VL-7B-Instruct}  # or a local directory

python3 -m easyvlm.trainer.main \
    config=examples/qwen2_5_vl_gpu.yaml \
    data.train_files=hiyouga/geometry3k@train \
    data.val_files=hiyouga/geometry3k@test \
    data.format_prompt=./format_prompts/math.jinja \
    data.rollout_batch_size=512 \
    data.mini_rollout_batch_size=256 \
    algorithm.disable_kl=true \
    algorithm.use_kl_loss=false \
    algorithm.online_filtering=true \
    algorithm.filter_key=accuracy \
    algorithm.filter_low=0.01 \
    algorithm.filter_high=0.99 \
    worker.actor.model.model_path="${MODEL_PATH}" \
    worker.actor.clip_ratio_low=0.2 \
    worker.actor.clip_ratio_high=0.28 \
    worker.actor.loss_avg_mode=token \
    worker.actor.loss_type=default \
    worker.rollout.n=8 \
    worker.rollout.tensor_parallel_size=2 \
    worker.reward.reward_function=./reward_functions/math.py:compute_score \
    trainer.max_try_make_batch=10 \
    trainer.experiment_name=qwen2_5_vl_7b_geo3k_dapo \
    trainer.n_gpus_per_node=8 \
    "$@"
