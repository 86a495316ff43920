#!/usr/bin/env bash
# The offline demo: install, then 4 DECA clients on CPU ranks (gloo) fine-tune the built-in tiny
# Llama on the built-in non-IID task, with no GPU and no network.
set -euo pipefail
cd "$(dirname "$0")/.."
bash launch/install.sh
# The README's numbers are an AMD EPYC's with ATen's AVX2 kernels: another EPYC with AVX-512 runs those
# too, so that it prints them to the last digit (an Intel Xeon lands close: docs/training.md); a value
# already set wins.
if [[ -z "${ATEN_CPU_CAPABILITY:-}" ]] && grep -qw avx2 /proc/cpuinfo 2>/dev/null; then
    export ATEN_CPU_CAPABILITY=avx2
fi
exec .venv/bin/deepspeed --num_gpus 4 launch/train.py --ds_config ds_configs/cpu_demo.json --overwrite "$@"
