"""deca-ds: decentralized full-parameter fine-tuning of LLMs with DECA (block-wise Adam + BMA)."""

from .blocks import BLOCK_ORDERS, Block, Partition, block_order, find_decoder_layers, partition_model
from .config import VARIANTS, DecaConfig
from .decentralized import DecentralizedOptimizer
from .methods import METHODS, Method
from .mixing import IdentityMixer, InProcessMixer, Mixer
from .optimizer import DecaOptimizer
from .simulate import StepInfo, simulate
from .topology import (
    TOPOLOGIES,
    WEIGHT_SCHEMES,
    Topology,
    load_mixing_matrix,
    make_topology,
    spectral_rho,
    validate_mixing_matrix,
)

__version__ = "0.1.0"

__all__ = [
    "BLOCK_ORDERS", "Block", "DecaConfig", "DecaOptimizer", "DecentralizedOptimizer", "IdentityMixer",
    "InProcessMixer", "METHODS", "Method", "Mixer", "Partition", "StepInfo", "TOPOLOGIES", "Topology", "VARIANTS", "WEIGHT_SCHEMES",
    "block_order", "find_decoder_layers", "load_mixing_matrix", "make_topology",
    "partition_model", "simulate", "spectral_rho", "validate_mixing_matrix",
]
