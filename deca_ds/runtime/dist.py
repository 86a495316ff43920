"""Clients over torch.distributed: rank layout, process groups and neighbor mixing.

World = N clients × G ranks. Client c owns ranks c·G … c·G+G−1; they do data parallelism inside
the client (DeepSpeed's data-parallel group). Rank l of client c gossips with rank l of each
neighbor client, over a two-rank process group per link: on gloo a timed-out or broken link
poisons its whole group, so one group per link keeps a failure local and attributable.
"""

from __future__ import annotations

import contextlib
import os
import time
from dataclasses import dataclass
from datetime import timedelta

import numpy as np
import torch
import torch.distributed as dist

from ..mixing import MIX_CHUNK, mixing_order, weighted_sum
from .transport import HostStaging


class PeerError(RuntimeError):
    """A neighbor did not deliver its block: it died, hung past the timeout, or broke the link."""


@contextlib.contextmanager
def answered_within(timeout_s: float, what: str):
    """A collective of every rank (or a client's) that fails (gloo and NCCL raise a plain
    RuntimeError) as a PeerError that names it and the run's timeout, as a link's failure names its
    neighbour: which of the two a hung rank stops first depends on where in its step it hung."""
    try:
        yield
    except PeerError:
        raise
    except RuntimeError as err:
        raise PeerError(f"no answer to {what} within {timeout_s:g} s (a rank hung or was lost): {err}") from err


@dataclass(frozen=True)
class ClientLayout:
    rank: int
    world_size: int
    ranks_per_client: int

    @property
    def n_clients(self) -> int:
        return self.world_size // self.ranks_per_client

    @property
    def client(self) -> int:
        return self.rank // self.ranks_per_client

    @property
    def local_rank(self) -> int:
        return self.rank % self.ranks_per_client

    def rank_of(self, client: int, local_rank: int | None = None) -> int:
        return client * self.ranks_per_client + (self.local_rank if local_rank is None else local_rank)

    @property
    def client_ranks(self) -> list[int]:
        return [self.rank_of(self.client, local) for local in range(self.ranks_per_client)]


def check_layout(world_size: int, ranks_per_client: int, n_clients: int | None) -> int:
    """The number of clients; the error every rank raises, before any group exists, when the
    numbers do not fit."""
    if world_size % ranks_per_client:
        raise ValueError(f"world size {world_size} is not divisible by ranks per client G={ranks_per_client}")
    n = world_size // ranks_per_client
    if n_clients is not None and n_clients != n:
        raise ValueError(f"--clients {n_clients} but world size {world_size} with G={ranks_per_client} "
                         f"makes {n} client{'s' if n != 1 else ''}: start {n_clients * ranks_per_client} ranks "
                         "(deepspeed --num_gpus, torchrun --nproc-per-node), or leave --clients out")
    return n


def host_staging(device: torch.device) -> HostStaging | None:
    """The staging the mixer needs: on GPU ranks over gloo, or on CPU ranks with DECA_STAGE_ON_CPU=1
    (the tests drive the staged path with CPU tensors)."""
    if dist.get_backend() != "gloo":
        return None
    if device.type == "cuda" or os.environ.get("DECA_STAGE_ON_CPU") == "1":
        return HostStaging(device)
    return None


class Heartbeat:
    """Every rank posts its step on the rendezvous store. When a wait fails, the rank that saw it
    reads the board to name the ranks that went silent: a dead or hung rank neither posts new
    steps nor reports a failure of its own, while its survivors do one or the other."""

    def __init__(self, store: dist.Store, layout: ClientLayout) -> None:
        self.store, self.layout = dist.PrefixStore("deca", store), layout
        self.silent: set[int] = set()  # the ranks this one last found silent

    def beat(self, step: int) -> None:
        self.store.set(f"step/{self.layout.rank}", str(step))

    def _board(self) -> dict[int, tuple[int, bool]]:
        board = {}
        for r in range(self.layout.world_size):
            step = int(self.store.get(f"step/{r}")) if self.store.check([f"step/{r}"]) else -1
            board[r] = step, self.store.check([f"failed/{r}"])
        return board

    def silent_ranks(self, step: int, grace_s: float) -> str:
        """Who stopped, as a sentence; waits `grace_s` for live ranks to move or report."""
        try:
            self.store.set(f"failed/{self.layout.rank}", str(step))
            before = self._board()
            time.sleep(grace_s)
            after = self._board()
            self.store.set(f"read/{self.layout.rank}", str(step))
        except Exception:  # the store lives in rank 0: no answer means rank 0 is gone
            return f"the rendezvous store on {self._name(0)} does not answer: {self._name(0)} is down"
        silent = [r for r in after if r != self.layout.rank and not after[r][1] and after[r][0] == before[r][0]]
        self.silent = set(silent)
        if not silent:
            return "every other rank is alive or has reported its own failure"
        return (f"silent for {grace_s:g} s (dead or hung): "
                + ", ".join(f"{self._name(r)} at step {after[r][0]}" for r in silent))

    def wait_for_readers(self, timeout_s: float) -> list[int]:
        """Rank 0 hosts the store, so before it exits on a peer's failure it waits, `timeout_s` at
        most, until every other rank it did not find silent has read the board; those that have
        not by then."""
        deadline = time.monotonic() + timeout_s
        waiting = [r for r in range(self.layout.world_size) if r != self.layout.rank and r not in self.silent]
        while True:
            waiting = [r for r in waiting if not self.store.check([f"read/{r}"])]
            if not waiting or time.monotonic() >= deadline:
                return waiting
            time.sleep(0.05)

    def _name(self, r: int) -> str:
        return f"client {r // self.layout.ranks_per_client} (rank {r})"


