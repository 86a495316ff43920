"""The arithmetic of every method's update, apart from the optimizers that call it (as DeepSpeed's
`ops/adam/`): Adam's half step, which every method's local step is, and DECA's BMA carry.

Each comes as eager in-place PyTorch ops over the flat vectors or tensor by tensor, and as a
function `fused` compiles into kernels that read and write each tensor once. The optimizers
(deca_ds.optimizer, deca_ds.methods.adam) pick which to run; nothing here keeps state.
"""

from __future__ import annotations

import functools
from typing import Callable, Iterable, Sequence

import torch
from torch import nn


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
    """Factor that clips the gradients of `params` to global norm `max_norm` (1.0 when None):
    min(1, max_norm / (‖g‖ + 1e-6)), in `dtype`, by the operations of DeepSpeed's clip_grad_norm_
    (each tensor's norm, their squares summed, the root; a tensor divided by a tensor). In fp32 it
    is then, to the bit, the factor DeepSpeed's engine applies in a deca-train run with
    `gradient_clipping`: a run moves with the factor's last bit (tests/test_runtime.py)."""
    if max_norm is None:
        return 1.0
    norms = [p.grad.detach().to(dtype).norm(2) for p in params if p.grad is not None]
    if not norms:
        return 1.0
    total = torch.stack(norms).pow(2.0).sum().pow(0.5)
    return torch.clamp(torch.tensor(max_norm, dtype=dtype) / (total + 1e-6), max=1.0).item()


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
    settings = torch._dynamo.config.patch(specialize_float=True, recompile_limit=64)  # made once: re-entrant

    def call(*args):
        with settings:
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
    _adam_direction(m, v, bc2, eps, out)
    _add_step(x, neg_step, keep, out)


def _adam_direction(m: torch.Tensor, v: torch.Tensor, bc2: torch.Tensor, eps: float, out: torch.Tensor) -> None:
    torch.div(v, bc2, out=out).sqrt_().add_(eps)  # √v̂ + ε, in the x½ buffer
    torch.div(m, out, out=out)


def _add_step(x: torch.Tensor, neg_step: torch.Tensor, keep: torch.Tensor | None, out: torch.Tensor) -> None:
    """out = keep·x + neg_step·out (x + neg_step·out where keep is None)."""
    if keep is None:  # no weight decay: one pass less for the eager ops
        torch.addcmul(x, out, neg_step, out=out)
    else:
        out.mul_(neg_step).addcmul_(x, keep)


def _stretches(x: torch.Tensor, out: torch.Tensor, sizes: list[int], keeps: list[torch.Tensor | None]):
    """(piece of x, piece of out, keep) for each run of consecutive tensors (of `sizes`, flattened
    into x and out) with the same keep: x and out themselves where every tensor decays alike, so
    the common case makes no views."""
    runs: list[list] = []  # [elements, keep]
    for size, keep in zip(sizes, keeps):
        if runs and runs[-1][1] is keep:
            runs[-1][0] += size
        else:
            runs.append([size, keep])
    if len(runs) == 1:
        return [(x, out, runs[0][1])]
    lengths = [n for n, _ in runs]
    return list(zip(x.split(lengths), out.split(lengths), (keep for _, keep in runs)))


def adam_step(x: torch.Tensor, m: torch.Tensor, v: torch.Tensor, neg_step: torch.Tensor, bc2: torch.Tensor,
              eps: float, keep: torch.Tensor | None) -> torch.Tensor:
    """x½ from m½, v½ out of place (the ops of _adam_step), for compiled kernels."""
    u = m / ((v / bc2).sqrt() + eps)
    return torch.addcmul(x, u, neg_step) if keep is None else torch.addcmul(u * neg_step, x, keep)


def _fold(ms: list[torch.Tensor], vs: list[torch.Tensor], gs: list[torch.Tensor], a1: float, a2: float) -> None:
    """moments_ on every tensor as four foreach calls, not four ops per tensor issued from Python:
    where the host issuing the ops sets a step's time (profiling/op_counts.py), a LoRA client's 168
    tensors cost 4 calls, not 672. On the CPU, and on a GPU where the lists mix dtypes (a bf16
    gradient into fp32 moments), ATen runs the plain ops tensor by tensor: moments_' arithmetic to
    the bit (checked on CPU for every method). On a GPU with lists of one dtype (fp32 LoRA factors)
    it runs multi-tensor kernels, whose rounding against the plain ops is not checked."""
    torch._foreach_mul_(ms, a1)
    torch._foreach_add_(ms, gs, alpha=1 - a1)
    torch._foreach_mul_(vs, a2)
    torch._foreach_addcmul_(vs, gs, gs, value=1 - a2)


