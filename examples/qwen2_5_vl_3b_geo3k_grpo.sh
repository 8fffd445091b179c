#!/usr/bin/env bash
# GRPO on geometry3k with Qwen2.5-VL-3B-Instruct on 8 GPUs: the 7B recipe with one GPU per vLLM
# engine (the 3B model fits) and no parameter offloading. EasyR1: qwen2_5_vl_3b_geo3k_grpo.sh.
# docs/recipes.md explains the settings. Extra key=value arguments are passed on.
set -euo pipefail
cd "$(dirname "$0")/.."  # paths below are relative to the repository root
export PYTHONUNBUFFERED=1

MODEL_PATH=${MODEL_PATH:-Qwen/Qwen2.5-VL-3B-Instruct}  # or a local directory

python3 -m easyvlm.trainer.main \
    config=examples/qwen2_5_vl_gpu.yaml \
    data.train_files=hiyouga/geometry3k@train \
    data.val_files=hiyouga/geometry3k@test \
    data.format_prompt=./format_prompts/math.jinja \
    worker.actor.model.model_path="${MODEL_PATH}" \
    worker.actor.micro_batch_size_per_device_for_update=4 \
    worker.actor.micro_batch_size_per_device_for_experience=16 \
    worker.actor.offload.offload_params=false \
    worker.actor.offload.offload_optimizer=false \
    worker.ref.offload.offload_params=false \
    worker.rollout.tensor_parallel_size=1 \
    worker.reward.reward_function=./reward_functions/math.py:compute_score \
    trainer.experiment_name=qwen2_5_vl_3b_geo3k_grpo \
    trainer.n_gpus_per_node=8 \
    "$@"
