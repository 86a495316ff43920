"""Where ranks run and how they talk: the transport (NCCL or gloo over TCP), the rank → GPU map,
and the host staging that lets gloo carry the active block of GPU ranks.

NCCL refuses two ranks of one GPU in a communicator and needs a fabric between sites; gloo runs
over plain TCP and between ranks that share a GPU, with the block staged through pinned host
memory. Layouts are checked from the environment alone, so every rank refuses a bad one with the
same message before any process group exists.
"""

from __future__ import annotations

import os
from collections import Counter
from dataclasses import dataclass

import torch

from .options import TRANSPORTS


@dataclass(frozen=True)
class RankPlace:
    """One rank's machine (node), GPU index (None on a CPU rank) and global rank."""

    node: int
    gpu: int | None
    rank: int


def resolve_transport(transport: str, on_gpu: bool) -> str:
    """'auto' is NCCL on GPU ranks and gloo on CPU ranks; NCCL cannot run without a GPU."""
    if transport not in TRANSPORTS:
        raise ValueError(f"--transport must be one of {TRANSPORTS}, got {transport!r}")
    if transport == "auto":
        return "nccl" if on_gpu else "gloo"
    if transport == "nccl" and not on_gpu:
        raise ValueError("--transport nccl needs GPU ranks; these ranks see no GPU (use gloo)")
    return transport


def parse_device_map(device_map: str) -> list[int] | None:
    """'auto' → None (local rank modulo the visible GPUs), or GPU indices '0,0,1,1' by local rank."""
    if device_map == "auto":
        return None
    try:
        gpus = [int(x) for x in device_map.split(",")]
    except ValueError:
        raise ValueError(f"--device-map takes 'auto' or GPU indices by local rank like 0,0,1,1; "
                         f"got {device_map!r}") from None
    if not gpus or min(gpus) < 0:
        raise ValueError(f"--device-map: GPU indices must be >= 0, got {device_map!r}")
    return gpus


def gpu_of(local_rank: int, n_gpus: int, device_map: list[int] | None) -> int:
    """The GPU index of local rank `local_rank` on a node with `n_gpus` visible GPUs."""
    if device_map is None:
        return local_rank % n_gpus
    if local_rank >= len(device_map):
        raise ValueError(f"--device-map names {len(device_map)} GPUs but this node runs local rank {local_rank}")
    if device_map[local_rank] >= n_gpus:
        raise ValueError(f"--device-map puts local rank {local_rank} on GPU {device_map[local_rank]}, "
                         f"but only {n_gpus} are visible")
    return device_map[local_rank]


def node_places(node: int, first_rank: int, local_world_size: int, n_gpus: int,
                device_map: list[int] | None) -> list[RankPlace]:
    """The places of one node's ranks: launchers number them contiguously from `first_rank`, with
    local ranks 0 … L−1 (nodes may run different numbers of ranks)."""
    return [RankPlace(node, gpu_of(local, n_gpus, device_map) if n_gpus else None, first_rank + local)
            for local in range(local_world_size)]


