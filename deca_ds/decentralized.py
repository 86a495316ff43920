"""What every method's optimizer offers the runtime and the simulator, and the Adam pieces they share.

A decentralized step is two halves around the exchange with the neighbors:

    payload = opt.local_step()       after backward: this client's local update x½ (one flat vector)
    opt.combine(mixer, payload)      mixer.mix (Σ_j w_ij x½_j) or mixer.exchange (every x½_j) → new x

`step()` runs both with the optimizer's own mixer (the DeepSpeed runtime); the simulator runs the
first half on every client, then the second with each client's view of the others' payloads.
"""

from __future__ import annotations

import functools
import time
from typing import Callable, Iterable, Sequence

import torch
from torch import nn

from .mixing import IdentityMixer, Mixer


def segments(params: Sequence[nn.Parameter], flat: torch.Tensor):
    """(param, view of `flat` shaped like param) for each tensor, in order."""
    offset = 0
    for p in params:
        yield p, flat[offset:offset + p.numel()].view_as(p)
        offset += p.numel()


def flat_segments(params: Sequence[nn.Parameter], flat: torch.Tensor) -> list[torch.Tensor]:
    """Each tensor's 1-D slice of `flat`, in order: the lists the compiled kernels go through."""
    return list(flat.split([p.numel() for p in params]))


def clip_scale(params: Iterable[nn.Parameter], max_norm: float | None, dtype: torch.dtype) -> float:
    """Factor that clips the gradients of `params` to global norm `max_norm` (1.0 when None)."""
    if max_norm is None:
        return 1.0
    norms = [p.grad.detach().to(dtype).norm() for p in params if p.grad is not None]
    total = torch.linalg.vector_norm(torch.stack(norms)).item() if norms else 0.0
    return min(1.0, max_norm / (total + 1e-6))


@functools.cache
def fused(fn: Callable) -> Callable:
    """`fn` compiled by torch.compile into fused kernels: one pass over its tensors where eager
    PyTorch makes one pass per op (profiling/update_cost.py counts them). Compiled on the first
    call, for any length.

    Python floats are compiled in as constants, each guarded, so a new value recompiles: torch
    2.13's symbolic floats can reuse a stale value where one reaches an op's `alpha=`/`value=`
    (pytorch/pytorch#194976, #197889), the form the in-place math here is written in. A scalar
    that changes every step (bias correction, a scheduled lr) therefore enters as a 0-d tensor;
    a run compiles each kernel once per dtype, and a process that trains under many
    hyperparameters (the tests) may hold more versions than dynamo's default limit of 8."""
    compiled = torch.compile(fn, dynamic=True, fullgraph=True)

    def call(*args):
        with torch._dynamo.config.patch(specialize_float=True, recompile_limit=64):
            return compiled(*args)
    return call


def moments_(m: torch.Tensor, v: torch.Tensor, u: torch.Tensor, c1: float, c2: float) -> None:
    """m = c1·m + (1−c1)·u, v = c2·v + (1−c2)·u⊙u in place: the gradient's fold into Adam's
    moments and DECA's BMA carry of h alike."""
    m.mul_(c1).add_(u, alpha=1 - c1)
    v.mul_(c2).addcmul_(u, u, value=1 - c2)


def moments(m: torch.Tensor, v: torch.Tensor, u: torch.Tensor, c1: float, c2: float):
    """moments_ out of place, for compiled kernels that keep the results in registers (the same
    ops, so the same arithmetic)."""
    return torch.add(m * c1, u, alpha=1 - c1), torch.addcmul(v * c2, u, u, value=1 - c2)


def _adam_step(x: torch.Tensor, m: torch.Tensor, v: torch.Tensor, neg_step: torch.Tensor, bc2: torch.Tensor,
               eps: float, keep: torch.Tensor | None, out: torch.Tensor) -> None:
    torch.div(v, bc2, out=out).sqrt_().add_(eps)  # √v̂ + ε, in the x½ buffer
    torch.div(m, out, out=out)
    if keep is None:  # no weight decay: one pass less for the eager ops
        torch.addcmul(x, out, neg_step, out=out)
    else:
        out.mul_(neg_step).addcmul_(x, keep)


def adam_step(x: torch.Tensor, m: torch.Tensor, v: torch.Tensor, neg_step: torch.Tensor, bc2: torch.Tensor,
              eps: float, keep: torch.Tensor | None) -> torch.Tensor:
    """x½ from m½, v½ out of place (the ops of _adam_step), for compiled kernels."""
    u = m / ((v / bc2).sqrt() + eps)
    return torch.addcmul(x, u, neg_step) if keep is None else torch.addcmul(u * neg_step, x, keep)


def _fold_and_step(xs: list[torch.Tensor], ms: list[torch.Tensor], vs: list[torch.Tensor], gs: list[torch.Tensor],
                   outs: list[torch.Tensor], a1: float, a2: float, neg_step: torch.Tensor, bc2: torch.Tensor,
                   eps: float, keep: torch.Tensor | None) -> None:
    for x, m, v, g, out in zip(xs, ms, vs, gs, outs):
        moments_(m, v, g, a1, a2)
        _adam_step(x, m, v, neg_step, bc2, eps, keep, out)


