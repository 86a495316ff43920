"""A process's memory peak phase by phase: the resident set's high-water mark on Linux (VmHWM,
reset through /proc/self/clear_refs); on a GPU, torch.cuda's allocated/reserved peaks and the
device memory in use (the CUDA context and other processes included); on CPU, with a TensorBytes
counter on (deca_ds.runtime.allocated), the bytes of tensors allocated, the counterpart of
torch.cuda's allocated counter.

    peaks = PhasePeaks(DeviceMemory(device))  # on CPU DeviceMemory(cpu, counter), inside `with` the counter
    peaks.mark("load")   # closes the phase before it (named at the previous mark), opens "load"
    ...
    peaks.mark("train")  # the rows so far: [{"phase": "start", ...}, {"phase": "load", ...}]
"""

from __future__ import annotations

import ctypes
import ctypes.util
from pathlib import Path

import torch

from deca_ds.runtime.allocated import DeviceMemory

_STATUS = Path("/proc/self/status")
_CLEAR_REFS = Path("/proc/self/clear_refs")


def _status_bytes(key: str) -> int:
    for line in _STATUS.read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024  # kB
    raise RuntimeError(f"{_STATUS} has no {key}")


def rss() -> int:
    """The process's resident set now (bytes)."""
    return _status_bytes("VmRSS")


def rss_peak() -> int:
    """The resident set's high-water mark since the process started or the last reset_rss_peak."""
    return _status_bytes("VmHWM")


def reset_rss_peak() -> None:
    """Set the high-water mark to the resident set now (Linux >= 4.0: write 5 to clear_refs)."""
    _CLEAR_REFS.write_text("5")


# glibc's mallopt parameters (malloc.h)
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD, M_MMAP_MAX = -1, -3, -4


def mallopt(settings: dict[int, int], otherwise: str) -> None:
    """Set glibc malloc's parameters {M_*: value} for this process; RuntimeError naming `otherwise`
    (what to do instead) where there is no glibc."""
    libc = ctypes.CDLL(ctypes.util.find_library("c"))
    if not all(libc.mallopt(param, value) for param, value in settings.items()):
        raise RuntimeError(f"mallopt failed: not glibc? {otherwise}")


def map_each_allocation(threshold: int = 64 * 1024) -> str:
    """glibc malloc: every allocation of `threshold` bytes or more gets pages of its own, returned to
    the system when it is freed, so the resident set rises by what a phase allocates, as
    torch.cuda's allocated counter does. Left as it is, malloc raises the threshold as it frees
    large chunks and serves later tensors from heap pages that are already resident (this
    process's earlier frees, or in a forked process its parent's), and a phase measures low by
    whatever it happened to reuse."""
    mallopt({M_MMAP_THRESHOLD: threshold}, "the resident-set peaks need glibc's malloc")
    return f"glibc malloc, a mapping for each allocation of {threshold} bytes or more (mallopt M_MMAP_THRESHOLD)"


class PhasePeaks:
    """Consecutive phases of one process, each with its own peak. The first phase, "start", runs
    from process start (VmHWM is not reset before it) to the first mark. Where `memory` counts
    tensor memory (a GPU, or a CPU counter), each row also has its allocated peak and its count at
    the phase's end (`cuda_…` or `cpu_…`)."""

    def __init__(self, memory: DeviceMemory) -> None:
        self.memory, self.device = memory, memory.device
        self.rows: list[dict] = []
        self.phase = "start"

    def _cuda(self) -> bool:
        return self.memory.cuda and torch.cuda.is_initialized()

    def mark(self, next_phase: str) -> dict:
        """End the current phase (its row: peak and memory now), reset the peaks, start `next_phase`."""
        row = {"phase": self.phase, "rss_peak": rss_peak(), "rss_end": rss()}
        if self._cuda():  # also what torch reserved, and the device's memory in use (the CUDA context included)
            torch.cuda.synchronize(self.device)
            free, total = torch.cuda.mem_get_info(self.device)
            row.update(cuda_reserved_peak=torch.cuda.max_memory_reserved(self.device),
                       cuda_device_used_end=total - free)
        if self._cuda() or self.memory.counter is not None:
            row.update({f"{self.device.type}_allocated_peak": self.memory.peak(),
                        f"{self.device.type}_allocated_end": self.memory.allocated()})
            self.memory.reset_peak()
        self.rows.append(row)
        reset_rss_peak()
        self.phase = next_phase
        return row

    def peak(self, key: str, phases=None) -> int | None:
        """The largest `key` over the rows of `phases` (all when None); None if no row has it."""
        values = [r[key] for r in self.rows if key in r and (phases is None or r["phase"] in phases)]
        return max(values) if values else None
