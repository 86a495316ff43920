"""DECA as one method among the others: block-wise Adam with BMA (deca_ds.optimizer)."""

from __future__ import annotations

from typing import Callable

from torch import nn

from ..blocks import Partition
from ..config import DecaConfig
from ..mixing import Mixer
from ..optimizer import DecaOptimizer, model_partition
from .base import Method


class Deca(Method):
    name = "deca"

    def __init__(self, config: DecaConfig, partition: Partition | None = None) -> None:
        self.config, self.partition = config, partition

    def trainable(self, model: nn.Module) -> list[nn.Parameter]:
        partition = self.partition or model_partition(model, self.config)
        return [p for k in range(partition.num_blocks) for p in partition.params(model, k)]

    def optimizer(self, model: nn.Module, mixer: Mixer | None = None, *,
                  before_activate: Callable[[int], None] | None = None) -> DecaOptimizer:
        return DecaOptimizer(model, self.config, partition=self.partition, mixer=mixer,
                             before_activate=before_activate)
