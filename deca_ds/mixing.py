"""Neighbor mixing, x⁺_i = Σ_j w_ij · x½_j (Algorithm 1, step 5), for clients in one process.

A mixer offers the sum (`mix`) and, for methods that combine their neighbors' vectors some
other way (DeCAF), the weighted terms themselves (`exchange`).

The DeepSpeed runtime has its own mixer that exchanges over torch.distributed; both form the
sum with `weighted_sum` in the same order (`mixing_order`), so a distributed run and the
in-process simulator produce the same bits.
"""

from __future__ import annotations

from typing import Protocol, Sequence

import numpy as np
import torch

from .topology import validate_mixing_matrix


Terms = list[tuple[float, torch.Tensor]]


class Mixer(Protocol):
    """What an optimizer's combine() needs from the network."""

    def mix(self, x_half: torch.Tensor) -> torch.Tensor:
        """This client's x⁺ = Σ_j w_ij x½_j, in x½'s dtype, in a buffer the caller may keep as its
        new x: x½ itself (summed over) or a new tensor, never one another client still reads."""

    def exchange(self, x_half: torch.Tensor) -> Terms:
        """(w_ij, x½_j) for every j in `mixing_order`, this client's own x½ included."""


# Elements per exchange in DistributedMixer.mix: bounds each receive buffer at 128 MiB of fp32
# instead of a whole block (0.8 GiB per neighbor for one Llama-3.1-8B layer).
MIX_CHUNK = 2**25


def weighted_sum(terms: Sequence[tuple[float, torch.Tensor]], *, dtype: torch.dtype | None = None,
                 out: torch.Tensor | None = None) -> torch.Tensor:
    """Σ w·x over (w, x) pairs, accumulated left to right in `dtype` (default: the first x's).

    `out` may be the first x itself (the sum then overwrites it: no extra block-sized buffer).
    Lower-precision terms are widened element by element inside the add, never copied whole."""
    (w0, x0), *rest = terms
    if out is None:
        out = torch.empty_like(x0, dtype=dtype or x0.dtype)
    if x0.dtype == out.dtype:
        torch.mul(x0, w0, out=out)  # one pass, not a copy and then a scaling pass
    else:  # a narrower x0 times w0 would be rounded to x0's dtype before it is widened into out
        out.copy_(x0).mul_(w0)
    for w, x in rest:
        out.add_(x, alpha=w)
    return out


def mixing_order(W: np.ndarray, i: int) -> list[int]:
    """Clients whose x½ enters client i's mix (w_ij > 0, i itself included when w_ii > 0), in
    ascending order for every client: with W = 11ᵀ/N all clients then add the same numbers in the
    same order and hold the same bits. Both mixers use this order."""
    return [j for j in range(W.shape[0]) if W[i, j] > 0]


class IdentityMixer:
    """A single client (W = [1]): x⁺ = x½. Makes N = 1 plain block-wise Adam."""

    def mix(self, x_half: torch.Tensor) -> torch.Tensor:
        return x_half

    def exchange(self, x_half: torch.Tensor) -> Terms:
        return [(1.0, x_half)]


class ClientView:
    """Client i's mixer in the simulator: every client's payload is already known."""

    def __init__(self, terms: Terms, own: torch.Tensor) -> None:
        self.terms, self.own = terms, own

    def exchange(self, x_half: torch.Tensor) -> Terms:
        if x_half is not self.own:
            raise ValueError("a client view mixes only the payload it was made for")
        return self.terms

    def mix(self, x_half: torch.Tensor) -> torch.Tensor:
        return weighted_sum(self.exchange(x_half))


class InProcessMixer:
    """Mixes the x½ of all N clients held in one process (the simulator)."""

    def __init__(self, mixing_matrix) -> None:
        self.W = validate_mixing_matrix(mixing_matrix)

    @property
    def n(self) -> int:
        return self.W.shape[0]

    def views(self, x_halves: Sequence[torch.Tensor]) -> list[ClientView]:
        """One mixer per client over all clients' payloads (which combine() must not modify)."""
        if len(x_halves) != self.n:
            raise ValueError(f"expected {self.n} client vectors, got {len(x_halves)}")
        return [ClientView([(float(self.W[i, j]), x_halves[j]) for j in mixing_order(self.W, i)], x_halves[i])
                for i in range(self.n)]