def _fold_and_step(xs: list[torch.Tensor], ms: list[torch.Tensor], vs: list[torch.Tensor], gs: list[torch.Tensor],
                   outs: list[torch.Tensor], a1: float, a2: float, neg_step: torch.Tensor, bc2: torch.Tensor,
                   eps: float, keeps: list[torch.Tensor | None]) -> None:
    for x, m, v, g, out, keep in zip(xs, ms, vs, gs, outs, keeps):
        moments_(m, v, g, a1, a2)
        _adam_step(x, m, v, neg_step, bc2, eps, keep, out)


def decays(p: nn.Parameter, weight_decay_on: str) -> bool:
    """Whether weight decay applies to `p`: every tensor ('all'), or tensors of two or more
    dimensions only ('matrices': linear weights, embeddings, LoRA factors; not the norms' weights
    nor biases, as nanoGPT and Hugging Face's Trainer decay)."""
    return weight_decay_on == "all" or p.ndim >= 2


def step_inputs(params: Sequence[nn.Parameter], x: torch.Tensor, *, lr: float, betas: tuple[float, float], t: int,
                weight_decay: float, weight_decay_on: str, scale: float):
    """What Adam's step at t on `params` (master vector x) reads besides x, m, v: the flat
    gradients, scaled in place first when clipped (a lower-precision one is widened inside the
    ops that read it; a zero of x's dtype where a tensor got none), and the step's scalars as 0-d
    tensors (compiled kernels take them without recompiling): −γ/(1−α1^t), 1−α2^t, and each
    tensor's 1−γλ (None where it does not decay: without weight decay, or not `decays`)."""
    scalar = lambda value: torch.full((), value, dtype=x.dtype, device=x.device)  # noqa: E731
    neg_step, bc2 = scalar(-lr / (1 - betas[0] ** t)), scalar(1 - betas[1] ** t)
    keep = scalar(1 - lr * weight_decay) if weight_decay else None
    keeps = [keep if decays(p, weight_decay_on) else None for p in params]
    zero = scalar(0.0)
    grads = [zero if p.grad is None else (p.grad if scale == 1.0 else p.grad.mul_(scale)).reshape(-1) for p in params]
    return grads, neg_step, bc2, keeps


@torch.no_grad()
def half_step(params: Sequence[nn.Parameter], x: torch.Tensor, m: torch.Tensor, v: torch.Tensor, *, lr: float,
              betas: tuple[float, float], eps: float, t: int, weight_decay: float = 0.0, weight_decay_on: str = "all",
              scale: float = 1.0, use_fused: bool = False, out: torch.Tensor | None = None) -> torch.Tensor:
    """Adam's local step on `params`, whose master vector is x: fold each gradient into the moments
    in place (m½ = α1·m + (1−α1)·g, v½ = α2·v + (1−α2)·g⊙g), drop the gradients, and return

        x½ = (1 − γ·λ)·x − γ/(1−α1^t) · m½/(√(v½/(1−α2^t)) + ε)

    in `out` (default: a new buffer), with λ = 0 on a tensor weight_decay_on leaves out (`decays`).
    Each gradient is widened inside the adds (scaled in place first, when clipped): no master-dtype
    copy of it is ever held; a tensor without a gradient folds a zero. Eager, the fold runs tensor
    by tensor (four foreach calls, _fold) and the step as a few large ops over the flat vectors (its
    last once per stretch of tensors that decay alike). Fused, one compiled call does both tensor by
    tensor, reading and writing m and v once; it holds the gradients and x½ together, where the
    eager path frees the gradients first."""
    a1, a2 = betas
    grads, neg_step, bc2, keeps = step_inputs(params, x, lr=lr, betas=betas, t=t, weight_decay=weight_decay,
                                              weight_decay_on=weight_decay_on, scale=scale)
    if use_fused:
        out = torch.empty_like(x) if out is None else out
        fused(_fold_and_step)(*(flat_segments(params, t) for t in (x, m, v)), grads, flat_segments(params, out),
                              a1, a2, neg_step, bc2, eps, keeps)
    else:  # a function of its own: a loop variable here would hold the last gradient beside x½
        _fold(flat_segments(params, m), flat_segments(params, v), grads, a1, a2)
    del grads
    for p in params:
        p.grad = None
    if use_fused:
        return out
    out = torch.empty_like(x) if out is None else out  # allocated once the gradients are gone
    _adam_direction(m, v, bc2, eps, out)  # over the flat vectors, then the step by stretches that decay alike
    for x_part, out_part, keep in _stretches(x, out, [p.numel() for p in params], keeps):
        _add_step(x_part, neg_step, keep, out_part)
    return out


@torch.no_grad()
def write_params(params: Sequence[nn.Parameter], flat: torch.Tensor) -> None:
    """Copy the flat master vector into the (possibly lower-precision) working parameters, as one
    foreach copy: on a GPU a few kernels, not one per tensor (where the host issuing them sets a
    step's time, profiling/op_counts.py, each costs about as much as a kernel)."""
    torch._foreach_copy_(list(params), [x.view_as(p) for p, x in zip(params, flat_segments(params, flat))])


