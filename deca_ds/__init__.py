"""deca-ds: decentralized full-parameter fine-tuning of LLMs with DECA (block-wise Adam + BMA).

The public names below load on first use (PEP 562), so `import deca_ds.train` can parse a command
line, print `--help` or the resolved config without importing torch.
"""

import sys
import types
from importlib import import_module

__version__ = "0.1.0"

_SOURCES = {
    ".blocks": ("BLOCK_ORDERS", "Block", "Partition", "block_order", "find_decoder_layers", "partition_model"),
    ".config": ("VARIANTS", "DecaConfig"),
    ".decentralized": ("DecentralizedOptimizer",),
    ".methods": ("METHODS", "Method"),
    ".mixing": ("IdentityMixer", "InProcessMixer", "Mixer"),
    ".optimizer": ("DecaOptimizer",),
    ".rng": ("ClientGenerators",),
    ".simulate": ("StepInfo", "simulate"),
    ".topology": ("TOPOLOGIES", "WEIGHT_SCHEMES", "Topology", "load_mixing_matrix", "make_topology", "spectral_rho",
                  "validate_mixing_matrix"),
}
_MODULE_OF = {name: module for module, names in _SOURCES.items() for name in names}

__all__ = sorted(_MODULE_OF)


def __getattr__(name: str):
    if name not in _MODULE_OF:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(import_module(_MODULE_OF[name], __name__), name)
    globals()[name] = value  # later look-ups skip this function
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *__all__])


class _Package(types.ModuleType):
    def __setattr__(self, name: str, value) -> None:
        # Importing the submodule deca_ds.simulate binds it on the package; the public name is the
        # function simulate, as it was when this file imported everything eagerly.
        if name in _MODULE_OF and isinstance(value, types.ModuleType):
            return
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Package
