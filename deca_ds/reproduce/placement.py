"""Where a grid run's cells go: the GPUs (or hosts' GPUs) its cells share, `jobs` at a time, and for
each cell the deepspeed launcher's arguments or the GPU its process sees, checked for every cell
before the first one starts.

Left to itself, the deepspeed launcher gets a grid wrong twice: `--num_gpus N` makes it drop
CUDA_VISIBLE_DEVICES (a scheduler's share of a node) and take GPUs 0..N-1, and a hostfile without a
filter gives every cell every slot of every host (a cell of 12 clients on two 8-GPU nodes would
start 16 ranks, which deca-train refuses). So a deepspeed cell holds one slot per rank while it
runs, and a cell that finds too few free waits for the cells that hold them:

- with a hostfile (deepspeed_args' `--hostfile`, or the launcher's default /job/hostfile where it
  exists): the fewest hosts that hold the cell's clients now (the freest first, the file's order
  among equals), the clients spread over them as evenly as they go (a client's ranks on one host),
  as `--include host:0,1,..@host:..`, and `--master_port` 29500 + its first slot, so that two cells
  on one host meet at ports of their own;
- without one, on a machine with GPUs: free GPUs of those it shows (CUDA_VISIBLE_DEVICES, else
  all), as `--include localhost:..`, and a free port: two grid runs on one node, each given its own
  GPUs, do not meet at the launcher's 29500 either;
- on CPU ranks (no GPU): `--num_gpus N` processes and a free port.

With `clients_per_gpu` K above 1 a GPU of this machine holds up to K ranks (a client each), and a
cell's clients spread over all GPUs with room, as evenly as it allows, so that they time-share as
few to a card as they can. The deepspeed launcher gives every slot one process, so these cells are
started by torchrun, with the GPUs they take as CUDA_VISIBLE_DEVICES, deca-train's `--device-map`
putting each local rank on its GPU, and `--transport gloo` (NCCL refuses two ranks of one GPU).

deepspeed_args that place the ranks themselves (`--include`, `--exclude`, `--num_nodes`,
`--num_gpus`) or name the port are passed as they are. A simulated cell (every client in one
process) runs on the visible GPU that runs the fewest cells then (its CUDA_VISIBLE_DEVICES), so
`jobs` cells spread over a machine's GPUs instead of sharing the first one.
"""

from __future__ import annotations

import os
import threading
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from ..runtime.rank import free_port
from .grid import Cell, Grid, GridError

PORT = 29500  # the deepspeed launcher's rendezvous port (deepspeed.constants.TORCH_DISTRIBUTED_DEFAULT_PORT)


@dataclass(frozen=True)
class Launch:
    """How one cell starts: the deepspeed launcher's arguments (deepspeed backend) and what its
    process's environment changes."""

    args: list[str] = field(default_factory=list)  # the launcher's
    env: dict[str, str] = field(default_factory=dict)
    launcher: str = "deepspeed"  # or "torchrun": ranks that share a GPU
    train_args: list[str] = field(default_factory=list)  # deca-train's, besides the cell's options


