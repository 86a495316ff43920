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

How the two halves run (eager, fused, in place without neighbors, 8-bit moments) is picked once,
when the optimizer is made: deca_ds.updates.

Only the active block has a master copy and moments, in `master_dtype`; they are created when the
block is activated and dropped when it is left. Every parameter outside the active block has
requires_grad=False, so backward never produces a gradient for it.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from .blocks import Partition, block_order, partition_model
from .config import DecaConfig
from .decentralized import DecentralizedOptimizer, check_saved_config
from .kernels import clip_scale
from .mixing import IdentityMixer, Mixer
from .quantized import QuantizedVector
from .updates import ActiveBlock, update_path


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

    def __init__(self, model: nn.Module, config: DecaConfig, *, partition: Partition | None = None,
                 mixer: Mixer | None = None, before_activate: Callable[[int], None] | None = None) -> None:
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
        self.update = update_path(config, self.mixer.alone)
        # Called with a block's index before the block's parameters are read, the first block's
        # included (the frozen-layer offload makes them resident there).
        self.before_activate = before_activate
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
        """Steps 1–4: fold the gradient into m½, v½ and return x½, the payload for the neighbors
        (without neighbors and fused: x itself, see deca_ds.updates.InPlaceUpdate)."""
        if self.done:
            raise RuntimeError(f"all {self.config.rounds} rounds are done; no block is active")
        blk, cfg = self.active, self.config
        group = self.param_groups[blk.index]
        # the bias corrections restart with every block (r + 1 steps)
        return self.update.half_step(blk, lr=group["lr"], betas=cfg.adam_betas, eps=cfg.eps, t=self.step_in_block + 1,
                                     weight_decay=group["weight_decay"], weight_decay_on=cfg.weight_decay_on,
                                     scale=clip_scale(blk.params, cfg.grad_clip, cfg.master_dtype))

    @torch.no_grad()
    def bma_correct(self, x_plus: torch.Tensor) -> None:
        """Steps 6–8: discrepancy h, carried moments by variant, x = x⁺; then the next step.

        `x_plus` becomes the master itself, not a copy (Mixer.mix returns a buffer the caller may
        keep): hand each optimizer a tensor of its own, and do not use it after this call."""
        self.update.correct(self.active, x_plus)
        # Drop this frame's reference to x⁺ (now the master) first: at the end of a block _advance
        # allocates the next block's master, m, v, and the finished block's must be free by then.
        del x_plus
        self._advance()

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
        check_saved_config(state["config"], self.config, "DecaConfig")
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


def _copy(moment: torch.Tensor | QuantizedVector):
    """A checkpointable copy of a moment: a tensor, or the 8-bit codes and absmax as plain tensors."""
    return moment.state_dict() if isinstance(moment, QuantizedVector) else moment.clone()