class ClientGroups:
    """Every process group the run needs, created in the same order on every rank."""

    def __init__(self, layout: ClientLayout, W: np.ndarray, timeout_s: float, *,
                 client_backend: str | None = None) -> None:
        timeout = timedelta(seconds=timeout_s)
        self.client = None
        self.single = None
        for c in range(layout.n_clients):
            ranks = [layout.rank_of(c, local) for local in range(layout.ranks_per_client)]
            # `client_backend`: NCCL inside a client of GPU ranks run over gloo (its G ranks have a
            # GPU each, check_placement), so DeepSpeed's gradient all-reduce stays on the device.
            group = dist.new_group(ranks, timeout=timeout, backend=client_backend)
            if c == layout.client:
                self.client = group
        # DeepSpeed clips with a model-parallel group; it must span this rank alone.
        for r in range(layout.world_size):
            group = dist.new_group([r], timeout=timeout)
            if r == layout.rank:
                self.single = group
        self.links: dict[int, dist.ProcessGroup] = {}
        n = layout.n_clients
        for a in range(n):
            for b in range(a + 1, n):
                if W[a, b] <= 0:
                    continue
                for local in range(layout.ranks_per_client):
                    group = dist.new_group([layout.rank_of(a, local), layout.rank_of(b, local)], timeout=timeout)
                    if local == layout.local_rank and layout.client in (a, b):
                        self.links[b if layout.client == a else a] = group


