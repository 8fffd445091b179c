#!/usr/bin/env bash
# GRPO on CLEVR counting ("How many items are there in the image?") with Qwen2.5-VL-3B-Instruct on
# 8 GPUs, R1-V style: reason in <think>, answer in <answer>. EasyR1: qwen2_5_vl_3b_clevr.sh
# (BUAADreamer/clevr_count_70k, r1v reward). docs/recipes.md explains the settings.
# Extra key=value arguments are passed on.
set -euo pipefail
cd "$(dirname "$0")/.."  # paths below are relative to the repository root
export PYTHONUNBUFFERED=1

MODEL_PATH=${MODEL_PATH:-Qwen/Qwen2.5-VL-3B-Instruct}  # or a local directory

python3 -m easyvlm.trainer.main \
    config=examples/qwen2_5_vl_gpu.yaml \
    data.train_files=BUAADreamer/clevr_count_70k@train \
    data.val_files=BUAADreamer/clevr_count_70k@test \
    data.format_prompt=./format_prompts/r1v.jinja \
    data.max_response_length=1024 \
    worker.actor.model.model_path="${MODEL_PATH}" \
    worker.actor.micro_batch_size_per_device_for_update=4 \
    worker.actor.micro_batch_size_per_device_for_experience=16 \
    worker.actor.offload.offload_params=false \
    worker.actor.offload.offload_optimizer=false \
    worker.ref.offload.offload_params=false \
    worker.rollout.tensor_parallel_size=1 \
    worker.reward.reward_function=./reward_functions/r1v.py:compute_score \
    trainer.experiment_name=qwen2_5_vl_3b_clevr_grpo \
    trainer.n_gpus_per_node=8 \
    "$@"
