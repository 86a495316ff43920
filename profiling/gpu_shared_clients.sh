#!/usr/bin/env bash
# Issue 16's GPU checks in one call on a lent GPU machine (device tool): clients sharing one GPU
# through the host-staged gloo transport. Each step has its own time limit and runs only while the
# call's budget (BUDGET seconds, default 560) lasts; the results so far are packed into
# $OUT/results.tgz after each (the tool brings back at most 8 files).
#   exact   distributed == simulator, 4 clients on the GPU, fp32 (profiling/shared_device_exact.py)
#   table9  Table 9 with 4 clients on the GPU, Qwen2-1.5B: one method per call, merged into one table
#   memory  Llama-3.1-8B, 2 clients on the GPU, ring: peak per client against the estimator
#   offload Llama-3.1-8B, 4 clients with --offload frozen (an H200's memory)
# Usage: bash profiling/gpu_shared_clients.sh [step ...]   (default: table9 offload)
# Wheels the machine lacks travel in .whl/ (see profiling/results/gpu_h200/README.md).
set -u -o pipefail
OUT=${OUT:-/tmp/out}
RES=/tmp/res
DEADLINE=$((SECONDS + ${BUDGET:-560}))
mkdir -p "$RES" "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
pack() { tar czf "$OUT/results.tgz" -C "$RES" .; }
# step LIMIT NAME CMD...: CMD with at most LIMIT seconds, fewer if the call's budget is shorter
step() {
  local limit=$1 name=$2 left=$((DEADLINE - SECONDS - 10))
  shift 2
  if ((left < 30)); then echo "$name skipped: the call's budget is spent"; return; fi
  timeout $((limit < left ? limit : left)) "$@"
  echo "$name rc=$?"
  pack
}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$RES/device.txt"
PYTHONPATH=/tmp/site python3 -m pip check | grep -v "^$" | head -20  # what the carried wheels still lack
python3 -c "import torch, deepspeed, transformers, peft, huggingface_hub.hf_api, deca_ds.runtime.trainer
print(torch.__version__, deepspeed.__version__, transformers.__version__, peft.__version__)" | tee -a "$RES/device.txt" || exit 1

QWEN=(--from-config --model profiling/configs/qwen2-1.5b.json --transport gloo --layers-per-block 4)
LLAMA=(--from-config --model profiling/configs/llama-3.1-8b-instruct.json --transport gloo)
TABLE9=(--ds-config ds_configs/profile_bf16.json --ranks 4 --steps-per-block 3 --warmup 3 --out "$RES"
        --name profile_resources_4clients_qwen2-1.5b --merge)

steps=("$@")
((${#steps[@]})) || steps=(table9 offload)
for what in "${steps[@]}"; do
  case $what in
    exact) step 120 exact python3 profiling/shared_device_exact.py --ranks 4 --out "$RES/shared_device_exact.json" \
             --train-args --from-config --model profiling/configs/cpu/llama-8x256 ;;
    table9) for method in deca dec_lora dec_adapter decaf dadam; do
              step 150 "table9 $method" python3 profiling/profile_resources.py "${TABLE9[@]}" --methods $method \
                --train-args "${QWEN[@]}"
            done ;;
    memory) step 150 memory python3 profiling/profile_memory.py --ds-config ds_configs/profile_bf16.json --ranks 2 \
              --layers-per-block 1 --offload none --steps-per-block 2 --warmup 2 --out "$RES" \
              --name profile_memory_2clients_llama-3.1-8b --train-args "${LLAMA[@]}" ;;
    offload) step 240 offload python3 profiling/profile_memory.py --ds-config ds_configs/profile_bf16.json --ranks 4 \
               --layers-per-block 1 --offload frozen --steps-per-block 2 --warmup 2 --out "$RES" \
               --name profile_memory_4clients_offload_llama-3.1-8b --train-args "${LLAMA[@]}" ;;
    *) echo "unknown step $what (exact, table9, memory, offload)"; exit 2 ;;
  esac
done