# ---- DECA's steps 6–8 (BMA), for deca_ds.optimizer's update paths
def discrepancy_(x: torch.Tensor, x_plus: torch.Tensor) -> torch.Tensor:
    """h = (x − x⁺)/‖x − x⁺‖ over the whole block, written into x (h = 0 where x = x⁺)."""
    d = x.sub_(x_plus)
    return d.div_(torch.linalg.vector_norm(d).clamp_min(torch.finfo(d.dtype).tiny))


def carry_and_write(xs: list[torch.Tensor], x_pluses: list[torch.Tensor], ms: list[torch.Tensor],
                    vs: list[torch.Tensor], weights: list[torch.Tensor], c1: float, c2: float) -> None:
    """Steps 6–8 in one compiled call, tensor by tensor: h = (x − x⁺)/‖x − x⁺‖ over the block,
    m = c1·m + (1−c1)·h, v = c2·v + (1−c2)·h⊙h, and the working weights from x⁺. Written without
    in-place ops on x (the eager path's discrepancy_ writes h into x), which would make the
    compiled code store h back into x for nothing: one pass for the norm, one for the rest."""
    norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(x - xp) for x, xp in zip(xs, x_pluses)]))
    norm = norm.clamp_min(torch.finfo(norm.dtype).tiny)
    for x, xp, m, v, w in zip(xs, x_pluses, ms, vs, weights):
        moments_(m, v, (x - xp) / norm, c1, c2)
        w.copy_(xp)


def distance_alone(xs: list[torch.Tensor], ms: list[torch.Tensor], vs: list[torch.Tensor], gs: list[torch.Tensor],
                   a1: float, a2: float, neg_step: torch.Tensor, bc2: torch.Tensor, eps: float,
                   keeps: list[torch.Tensor | None]) -> torch.Tensor:
    """‖x − x½‖ over the block, x½ formed tensor by tensor in registers and never stored: for a
    client without neighbors this is step 6's ‖x − x⁺‖ before any x⁺ exists."""
    norms = [torch.linalg.vector_norm(x - adam_step(x, *moments(m, v, g, a1, a2), neg_step, bc2, eps, keep))
             for x, m, v, g, keep in zip(xs, ms, vs, gs, keeps)]
    return torch.linalg.vector_norm(torch.stack(norms))


def step_alone(xs: list[torch.Tensor], ms: list[torch.Tensor], vs: list[torch.Tensor], gs: list[torch.Tensor],
               weights: list[torch.Tensor], a1: float, a2: float, neg_step: torch.Tensor, bc2: torch.Tensor,
               eps: float, keeps: list[torch.Tensor | None], variant: str, c1: float, c2: float) -> None:
    """Steps 2–8 of a client without neighbors: ‖x − x½‖ (distance_alone; no_bma needs none), then
    update_alone. One compiled call for both passes, not one each: a call costs the host Dynamo's
    guards and the compiled code's wrappers (about 0.3 ms), and where the device waits for the host
    those are the step's time."""
    distance = None if variant == "no_bma" else distance_alone(xs, ms, vs, gs, a1, a2, neg_step, bc2, eps, keeps)
    update_alone(xs, ms, vs, gs, weights, a1, a2, neg_step, bc2, eps, keeps, distance, variant, c1, c2)


def update_alone(xs: list[torch.Tensor], ms: list[torch.Tensor], vs: list[torch.Tensor], gs: list[torch.Tensor],
                 weights: list[torch.Tensor], a1: float, a2: float, neg_step: torch.Tensor, bc2: torch.Tensor,
                 eps: float, keeps: list[torch.Tensor | None], distance: torch.Tensor | None, variant: str, c1: float,
                 c2: float) -> None:
    """Steps 2–8 of a client without neighbors in one compiled call, tensor by tensor and in
    place: m½, v½ and x½ = x⁺ again (the same ops as distance_alone), h = (x − x½)/distance,
    m, v carried by variant, then x and the working weights from x½. Reads g, x, m, v and writes
    x, m, v and the weights once."""
    if distance is not None:
        distance = distance.clamp_min(torch.finfo(distance.dtype).tiny)
    for x, m, v, g, w, keep in zip(xs, ms, vs, gs, weights, keeps):
        m_half, v_half = moments(m, v, g, a1, a2)
        x_half = adam_step(x, m_half, v_half, neg_step, bc2, eps, keep)
        if variant == "no_bma":
            m_new, v_new = m_half, v_half
        else:  # deca carries from m½, v½; trivial_bma from the moments before this step
            carried = (m_half, v_half) if variant == "deca" else (m, v)
            m_new, v_new = moments(*carried, (x - x_half) / distance, c1, c2)
        m.copy_(m_new)
        v.copy_(v_new)
        x.copy_(x_half)
        w.copy_(x_half)
