"""Every client starts the same run from the same model, or the run stops before its first step.

Each site runs its own command line and loads the model from its own disk or hub cache, and a
random initialisation is drawn on each rank's device. Another option at one site (a learning
rate, a topology seed, an evaluation interval, whose collectives the others would wait for),
another revision, dtype or tokenizer, or a CPU initialisation beside GPU ones would train unlike
models or hang. Each rank fingerprints its options (all but `PER_SITE`), tokenizer and, when the
job spans nodes (ranks of one node load the same files), its loaded weights before the method adds
its own; the ranks gather and compare them, and a difference is the same refusal on every rank,
naming the clients and the options.
"""

from __future__ import annotations

import hashlib
from dataclasses import asdict

import torch
import torch.distributed as dist

from .dist import ClientLayout
from .options import NOT_RESULT_DS, PER_SITE, RunOptions
from .token_cache import tokenizer_fingerprint

# integers of the element's width, at most 32 bits (an 8-byte element is summed as its two halves),
# so that a chunk's int64 sum cannot overflow
_BITS = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int32}
CHUNK = 1 << 22  # integers summed at a time (accumulated in int64, no copy)


def bit_sum(tensor: torch.Tensor, chunk: int = CHUNK) -> int:
    """The sum of the tensor's bits read as integers (`_BITS`): exact, so the same on any device and
    in any order of summation (float sums would round differently on another GPU)."""
    bits = tensor.detach().contiguous().reshape(-1).view(_BITS[tensor.element_size()])
    return sum(int(part.sum(dtype=torch.int64)) for part in bits.split(chunk))


def weights_fingerprint(model: torch.nn.Module) -> str:
    """SHA-256 over every state tensor's name, dtype, shape and bit sum."""
    h = hashlib.sha256()
    for name, tensor in model.state_dict().items():
        h.update(f"{name}:{tensor.dtype}:{tuple(tensor.shape)}:{bit_sum(tensor)};".encode())
    return h.hexdigest()


def shared_options(opts: RunOptions, ds_config: dict) -> dict:
    """The options and DeepSpeed keys every site must set alike."""
    return {**{k: v for k, v in asdict(opts).items() if k not in PER_SITE},
            **{f"ds_config.{k}": v for k, v in ds_config.items() if k not in NOT_RESULT_DS}}


def start_fingerprint(model: torch.nn.Module, tokenizer, opts: RunOptions, ds_config: dict, *,
                      weights: bool = True) -> dict:
    """What check_same_start compares; `weights` False (every rank alike) skips summing them."""
    return {"options": shared_options(opts, ds_config), "weights": weights_fingerprint(model) if weights else None,
            "tokenizer": tokenizer_fingerprint(tokenizer)}


def check_same_start(mine: dict, layout: ClientLayout) -> None:
    everyone = [None] * layout.world_size
    dist.all_gather_object(everyone, mine)
    compare_starts(everyone, layout.ranks_per_client)


def compare_starts(everyone: list[dict], ranks_per_client: int) -> None:
    """Every rank's fingerprints (rank order) against rank 0's: a ValueError naming the clients that
    differ (and, for options, each option with both values)."""
    first = everyone[0]
    for rank, theirs in enumerate(everyone):
        keys = sorted(set(first["options"]) | set(theirs["options"]))
        differ = [k for k in keys if first["options"].get(k) != theirs["options"].get(k)]
        if differ:
            client = rank // ranks_per_client
            lines = "; ".join(f"{k}: {first['options'].get(k)!r} at client 0, {theirs['options'].get(k)!r} at client "
                              f"{client}" for k in differ)
            raise ValueError(f"client {client} runs with other options than client 0: {lines}. Every site must pass "
                             f"the same options, but for {', '.join(sorted(PER_SITE))}")
    for what in ("weights", "tokenizer"):
        differ = sorted({rank // ranks_per_client for rank, e in enumerate(everyone) if e[what] != first[what]})
        if differ:
            raise ValueError(f"client(s) {differ} start from other {what} than client 0: every site must load the "
                             "same model (the same revision and --working-dtype; a random initialisation drawn on "
                             "the same kind of device)")
