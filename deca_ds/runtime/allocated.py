"""Tensor memory allocated, and its peak, on any device: torch.cuda's counters on a GPU, and on CPU
a count of the tensor memory operators allocate (TensorBytes), which CPU runs keep when asked
(DECA_COUNT_CPU_MEMORY=1: the trainer's records then carry mem_allocated, mem_peak and each
section's peak as on a GPU, at the cost of a Python call per operator). Without it a CPU run
records its resident set, which is mostly the interpreter's and the libraries'."""

from __future__ import annotations

import os
import weakref
from contextlib import nullcontext

import psutil
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

COUNT_ON_CPU = "DECA_COUNT_CPU_MEMORY"


class TensorBytes(TorchDispatchMode):
    """While on (`with counter:`), the bytes of tensor memory on `device` that operators allocate,
    as long as it lives (`live`), and their high-water mark (`peak`): what torch.cuda's
    memory_allocated and max_memory_allocated count on a GPU, without its allocator's rounding.

    Exact where the resident set is not: memory allocated before the counter was on, or not by an
    operator (a safetensors file mapped into memory), is not counted, so its release inside a phase
    cannot lower the phase's number (the resident set nets it out: a freed interpreter arena once
    put a model's init 189 KB under its weights), and the C allocator's reuse of freed pages cannot
    hide an allocation. An operator's result counts when no input of it holds the same memory (a
    view or an in-place result is its input's), from then until its storage is freed. What an
    operator allocates and frees inside itself (a LAPACK workspace) is not seen, nor is anything
    torch.compile'd code allocates."""

    def __init__(self, device: torch.device | str = "cpu") -> None:
        super().__init__()
        self.device = torch.device(device)
        self.live = self.peak = 0
        self._counted: dict[int, weakref.ref] = {}  # data pointer -> the storage, until it is freed

    def reset_peak(self) -> None:
        self.peak = self.live

    def _freed(self, pointer: int, nbytes: int) -> None:
        del self._counted[pointer]
        self.live -= nbytes

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        inputs = {t.untyped_storage().data_ptr() for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
        for t in tree_leaves(out):
            if not isinstance(t, torch.Tensor) or t.device != self.device:
                continue
            storage = t.untyped_storage()
            pointer, nbytes = storage.data_ptr(), storage.nbytes()
            if nbytes and pointer not in inputs and pointer not in self._counted:
                # torch keeps a storage's Python object alive as long as the storage: the callback runs when it is freed
                self._counted[pointer] = weakref.ref(storage, lambda _, p=pointer, n=nbytes: self._freed(p, n))
                self.live += nbytes
                self.peak = max(self.peak, self.live)
        return out


def cpu_counter(device: torch.device) -> TensorBytes | None:
    """A counter for a CPU run that asked for one (DECA_COUNT_CPU_MEMORY=1), else None."""
    return TensorBytes(device) if device.type == "cpu" and os.environ.get(COUNT_ON_CPU) == "1" else None


def counting(counter: TensorBytes | None):
    """`with counting(counter):` the counter on, or nothing."""
    return counter if counter is not None else nullcontext()


class DeviceMemory:
    """The tensor memory of `device`: allocated now and the peak since the last reset_peak(),
    torch.cuda's on a GPU, `counter`'s on CPU; neither without a counter on CPU (`counted` False)."""

    def __init__(self, device: torch.device, counter: TensorBytes | None = None) -> None:
        self.device, self.counter = device, counter
        self.cuda = device.type == "cuda"
        self.counted = self.cuda or counter is not None

    def allocated(self) -> int:
        return torch.cuda.memory_allocated(self.device) if self.cuda else self.counter.live

    def peak(self) -> int:
        return torch.cuda.max_memory_allocated(self.device) if self.cuda else self.counter.peak

    def reset_peak(self) -> None:
        if self.cuda:
            torch.cuda.reset_peak_memory_stats(self.device)
        elif self.counter is not None:
            self.counter.reset_peak()

    def now(self) -> dict:
        """In use now and the peak so far, or the process's resident set where nothing counts."""
        if self.counted:
            return {"mem_allocated": self.allocated(), "mem_peak": self.peak()}
        return {"mem_rss": psutil.Process().memory_info().rss}
