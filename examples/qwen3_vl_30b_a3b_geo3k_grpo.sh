#!/usr/bin/env bash
# GRPO on geometry3k with Qwen3-VL-30B-A3B-Instruct (MoE: 128 experts, 8 per token) on 8 GPUs.
# EasyR1: qwen3_vl_30b_geo3k_grpo.sh. The 7B recipe's data and algorithm; for the MoE:
# - R2 router replay: the update routes every token to the experts the old-log-prob pass chose, so
#   one update's ratios do not jump when a token near a routing tie switches experts (R3, the
#   sampler's own experts, comes from vLLM's enable_return_routed_experts on GPUs: wired, not yet
#   run on a GPU here: docs/models.md);
# - the model's own load-balancing loss (router_aux_loss_coef: null = its 0.001);
# - the vision tower frozen, vLLM over 4 GPUs per engine (30 B parameters in bf16), actor and
#   reference offloaded between phases as in the 7B recipe.
# docs/recipes.md explains the settings. Extra key=value arguments are passed on.
set -euo pipefail
cd "$(dirname "$0")/.."  # paths below are relative to the repository root
export PYTHONUNBUFFERED=1

MODEL_PATH=${MODEL_PATH:-Qwen/Qwen3-VL-30B-A3B-Instruct}  # or a local directory

python3 -m easyvlm.trainer.main \
    config=examples/qwen2_5_vl_gpu.yaml \
    data.train_files=hiyouga/geometry3k@train \
    data.val_files=hiyouga/geometry3k@test \
    data.format_prompt=./format_prompts/math.jinja \
    worker.actor.model.model_path="${MODEL_PATH}" \
    worker.actor.model.freeze_vision_tower=true \
    worker.actor.router_replay=R2 \
    worker.rollout.tensor_parallel_size=4 \
    worker.reward.reward_function=./reward_functions/math.py:compute_score \
    trainer.experiment_name=qwen3_vl_30b_a3b_geo3k_grpo \
    trainer.n_gpus_per_node=8 \
    "$@"
