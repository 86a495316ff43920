"""Adapt-then-combine Adam on a fixed set of tensors, and D-Adam (decentralized full-parameter Adam).

Every local step, on the flat vector x of all trainable tensors (master copy in `master_dtype`):

    m = α1·m + (1−α1)·g     v = α2·v + (1−α2)·g⊙g     x½ = x − γ·m̂/(√v̂+ε)   (t-step bias correction)
    x = Σ_j w_ij x½_j   every `mix_every` steps (else x = x½); moments stay local.

This is the optimizer of D-Adam, Dec-LoRA and Dec-Adapter (each an `AdamMethod`: what trains is all
they define); DeCAF overrides how x½ is combined.
D-Adam holds master, m and v for every trainable weight at once (the paper's 9M–11M case), which
is what DECA's one-block-at-a-time state avoids.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn

from ..blocks import partition_model
from ..config import AdamSettings, check_counts
from ..decentralized import DecentralizedOptimizer, check_saved_config
from ..kernels import clip_scale, half_step, segments, write_params
from ..mixing import IdentityMixer, Mixer
from .base import Method


@dataclass(kw_only=True)
class AdamConfig(AdamSettings):
    """The baselines' local Adam (AdamSettings) and their mixing schedule: `steps` local steps,
    mixing after every `mix_every`-th."""

    steps: int
    lr: float = 1e-4
    mix_every: int = 1

    def __post_init__(self) -> None:
        super().__post_init__()
        check_counts(self, ("steps", "mix_every"))


class MixedAdam(DecentralizedOptimizer):
    """Local Adam on `params`, then neighbor mixing of the whole trainable vector."""

    def __init__(self, model: nn.Module, params: list[nn.Parameter], config: AdamConfig, *,
                 mixer: Mixer | None = None) -> None:
        if not params:
            raise ValueError("the method has no trainable parameters")
        super().__init__(params, {"lr": config.lr, "weight_decay": config.weight_decay})
        self.config, self.params = config, params
        self.mixer = mixer or IdentityMixer()
        for p in model.parameters():
            p.requires_grad_(False)
        for p in params:
            p.requires_grad_(True)
        numel = sum(p.numel() for p in params)
        self.master = torch.empty(numel, dtype=config.master_dtype, device=params[0].device)
        for p, x in segments(params, self.master):
            x.copy_(p.detach())
        self.m, self.v = torch.zeros_like(self.master), torch.zeros_like(self.master)
        self.t = 0  # local steps taken

    @property
    def total_steps(self) -> int:
        return self.config.steps

    @property
    def global_step(self) -> int:
        return self.t

    def where(self) -> dict:
        return {"round": 0, "block": None, "r": self.t}

    def consensus_vector(self) -> torch.Tensor:
        return self.master

    def state_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.master, self.m, self.v))

    def mixes_now(self) -> bool:
        return (self.t + 1) % self.config.mix_every == 0

    @torch.no_grad()
    def local_step(self) -> torch.Tensor:
        if self.done:
            raise RuntimeError(f"all {self.total_steps} steps are done")
        cfg, group = self.config, self.param_groups[0]
        return half_step(self.params, self.master, self.m, self.v, lr=group["lr"], betas=cfg.adam_betas, eps=cfg.eps,
                         t=self.t + 1, weight_decay=group["weight_decay"], weight_decay_on=cfg.weight_decay_on,
                         scale=clip_scale(self.params, cfg.grad_clip, cfg.master_dtype), use_fused=cfg.fused_update)

    @torch.no_grad()
    def combine(self, mixer: Mixer, payload: torch.Tensor) -> None:
        # the mixer's buffer (or x½ itself) becomes the master: no copy
        self.master = self.aggregate(mixer, payload) if self.mixes_now() else payload
        write_params(self.params, self.master)
        self.t += 1

    def aggregate(self, mixer: Mixer, x_half: torch.Tensor) -> torch.Tensor:
        """x = Σ_j w_ij x½_j (adapt-then-combine)."""
        return mixer.mix(x_half)

    @torch.no_grad()
    def combine_now(self, mixer: Mixer) -> None:
        """Replace x by its combination through `mixer` (no local step): the consensus of a
        method whose combination is not the mean is its combination with uniform weights."""
        self.master.copy_(self.aggregate(mixer, self.master))
        write_params(self.params, self.master)

    def state_dict(self) -> dict:
        return {"t": self.t, "master": self.master.clone(), "m": self.m.clone(), "v": self.v.clone(),
                "lr": self.param_groups[0]["lr"], "config": self.config.to_dict()}

    def load_state_dict(self, state: dict) -> None:
        check_saved_config(state["config"], self.config, "config")
        self.t = state["t"]
        self.param_groups[0]["lr"] = state["lr"]
        for name in ("master", "m", "v"):
            getattr(self, name).copy_(state[name])


class AdamMethod(Method):
    """A baseline: every tensor it trains takes the local Adam step (MixedAdam, `config`) at every
    step, then mixes; there are no blocks to activate."""

    config: AdamConfig

    def optimizer(self, model: nn.Module, mixer: Mixer | None = None, *,
                  before_activate: Callable[[int], None] | None = None) -> MixedAdam:
        if before_activate is not None:
            raise ValueError(f"{self.name} trains all its parameters at every step: it activates no blocks, "
                             "so before_activate (the frozen-layer offload's hook) is for DECA only")
        return self.adam(model, mixer)

    def adam(self, model: nn.Module, mixer: Mixer | None) -> MixedAdam:
        """The optimizer over `trainable(model)`; DeCAF's combines its LoRA pairs its own way."""
        return MixedAdam(model, self.trainable(model), self.config, mixer=mixer)


class DAdam(AdamMethod):
    """Decentralized full-parameter Adam: every tensor DECA's blocks cover trains at once."""

    name = "dadam"

    def __init__(self, config: AdamConfig, *, train_embeddings: bool = False, train_final_norm: bool = False,
                 train_lm_head: bool = False) -> None:
        self.config = config
        self.extra = dict(train_embeddings=train_embeddings, train_final_norm=train_final_norm,
                          train_lm_head=train_lm_head)

    def trainable(self, model: nn.Module) -> list[nn.Parameter]:
        partition = partition_model(model, 1, **self.extra)
        return [p for k in range(partition.num_blocks) for p in partition.params(model, k)]
