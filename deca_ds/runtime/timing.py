"""How a run times the phases of its steps (`--phase-timing`).

"sync" (the default) synchronizes a GPU at every phase boundary, so a phase's seconds hold its
kernels, and the host waits for them: it launches the next phase only once the device has finished
this one, and the device is idle while the host works (DeepSpeed's step around the update, the
optimizer's own Python, the launches).

"events" records a CUDA event at each boundary instead and reads the events after the step, once
the step's own checks have waited for the device: the host runs ahead, the device goes from one
phase's kernels to the next, and a phase's seconds are the device's time between its events (what
the phase costs the device, idle time included where the host falls behind). A time is then a
`DeviceTime` until float() reads it. On CPU ranks there is no device to wait for: an event is the
host's clock when it is recorded, and both give the same times.
"""

from __future__ import annotations

import time

import torch

from .allocated import DeviceMemory

PHASE_TIMINGS = ("sync", "events")


class HostEvent:
    """The interface of torch.cuda.Event for a CPU rank: the host's clock when recorded."""

    def record(self) -> None:
        self.at = time.perf_counter()

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        pass

    def elapsed_time(self, end: HostEvent) -> float:
        return 1e3 * (end.at - self.at)  # milliseconds, as CUDA's


class Stamp:
    """A point of the device's timeline: an event recorded on the current stream; `end - start`
    is the DeviceTime between them."""

    __slots__ = ("event",)

    def __init__(self, cuda: bool) -> None:
        self.event = torch.cuda.Event(enable_timing=True) if cuda else HostEvent()
        self.event.record()

    def __sub__(self, start: Stamp) -> DeviceTime:
        return DeviceTime(0.0, ((1, start, self),))


class DeviceTime:
    """Seconds of the device's timeline: a known part and signed spans between stamps not read yet.
    Its sums and differences with numbers and other device times are device times; float() reads
    the spans, waiting for their events. A span the device has passed is read as soon as a sum is
    formed, so a running total (the mixer's exchange seconds) stays short."""

    __slots__ = ("known", "spans")

    def __init__(self, known: float, spans: tuple = ()) -> None:
        self.known, self.spans = known, spans

    def __add__(self, other) -> DeviceTime:
        known, spans = (other.known, other.spans) if isinstance(other, DeviceTime) else (float(other), ())
        return DeviceTime(self.known + known, self.spans + spans)._read_done()

    __radd__ = __add__

    def __neg__(self) -> DeviceTime:
        return DeviceTime(-self.known, tuple((-sign, start, end) for sign, start, end in self.spans))

    def __sub__(self, other) -> DeviceTime:
        return self + -other

    def __rsub__(self, other) -> DeviceTime:
        return -self + other

    def __float__(self) -> float:
        for _, start, end in self.spans:
            start.event.synchronize()
            end.event.synchronize()
        return self._read_done().known

    def _read_done(self) -> DeviceTime:
        done = [start.event.query() and end.event.query() for _, start, end in self.spans]
        if not any(done):
            return self
        read = sum(sign * start.event.elapsed_time(end.event)
                   for (sign, start, end), ended in zip(self.spans, done) if ended) / 1e3
        return DeviceTime(self.known + read, tuple(span for span, ended in zip(self.spans, done) if not ended))


class Timer:
    """The sections of a step: their times (by `timing`, above) and, where tensor memory is counted
    (a GPU, or a CPU run that asked: runtime.allocated), each section's allocation peak, so a run
    says which phase sets its peak. now() is the clock the optimizer and the mixer time their parts
    with."""

    def __init__(self, memory: DeviceMemory, timing: str = "sync") -> None:
        if timing not in PHASE_TIMINGS:
            raise ValueError(f"phase timing must be one of {PHASE_TIMINGS}, got {timing!r}")
        self.device_memory, self.cuda = memory, memory.cuda
        self.events = timing == "events"
        self.peak = 0  # the allocation peak since setup, over every section
        self._sections: dict[str, int] = {}

    def now(self) -> float | Stamp:
        if self.events:
            return Stamp(self.cuda)
        if self.cuda:
            torch.cuda.synchronize()
        return time.perf_counter()

    def mark(self, section: str = "other") -> float | Stamp:
        """now(), ending `section` ("other": the work between the named sections, such as the
        checks after the update) and keeping its allocation peak for this step's record; the
        peak counter restarts here. (The allocator counts at allocation, as the host runs: a
        section's peak is its own with events too.)"""
        t = self.now()
        if self.device_memory.counted:
            value = self.device_memory.peak()
            self.device_memory.reset_peak()
            self.peak = max(self.peak, value)
            self._sections[section] = max(self._sections.get(section, 0), value)
        return t

    def memory(self) -> dict:
        """The step's memory record: the allocation now, the peak since setup and each section's
        peak in this step (mem_peak_forward, …, mem_peak_other), so the step's peak is always one
        section's; where nothing counts tensor memory (CPU), the resident set."""
        if not self.device_memory.counted:
            return self.device_memory.now()
        self.mark()
        sections, self._sections = self._sections, {}
        return {"mem_allocated": self.device_memory.allocated(), "mem_peak": self.peak,
                **{f"mem_peak_{name}": value for name, value in sections.items()}}
