#!/usr/bin/env bash
# Issue 47's GPU figures in one device call, each stage under its own time limit, each writing its
# log and its JSON line (bench/gpu_step.py's last line) to $OUT (or /tmp/issue47) as it ends, so a
# call cut off in one stage still returns the others. Prepared on the CPU; run on the GPU machine
# from the project root:
#
#   source .gpu/env.sh && bash bench/gpu_issue47.sh [cache] [7b] [vllm]      # default: cache 7b
#
#   cache  Qwen2.5-VL-3B's shapes, 16 x 8 x 256, the tower frozen: the step with the vision cache
#          off, then on (docs/benchmarks.md: reference and update seconds, the tower's share, MFU
#          executed and per sample)
#   7b     Qwen2.5-VL-7B's shapes with EasyR1's 7B memory settings (params and optimizer offloaded
#          between phases through the pinned host buffers), 4 x 8 x 256, one step: each phase's peak
#          memory as it ends
#   vllm   the 3B step with worker.rollout.name=vllm (vLLM installed from the wheelhouse first:
#          docs/gpu.md), generation tokens/s beside the cache stage's hf engine
set -uo pipefail
out=${OUT:-/tmp/issue47}
mkdir -p "$out"
stages=("$@")
[[ ${#stages[@]} -eq 0 ]] && stages=(cache 7b)
frozen=(worker.actor.model.freeze_vision_tower=true worker.actor.max_token_len_per_device=32768)

run() {  # name, limit in seconds, gpu_step.py arguments...
  local name=$1 limit=$2
  shift 2
  local start=$SECONDS
  timeout "$limit" python bench/gpu_step.py "$@" > "$out/$name.log" 2>&1
  local rc=$?
  tail -1 "$out/$name.log" > "$out/$name.json"
  echo "$name: exit $rc after $((SECONDS - start)) s; $(grep -E '^step [0-9]+:' "$out/$name.log" | tail -1)"
}

for stage in "${stages[@]}"; do
  case $stage in
    cache)
      run cache_off 200 --shape qwen2.5-vl-3b --steps 2 --no-profile "${frozen[@]}" worker.actor.vision_cache_mb=0
      run cache_on 200 --shape qwen2.5-vl-3b --steps 2 --no-profile "${frozen[@]}" worker.actor.vision_cache_mb=1024 ;;
    7b)
      run 7b 280 --shape qwen2.5-vl-7b --prompts 4 --steps 1 --no-profile ;;
    vllm)
      run vllm 240 --shape qwen2.5-vl-3b --steps 2 --no-profile --rollout vllm "${frozen[@]}" ;;
    *)
      echo "unknown stage $stage (cache, 7b, vllm)" >&2; exit 2 ;;
  esac
done
