#!/usr/bin/env bash
# What a lent GPU machine needs from this checkout for profiling/gpu_checks.sh (device tool, carry
# [".whl", "data"]): in .whl/ the wheels its image lacks, for its Python 3.12, at the versions
# requirements/cpu.lock pins (DeepSpeed's built here by launch/install.sh, found in pip's cache); in
# data/ag_news the AG News subset the accuracy grid reads. Both folders are ignored by git. Once per
# checkout, after launch/install.sh; --dry-run prints the commands instead.
set -euo pipefail
cd "$(dirname "$0")/.."

# The machine has torch, pyarrow (55 MB: it would not fit the 64 MiB a call carries) and the rest
# (profiling/results/gpu_h200/README.md); not these, or not at the lock's versions.
WHEELS=(hjson pydantic pydantic_core annotated-types typing-inspection typing-extensions transformers huggingface_hub
        httpx2 httpcore2 hf-xet click peft tokenizers truststore idna h11 anyio datasets dill multiprocess xxhash fsspec)
PLATFORMS=(manylinux_2_28_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64)
dry=0
[[ ${1:-} == --dry-run ]] && dry=1
run() {
    echo "+ $*"
    ((dry)) || "$@"
}

deepspeed=$(grep -i '^deepspeed==' requirements/cpu.lock | cut -d= -f3)
((dry)) || {
    mkdir -p .git/info .whl data
    for path in /.whl/ /data/; do grep -qxF "$path" .git/info/exclude 2> /dev/null || echo "$path" >> .git/info/exclude; done
}
built=$(find ~/.cache/pip/wheels -name "deepspeed-$deepspeed-py3-none-any.whl" 2> /dev/null | head -n 1 || true)
if [[ -n $built ]]; then
    run cp "$built" .whl/
else  # pure Python with its ops left to build at run time, as launch/install.sh installs it
    DS_BUILD_OPS=0 run python3 -m pip wheel --no-deps -w .whl "deepspeed==$deepspeed"
fi
run python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    "${PLATFORMS[@]/#/--platform=}" -c requirements/cpu.lock -d .whl "${WHEELS[@]}"
[[ -d data/ag_news ]] || run cp -r ../shared/data/ag_news data/
((dry)) || du -sh .whl data