@dataclass
class Placement:
    where: str  # what the slots are, for messages
    slots: dict[str, list[str]] | None = None  # host -> its GPUs, in order; None: nothing to place
    given: tuple[str, ...] = ()  # the grid's deepspeed_args
    by_count: bool = False  # CPU ranks: --num_gpus N processes
    port: str = "given"  # "free": a free one per launch (this machine); "slot": 29500 + the first slot (hosts)
    shared: bool = False  # simulated cells: one GPU each, shared with other cells
    per_gpu: int = 1  # deepspeed cells: ranks a GPU holds (the grid's clients_per_gpu; one host)
    _held: dict[str, Counter] = field(init=False, repr=False)  # host -> slot -> cells on it
    _changed: threading.Condition = field(init=False, repr=False, default_factory=threading.Condition)

    def __post_init__(self) -> None:
        self._held = {host: Counter() for host in self.slots or {}}

    def capacity(self, ranks_per_client: int) -> int:
        """Clients the slots hold, each client's ranks on one host."""
        return sum(len(s) * self.per_gpu // ranks_per_client for s in self.slots.values())

    @contextmanager
    def cell(self, cell: Cell, stopped: Callable[[], bool]) -> Iterator[Launch | None]:
        """How `cell` starts, its slots held until the block ends; None if the grid stopped while it
        waited for slots (every wait a second long: the cells that hold them end within their time
        limit)."""
        with self._changed:
            while (taken := self._take(cell.clients, cell.ranks_per_client)) is None and not stopped():
                self._changed.wait(timeout=1.0)
            for host, slots in (taken or {}).items():
                self._held[host].update(slots)
        if taken is None:
            yield None
            return
        try:
            yield self._launch(taken, cell.clients * cell.ranks_per_client)
        finally:
            with self._changed:
                for host, slots in taken.items():
                    self._held[host].subtract(slots)
                self._changed.notify_all()

    def _take(self, clients: int, ranks_per_client: int) -> dict[str, list[str]] | None:
        """The slots the cell would run on now ({} where nothing is placed), None if too few are free."""
        if self.slots is None:
            return {}
        if self.shared:
            host, slots = next(iter(self.slots.items()))
            return {host: [min(slots, key=lambda s: self._held[host][s])]}  # the first of the least busy
        if self.per_gpu > 1:  # one host; ranks_per_client is 1 (Grid)
            host, slots = next(iter(self.slots.items()))
            room = [self.per_gpu - self._held[host][s] for s in slots]
            if sum(room) < clients:
                return None
            return {host: [s for s, n in zip(slots, _spread(clients, room, fewest=False)) for _ in range(n)]}
        free = {host: [s for s in slots if not self._held[host][s]] for host, slots in self.slots.items()}
        room = [len(f) // ranks_per_client for f in free.values()]
        if sum(room) < clients:
            return None
        return {host: f[:n * ranks_per_client] for (host, f), n in zip(free.items(), _spread(clients, room)) if n}

    def _launch(self, taken: dict[str, list[str]], ranks: int) -> Launch:
        if self.shared:
            return Launch(env={"CUDA_VISIBLE_DEVICES": next(iter(taken.values()))[0]})
        if self.per_gpu > 1:
            return _torchrun(next(iter(taken.values())))
        args = list(self.given)
        if self.by_count:
            args += ["--num_gpus", str(ranks)]
        if taken:
            args += ["--include", "@".join(f"{host}:{','.join(slots)}" for host, slots in taken.items())]
        if self.port == "free":  # no hostfile: the launcher meets at 127.0.0.1
            args += ["--master_port", str(free_port())]
        elif self.port == "slot":
            args += ["--master_port", str(PORT + int(next(iter(taken.values()))[0]))]
        return Launch(args=args)


def _torchrun(gpus: list[str]) -> Launch:
    """One rank per entry of `gpus` (a GPU's name once for each rank it holds), on this machine."""
    visible = list(dict.fromkeys(gpus))
    return Launch(args=["--nproc-per-node", str(len(gpus)), "--master-addr", "127.0.0.1",
                        "--master-port", str(free_port())],
                  env={"CUDA_VISIBLE_DEVICES": ",".join(visible)}, launcher="torchrun",
                  train_args=["--device-map", ",".join(str(visible.index(g)) for g in gpus), "--transport", "gloo"])


def placement(grid: Grid, cells: Iterable[Cell], env: Mapping[str, str] | None = None) -> Placement:
    """Where `grid`'s cells go here; GridError, before any cell runs, for deepspeed_args the
    launcher refuses, a hostfile that is not there or not one, and a cell of `cells` that the slots
    cannot hold."""
    env = os.environ if env is None else env
    if grid.backend != "deepspeed":  # one GPU: its cells' processes see it as they would anyway
        gpus = _visible_gpus(env)
        if gpus is None or len(gpus[0]) == 1:
            return Placement(gpus[1] if gpus else "the CPU")
        return Placement(gpus[1], {"localhost": gpus[0]}, shared=True)
    from deepspeed.launcher.constants import PDSH_LAUNCHER
    from deepspeed.launcher.runner import DLTS_HOSTFILE, fetch_hostfile, parse_args

    given = tuple(grid.deepspeed_args)
    try:
        args = parse_args([*given, "--module", "deca_ds.train"])
    except SystemExit as exit_:  # argparse has printed why
        raise GridError(f"deepspeed_args {list(given)}: the deepspeed launcher refuses them") from exit_
    hostfile = Path(args.hostfile).is_file()
    if not hostfile and args.hostfile != DLTS_HOSTFILE:  # the launcher would only warn, and run every rank here
        raise GridError(f"deepspeed_args: hostfile {args.hostfile} does not exist")
    if hostfile and args.launcher.lower() != PDSH_LAUNCHER:
        raise GridError(f"deepspeed_args: --launcher {args.launcher}: deca-train joins its job through RANK, "
                        f"WORLD_SIZE and MASTER_ADDR, which the {PDSH_LAUNCHER} launcher (the default) sets on every "
                        "host and the MPI and slurm ones do not")
    sharing = grid.clients_per_gpu > 1
    if sharing and (hostfile or given):
        raise GridError(f"clients_per_gpu {grid.clients_per_gpu}: ranks that share a GPU are started by torchrun on "
                        "this machine, without the deepspeed launcher's "
                        + (f"hostfile {args.hostfile}" if hostfile else f"arguments {list(given)}")
                        + "; share GPUs on one node, or give each client a GPU of its own")
    named = any(a.split("=", 1)[0].startswith("--master_p") for a in given)
    port = "given" if named else "slot" if hostfile else "free"
    if args.include or args.exclude or args.num_nodes > 0 or args.num_gpus > 0:
        if grid.jobs > 1:
            raise GridError(f"jobs {grid.jobs}: deepspeed_args {list(given)} place every cell's ranks on the same "
                            "GPUs; leave the placing to the grid, or run one cell at a time")
        return Placement("as deepspeed_args place them", given=given, port="given" if port == "slot" else port)
    if hostfile:
        try:
            hosts = fetch_hostfile(args.hostfile)
        except ValueError as err:
            raise GridError(f"deepspeed_args: hostfile {args.hostfile}: {err}") from None
        found = Placement(f"hostfile {args.hostfile} ({', '.join(f'{h}: {n}' for h, n in hosts.items())} slots)",
                          {h: [str(s) for s in range(n)] for h, n in hosts.items()}, given=given, port=port)
    elif (gpus := _visible_gpus(env)) is None:
        return Placement("CPU ranks", given=given, by_count=True, port=port)
    elif not all(g.isdigit() for g in gpus[0]):
        raise GridError(f"CUDA_VISIBLE_DEVICES={env['CUDA_VISIBLE_DEVICES']}: the deepspeed launcher places "
                        "ranks by GPU index; name the GPUs by index")
    else:
        k = grid.clients_per_gpu
        found = Placement(gpus[1] + (f", up to {k} clients a GPU" if sharing else ""), {"localhost": gpus[0]},
                          given=given, port=port, per_gpu=k)
    short = [c for c in cells if c.clients > found.capacity(c.ranks_per_client)]
    if short:
        c = short[0]
        raise GridError(
            f"{len(short)} cell(s) need more GPUs than {found.where}, e.g. {c.key}: {c.clients} clients x "
            f"{c.ranks_per_client} rank(s), "
            + (f"up to {found.per_gpu} on a GPU" if found.per_gpu > 1 else "each on a GPU of its own")
            + ". Give the grid a hostfile of more nodes (deepspeed_args: [--hostfile, FILE])"
            + ("" if hostfile else " or more clients a GPU (clients_per_gpu)")
            + ", or run those cells where they fit (--only)")
    return found


def _visible_gpus(env: Mapping[str, str]) -> tuple[list[str], str] | None:
    """(the GPUs this machine shows, as CUDA_VISIBLE_DEVICES names them, and how to say so), or None
    without a GPU."""
    import torch

    if not torch.cuda.is_available():
        return None
    visible = env.get("CUDA_VISIBLE_DEVICES")
    gpus = [v.strip() for v in visible.split(",")] if visible else [str(i) for i in range(torch.cuda.device_count())]
    if not gpus:
        return None
    where = f"GPU{'s' * (len(gpus) > 1)} {','.join(gpus)} of this machine" + (" (CUDA_VISIBLE_DEVICES)" * bool(visible))
    return gpus, where


def _spread(clients: int, room: list[int], *, fewest: bool = True) -> list[int]:
    """Clients per host (or GPU): on the fewest hosts that hold them (those with the most room, the
    first of equal ones), or on all with room where not `fewest`, as evenly as each one's room allows."""
    order = sorted(range(len(room)), key=lambda i: -room[i])
    n = next(n for n in range(1, len(room) + 1) if sum(room[i] for i in order[:n]) >= clients) if fewest else len(room)
    take = [0] * len(room)
    while clients:
        for i in order[:n]:
            if clients and take[i] < room[i]:
                take[i] += 1
                clients -= 1
    return take

