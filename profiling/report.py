"""What every profiling tool writes: provenance here; the result files and the plot backend from
deca_ds.reporting."""

from __future__ import annotations

import json
import platform
import subprocess
import sys
from datetime import datetime, timezone
from pathlib import Path

from deca_ds.reporting import pyplot, setting, write_results

__all__ = ["emit", "provenance", "pyplot", "setting", "write_results"]


def provenance(tool: str, argv: list[str] | None, *, cuda: bool = False, threads: int | None = None) -> dict:
    """What every result names: the command that made it (`argv`: the tool's arguments, default
    sys.argv's), the UTC date, the commit of the code (check_results.py compares it with the
    code's last change), the device (CPU: with `threads` when given) and the versions."""
    import torch

    cpu = f"CPU ({platform.processor() or platform.machine()}" + (f", {threads} threads)" if threads else ")")
    return {"command": " ".join([f"python profiling/{tool}", *(sys.argv[1:] if argv is None else argv)]),
            "date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"), "commit": commit(),
            "device": torch.cuda.get_device_name() if cuda else cpu,
            "versions": {"torch": str(torch.__version__), "python": platform.python_version()}}


def commit() -> str:
    """HEAD's short hash, "+dirty" when tracked files differ from it; "unknown" outside a checkout."""
    root = Path(__file__).resolve().parents[1]

    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=root, capture_output=True, text=True, timeout=30,
                              check=True).stdout.strip()

    try:
        head = git("rev-parse", "--short=7", "HEAD")
        return head + ("+dirty" if git("status", "--porcelain", "--untracked-files=no") else "")
    except (OSError, subprocess.SubprocessError):
        return "unknown"



def emit(result: dict, out: str | None, *, indent: int = 2) -> None:
    """Print `result` as JSON, and write it to the file `out` when one is named."""
    text = json.dumps(result, indent=indent, allow_nan=False)
    if out:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        Path(out).write_text(text + "\n")
    print(text)
