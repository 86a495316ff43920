"""DecaConfig: the hyperparameters of Algorithm 1, validated once at construction; AdamSettings: the
local Adam's, which DECA and the baselines (methods.AdamConfig) both extend."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields
from typing import Sequence

import torch

VARIANTS = ("deca", "trivial_bma", "no_bma")
# Which trained tensors weight decay scales (deca_ds.kernels.decays): all, or those of two or more
# dimensions (not the norms' weights nor biases).
WEIGHT_DECAY_ON = ("all", "matrices")

# The dtype names every option, config and the estimator accept: the first name of each is its short one.
DTYPES = {
    "fp32": torch.float32, "float32": torch.float32,
    "fp64": torch.float64, "float64": torch.float64,
    "bf16": torch.bfloat16, "bfloat16": torch.bfloat16,
    "fp16": torch.float16, "float16": torch.float16,
}


def parse_dtype(value: str | torch.dtype, what: str = "dtype",
                allowed: Sequence[torch.dtype] | None = None) -> torch.dtype:
    """A dtype from its name (or itself), refused naming `what` and the names it may take."""
    dtype = value if isinstance(value, torch.dtype) else DTYPES.get(str(value).lower())
    if dtype is None or (allowed is not None and dtype not in allowed):
        names = sorted(k for k, v in DTYPES.items() if allowed is None or v in allowed)
        raise ValueError(f"{what} must be one of {names}, got {value!r}")
    return dtype


def dtype_name(dtype: torch.dtype) -> str:
    """The short name of a dtype of DTYPES (bf16, fp32, ...)."""
    return next(k for k, v in DTYPES.items() if v == dtype)


def check_master_dtype(value) -> torch.dtype:
    dtype = parse_dtype(value, "master_dtype")
    if dtype not in (torch.float32, torch.float64):
        raise ValueError(f"master_dtype must be float32 or float64, got {dtype}")
    return dtype


def check_variant(value: str) -> str:
    if value not in VARIANTS:
        raise ValueError(f"variant must be one of {VARIANTS}, got {value!r}")
    return value


def check_state_bits(value: int) -> int:
    """32 or 8; whether 8 can run (the bitsandbytes extra) is DecaConfig's check, not an estimate's."""
    if value not in (32, 8):
        raise ValueError(f"state_bits must be 32 or 8, got {value!r}")
    return value


def check_betas(name: str, betas: Sequence[float], *, one: bool = True) -> tuple[float, float]:
    """Two decay rates in [0, 1], or in [0, 1) where `one` is False: Adam's, whose bias correction
    divides by 1 - α^(r+1) (torch.optim.Adam refuses 1 too); BMA's β = 1 is the plain step (no_bma)."""
    betas = tuple(float(b) for b in betas)
    if len(betas) != 2 or not all(0.0 <= b <= 1.0 and (one or b < 1.0) for b in betas):
        raise ValueError(f"{name} must be two numbers in {'[0, 1]' if one else '[0, 1)'}, got {betas}")
    return betas


def check_counts(config, names: Sequence[str]) -> None:
    """Each of `config`'s fields `names` an integer >= 1 (a bool is not one)."""
    for name in names:
        value = getattr(config, name)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be an integer >= 1, got {value!r}")


def check_bool(name: str, value) -> None:
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be True or False, got {value!r}")


@dataclass(kw_only=True)
class AdamSettings:
    """The local Adam's hyperparameters, declared and checked once: DECA's block-wise Adam
    (DecaConfig) and the baselines' (methods.AdamConfig) extend them. lr is γ, adam_betas (α1, α2);
    weight_decay λ is decoupled (AdamW), on the tensors weight_decay_on names (WEIGHT_DECAY_ON);
    master_dtype holds the trained weights' master, m and v. fused_update: the update as
    torch.compile'd kernels (deca_ds.kernels.fused), compiled at the first step."""

    lr: float = 5e-5
    adam_betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 0.0
    weight_decay_on: str = "all"
    grad_clip: float | None = None
    master_dtype: torch.dtype = torch.float32
    fused_update: bool = False

    def __post_init__(self) -> None:
        if not self.lr > 0:
            raise ValueError(f"lr must be > 0, got {self.lr}")
        self.adam_betas = check_betas("adam_betas", self.adam_betas, one=False)
        if not self.eps > 0:
            raise ValueError(f"eps must be > 0, got {self.eps}")
        if not self.weight_decay >= 0:
            raise ValueError(f"weight_decay must be >= 0, got {self.weight_decay}")
        if not self.lr * self.weight_decay < 1:  # AdamW scales the weights by 1 − γλ each step
            raise ValueError(f"lr × weight_decay must be < 1 (each step scales the weights by 1 − lr·weight_decay), "
                             f"got {self.lr} × {self.weight_decay}")
        if self.weight_decay_on not in WEIGHT_DECAY_ON:
            raise ValueError(f"weight_decay_on must be one of {WEIGHT_DECAY_ON}, got {self.weight_decay_on!r}")
        if self.grad_clip is not None and not self.grad_clip > 0:
            raise ValueError(f"grad_clip must be > 0 or None, got {self.grad_clip}")
        self.master_dtype = check_master_dtype(self.master_dtype)
        check_bool("fused_update", self.fused_update)

    def adam_settings(self) -> dict:
        """These settings alone, as keyword arguments: a baseline's AdamConfig(**them) runs the same
        local Adam as this config."""
        return {f.name: getattr(self, f.name) for f in fields(AdamSettings)}

    def to_dict(self) -> dict:
        return {**asdict(self), "master_dtype": str(self.master_dtype).removeprefix("torch.")}


@dataclass(kw_only=True)
class DecaConfig(AdamSettings):
    """Algorithm 1's hyperparameters. Defaults are the paper's (classification tasks).

    The local Adam's are AdamSettings'; bma_betas (β1, β2), steps_per_block R, rounds T.
    state_bits: 32 (default) keeps the active block's m and v in master_dtype; 8 holds them in
    8 bits (deca_ds.quantized, the optional `bnb` extra), the master and the arithmetic stay fp32.
    fused_update: run the update as two torch.compile'd calls that move only what the update
    must read and write, instead of one pass per op (compiled at the first step;
    deca_ds.kernels.fused). With neighbors the block's gradient and x½ are then held
    together; a client without neighbors (N = 1) updates in place and holds no x½ at all.
    """

    bma_betas: tuple[float, float] = (0.9, 0.999)
    steps_per_block: int = 48
    rounds: int = 4
    layers_per_block: int = 2
    variant: str = "deca"
    block_order: str = "ascending"
    seed: int = 0
    train_embeddings: bool = False
    train_final_norm: bool = False
    train_lm_head: bool = False
    custom_blocks: list | None = field(default=None)
    state_bits: int = 32

    def __post_init__(self) -> None:
        from .blocks import BLOCK_ORDERS  # blocks imports torch only; kept local to avoid a cycle

        super().__post_init__()
        self.bma_betas = check_betas("bma_betas", self.bma_betas)
        check_counts(self, ("steps_per_block", "rounds", "layers_per_block"))
        check_variant(self.variant)
        if self.block_order not in BLOCK_ORDERS:
            raise ValueError(f"block_order must be one of {BLOCK_ORDERS}, got {self.block_order!r}")
        check_state_bits(self.state_bits)
        if self.state_bits == 8:
            if self.master_dtype != torch.float32:
                raise ValueError(f"state_bits=8 needs master_dtype float32 (bitsandbytes quantizes fp32), "
                                 f"got {self.master_dtype}")
            from .quantized import bitsandbytes_functional

            bitsandbytes_functional()  # fail here, with the extra to install, not at the first step
