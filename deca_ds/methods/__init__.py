"""The decentralized methods the runtime can train with (`--method`): DECA and the paper's baselines.

A new method is one module here: a `Method` (what trains, how it is initialized and exported)
whose optimizer is a `DecentralizedOptimizer` (local step, then combine with the neighbors).
"""

from .adam import AdamConfig, DAdam, MixedAdam
from .adapter import DecAdapter, add_adapters, load_adapters, saved_adapters
from .base import Method
from .deca import Deca
from .lora import DeCAF, DecLoRA, truncated_factors

METHODS = {m.name: m for m in (Deca, DAdam, DecLoRA, DecAdapter, DeCAF)}

__all__ = ["AdamConfig", "DAdam", "DeCAF", "Deca", "DecAdapter", "DecLoRA", "METHODS", "Method", "MixedAdam",
           "add_adapters", "load_adapters", "saved_adapters", "truncated_factors"]
