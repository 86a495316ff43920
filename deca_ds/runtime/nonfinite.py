"""A NaN is an error, not a result: every rank learns every rank's non-finite loss, gradient, update
or weights with one all-reduce, and all stop (or, with --skip-nonfinite, skip the step) together,
with one message naming the clients."""

from __future__ import annotations

from contextlib import contextmanager

import torch
import torch.distributed as dist

from ..decentralized import DecentralizedOptimizer
from ..finite import finite
from .dist import ClientLayout, answered_within


def update_finite(optimizer: DecentralizedOptimizer) -> bool:
    """Whether the active block's (or the trainable vector's) new values are finite. Right after a
    block's last step no block is active: its weights are checked by the next step's loss and
    before export."""
    if getattr(optimizer, "active", True) is None:
        return True
    return finite(optimizer.consensus_vector())


class NonFiniteError(ValueError):
    """A client's loss or update is NaN or infinite; every rank stops at the same step."""


_NONFINITE = {1: "loss", 2: "gradient or update", 3: "weights"}


def nonfinite_ranks(problem: int, layout: ClientLayout, device: torch.device, timeout_s: float) -> dict[int, int]:
    """Every rank posts its `problem` (0: none, else a key of _NONFINITE) and learns everyone's with
    one all-reduce, so all ranks decide the same: {rank: problem} of the ranks that have one. A rank
    that never joins it (hung, lost) is a PeerError naming the check and the run's `timeout_s`."""
    flags = torch.zeros(layout.world_size, dtype=torch.float64, device=device)
    flags[layout.rank] = problem
    with answered_within(timeout_s, "the finite check (an all-reduce of every rank)"):
        dist.all_reduce(flags)
    return {r: int(f) for r, f in enumerate(flags.tolist()) if f}


def describe_nonfinite(bad: dict[int, int], layout: ClientLayout) -> str:
    return "; ".join(f"non-finite {_NONFINITE[f]} on client {r // layout.ranks_per_client} (rank {r})"
                     for r, f in bad.items())


def stop_if_nonfinite(problem: int, layout: ClientLayout, device: torch.device, when: str, timeout_s: float) -> None:
    """All ranks stop at the same step with the same message naming the clients."""
    bad = nonfinite_ranks(problem, layout, device, timeout_s)
    if bad:
        raise NonFiniteError(f"{describe_nonfinite(bad, layout)} {when}: every rank stops here and nothing is "
                             "exported (a smaller --lr, or check the data; --skip-nonfinite skips such steps)")


@contextmanager
def skipped_update(optimizer: DecentralizedOptimizer, skip: bool):
    """DeepSpeed's engine.step() on the accumulation boundary without the optimizer's step (no
    update, no mixing, DECA's schedule does not advance); the gradients are still cleared. The
    engine takes the step for an fp16 overflow (its `overflow` flag): it counts it in
    `skipped_steps` and leaves a preset's LR schedule where it was, so the schedule follows the
    steps taken, as DECA's blocks do."""
    if not skip:
        yield
        return
    own = vars(optimizer).get("step")  # a torch LR schedule wraps the step (it counts the calls)
    optimizer.step = lambda closure=None: None
    optimizer.overflow = True
    try:
        yield
    finally:
        del optimizer.overflow
        if own is None:
            del optimizer.step  # the class's step again
        else:
            optimizer.step = own
