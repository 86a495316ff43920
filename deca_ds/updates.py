"""The four ways DecaOptimizer runs a step on the active block, one picked when it is made (`update_path`).

Each is Algorithm 1's two halves (deca_ds.optimizer): `half_step` (steps 1–4: m½, v½, x½, the
payload for the neighbors) and `correct` (steps 6–8, given x⁺: h, the moments carried by variant,
x = x⁺ and the working weights). They compute the same step (tests/test_fused.py,
tests/test_quantized.py) and differ in what they hold and how often they read it:

    EagerUpdate      PyTorch ops over the flat vectors
    FusedUpdate      fused_update: two torch.compile'd calls (deca_ds.kernels.fused), the fold of the
                     gradient with the Adam step, and ‖x − x⁺‖ with the carry and the working weights;
                     m and v are read and written twice per step, not four times
    InPlaceUpdate    fused_update and no neighbors (N = 1): x⁺ = x½, so no x½ is stored. half_step
                     keeps the step's inputs; correct runs one compiled call of two passes: ‖x − x½‖
                     (x½ in registers), then x½ formed again and written over x with the carried m, v
                     and the working weights. The gradients live until then.
    QuantizedUpdate  state_bits=8: the moments held in 8 bits (deca_ds.quantized), every phase one
                     tensor at a time: dequantize that tensor's m, v to fp32, update, quantize back
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from .config import DecaConfig
from .kernels import (
    carry_and_write,
    discrepancy_,
    flat_segments,
    fused,
    half_step,
    moments_,
    segments,
    step_alone,
    step_inputs,
    write_params,
)
from .quantized import QuantizedVector


@dataclass
class ActiveBlock:
    index: int
    params: list[nn.Parameter]
    master: torch.Tensor  # x
    m: torch.Tensor | QuantizedVector
    v: torch.Tensor | QuantizedVector

    def segments(self, flat: torch.Tensor):
        """(param, view of `flat` shaped like param) for each of the block's tensors."""
        return segments(self.params, flat)

    def nbytes(self) -> int:
        return sum(t.nbytes for t in (self.master, self.m, self.v))


def update_path(config: DecaConfig, alone: bool) -> EagerUpdate:
    """The update DecaOptimizer runs for `config`; `alone`: its mixer has no neighbors."""
    if config.state_bits == 8:
        return QuantizedUpdate(config)
    if not config.fused_update:
        return EagerUpdate(config)
    return InPlaceUpdate(config) if alone else FusedUpdate(config)


class EagerUpdate:
    """Steps 1–4 and 6–8 as PyTorch ops over the flat vectors; the others change what they must."""

    def __init__(self, config: DecaConfig) -> None:
        self.config = config
        # Step 7's moments and betas by variant: trivial_bma carries from the moments before this
        # step's gradient with Adam's betas, deca from m½, v½ with BMA's; no_bma does not carry.
        self.carries = config.variant != "no_bma"
        self.betas = config.adam_betas if config.variant == "trivial_bma" else config.bma_betas
        self._before: tuple | None = None  # trivial_bma: m, v before this step's gradient

    def half_step(self, blk: ActiveBlock, **hyper) -> torch.Tensor:
        """Steps 1–4: fold the gradient into m½, v½ (in place of m, v) and return x½."""
        if self.config.variant == "trivial_bma":
            self._before = blk.m.clone(), blk.v.clone()
        return self._half_step(blk, hyper)

    def _half_step(self, blk: ActiveBlock, hyper: dict) -> torch.Tensor:
        return half_step(blk.params, blk.master, blk.m, blk.v, **hyper)

    def correct(self, blk: ActiveBlock, x_plus: torch.Tensor) -> None:
        """Steps 6–8: h, the carried moments, x = x⁺ and the working weights."""
        if self._before is not None:
            (blk.m, blk.v), self._before = self._before, None
        # x = x⁺: the mixer's buffer (x½ summed over, or a new one) becomes the master, no copy;
        # the old master is free to hold h.
        x, blk.master = blk.master, x_plus
        self._carry_and_write(blk, x, x_plus)

    def _carry_and_write(self, blk: ActiveBlock, x: torch.Tensor, x_plus: torch.Tensor) -> None:
        if self.carries:
            moments_(blk.m, blk.v, discrepancy_(x, x_plus), *self.betas)
        write_params(blk.params, x_plus)