def check_placement(places: list[RankPlace], ranks_per_client: int, transport: str) -> dict[int, int]:
    """Refuse a layout the transport cannot run; return how many clients share each GPU of the
    busiest of the nodes in `places` as {gpu: clients} (empty on CPU ranks).

    NCCL cannot hold two ranks of one GPU in a communicator; the G ranks of one client share
    DeepSpeed's gradient all-reduce, which must not see two ranks of one device either."""
    shared = Counter((p.node, p.gpu) for p in places if p.gpu is not None)
    clients: dict[int, list[RankPlace]] = {}
    for p in places:
        clients.setdefault(p.rank // ranks_per_client, []).append(p)
    for c, mine in sorted(clients.items()):
        seen = Counter((p.node, p.gpu) for p in mine if p.gpu is not None)
        twice = [key for key, n in seen.items() if n > 1]
        if twice:
            node, gpu = twice[0]
            raise ValueError(f"client {c} would have {seen[twice[0]]} of its {ranks_per_client} ranks on GPU {gpu} "
                             f"of node {node}: the ranks of one client (data parallel) need a GPU each; use fewer "
                             "ranks per client or place them with --device-map")
    crowded = [key for key, n in shared.items() if n > 1]
    if crowded and transport == "nccl":
        node, gpu = crowded[0]
        raise ValueError(f"{shared[crowded[0]]} ranks share GPU {gpu} of node {node}, which NCCL refuses; "
                         "run them with --transport gloo (the block is staged through host memory)")
    per_gpu: dict[int, int] = {}
    for (node, gpu), n in shared.items():
        per_gpu[gpu] = max(per_gpu.get(gpu, 0), n)
    return per_gpu


def local_world_size(default: int) -> int:
    """The ranks on this node, as the launcher says (torchrun: LOCAL_WORLD_SIZE, deepspeed: LOCAL_SIZE)."""
    return int(os.environ.get("LOCAL_WORLD_SIZE", os.environ.get("LOCAL_SIZE", str(default))))


def spans_nodes() -> bool:
    """Whether the job's ranks run on more than one node (each loads the model from its own disk)."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    return local_world_size(world) < world


def env_placement(device_map: str, n_gpus: int | None = None) -> list[RankPlace]:
    """The places of this node's ranks, from the launcher's environment (RANK − LOCAL_RANK is the
    node's first rank, LOCAL_WORLD_SIZE its count): every check is about one node's GPUs, so sites
    may run different numbers of ranks."""
    local_world = local_world_size(int(os.environ.get("WORLD_SIZE", "1")))
    first = int(os.environ.get("RANK", "0")) - int(os.environ.get("LOCAL_RANK", "0"))
    node = int(os.environ.get("GROUP_RANK", os.environ.get("NODE_RANK", "0")))
    gpus = torch.cuda.device_count() if n_gpus is None else n_gpus
    return node_places(node, first, local_world, gpus, parse_device_map(device_map))


class HostStaging:
    """The active block's exchange over gloo for ranks whose block lives on a GPU: each chunk is
    copied to pinned host memory, sent and received by gloo, and copied back.

    Two send slots let the device → host copy of chunk k+1 run (on a copy stream) while gloo
    carries chunk k; the host → device copy of what arrived is ordered before the compute
    stream's next use by an event, so the caller sums on the device as with NCCL. On CPU ranks
    (DECA_STAGE_ON_CPU=1, the tests) the same steps run with plain copies through separate host
    buffers.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.cuda = device.type == "cuda"
        self.copy_stream = torch.cuda.Stream(device) if self.cuda else None
        self._send: list[torch.Tensor | None] = [None, None]
        self._recv: dict[int, torch.Tensor] = {}
        self._slot = 0

    def _host(self, like: torch.Tensor, old: torch.Tensor | None) -> torch.Tensor:
        """A host buffer of `like`'s size and dtype, pinned on a GPU rank, reused while it fits."""
        if old is None or old.numel() < like.numel() or old.dtype != like.dtype:
            old = torch.empty(like.numel(), dtype=like.dtype, pin_memory=self.cuda)
        return old[:like.numel()].view(like.shape)

    def stage_out(self, send: torch.Tensor) -> tuple[torch.Tensor, object]:
        """Start copying `send` (on the device) into the next host slot: (host view, event)."""
        self._slot ^= 1
        host = self._host(send, self._send[self._slot])
        self._send[self._slot] = host if host._base is None else host._base
        if not self.cuda:
            host.copy_(send)
            return host, None
        self.copy_stream.wait_stream(torch.cuda.current_stream(self.device))  # send is written
        with torch.cuda.stream(self.copy_stream):
            host.copy_(send, non_blocking=True)
            send.record_stream(self.copy_stream)
            event = torch.cuda.Event()
            event.record(self.copy_stream)
        return host, event

    def recv_buffers(self, like: torch.Tensor, peers: list[int]) -> dict[int, torch.Tensor]:
        """Host receive buffers, one per peer."""
        out = {}
        for j in peers:
            out[j] = self._host(like, self._recv.get(j))
            self._recv[j] = out[j] if out[j]._base is None else out[j]._base
        return out

    @staticmethod
    def wait(event) -> None:
        if event is not None:
            event.synchronize()  # gloo reads the host buffer from this thread

    def stage_in(self, host: dict[int, torch.Tensor], device: dict[int, torch.Tensor]) -> None:
        """Copy what arrived back to the device buffers, ordered before the compute stream's next work."""
        if not self.cuda:
            for j, h in host.items():
                device[j].copy_(h)
            return
        self.copy_stream.wait_stream(torch.cuda.current_stream(self.device))  # buffers no longer read
        with torch.cuda.stream(self.copy_stream):
            for j, h in host.items():
                device[j].copy_(h, non_blocking=True)
        torch.cuda.current_stream(self.device).wait_stream(self.copy_stream)
        # the host buffers are reused by the next chunk's receive: that copy must be done first
        self.copy_stream.synchronize()
