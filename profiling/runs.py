"""Running launch/train.py on this machine's ranks (as torchrun starts them) and reading its metrics,
for the profiling tools that measure real runs."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def train(args: list[str], ranks: int, out: Path, timeout: float, what: str) -> Path:
    """Run launch/train.py with `args` on `ranks` ranks into `out`; exit naming `what` if a rank fails."""
    cmd = [sys.executable, str(ROOT / "launch" / "train.py"), *args, "--output-dir", str(out), "--overwrite"]
    port = str(free_port())
    procs = []
    for rank in range(ranks):
        env = {**os.environ, "RANK": str(rank), "WORLD_SIZE": str(ranks), "LOCAL_RANK": str(rank),
               "LOCAL_WORLD_SIZE": str(ranks), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port}
        procs.append(subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=subprocess.DEVNULL,
                                      stderr=subprocess.PIPE, text=True))
    errors = [(p.wait(timeout=timeout), p.stderr.read()) for p in procs]
    for code, err in errors:
        if code:
            raise SystemExit(f"{what}: a rank exited {code}:\n{err[-2000:]}")
    return out


def metrics(out: Path) -> list[list[dict]]:
    """Every client's per-step records."""
    return [[json.loads(line) for line in f.read_text().splitlines() if line]
            for f in sorted((out / "metrics").glob("client_*.jsonl"))]
