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

    # True for a client without neighbors (W = [1]): mix returns x½ itself, as it was.
    alone: bool

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

    alone = True

    def mix(self, x_half: torch.Tensor) -> torch.Tensor:
        return x_half

    def exchange(self, x_half: torch.Tensor) -> Terms:
        return [(1.0, x_half)]


class ClientView:
    """A client's mixer over payloads already known: (w_ij, x½_j) in mixing order and its own x½."""

    def __init__(self, terms: Terms, own: torch.Tensor) -> None:
        self.terms, self.own = terms, own
        self.alone = len(terms) == 1  # then its weight is 1: W is doubly stochastic

    def exchange(self, x_half: torch.Tensor) -> Terms:
        if x_half is not self.own:
            raise ValueError("a client view mixes only the payload it was made for")
        return self.terms

    def mix(self, x_half: torch.Tensor) -> torch.Tensor:
        terms = self.exchange(x_half)  # summed in x½'s dtype, whatever dtype the neighbours' came in
        return x_half if self.alone else weighted_sum(terms, dtype=x_half.dtype)


class InProcessMixer:
    """Mixes the x½ of all N clients held in one process (the simulator): client(i) is client i's
    mixer, and post() hands it every client's x½ of the step. With `transfer_dtype` (working-dtype
    mixing) each client gets its neighbours' x½ rounded to it, as the distributed mixer sends them,
    and its own as it is."""

    def __init__(self, mixing_matrix, transfer_dtype: torch.dtype | None = None) -> None:
        self.W = validate_mixing_matrix(mixing_matrix)
        self.transfer_dtype = transfer_dtype
        self.x_halves: list[torch.Tensor] | None = None
        self.sent: list[torch.Tensor] | None = None  # what the neighbours receive

    @property
    def n(self) -> int:
        return self.W.shape[0]

    def post(self, x_halves: Sequence[torch.Tensor]) -> None:
        """This step's payload of every client (which combine() must not modify)."""
        if len(x_halves) != self.n:
            raise ValueError(f"expected {self.n} client vectors, got {len(x_halves)}")
        self.x_halves = list(x_halves)
        self.sent = [x if self.transfer_dtype in (None, x.dtype) else x.to(self.transfer_dtype) for x in x_halves]

    def client(self, i: int) -> "InProcessClient":
        return InProcessClient(self, i)

    def views(self, x_halves: Sequence[torch.Tensor]) -> list["InProcessClient"]:
        """post(x_halves), then every client's mixer."""
        self.post(x_halves)
        return [self.client(i) for i in range(self.n)]


class InProcessClient:
    """Client i's mixer in the simulator, over the payloads last posted to its InProcessMixer.
    It exists before the first step, so an optimizer made with it knows whether it has neighbors."""

    def __init__(self, mixer: InProcessMixer, i: int) -> None:
        self.mixer, self.i = mixer, i
        self.order = mixing_order(mixer.W, i)
        self.alone = len(self.order) == 1

    def view(self) -> ClientView:
        xs = self.mixer.x_halves
        if xs is None:
            raise RuntimeError("no payloads posted to the in-process mixer yet")
        sent = self.mixer.sent
        return ClientView([(float(self.mixer.W[self.i, j]), xs[j] if j == self.i else sent[j]) for j in self.order],
                          xs[self.i])

    def exchange(self, x_half: torch.Tensor) -> Terms:
        return self.view().exchange(x_half)

    def mix(self, x_half: torch.Tensor) -> torch.Tensor:
        return self.view().mix(x_half)
