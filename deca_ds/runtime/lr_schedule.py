"""A preset's DeepSpeed `scheduler`, as DeepSpeed's engine builds it (one of deepspeed's
lr_schedules by name, else a torch.optim.lr_scheduler class, with the preset's `params`): checked
before a run starts, built for the simulate backend's clients as the engine builds it for a rank,
and put where an interrupted run left it by stepping it again.

Stepping it again, rather than loading a state, serves every schedule alike: torch's chained
schedules compute each lr from the one before, so only the same steps from the same start give the
same lr, to the bit, and a checkpoint needs to hold no more than its step.
"""

from __future__ import annotations

import warnings
from contextlib import contextmanager

import torch

# torch schedules that need what a JSON preset cannot give (functions, other schedules) or a
# step(metrics) that DeepSpeed's engine does not call
_NOT_FROM_JSON = {"LambdaLR", "MultiplicativeLR", "SequentialLR", "ChainedScheduler", "ReduceLROnPlateau"}


def schedule_class(name) -> type:
    """The class DeepSpeed's engine builds for a scheduler `type` (DeepSpeed's own names and torch's
    differ, so the order of the lookups changes nothing; torch's first, so a simulated cell with a
    torch schedule need not import DeepSpeed); ValueError naming those it takes."""
    torch_schedules = sorted(n for n, c in vars(torch.optim.lr_scheduler).items() if isinstance(c, type)
                             and issubclass(c, torch.optim.lr_scheduler.LRScheduler) and not n.startswith("_")
                             and n != "LRScheduler" and n not in _NOT_FROM_JSON)
    if name in torch_schedules:
        return getattr(torch.optim.lr_scheduler, name)
    from deepspeed.runtime import lr_schedules

    if name in lr_schedules.VALID_LR_SCHEDULES:
        return getattr(lr_schedules, name)
    raise ValueError(f"scheduler type {name!r} is not one deca-ds can run: DeepSpeed's "
                     f"{', '.join(lr_schedules.VALID_LR_SCHEDULES)}, or torch's {', '.join(torch_schedules)}")


def build(optimizer: torch.optim.Optimizer, spec: dict):
    """The schedule `spec` (a preset's "scheduler": {"type": …, "params": {…}}) of `optimizer`."""
    return schedule_class(spec.get("type"))(optimizer, **spec.get("params", {}))


def check(spec, source: str) -> None:
    """ValueError naming what is wrong with a preset's "scheduler" (not a mapping, an unknown type,
    params its class does not take or values it refuses), before anything is loaded: built on a
    stand-in optimizer and stepped once."""
    if not isinstance(spec, dict) or not isinstance(spec.get("params", {}), dict):
        raise ValueError(f"{source}: \"scheduler\" must be an object {{\"type\": NAME, \"params\": {{...}}}}, "
                         f"got {spec!r}")
    try:
        schedule = build(torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1e-3), spec)
        with _no_optimizer_step():
            schedule.step()
    except (TypeError, ValueError, KeyError, AssertionError) as err:
        raise ValueError(f"{source}: scheduler {spec}: {err}") from None


def go_to(schedule, steps: int) -> None:
    """`schedule`, new, where it stands after `steps` steps taken: stepped that many times, while
    the optimizer's groups still hold their first lr (before its state is loaded)."""
    with _no_optimizer_step():
        for _ in range(steps):
            schedule.step()


def step(schedules) -> None:
    """One step of each schedule of `schedules` whose optimizer's step() is not what updated it (the
    simulator's local_step and combine)."""
    with _no_optimizer_step():
        for schedule in schedules:
            schedule.step()


@contextmanager
def _no_optimizer_step():
    """Without torch's warning that a schedule steps before its optimizer has: here it does so on
    purpose, and the lr it computes is the same."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r"Detected call of `lr_scheduler.step\(\)` before")
        yield
