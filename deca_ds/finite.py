"""A NaN is an error, not a result: how a tensor is checked for NaN and infinity, and how many
non-finite steps in a row a run that skips them (--skip-nonfinite, simulate(skip_nonfinite=))
takes before it stops. The distributed checks build on these (runtime/nonfinite.py)."""

from __future__ import annotations

import math

import torch

# Consecutive skipped steps after which skipping gives up (the run has diverged).
MAX_CONSECUTIVE_SKIPS = 10


def largest_magnitude(t: torch.Tensor) -> torch.Tensor:
    """max |t| as a float64 scalar on t's device (NaN if any value is; 0 for an empty tensor), through
    one reduction: `isfinite(t).all()` makes tensor-sized temporaries (on a GPU, the |t| and the masks
    of one Llama-3.1-8B layer's fp32 master were 1.3 GB above the step's peak)."""
    if not t.numel():
        return torch.zeros((), dtype=torch.float64, device=t.device)
    return torch.linalg.vector_norm(t, float("inf")).double()


def finite(t: torch.Tensor) -> bool:
    """Whether every value of `t` is finite (waits for the device)."""
    return math.isfinite(largest_magnitude(t).item())


def nonfinite_problem(losses: list[float], model: torch.nn.Module) -> int:
    """1 if a loss is not finite, 2 if a gradient is not (before the update), else 0: what a step
    that skips non-finite steps checks, a rank's client or each simulated one."""
    if not all(math.isfinite(x) for x in losses):
        return 1
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    return 2 if not all(finite(g) for g in grads) else 0
