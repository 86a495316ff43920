"""One rank's start: what its launcher (deepspeed, torchrun, or none) set, its device, threads and
memory cap, and the process group it joins; free_port and torchrun_env for the tools and tests that
start ranks themselves."""

from __future__ import annotations

import os
import socket
from datetime import timedelta

import torch
import torch.distributed as dist

from .transport import gpu_of, local_world_size, parse_device_map, resolve_transport


def launch_rank() -> int:
    """This process's rank as its launcher numbered it (RANK), readable before any process group
    exists; 0 for a process started without one, a job of one rank."""
    return int(os.environ.get("RANK", "0"))


def launch_local_rank() -> int:
    """Its rank on its node (LOCAL_RANK; 0 without a launcher)."""
    return int(os.environ.get("LOCAL_RANK", "0"))


def local_device(device_map: str = "auto") -> torch.device:
    """This rank's device: the GPU --device-map gives local rank LOCAL_RANK (by default LOCAL_RANK
    modulo the visible GPUs, so k ranks can share one), or the CPU on a machine without one."""
    if not torch.cuda.is_available():
        return torch.device("cpu")
    return torch.device("cuda", gpu_of(launch_local_rank(), torch.cuda.device_count(), parse_device_map(device_map)))


def to_device(batch, device: torch.device):
    """`batch` (a tensor, or a dict of them) on `device`. To a GPU through pinned memory without
    waiting: a pageable copy waits for every kernel queued before it, so the host could not queue
    one step's (or client's) work while the device runs the previous one's."""
    if isinstance(batch, dict):
        return {k: to_device(v, device) for k, v in batch.items()}
    if device.type != "cuda":
        return batch.to(device)
    return batch.pin_memory().to(device, non_blocking=True)


def cap_gpu_memory(gb: float, device: torch.device, ranks_per_gpu: dict[int, int] | None = None) -> None:
    """--gpu-memory-gb: this process's CUDA allocator may hold at most `gb` GB of `device`, as if the
    card were that small (less its CUDA context, which the cap does not count); an allocation past
    it raises torch's out-of-memory error, as it would there. The ranks that share the GPU
    (`ranks_per_gpu`, {gpu: ranks}) each have this cap: together they must fit it, or a rank could
    run out below its cap. 0: no cap."""
    if not gb:
        return
    if device.type != "cuda":
        raise ValueError(f"--gpu-memory-gb {gb:g} caps the CUDA allocator, but this rank runs on the CPU (no GPU "
                         "visible)")
    total = torch.cuda.get_device_properties(device).total_memory
    sharing = (ranks_per_gpu or {}).get(device.index, 1)
    if gb * sharing * 1e9 > total:
        ranks = f"{sharing} ranks share GPU {device.index}, so {sharing} × {gb:g} GB must fit its" if sharing > 1 \
            else f"GPU {device.index} has only"
        raise ValueError(f"--gpu-memory-gb {gb:g}: {ranks} {total / 1e9:.2f} GB")
    torch.cuda.set_per_process_memory_fraction(gb * 1e9 / total, device)


def rank_threads(local_ranks: int, device: torch.device) -> int | None:
    """Torch threads for this rank: DECA_RANK_THREADS where set (a comparison with the simulator
    runs both at one count: CPU matmuls round differently at another), else cpu_count / local ranks
    on CPU (the ranks share the machine's cores; letting each use all of them thrashes), else None
    (GPU ranks keep torch's default)."""
    value = os.environ.get("DECA_RANK_THREADS", "").strip()
    if value:
        if not value.isdigit() or int(value) < 1:
            raise ValueError(f"DECA_RANK_THREADS={value!r}: give a positive number of threads per rank")
        return int(value)
    return max(1, (os.cpu_count() or 1) // local_ranks) if device.type == "cpu" else None


def free_port() -> int:
    """A port free on this machine now, on every interface, for a rendezvous that rank 0 binds a
    moment later."""
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def torchrun_env(rank: int, world_size: int, port: int | str, per_node: int | None = None) -> dict[str, str]:
    """The variables torchrun gives `rank` of `world_size` ranks on nodes of `per_node` (all on one
    node by default), its rendezvous on this machine's `port`: what init_process_group reads, for
    tools and tests that start the ranks themselves."""
    node, local = divmod(rank, per_node or world_size)
    return {"RANK": str(rank), "WORLD_SIZE": str(world_size), "LOCAL_RANK": str(local),
            "LOCAL_WORLD_SIZE": str(per_node or world_size), "GROUP_RANK": str(node),
            "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}


# What a launcher (deepspeed, torchrun) sets for every rank and init_process_group reads.
LAUNCH_VARS = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def _rendezvous(timeout_s: float) -> tuple[int, int, dist.Store]:
    """This rank, the world size and the launcher's rendezvous store (bound here by rank 0)."""
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    agent_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    host, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    try:
        store = dist.TCPStore(host, port, world_size, is_master=rank == 0 and not agent_store,
                              timeout=timedelta(seconds=timeout_s), multi_tenant=True)
    except (RuntimeError, OSError) as err:  # DistNetworkError / DistStoreError are RuntimeErrors
        what = (f"cannot bind the rendezvous port {host}:{port} (taken, or not this machine's address)"
                if rank == 0 and not agent_store else
                f"cannot reach the rendezvous at {host}:{port} within {timeout_s:g} s (rank 0 is not up, "
                "could not bind it, or a firewall blocks it)")
        raise ValueError(f"{what}: {err}") from err
    return rank, world_size, store


def init_process_group(timeout_s: float, transport: str = "auto",
                       device_map: str = "auto") -> tuple[int, int, torch.device, dist.Store]:
    """Join the job started by deepspeed/torchrun over `transport` (resolve_transport: NCCL on GPUs
    and gloo on CPU by default; gloo on GPUs too when asked, for ranks sharing a GPU or sites
    joined by TCP only).

    The rendezvous store is created here, as env:// would, so that the run keeps a handle on it
    for the heartbeat board (torchrun's agent hosts it itself; then every rank is a client).
    Started without a launcher (none of its variables set), the process is a job of one rank, its
    store in memory: `deca-train` alone trains one client, as `torchrun --nproc-per-node 1` would,
    without a port."""
    missing = [var for var in LAUNCH_VARS if var not in os.environ]
    if len(missing) == len(LAUNCH_VARS):
        rank, world_size, store = 0, 1, dist.HashStore()
        os.environ["LOCAL_RANK"] = "0"  # DeepSpeed's engine asserts it, as its own init_distributed sets it
    elif missing:
        raise ValueError(f"{', '.join(missing)} not set, but {', '.join(v for v in LAUNCH_VARS if v not in missing)} "
                         "set: start training with `deepspeed` or `torchrun`, or with none of them for one rank")
    else:
        rank, world_size, store = _rendezvous(timeout_s)
    device = local_device(device_map)
    backend = resolve_transport(transport, device.type == "cuda")
    threads = rank_threads(local_world_size(1), device)
    if threads is not None:
        torch.set_num_threads(threads)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(backend, store=dist.PrefixStore("default_pg", store), rank=rank,
                            world_size=world_size, timeout=timedelta(seconds=timeout_s),
                            device_id=device if backend == "nccl" else None)
    return rank, world_size, device, store
