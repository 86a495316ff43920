"""Running launch/train.py on this machine's ranks (as torchrun starts them) and reading its metrics,
for the profiling tools that measure real runs."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from deca_ds.runtime.rank import free_port, torchrun_env

ROOT = Path(__file__).resolve().parents[1]


def add_run_args(p, *, work_dir: str, ds_config: str = "cpu_demo.json", ranks: int = 4, warmup: int = 2) -> None:
    """The options of a tool that measures launch/train.py runs: the DeepSpeed config, the ranks, the
    steps left out, where the runs go, their time limit, and what else train.py is given."""
    import argparse

    p.add_argument("--ds-config", default=str(ROOT / "ds_configs" / ds_config))
    p.add_argument("--ranks", type=int, default=ranks, help="ranks on this machine (one client each)")
    p.add_argument("--warmup", type=int, default=warmup, help="first steps of each client left out of the timings")
    p.add_argument("--work-dir", default=work_dir, help="where the runs' outputs go")
    p.add_argument("--timeout", type=float, default=3600, help="seconds a run may take")
    p.add_argument("--train-args", nargs=argparse.REMAINDER, default=[],
                   help="everything after this goes to launch/train.py unchanged (every run)")


def start_rank(argv: list[str], env: dict[str, str], log: Path) -> subprocess.Popen:
    """One rank: `launch/train.py argv` with exactly `env`, its output (stdout and stderr) in a file."""
    with open(log, "w") as out:
        return subprocess.Popen([sys.executable, str(ROOT / "launch" / "train.py"), *argv], env=env, cwd=ROOT,
                                stdout=out, stderr=subprocess.STDOUT)


def tail(log: Path, lines: int = 25) -> str:
    """The last lines a rank wrote, a progress bar's redraws (carriage returns) as lines of their own."""
    text = log.read_text(errors="replace") if log.exists() else ""
    return "\n".join([line for line in re.split(r"[\r\n]+", text) if line.strip()][-lines:])


class Stopped(Exception):
    """The tool was sent SIGTERM (a time limit such as gpu_checks.sh's), while its ranks ran."""


def _stopped(signum, frame):
    raise Stopped


STOP_GRACE_S = 10.0  # how long a stopped rank has to say where it was (deca_ds.runtime.cleanup) before SIGKILL


def stop(procs: list) -> None:
    """SIGTERM to the ranks still running, which print where they were and exit; SIGKILL to those
    still there STOP_GRACE_S later."""
    running = [p for p in procs if p.poll() is None]
    for p in running:
        p.terminate()
    deadline = time.monotonic() + STOP_GRACE_S
    for p in running:
        try:
            p.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait(timeout=60)  # reaped at once once SIGKILLed; bounded as every wait is


def train(args: list[str], ranks: int, out: Path, timeout: float, what: str) -> Path:
    """Run launch/train.py with `args` on `ranks` ranks into `out`; exit naming `what` if a rank fails,
    the ranks are still running after `timeout` seconds, or the tool is stopped (SIGTERM), with each
    rank's last output (a stopped rank's says where it was). The ranks never outlive the call: left
    running, they would hold the GPU through whatever the machine runs next. The run forms and
    evaluates x̄ but writes no model (--no-export): the tools read its metrics and run_config, and an
    8B model is 16 GB (written by each run, they filled a lent machine's 64 GiB disk in one call)."""
    argv = [*args, "--output-dir", str(out), "--overwrite", "--no-export"]
    port = str(free_port())
    previous = signal.signal(signal.SIGTERM, _stopped)
    # output to files: a pipe would fill with a long run's progress bar and block the rank
    with tempfile.TemporaryDirectory() as logs:
        log = [Path(logs) / f"{rank}.log" for rank in range(ranks)]
        procs = []
        try:
            for rank in range(ranks):
                procs.append(start_rank(argv, {**os.environ, **torchrun_env(rank, ranks, port)}, log[rank]))
            deadline = time.monotonic() + timeout
            codes = [p.wait(timeout=max(0.0, deadline - time.monotonic())) for p in procs]
        except (subprocess.TimeoutExpired, Stopped) as e:
            why = f"still running after {timeout:g} s" if isinstance(e, subprocess.TimeoutExpired) else "stopped"
            raise SystemExit(f"{what}: the ranks were {why}; their last output:\n"
                             + "\n".join(f"rank {rank}:\n{tail(log[rank])}" for rank in range(len(procs)))) from None
        finally:
            stop(procs)
            signal.signal(signal.SIGTERM, previous)
        failed = [f"rank {rank} exited {code}:\n{tail(log[rank])}" for rank, code in enumerate(codes) if code]
        if failed:  # every failed rank's own error: the first to fail is often not rank 0
            raise SystemExit(f"{what}: " + "\n".join(failed))
    return out


def metrics(out: Path) -> list[list[dict]]:
    """Every client's per-step records."""
    return [[json.loads(line) for line in f.read_text().splitlines() if line]
            for f in sorted((out / "metrics").glob("client_*.jsonl"))]


def estimate(run_config: dict):
    """The memory estimate (deca_ds.memory; deca_ds.baseline_memory for a baseline) of the run
    run_config.json describes; None for the built-in tiny model or a hub id whose config is not here."""
    from deca_ds.runtime.footprint import estimate_run

    opts = run_config["options"]
    if not opts["from_config"] and not Path(opts["model"]).is_dir():
        return None
    degree = max(len(neighbors) for neighbors in run_config["topology"]["neighbors"])
    return estimate_run(opts, opts["model"], run_config["ds_config"], n_neighbors=degree,
                        loss_positions=run_config["loss_positions_max"])


def device_peak(out: Path) -> dict:
    """A GPU run's training peak (torch.cuda, the largest over every client and step; the set-up's
    is recorded apart) beside its estimate, in GiB; None for each from CPU ranks, whose resident
    set is not device memory."""
    from deca_ds.memory import GiB

    rows = [r for client in metrics(out) for r in client]
    if "mem_peak" not in rows[0]:
        return {"peak_gib": None, "estimate_gib": None}
    est = estimate(json.loads((out / "run_config.json").read_text()))
    return {"peak_gib": max(r["mem_peak"] for r in rows) / GiB, "estimate_gib": est and est.peak / GiB}