class FusedUpdate(EagerUpdate):
    """fused_update with neighbors: each half one compiled call (module docstring)."""

    def _half_step(self, blk: ActiveBlock, hyper: dict) -> torch.Tensor:
        return half_step(blk.params, blk.master, blk.m, blk.v, use_fused=True, **hyper)

    def _carry_and_write(self, blk: ActiveBlock, x: torch.Tensor, x_plus: torch.Tensor) -> None:
        if not self.carries:
            write_params(blk.params, x_plus)
            return
        fused(carry_and_write)(*(flat_segments(blk.params, t) for t in (x, x_plus, blk.m, blk.v)),
                               [p.detach().view(-1) for p in blk.params], *self.betas)


class InPlaceUpdate(EagerUpdate):
    """fused_update without neighbors: no x½ is ever stored (module docstring)."""

    def __init__(self, config: DecaConfig) -> None:
        super().__init__(config)
        self._pending: tuple | None = None  # what correct() reads: the gradients and the step's scalars

    def half_step(self, blk: ActiveBlock, *, eps: float, **step) -> torch.Tensor:
        """The step's inputs, kept for correct(), which runs the whole step; returns x as the
        payload, which the mixer hands back untouched."""
        grads, neg_step, bc2, keeps = step_inputs(blk.params, blk.master, **step)
        self._pending = grads, (*self.config.adam_betas, neg_step, bc2, eps, keeps)
        return blk.master

    def correct(self, blk: ActiveBlock, x_plus: torch.Tensor) -> None:
        """‖x − x½‖ with x½ in registers, then x⁺ = x½ formed again and written over x, with m, v
        carried and the working weights: one compiled call (kernels.step_alone)."""
        if x_plus is not blk.master:
            raise RuntimeError("this client's mixer has no neighbors, so its local step formed no x½ to send: "
                               "combine it through that mixer (the optimizer's own, or the one it was made with)")
        (grads, scalars), self._pending = self._pending, None
        fused(step_alone)(*(flat_segments(blk.params, t) for t in (blk.master, blk.m, blk.v)), grads,
                          [p.detach().view(-1) for p in blk.params], *scalars, self.config.variant, *self.betas)
        for p in blk.params:
            p.grad = None


class QuantizedUpdate(EagerUpdate):
    """state_bits=8: the eager steps tensor by tensor on dequantized moments (module docstring)."""

    def _half_step(self, blk: ActiveBlock, hyper: dict) -> torch.Tensor:
        """x½ from the fp32 m½, v½ before they are rounded to 8 bits, so quantization error enters
        only through the carried moments."""
        x_half = torch.empty_like(blk.master)
        for i, ((p, x), (_, out)) in enumerate(zip(blk.segments(blk.master), blk.segments(x_half))):
            m, v = blk.m.get(i), blk.v.get(i)
            half_step([p], x.view(-1), m, v, out=out.view(-1), use_fused=self.config.fused_update, **hyper)
            blk.m.put(i, m)
            blk.v.put(i, v)
        return x_half

    def _carry_and_write(self, blk: ActiveBlock, x: torch.Tensor, x_plus: torch.Tensor) -> None:
        if self.carries:
            for i, (_, h_i) in enumerate(blk.segments(discrepancy_(x, x_plus))):
                m, v = blk.m.get(i), blk.v.get(i)
                moments_(m, v, h_i.view(-1), *self.betas)
                blk.m.put(i, m)
                blk.v.put(i, v)
        write_params(blk.params, x_plus)
