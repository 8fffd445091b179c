#!/usr/bin/env bash
# GRPO on geometry3k with Qwen3.5-9B on 8 GPUs: the Qwen2.5-VL-7B recipe's settings (a model of a
# size). Qwen3.5 is natively multimodal and three of its four decoder layers are gated-DeltaNet
# linear attention: easyvlm packs them exactly (docs/models.md); Ulysses is refused for them, so
# ulysses_size stays 1. flash-linear-attention (`pip install flash-linear-attention`) gives the
# packed rows its varlen kernel; without it the torch implementation runs. docs/recipes.md explains
# the settings. Extra key=value arguments are passed on.
set -euo pipefail
cd "$(dirname "$0")/.."  # paths below are relative to the repository root
export PYTHONUNBUFFERED=1

MODEL_PATH=${MODEL_PATH:-Qwen/Qwen3.5-9B}  # or a local directory

python3 -m easyvlm.trainer.main \
    config=examples/qwen2_5_vl_gpu.yaml \
    data.train_files=hiyouga/geometry3k@train \
    data.val_files=hiyouga/geometry3k@test \
    data.format_prompt=./format_prompts/math.jinja \
    worker.actor.model.model_path="${MODEL_PATH}" \
    worker.rollout.tensor_parallel_size=2 \
    worker.reward.reward_function=./reward_functions/math.py:compute_score \
    trainer.experiment_name=qwen3_5_9b_geo3k_grpo \
    trainer.n_gpus_per_node=8 \
    "$@"
