#!/usr/bin/env bash
# Issue 47's GPU figures in one device call, each stage under its own time limit, each writing its
# log and its JSON line (bench/gpu_step.py's last line) to $OUT (or /tmp/issue47) as it ends, so a
# call cut off in one stage still returns the others. Prepared on the CPU; run on the GPU machine
# from the project root:
#
#   source .gpu/env.sh && bash bench/gpu_issue47.sh [cache] [7b] [vllm] [transfer]   # default: cache 7b
#
#   cache  Qwen2.5-VL-3B's shapes, 16 x 8 x 256, the tower frozen: the step with the vision cache
#          off, then on (docs/benchmarks.md: reference and update seconds, the tower's share, MFU
#          executed and per sample)
#   7b     Qwen2.5-VL-7B's shapes with EasyR1's 7B memory settings (params and optimizer offloaded
#          between phases through the pinned host buffers), 4 x 8 x 256, one step: each phase's peak
#          memory as it ends
#   vllm   the 3B step with worker.rollout.name=vllm (vLLM installed from the wheelhouse first:
#          docs/gpu.md), generation tokens/s beside the cache stage's hf engine
#   transfer the weight transfer to separate engines over NCCL (issue 58): the tensor groups of
#          tests/workers/test_weight_transfer.py, one GPU per member, where nvidia-smi -L lists >= 2
#          GPUs (NCCL refuses two ranks on one device; skipped, saying so, with fewer)
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

transfer() {  # the NCCL weight-transfer test (2 members; 3 too where 3 GPUs are listed)
  local gpus start=$SECONDS
  gpus=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU')
  if (( gpus < 2 )); then
    echo "transfer: skipped: nvidia-smi -L lists $gpus GPU(s); the NCCL transfer needs 2, one per member (NCCL" \
         "refuses two ranks on one device)" | tee "$out/transfer.log"
    return
  fi
  EASYVLM_TRANSFER_BACKEND=nccl timeout 240 python -m pytest -q -rs -p no:cacheprovider \
    tests/workers/test_weight_transfer.py -k test_the_receivers_get_every_tensor_bitwise_in_buckets > "$out/transfer.log" 2>&1
  local rc=$?
  echo "transfer: exit $rc after $((SECONDS - start)) s; $(tail -1 "$out/transfer.log")"
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
    transfer)
      transfer ;;
    *)
      echo "unknown stage $stage (cache, 7b, vllm, transfer)" >&2; exit 2 ;;
  esac
done
