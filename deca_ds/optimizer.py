"""DecaOptimizer: block-wise Adam with block-wise moment approximation (Algorithm 1).

One step on the active block, with x its master vector (all the block's tensors flattened):

    adam_half_step()   m½ = α1·m + (1−α1)·g            v½ = α2·v + (1−α2)·g⊙g
                       x½ = x − γ · m̂ / (√v̂ + ε)       m̂ = m½/(1−α1^(r+1)), v̂ = v½/(1−α2^(r+1))
    mixer.mix(x½)      x⁺ = Σ_j w_ij · x½_j
    bma_correct(x⁺)    h = (x − x⁺) / ‖x − x⁺‖
                       deca:        m = β1·m½ + (1−β1)·h      v = β2·v½ + (1−β2)·h⊙h
                       trivial_bma: m = α1·m + (1−α1)·h       v = α2·v + (1−α2)·h⊙h
                       no_bma:      m = m½                    v = v½
                       x = x⁺, and the working weights are refreshed from x.

With `fused_update` the update is two torch.compile'd calls (decentralized.fused): the fold of
the gradient with the Adam step (half_step), and ‖x − x⁺‖ with the carried moments and the working
weights (carry_and_write); m and v are then read and written twice per step, not four times.
A client without neighbors (its mixer `alone`: N = 1) has x⁺ = x½, so no x½ need be stored: the
fused local step only measures ‖x − x½‖ (distance_alone, reading g, x, m, v), and bma_correct
forms x½ again and writes it over x with the carried m, v and the working weights (update_alone);
the gradients live until then.

Only the active block has a master copy and moments, in `master_dtype`; they are created when the
block is activated and dropped when it is left. With `state_bits=8` the moments are held in 8 bits
(deca_ds.quantized) and every phase works on them one tensor at a time: dequantize that tensor's
m, v to fp32, update, quantize back. Every parameter outside the active block has
requires_grad=False, so backward never produces a gradient for it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn

from .blocks import Partition, block_order, partition_model
from .config import DecaConfig
from .decentralized import (
    DecentralizedOptimizer,
    adam_step,
    check_saved_config,
    clip_scale,
    flat_segments,
    fused,
    half_step,
    moments,
    moments_,
    segments,
    step_inputs,
    write_params,
)
from .mixing import IdentityMixer, Mixer
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


def block_schedule(config: DecaConfig, num_blocks: int, round_index: int) -> list[int]:
    """The blocks of round `round_index` in the order DecaOptimizer activates them."""
    return block_order(num_blocks, config.block_order, round_index, config.seed)


def model_partition(model: nn.Module, config: DecaConfig) -> Partition:
    return partition_model(
        model, config.layers_per_block,
        train_embeddings=config.train_embeddings, train_final_norm=config.train_final_norm,
        train_lm_head=config.train_lm_head, custom=config.custom_blocks,
    )


class DecaOptimizer(DecentralizedOptimizer):
    """A torch optimizer over all blocks of `model`; one param group per block.

    It owns the block schedule (T rounds × B blocks × R steps): after R steps on a block it
    activates the next one in the configured order. `step()` runs the three phases with
    `mixer` (default: a single client); the simulator calls the phases itself. local_step() is
    adam_half_step(), combine() is mixing then bma_correct().
    """

    def __init__(self, model: nn.Module, config: DecaConfig, *,
                 partition: Partition | None = None, mixer: Mixer | None = None) -> None:
        self.config = config
        self.partition = partition or model_partition(model, config)
        self.mixer = mixer or IdentityMixer()
        groups = [{"params": self.partition.params(model, k), "block": k}
                  for k in range(self.partition.num_blocks)]
        super().__init__(groups, {"lr": config.lr, "weight_decay": config.weight_decay})
        for p in model.parameters():
            p.requires_grad_(False)
        self.round = 0
        self.position = 0  # index into this round's block order
        self.step_in_block = 0  # r
        self.active: ActiveBlock | None = None
        self._alone_step: tuple | None = None  # what the in-place update reads (_local_step_alone)
        # Called with a block's index before the block's parameters are read (offload makes
        # them resident there).
        self.before_activate: Callable[[int], None] | None = None
        self._activate(self.block_schedule(0)[0])

    # ---- schedule -------------------------------------------------------------------------
    @property
    def num_blocks(self) -> int:
        return self.partition.num_blocks

    @property
    def total_steps(self) -> int:
        c = self.config
        return c.rounds * self.num_blocks * c.steps_per_block

    @property
    def global_step(self) -> int:
        c = self.config
        return (self.round * self.num_blocks + self.position) * c.steps_per_block + self.step_in_block

    @property
    def done(self) -> bool:
        return self.round >= self.config.rounds

    def where(self) -> dict:
        return {"round": self.round, "block": self.active.index, "r": self.step_in_block}

    def consensus_vector(self) -> torch.Tensor:
        return self.active.master

    def block_schedule(self, round_index: int) -> list[int]:
        return block_schedule(self.config, self.num_blocks, round_index)

    # ---- block activation ----------------------------------------------------------------
    def _activate(self, index: int, restored: dict | None = None) -> None:
        if self.before_activate is not None:
            self.before_activate(index)
        params = self.param_groups[index]["params"]
        dtype, device = self.config.master_dtype, params[0].device
        sizes = [p.numel() for p in params]
        if restored is None:
            master = torch.empty(sum(sizes), dtype=dtype, device=device)
        else:
            master = restored["master"].to(device=device, dtype=dtype).clone()
        if self.config.state_bits == 8:
            m, v = (QuantizedVector.zeros(sizes, signed, device) if restored is None
                    else QuantizedVector.from_state_dict(restored[k], device)
                    for k, signed in (("m", True), ("v", False)))  # v >= 0: the unsigned map
        elif restored is None:
            m, v = torch.zeros_like(master), torch.zeros_like(master)
        else:
            m, v = (restored[k].to(device=device, dtype=dtype).clone() for k in ("m", "v"))
        self.active = ActiveBlock(index, params, master, m, v)
        for p, x in self.active.segments(master):
            if restored is None:
                x.copy_(p.detach())  # widened tensor by tensor: no second block-sized copy
            p.requires_grad_(True)

    def _deactivate(self) -> None:
        for p in self.active.params:
            p.requires_grad_(False)
            p.grad = None
        self.active = None

    def _advance(self) -> None:
        self.step_in_block += 1
        if self.step_in_block < self.config.steps_per_block:
            return
        self._deactivate()
        self.step_in_block = 0
        self.position += 1
        if self.position == self.num_blocks:
            self.position, self.round = 0, self.round + 1
        if not self.done:
            self._activate(self.block_schedule(self.round)[self.position])

    def state_bytes(self) -> int:
        """Bytes of optimizer state held now (master, m, v of the active block)."""
        return self.active.nbytes() if self.active else 0

    # ---- Algorithm 1 ----------------------------------------------------------------------
    @torch.no_grad()
    def adam_half_step(self) -> torch.Tensor:
        """Steps 1–4: fold the gradient into m½, v½ (in place of m, v) and return x½ (a client
        without neighbors, fused: see _local_step_alone)."""
        if self.done:
            raise RuntimeError(f"all {self.config.rounds} rounds are done; no block is active")
        blk, cfg = self.active, self.config
        group = self.param_groups[blk.index]
        scale = clip_scale(blk.params, cfg.grad_clip, cfg.master_dtype)
        # the bias corrections restart with every block (r + 1 steps)
        hyper = dict(lr=group["lr"], betas=cfg.adam_betas, eps=cfg.eps, t=self.step_in_block + 1,
                     weight_decay=group["weight_decay"], scale=scale)
        if self._alone:
            return self._local_step_alone(**hyper)
        if cfg.variant == "trivial_bma":
            self._m_prev, self._v_prev = blk.m.clone(), blk.v.clone()
        hyper["use_fused"] = cfg.fused_update
        if cfg.state_bits == 8:
            return self._quantized_half_step(hyper)
        return half_step(blk.params, blk.master, blk.m, blk.v, **hyper)  # m, v now hold m½, v½

    @property
    def _alone(self) -> bool:
        """Whether the fused update runs in place: a client without neighbors, 32-bit moments."""
        cfg = self.config
        return cfg.fused_update and cfg.state_bits == 32 and self.mixer.alone

    def _local_step_alone(self, *, eps: float, **step) -> torch.Tensor:
        """The local step of a client without neighbors: ‖x − x½‖ (deca, trivial_bma) with x½
        formed in registers only; m, v and the gradients stay for bma_correct. Returns x as the
        payload, which the mixer hands back untouched: x⁺ = x½ is formed in place."""
        blk, cfg = self.active, self.config
        grads, neg_step, bc2, keep = step_inputs(blk.params, blk.master, **step)
        scalars = (*cfg.adam_betas, neg_step, bc2, eps, keep)
        distance = None
        if cfg.variant != "no_bma":
            distance = fused(distance_alone)(*(flat_segments(blk.params, t) for t in (blk.master, blk.m, blk.v)),
                                             grads, *scalars)
        self._alone_step = grads, scalars, distance
        return blk.master

    def _quantized_half_step(self, hyper: dict) -> torch.Tensor:
        """adam_half_step on 8-bit moments, tensor by tensor; x½ comes from the fp32 m½, v½ before
        they are rounded to 8 bits, so quantization error enters only through the carried moments."""
        blk = self.active
        x_half = torch.empty_like(blk.master)
        for i, ((p, x), (_, out)) in enumerate(zip(blk.segments(blk.master), blk.segments(x_half))):
            m, v = blk.m.get(i), blk.v.get(i)
            half_step([p], x.view(-1), m, v, out=out.view(-1), **hyper)
            blk.m.put(i, m)
            blk.v.put(i, v)
        return x_half

    @torch.no_grad()
    def bma_correct(self, x_plus: torch.Tensor) -> None:
        """Steps 6–8: discrepancy h, carried moments by variant, x = x⁺; then the next step."""
        blk, cfg = self.active, self.config
        c1, c2 = cfg.adam_betas if cfg.variant == "trivial_bma" else cfg.bma_betas
        if self._alone_step is not None:
            self._update_alone(x_plus, c1, c2)
        else:
            self._correct(x_plus, c1, c2)
        # Drop this frame's references to the block's state first: at the end of a block _advance
        # allocates the next block's master, m, v, and the finished block's must be free by then.
        del blk, x_plus
        self._advance()

    def _correct(self, x_plus: torch.Tensor, c1: float, c2: float) -> None:
        blk, cfg = self.active, self.config
        if cfg.variant == "trivial_bma":  # from the moments before this step's gradient
            blk.m, blk.v = self._m_prev, self._v_prev
            del self._m_prev, self._v_prev
        # x = x⁺: the mixer's buffer (x½ summed over, or a new one) becomes the master, no copy;
        # the old master is free to hold h.
        x, blk.master = blk.master, x_plus
        fused_carry = cfg.variant != "no_bma" and cfg.fused_update and cfg.state_bits == 32
        if fused_carry:  # writes the working weights too
            fused(carry_and_write)(*(flat_segments(blk.params, t) for t in (x, x_plus, blk.m, blk.v)),
                                   [p.detach().view(-1) for p in blk.params], c1, c2)
        elif cfg.variant != "no_bma":
            self._carry(discrepancy_(x, x_plus), c1, c2)
        if not fused_carry:
            write_params(blk.params, x_plus)

    def _update_alone(self, x_plus: torch.Tensor, c1: float, c2: float) -> None:
        blk, cfg = self.active, self.config
        if x_plus is not blk.master:
            raise RuntimeError("this client's mixer has no neighbors, so its local step formed no x½ to send: "
                               "combine it through that mixer (the optimizer's own, or the one it was made with)")
        (grads, scalars, distance), self._alone_step = self._alone_step, None
        fused(update_alone)(*(flat_segments(blk.params, t) for t in (blk.master, blk.m, blk.v)), grads,
                            [p.detach().view(-1) for p in blk.params], *scalars, distance, cfg.variant, c1, c2)
        for p in blk.params:
            p.grad = None

    def _carry(self, h: torch.Tensor, c1: float, c2: float) -> None:
        """Step 7 of deca / trivial_bma: m = c1·m + (1−c1)·h, v = c2·v + (1−c2)·h⊙h (8-bit moments:
        tensor by tensor)."""
        blk = self.active
        if self.config.state_bits == 32:
            moments_(blk.m, blk.v, h, c1, c2)
            return
        for i, (_, h_i) in enumerate(blk.segments(h)):
            m, v = blk.m.get(i), blk.v.get(i)
            moments_(m, v, h_i.view(-1), c1, c2)
            blk.m.put(i, m)
            blk.v.put(i, v)

    def local_step(self) -> torch.Tensor:
        return self.adam_half_step()

    def combine(self, mixer: Mixer, payload: torch.Tensor) -> None:
        self.bma_correct(mixer.mix(payload))

    # ---- checkpointing --------------------------------------------------------------------
    def state_dict(self) -> dict:
        blk = self.active
        return {
            "round": self.round, "position": self.position, "step_in_block": self.step_in_block,
            "block": None if blk is None else blk.index,
            "master": None if blk is None else blk.master.clone(),
            "m": None if blk is None else _copy(blk.m),
            "v": None if blk is None else _copy(blk.v),
            "lr": [g["lr"] for g in self.param_groups],
            "config": self.config.to_dict(),
        }

    def load_state_dict(self, state: dict) -> None:
        check_saved_config(state["config"], self.config.to_dict(), "DecaConfig")
        if self.active is not None:
            self._deactivate()
        self.round, self.position, self.step_in_block = (
            state["round"], state["position"], state["step_in_block"])
        for group, lr in zip(self.param_groups, state["lr"]):
            group["lr"] = lr
        if state["block"] is not None:
            expected = self.block_schedule(self.round)[self.position]
            if state["block"] != expected:
                raise ValueError(f"checkpoint's active block {state['block']} is not block {expected} "
                                 f"of round {self.round}, position {self.position}")
            self._activate(state["block"], restored=state)


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
                   keep: torch.Tensor | None) -> torch.Tensor:
    """‖x − x½‖ over the block, x½ formed tensor by tensor in registers and never stored: for a
    client without neighbors this is step 6's ‖x − x⁺‖ before any x⁺ exists."""
    norms = [torch.linalg.vector_norm(x - adam_step(x, *moments(m, v, g, a1, a2), neg_step, bc2, eps, keep))
             for x, m, v, g in zip(xs, ms, vs, gs)]
    return torch.linalg.vector_norm(torch.stack(norms))


def update_alone(xs: list[torch.Tensor], ms: list[torch.Tensor], vs: list[torch.Tensor], gs: list[torch.Tensor],
                 weights: list[torch.Tensor], a1: float, a2: float, neg_step: torch.Tensor, bc2: torch.Tensor,
                 eps: float, keep: torch.Tensor | None, distance: torch.Tensor | None, variant: str, c1: float,
                 c2: float) -> None:
    """Steps 2–8 of a client without neighbors in one compiled call, tensor by tensor and in
    place: m½, v½ and x½ = x⁺ again (the same ops as distance_alone), h = (x − x½)/distance,
    m, v carried by variant, then x and the working weights from x½. Reads g, x, m, v and writes
    x, m, v and the weights once."""
    if distance is not None:
        distance = distance.clamp_min(torch.finfo(distance.dtype).tiny)
    for x, m, v, g, w in zip(xs, ms, vs, gs, weights):
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


def _copy(moment: torch.Tensor | QuantizedVector):
    """A checkpointable copy of a moment: a tensor, or the 8-bit codes and absmax as plain tensors."""
    return moment.state_dict() if isinstance(moment, QuantizedVector) else moment.clone()