def step_inputs(params: Sequence[nn.Parameter], x: torch.Tensor, *, lr: float, betas: tuple[float, float], t: int,
                weight_decay: float, scale: float):
    """What Adam's step at t on `params` (master vector x) reads besides x, m, v: the flat
    gradients, scaled in place first when clipped (a lower-precision one is widened inside the
    ops that read it; a zero of x's dtype where a tensor got none), and the step's scalars as 0-d
    tensors (compiled kernels take them without recompiling): −γ/(1−α1^t), 1−α2^t and 1−γλ
    (None without weight decay)."""
    scalar = lambda value: torch.full((), value, dtype=x.dtype, device=x.device)  # noqa: E731
    neg_step, bc2 = scalar(-lr / (1 - betas[0] ** t)), scalar(1 - betas[1] ** t)
    keep = scalar(1 - lr * weight_decay) if weight_decay else None
    zero = scalar(0.0)
    grads = [zero if p.grad is None else (p.grad if scale == 1.0 else p.grad.mul_(scale)).reshape(-1) for p in params]
    return grads, neg_step, bc2, keep


@torch.no_grad()
def half_step(params: Sequence[nn.Parameter], x: torch.Tensor, m: torch.Tensor, v: torch.Tensor, *, lr: float,
              betas: tuple[float, float], eps: float, t: int, weight_decay: float = 0.0, scale: float = 1.0,
              use_fused: bool = False, out: torch.Tensor | None = None) -> torch.Tensor:
    """Adam's local step on `params`, whose master vector is x: fold each gradient into the moments
    in place (m½ = α1·m + (1−α1)·g, v½ = α2·v + (1−α2)·g⊙g), drop the gradients, and return

        x½ = (1 − γ·λ)·x − γ/(1−α1^t) · m½/(√(v½/(1−α2^t)) + ε)

    in `out` (default: a new buffer). Each gradient is widened inside the adds (scaled in place
    first, when clipped): no master-dtype copy of it is ever held; a tensor without a gradient
    folds a zero. Eager, the fold runs tensor by tensor and the step as a few large ops over the
    flat vectors. Fused, one compiled call does both tensor by tensor, reading and writing m and v
    once; it holds the gradients and x½ together, where the eager path frees the gradients first."""
    a1, a2 = betas
    grads, neg_step, bc2, keep = step_inputs(params, x, lr=lr, betas=betas, t=t, weight_decay=weight_decay,
                                             scale=scale)
    if use_fused:
        out = torch.empty_like(x) if out is None else out
        fused(_fold_and_step)(*(flat_segments(params, t) for t in (x, m, v)), grads, flat_segments(params, out),
                              a1, a2, neg_step, bc2, eps, keep)
    else:
        for m_p, v_p, g in zip(flat_segments(params, m), flat_segments(params, v), grads):
            moments_(m_p, v_p, g, a1, a2)
    del grads
    for p in params:
        p.grad = None
    if use_fused:
        return out
    out = torch.empty_like(x) if out is None else out  # allocated once the gradients are gone
    _adam_step(x, m, v, neg_step, bc2, eps, keep, out)
    return out


@torch.no_grad()
def write_params(params: Sequence[nn.Parameter], flat: torch.Tensor) -> None:
    """Copy the flat master vector into the (possibly lower-precision) working parameters."""
    for p, x in segments(params, flat):
        p.copy_(x)


# Options that choose how the update runs, not what it computes: a run may resume with either.
EXECUTION_ONLY = ("fused_update",)


def check_saved_config(saved: dict, current: dict, what: str) -> None:
    """Refuse optimizer state saved under other hyperparameters, naming each that differs."""
    saved, current = ({k: v for k, v in d.items() if k not in EXECUTION_ONLY} for d in (saved, current))
    if saved != current:
        diff = {k: (saved.get(k), current.get(k)) for k in saved.keys() | current.keys()
                if saved.get(k) != current.get(k)}
        raise ValueError(f"optimizer state was saved with a different {what} (saved, now): {diff}")


class DecentralizedOptimizer(torch.optim.Optimizer):
    """Base of every method's optimizer: the step split around mixing, and the schedule queries
    the runtime logs and checkpoints by."""

    mixer: Mixer = IdentityMixer()
    # The runtime swaps in a clock that synchronizes the GPU, so the phase times count kernels.
    clock: Callable[[], float] = staticmethod(time.perf_counter)
    last_times: dict[str, float] = {}
    # Whether combining is linear in the clients' vectors: then the consensus x̄ is their mean.
    linear = True

    @property
    def total_steps(self) -> int:
        raise NotImplementedError

    @property
    def global_step(self) -> int:
        raise NotImplementedError

    @property
    def done(self) -> bool:
        return self.global_step >= self.total_steps

    def where(self) -> dict:
        """Where the schedule stands, for logs: round, block (None: every trainable tensor), r."""
        raise NotImplementedError

    def consensus_vector(self) -> torch.Tensor:
        """The flat vector this client mixes with its neighbors (for the consensus distance)."""
        raise NotImplementedError

    def state_bytes(self) -> int:
        """Bytes of optimizer state held now."""
        raise NotImplementedError

    def local_step(self) -> torch.Tensor:
        raise NotImplementedError

    def combine(self, mixer: Mixer, payload: torch.Tensor) -> None:
        raise NotImplementedError

    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        t0 = self.clock()
        payload = self.local_step()
        t1 = self.clock()
        self.combine(self.mixer, payload)
        self.last_times = {"local_update": t1 - t0, "combine": self.clock() - t1}
        return loss
