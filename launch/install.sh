#!/usr/bin/env bash
# Create .venv (if missing) and install deca-ds with its test extras (and bitsandbytes for the 8-bit
# moment tests), CPU-only and offline-friendly.
set -euo pipefail
cd "$(dirname "$0")/.."
[ -x .venv/bin/python ] || python3 -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
# torch first and pinned: its CPU build lies on this machine's disk; an unpinned torch pulls a
# multi-GB CUDA build. On a GPU machine install the CUDA torch of your choice before this script.
.venv/bin/python -c "import torch" 2>/dev/null || .venv/bin/python -m pip install -q torch==2.13.0
DS_BUILD_OPS=0 .venv/bin/python -m pip install -q -e '.[dev,bnb]'
