#!/usr/bin/env bash
# The offline demo: install, then 4 DECA clients on CPU ranks (gloo) fine-tune the built-in tiny
# Llama on the built-in non-IID task, with no GPU and no network.
set -euo pipefail
cd "$(dirname "$0")/.."
bash launch/install.sh
exec .venv/bin/deepspeed --num_gpus 4 launch/train.py --ds_config ds_configs/cpu_demo.json --overwrite "$@"
