"""--trace-steps: a torch.profiler trace of a few steps on every rank, to see where a step's time
goes (each kernel, and the host's work between them) beside the phase times the metrics record.

The trainer's three phases are ranges of the trace (`deca.forward`, `deca.backward`, `deca.step`:
DeepSpeed's step, the optimizer's update and mixing inside it). Each rank writes, under
<output-dir>/trace/:
- rank<R>.trace.json.gz: the Chrome trace (chrome://tracing, https://ui.perfetto.dev);
- rank<R>.json: per traced step, the wall time, each phase's host time (its range on the CPU,
  launches and waits included), the device time of the kernels it launched, and the operators
  inside it that took the most, and those between the phases (the trainer's checks and records);
- rank<R>.ops.txt: torch's operator table, sorted by device time on a GPU, by host time on CPU.
"""

from __future__ import annotations

import bisect
import contextlib
from pathlib import Path

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile, record_function

from ..files import write_json

PHASES = ("forward", "backward", "step")
RANGES = {f"deca.{phase}": phase for phase in PHASES}
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
        sort = "self_device_time_total" if self.cuda else "self_cpu_time_total"
        stem.with_suffix(".ops.txt").write_text(profiler.key_averages().table(sort_by=sort, row_limit=60) + "\n")
        write_json(stem.with_suffix(".json"), summary(profiler.events(), self.first, self.end, self.cuda))


def summary(events, first: int, end: int, cuda: bool) -> dict:
    """Milliseconds per traced step: the step's wall time (the traced window over its steps), each
    phase's host time (its range), the device time of the kernels launched within it, and the
    TOP_OPS operators within it by self time on the device (a GPU) or on the host (CPU); on a GPU
    also by self time on the host (`host_ops`: launches, waits for the device). `outside`: the
    operators between the phases by host time (the trainer's checks and records). An operator is
    within a phase when it runs inside the phase's range on any thread: on a GPU autograd runs the
    backward on a thread of its own."""
    steps, ms = end - first, 1e-3 / (end - first)  # the profiler counts microseconds
    host = [e for e in events if e.device_type == DeviceType.CPU]  # a GPU's timeline repeats the ranges
    ranges = [e for e in host if e.name in RANGES]
    ops = sorted((e for e in host if e.name not in RANGES), key=lambda e: e.time_range.start)
    starts = [e.time_range.start for e in ops]
    phases, inside = {}, set()
    for r in ranges:
        phase = phases.setdefault(RANGES[r.name], {"calls_per_step": 0.0, "host_ms": 0.0, "device_ms": 0.0, "ops": {}})
        phase["calls_per_step"] += 1 / steps
        phase["host_ms"] += r.cpu_time_total * ms
        for i in range(bisect.bisect_left(starts, r.time_range.start), bisect.bisect_right(starts, r.time_range.end)):
            e = ops[i]
            if e.time_range.end <= r.time_range.end:
                inside.add(i)
                _count(phase["ops"], e, steps)
                phase["device_ms"] += e.self_device_time_total * ms  # the kernels it launched
    for phase in phases.values():
        counted = phase.pop("ops").values()
        phase["ops"] = _top(counted, "self_device_ms" if cuda else "self_host_ms")
        if cuda:
            phase["host_ops"] = _top(counted, "self_host_ms")
    outside = {}
    for i, e in enumerate(ops):
        if i not in inside:
            _count(outside, e, steps)
    window = max(e.time_range.end for e in host) - min(e.time_range.start for e in host) if host else 0
    return {"steps": [first, end], "device": "cuda" if cuda else "cpu", "wall_ms": window * ms, "phases": phases,
            "outside": _top(outside.values(), "self_host_ms")}


def _count(table: dict, e, steps: int) -> None:
    """Add one event to `table`'s row of its operator: calls and self milliseconds per step."""
    op = table.setdefault(e.name, {"name": e.name, "calls_per_step": 0.0, "self_host_ms": 0.0, "self_device_ms": 0.0})
    op["calls_per_step"] += 1 / steps
    op["self_host_ms"] += e.self_cpu_time_total * 1e-3 / steps  # the profiler counts microseconds
    op["self_device_ms"] += e.self_device_time_total * 1e-3 / steps


def _top(rows, key: str) -> list[dict]:
    return sorted(rows, key=lambda op: op[key], reverse=True)[:TOP_OPS]