class DistributedMixer:
    """x⁺_i = Σ_j w_ij x½_j with x½_j received from rank `local_rank` of each neighbor client j.

    Transfers in the master dtype by default (exact). transfer_dtype set to the working dtype
    ("working-dtype mixing") halves the bytes of a bf16 run at the cost of rounding the
    neighbors' contribution.
    """

    def __init__(self, W: np.ndarray, layout: ClientLayout, groups: ClientGroups, *, timeout_s: float,
                 transfer_dtype: torch.dtype | None = None, chunk: int = MIX_CHUNK,
                 staging: HostStaging | None = None) -> None:
        self.W, self.layout, self.groups, self.chunk = W, layout, groups, chunk
        self.staging = staging  # gloo on GPU ranks: the block goes through pinned host buffers
        self.order = mixing_order(W, layout.client)
        self.neighbors = [j for j in self.order if j != layout.client]
        self.alone = not self.neighbors  # W = [1]: x⁺ = x½, nothing to exchange or sum
        self.timeout = timedelta(seconds=timeout_s)
        self.transfer_dtype = transfer_dtype
        self.total_bytes_sent = 0
        self.total_exchange_s = 0.0
        self.clock = time.perf_counter  # the runtime's timer's clock, which counts the GPU's work (runtime.timing)

    def _peer(self, j: int) -> str:
        return f"client {j} (rank {self.layout.rank_of(j)})"

    def _p2p(self, send: torch.Tensor, received: dict[int, torch.Tensor]) -> None:
        """Send `send` to every neighbor and receive each one's into `received[j]`."""
        pending = []
        for j in self.neighbors:
            peer = self.layout.rank_of(j)
            group = self.groups.links[j]
            try:
                pending.append((j, dist.batch_isend_irecv([
                    dist.P2POp(dist.isend, send, peer, group=group),
                    dist.P2POp(dist.irecv, received[j], peer, group=group),
                ])))
            except RuntimeError as err:
                raise PeerError(f"lost {self._peer(j)} while sending to it: {err}") from err
        for j, works in pending:
            for work in works:
                try:
                    work.wait(timeout=self.timeout)
                except RuntimeError as err:
                    raise PeerError(f"no block from {self._peer(j)} within {self.timeout.total_seconds():g} s "
                                    f"or the link broke: {err}") from err

    def _outgoing(self, x_half: torch.Tensor) -> torch.Tensor:
        return x_half if self.transfer_dtype in (None, x_half.dtype) else x_half.to(self.transfer_dtype)

    def _terms(self, x_half: torch.Tensor, received: dict[int, torch.Tensor]) -> list[tuple[float, torch.Tensor]]:
        i = self.layout.client
        return [(float(self.W[i, j]), x_half if j == i else received[j]) for j in self.order]

    def exchange(self, x_half: torch.Tensor) -> list[tuple[float, torch.Tensor]]:
        """Send x½ to every neighbor and receive theirs: (w_ij, x½_j) in mixing order."""
        start = self.clock()
        send = self._outgoing(x_half)
        received = {j: torch.empty_like(send) for j in self.neighbors}
        if self.staging is None:
            self._p2p(send, received)
        else:
            host, event = self.staging.stage_out(send)
            self.staging.wait(event)
            arrived = self.staging.recv_buffers(host, self.neighbors)
            self._p2p(host, arrived)
            self.staging.stage_in(arrived, received)
        self.total_bytes_sent += len(self.neighbors) * send.numel() * send.element_size()
        self.total_exchange_s += self.clock() - start
        return self._terms(x_half, received)

    def _sum_into(self, chunk: torch.Tensor, terms: list[tuple[float, torch.Tensor]]) -> None:
        # Every send of this chunk has completed, so its x½ and receive buffers are free:
        # x⁺ is summed into the first term's buffer when it has the master dtype.
        first = terms[0][1]
        summed = weighted_sum(terms, dtype=chunk.dtype, out=first if first.dtype == chunk.dtype else None)
        if summed is not chunk:
            chunk.copy_(summed)

    def mix(self, x_half: torch.Tensor) -> torch.Tensor:
        """x⁺, written over x½, exchanged `chunk` elements at a time: the receive buffers are
        chunk-sized, not block-sized (each element is summed exactly as in one piece)."""
        if self.alone:  # 1 · x½ is x½ bit for bit: no pass over the block
            return x_half
        if self.staging is not None:
            return self._mix_staged(x_half)
        for chunk in x_half.split(self.chunk):
            self._sum_into(chunk, self.exchange(chunk))
        return x_half

    def _mix_staged(self, x_half: torch.Tensor) -> torch.Tensor:
        """mix through host memory: chunk k+1 is copied to the host while gloo carries chunk k."""
        chunks = x_half.split(self.chunk)
        received: dict[int, torch.Tensor] = {}
        outgoing = self.staging.stage_out(self._outgoing(chunks[0]))
        for k, chunk in enumerate(chunks):
            start = self.clock()
            host, event = outgoing
            self.staging.wait(event)
            if not received or received[self.neighbors[0]].numel() != host.numel():
                received = {j: torch.empty(host.shape, dtype=host.dtype, device=x_half.device) for j in self.neighbors}
            arrived = self.staging.recv_buffers(host, self.neighbors)
            if k + 1 < len(chunks):  # overlaps the transfer below (a copy stream on a GPU)
                outgoing = self.staging.stage_out(self._outgoing(chunks[k + 1]))
            self._p2p(host, arrived)
            self.staging.stage_in(arrived, received)
            self.total_bytes_sent += len(self.neighbors) * host.numel() * host.element_size()
            self.total_exchange_s += self.clock() - start
            self._sum_into(chunk, self._terms(chunk, received))
        return x_half


def _via_host(tensor: torch.Tensor) -> bool:
    """Whether a collective on `tensor` goes through host memory: gloo on a GPU rank (gloo
    reduces GPU tensors only for a few collectives; a host copy works for all of them)."""
    return tensor.is_cuda and dist.get_backend() == "gloo"


def all_mean_(tensor: torch.Tensor) -> torch.Tensor:
    """In-place mean over every rank of the world (each client counted once: its G ranks agree)."""
    if _via_host(tensor):
        host = tensor.cpu()
        dist.all_reduce(host)
        tensor.copy_(host)
    else:
        dist.all_reduce(tensor)
    return tensor.div_(dist.get_world_size())


def all_gather_(tensor: torch.Tensor) -> list[torch.Tensor]:
    """Every rank's `tensor`, on this rank's device."""
    source = tensor.cpu() if _via_host(tensor) else tensor
    gathered = [torch.empty_like(source) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, source)
    return [g.to(tensor.device) for g in gathered]
