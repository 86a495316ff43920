"""--trace-steps: a torch.profiler trace of a few steps on every rank, to see where a step's time
goes (each kernel, and the host's work between them) beside the phase times the metrics record.

The trainer's three phases are ranges of the trace (`deca.forward`, `deca.backward`, `deca.step`:
DeepSpeed's step, the optimizer's update and mixing inside it). Each rank writes, under
<output-dir>/trace/:
- rank<R>.trace.json.gz: the Chrome trace (chrome://tracing, https://ui.perfetto.dev);
- rank<R>.json: per traced step, each phase's host time (its range on the CPU, launches and waits
  included) and the device time of the kernels it launched, and the operators that took the most;
- rank<R>.ops.txt: torch's operator table, sorted by device time on a GPU, by host time on CPU.
"""

from __future__ import annotations

import contextlib
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile, record_function

from .checkpoint import write_json

PHASES = ("forward", "backward", "step")
TOP_OPS = 30


def check_window(start: int, steps: int, total: int) -> None:
    """Refuse a trace that would begin or end past the run's last step, before any step runs."""
    if steps and start + steps > total:
        raise ValueError(f"--trace-start {start} --trace-steps {steps} goes past the run's {total} steps: the trace "
                         f"would end at step {start + steps}")


class StepTrace:
    """Traces the global steps [start, start + steps) of one rank; off (every call a no-op) when
    steps is 0. Call at_step(step) as each step begins and close() after the last."""

    def __init__(self, out: Path, rank: int, start: int, steps: int, cuda: bool) -> None:
        self.dir, self.rank = out / "trace", rank
        self.first, self.end = start, start + steps
        self.cuda = cuda
        self.profiler: profile | None = None

    def at_step(self, step: int) -> None:
        if self.first < self.end and step == self.first:
            activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.cuda else [])
            self.profiler = profile(activities=activities)
            self.profiler.start()
        elif step == self.end:
            self.close()

    def phase(self, name: str):
        """The range of one of the trainer's PHASES, while tracing."""
        return record_function(f"deca.{name}") if self.profiler is not None else contextlib.nullcontext()

    def close(self) -> None:
        """Stop tracing (if it runs) and write this rank's files."""
        if self.profiler is None:
            return
        if self.cuda:
            torch.cuda.synchronize()
        profiler, self.profiler = self.profiler, None
        profiler.stop()
        self.dir.mkdir(parents=True, exist_ok=True)
        stem = self.dir / f"rank{self.rank}"
        profiler.export_chrome_trace(f"{stem}.trace.json.gz")  # torch gzips a path ending in .gz
        events = profiler.key_averages()
        sort = "self_device_time_total" if self.cuda else "self_cpu_time_total"
        stem.with_suffix(".ops.txt").write_text(events.table(sort_by=sort, row_limit=60) + "\n")
        write_json(stem.with_suffix(".json"), summary(events, self.first, self.end, self.cuda))


def summary(events, first: int, end: int, cuda: bool) -> dict:
    """Milliseconds per traced step: each phase's host and device time, and the TOP_OPS operators
    by self time on the device (a GPU) or on the host (CPU)."""
    steps, ms = end - first, 1e-3 / (end - first)  # the profiler counts microseconds
    phases = {}
    for e in events:
        name = e.key.removeprefix("deca.")
        if e.key.startswith("deca.") and name in PHASES:
            phases[name] = {"calls_per_step": e.count / steps, "host_ms": e.cpu_time_total * ms,
                            "device_ms": e.device_time_total * ms}
    ops = [e for e in events if not e.key.startswith("deca.")]
    ops.sort(key=lambda e: e.self_device_time_total if cuda else e.self_cpu_time_total, reverse=True)
    return {"steps": [first, end], "device": "cuda" if cuda else "cpu", "phases": phases,
            "ops": [{"name": e.key, "calls_per_step": e.count / steps, "self_host_ms": e.self_cpu_time_total * ms,
                     "self_device_ms": e.self_device_time_total * ms} for e in ops[:TOP_OPS]]}
