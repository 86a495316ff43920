"""What every method's optimizer offers the runtime and the simulator (its arithmetic: deca_ds.kernels).

A decentralized step is two halves around the exchange with the neighbors:

    payload = opt.local_step()       after backward: this client's local update x½ (one flat vector)
    opt.combine(mixer, payload)      mixer.mix (Σ_j w_ij x½_j) or mixer.exchange (every x½_j) → new x

`step()` runs both with the optimizer's own mixer (the DeepSpeed runtime); the simulator runs the
first half on every client, then the second with each client's view of the others' payloads.
"""

from __future__ import annotations

import dataclasses
import time
from abc import ABC, abstractmethod
from typing import Callable

import torch

from .mixing import IdentityMixer, Mixer

# Options that choose how the update runs, not what it computes: a run may resume with either.
EXECUTION_ONLY = ("fused_update",)


def check_saved_config(saved: dict, config, what: str) -> None:
    """Refuse optimizer state saved under other hyperparameters than the dataclass `config`'s,
    naming each that differs. A field the saved state predates counts as its default: the step
    it took then, before the field existed."""
    defaults = {f.name: f.default for f in dataclasses.fields(config) if f.default is not dataclasses.MISSING}
    saved = {**{k: v for k, v in defaults.items() if k not in saved}, **saved}
    saved, current = ({k: v for k, v in d.items() if k not in EXECUTION_ONLY} for d in (saved, config.to_dict()))
    if saved != current:
        diff = {k: (saved.get(k), current.get(k)) for k in saved.keys() | current.keys()
                if saved.get(k) != current.get(k)}
        raise ValueError(f"optimizer state was saved with a different {what} (saved, now): {diff}")


class DecentralizedOptimizer(torch.optim.Optimizer, ABC):
    """Base of every method's optimizer: the step split around mixing, and the schedule queries
    the runtime logs and checkpoints by."""

    mixer: Mixer = IdentityMixer()
    # The runtime swaps in its timer's clock, which counts a GPU's kernels (runtime.timing); its
    # times subtract and add as numbers, and float() reads them.
    clock: Callable[[], float] = staticmethod(time.perf_counter)
    last_times: dict[str, float] = {}
    # Whether combining is linear in the clients' vectors: then the consensus x̄ is their mean.
    linear = True

    @property
    @abstractmethod
    def total_steps(self) -> int:
        """Local steps of the whole run."""

    @property
    @abstractmethod
    def global_step(self) -> int:
        """Local steps taken."""

    @property
    def done(self) -> bool:
        return self.global_step >= self.total_steps

    @property
    def lr(self) -> float:
        """The learning rate of the next local step: a preset's schedule (stepped after each step, as
        DeepSpeed's engine steps it) sets every group's alike."""
        return self.param_groups[0]["lr"]

    @abstractmethod
    def where(self) -> dict:
        """Where the schedule stands, for logs: round, block (None: every trainable tensor), r."""

    @abstractmethod
    def consensus_vector(self) -> torch.Tensor:
        """The flat vector this client mixes with its neighbors (for the consensus distance)."""

    @abstractmethod
    def state_bytes(self) -> int:
        """Bytes of optimizer state held now."""

    @abstractmethod
    def local_step(self) -> torch.Tensor:
        """The first half of a step, after backward: this client's payload for its neighbors."""

    @abstractmethod
    def combine(self, mixer: Mixer, payload: torch.Tensor) -> None:
        """The second half: the new x from `mixer`'s view of the neighbors' payloads."""

    def combine_now(self, mixer: Mixer) -> None:
        """Replace x by its combination through `mixer`, with no local step: the consensus of a
        method that is not `linear`, whose consensus is not the clients' mean."""
        raise NotImplementedError(f"{type(self).__name__} combines linearly: its consensus is the clients' mean")

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
