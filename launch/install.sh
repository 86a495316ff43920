#!/usr/bin/env bash
# Install deca-ds (editable, with the dev extra: pytest, ruff) into a virtual environment, every
# package pinned by requirements/cpu.lock. Docs: docs/install.md.
#
#   bash launch/install.sh [--cpu | --cuda 12.X] [--bnb] [--venv PATH] [--update-lock] [--dry-run]
#
#   --cpu          CPU build of torch (the default)
#   --cuda 12.X    CUDA 12.X build of torch (torch==2.13.0+cu12X from download.pytorch.org/whl/cu12X)
#   --bnb          also the bnb extra: bitsandbytes, for 8-bit Adam moments (--state-bits 8)
#   --venv PATH    the virtual environment to create or reuse (default .venv)
#   --update-lock  install into a fresh venv without the lock and write requirements/cpu.lock from it
#   --dry-run      print the commands, run nothing
#
# PYTHON names the interpreter that creates the venv (default python3).
set -euo pipefail
cd "$(dirname "$0")/.."

TORCH=2.13.0
LOCK=requirements/cpu.lock
PYTHON=${PYTHON:-python3}
build=cpu venv=.venv bnb=0 update=0 dry=0

die() { echo "install.sh: $*" >&2; exit 2; }
while [ $# -gt 0 ]; do
    case "$1" in
        --cpu) build=cpu ;;
        --cuda)
            [ $# -ge 2 ] && [[ "$2" =~ ^[0-9]+\.[0-9]+$ ]] || die "--cuda needs a version like 12.8, got '${2:-}'"
            build="cu${2/./}"
            shift ;;
        --bnb) bnb=1 ;;
        --venv)
            [ $# -ge 2 ] && [ -n "$2" ] && [[ "$2" != --* ]] || die "--venv needs a path"
            venv=$2
            shift ;;
        --update-lock) update=1 ;;
        --dry-run) dry=1 ;;
        -h | --help) sed -n '2,14p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
        *) die "unknown argument '$1' (see --help)" ;;
    esac
    shift
done

if [ $update = 1 ]; then
    # the lock is one file for every build: torch is pinned without its build label (+cpu, +cu128)
    [ $build = cpu ] || die "--update-lock resolves on the CPU build of torch: drop --cuda"
    [ "$venv" != .venv ] || venv=$(mktemp -u -d)/venv
    [ ! -e "$venv" ] || die "--update-lock needs a fresh venv, and $venv exists"
    bnb=1  # the lock covers the bnb extra too
fi

run() {  # print a command as `set -x` would, then run it unless --dry-run
    echo "+ $*"
    [ $dry = 1 ] || "$@"
}

py=$venv/bin/python
constrain=(-c "$LOCK")
[ $update = 0 ] || constrain=()
extras=dev
[ $bnb = 0 ] || extras=dev,bnb

[ -x "$py" ] || run "$PYTHON" -m venv "$venv"
run "$py" -m pip install -q --upgrade pip "${constrain[@]}"

# torch first, its build named: a bare `torch` from PyPI is a multi-GB CUDA build. A wheel pip finds
# without an index wins (its find-links: this machine keeps the CPU build on disk); otherwise the
# PyTorch index of that build. torch's own dependencies come with the project below.
spec="torch==$TORCH+$build"
local_torch=("$py" -m pip install -q --no-index --no-deps "$spec")
index_torch=("$py" -m pip install -q --extra-index-url "https://download.pytorch.org/whl/$build" "$spec" "${constrain[@]}")
echo "+ ${local_torch[*]} || ${index_torch[*]}"
if [ $dry = 0 ] && ! "${local_torch[@]}" 2>/dev/null; then
    "${index_torch[@]}"
fi

# DS_BUILD_OPS=0: DeepSpeed compiles its ops when first used, not at install
run env DS_BUILD_OPS=0 "$py" -m pip install -q "${constrain[@]}" -e ".[$extras]"

if [ $update = 1 ]; then
    echo "+ $py -m pip freeze --all --exclude-editable > $LOCK"
    if [ $dry = 0 ]; then
        version=$("$py" -c 'import sys; print(*sys.version_info[:2], sep=".")')
        # torch's build label dropped: torch==2.13.0 admits 2.13.0+cpu and 2.13.0+cu128 alike
        {
            echo "# deca-ds dependencies pinned for Python $version on Linux"
            echo "# regenerate: bash launch/install.sh --update-lock (docs/install.md)"
            "$py" -m pip freeze --all --exclude-editable | sed -E 's/^(torch==[^+]+)\+.*/\1/'
        } > "$LOCK.tmp"
        mv "$LOCK.tmp" "$LOCK"
        echo "wrote $LOCK ($(grep -vc '^#' "$LOCK") packages) from $venv"
    fi
fi
