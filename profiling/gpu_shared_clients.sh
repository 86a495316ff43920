#!/usr/bin/env bash
# Issue 16's GPU checks in one call on a lent GPU machine (device tool): clients sharing one GPU
# through the host-staged gloo transport. Each step has its own time limit, and the results so far
# are packed into $OUT/results.tgz after each (the tool brings back at most 8 files).
#   1. distributed == simulator, 4 clients on the GPU, fp32 (profiling/shared_device_exact.py)
#   2. Table 9 with 4 clients on the GPU: DECA and the PEFT baselines on Qwen2-1.5B
#   3. Llama-3.1-8B, 2 clients on the GPU, ring: peak per client against the estimator
#   4. D-Adam beside step 2 (it moves every decoder weight per step, so a few steps only)
# Wheels the machine lacks travel in .whl/ (see profiling/results/gpu_h200/README.md).
set -u -o pipefail
OUT=${OUT:-/tmp/out}
RES=/tmp/res
mkdir -p "$RES" "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
pack() { tar czf "$OUT/results.tgz" -C "$RES" .; }
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$RES/device.txt"
PYTHONPATH=/tmp/site python3 -m pip check | grep -v "^$" | head -20  # what the carried wheels still lack
python3 -c "import torch, deepspeed, transformers, peft, huggingface_hub.hf_api, deca_ds.runtime.trainer
print(torch.__version__, deepspeed.__version__, transformers.__version__, peft.__version__)" | tee -a "$RES/device.txt" || exit 1

QWEN=(--from-config --model profiling/configs/qwen2-1.5b.json --transport gloo)
LLAMA=(--from-config --model profiling/configs/llama-3.1-8b-instruct.json --transport gloo)

timeout 100 python3 profiling/shared_device_exact.py --ranks 4 --out "$RES/shared_device_exact.json" \
  --train-args --from-config --model profiling/configs/cpu/llama-8x256; echo "exact rc=$?"; pack

timeout 200 python3 profiling/profile_resources.py --ds-config ds_configs/profile_bf16.json --ranks 4 \
  --methods deca dec_lora dec_adapter decaf --steps-per-block 3 --warmup 3 --out "$RES" \
  --name profile_resources_4clients_qwen2-1.5b --train-args "${QWEN[@]}" --layers-per-block 2
echo "resources rc=$?"; pack

timeout 140 python3 profiling/profile_memory.py --ds-config ds_configs/profile_bf16.json --ranks 2 \
  --layers-per-block 1 --offload none --steps-per-block 2 --warmup 2 --out "$RES" \
  --name profile_memory_2clients_llama-3.1-8b --train-args "${LLAMA[@]}"
echo "memory rc=$?"; pack

timeout 90 python3 profiling/profile_resources.py --ds-config ds_configs/profile_bf16.json --ranks 4 \
  --methods dadam --steps-per-block 1 --warmup 2 --out "$RES" \
  --name profile_resources_4clients_qwen2-1.5b_dadam --train-args "${QWEN[@]}" --layers-per-block 7
echo "dadam rc=$?"; pack
