"""Method: what a decentralized fine-tuning method decides, apart from the shared runtime.

A method says which parameters train (and adds any it needs: LoRA factors, adapters), builds
the optimizer whose combine() mixes them after each local step, and writes its consensus model.
Data, topology, mixing transport, metrics and checkpoints are the runtime's, the same for all.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from contextlib import contextmanager
from pathlib import Path
from typing import Callable

import torch
from torch import nn

from ..decentralized import DecentralizedOptimizer
from ..mixing import Mixer


class Method(ABC):
    name: str = ""
    # whether its optimizer's combination is linear (DecentralizedOptimizer.linear): then x̄ is the clients' mean
    linear: bool = True

    def prepare(self, model: nn.Module) -> nn.Module:
        """The model to train: `model` itself, or a wrapper with the method's added parameters,
        initialized identically on every client."""
        return model

    @abstractmethod
    def trainable(self, model: nn.Module) -> list[nn.Parameter]:
        """The tensors the method trains and mixes, in mixing order."""

    @abstractmethod
    def optimizer(self, model: nn.Module, mixer: Mixer | None = None, *,
                  before_activate: Callable[[int], None] | None = None) -> DecentralizedOptimizer:
        """The optimizer over `trainable(model)` whose combine() mixes through `mixer` (default: a
        client alone). `before_activate(block)` is called before a block-wise optimizer reads a
        block's parameters (the frozen-layer offload's hook); a method without blocks refuses it."""

    def num_trainable(self, model: nn.Module) -> int:
        return sum(p.numel() for p in self.trainable(model))

    def plain_state(self, model: nn.Module) -> dict[str, torch.Tensor]:
        """The weights, by transformers' names, of a plain model of the base architecture that
        computes what this client's model computes (what clients/client_NNN/ holds)."""
        return model.state_dict()

    def save_extras(self, model: nn.Module, directory: Path) -> None:
        """Write beside a client's plain weights what they cannot hold (Dec-Adapter's adapters)."""

    def save_consensus(self, model: nn.Module, directory: Path, tokenizer) -> nn.Module:
        """Write the consensus model (its weights already x̄) to `directory`; return the model
        to evaluate."""
        model.save_pretrained(directory, safe_serialization=True)
        tokenizer.save_pretrained(directory)
        return model


@contextmanager
def seeded(seed: int):
    """Forked RNG with `seed`: every client draws the same initial method parameters, and the
    caller's random stream does not move."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        yield
