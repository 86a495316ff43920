"""Where the deepspeed backend's cells run: the launcher's arguments for each cell's ranks, from the
grid's `deepspeed_args` and the machine the grid runs on, checked for every cell before the first
one starts.

Left to itself, the deepspeed launcher gets a grid wrong twice: `--num_gpus N` makes it drop
CUDA_VISIBLE_DEVICES (a scheduler's share of a node) and take GPUs 0..N-1, and a hostfile without a
filter gives every cell every slot of every host (a cell of 12 clients on two 8-GPU nodes would
start 16 ranks, which deca-train refuses). So each cell's ranks are named:

- with a hostfile (deepspeed_args' `--hostfile`, or the launcher's default /job/hostfile where it
  exists): the fewest hosts, in the file's order, that hold the cell's clients, the clients spread
  over them as evenly as they go (a client's ranks on one host), as `--include host:0,1,..@host:..`;
- without one, on a machine with GPUs: the first clients x ranks_per_client of those it shows
  (CUDA_VISIBLE_DEVICES, else all), as `--include localhost:..`, and a free port (`--master_port`),
  so that two grid runs on one node, each given its own GPUs, do not meet at the launcher's 29500;
- on CPU ranks (no GPU): `--num_gpus N` processes and a free port.

deepspeed_args that place the ranks themselves (`--include`, `--exclude`, `--num_nodes`,
`--num_gpus`) or name the port are passed as they are.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

from .grid import Cell, Grid, GridError


@dataclass(frozen=True)
class Placement:
    given: tuple[str, ...]  # the grid's deepspeed_args
    slots: dict[str, list[int]] | None  # host -> its slots to fill, in order; None: by count, or as given
    by_count: bool  # CPU ranks: --num_gpus N processes
    own_port: bool  # a launch on this machine, and the grid names no port: a free one per launch
    where: str  # what the slots are, for messages

    def capacity(self, ranks_per_client: int) -> int:
        """Clients the slots hold, each client's ranks on one host."""
        return sum(len(s) // ranks_per_client for s in self.slots.values())

    def args(self, clients: int, ranks_per_client: int) -> list[str]:
        """The launcher's arguments for a cell of `clients` x `ranks_per_client` ranks."""
        args = list(self.given)
        if self.by_count:
            args += ["--num_gpus", str(clients * ranks_per_client)]
        if self.slots is not None:
            take = _spread(clients, [len(s) // ranks_per_client for s in self.slots.values()])
            args += ["--include", "@".join(f"{host}:{','.join(map(str, slots[:n * ranks_per_client]))}"
                                           for (host, slots), n in zip(self.slots.items(), take) if n)]
        if self.own_port:
            args += ["--master_port", str(_free_port())]
        return args


def placement(grid: Grid, cells: Iterable[Cell], env: Mapping[str, str] | None = None) -> Placement:
    """How `grid`'s deepspeed cells launch here; GridError, before any cell runs, for deepspeed_args
    the launcher refuses, a hostfile that is not there, and a cell of `cells` its slots cannot hold."""
    from deepspeed.launcher.runner import DLTS_HOSTFILE, fetch_hostfile, parse_args

    env = os.environ if env is None else env
    given = tuple(grid.deepspeed_args)
    try:
        args = parse_args([*given, "--module", "deca_ds.train"])
    except SystemExit as exit_:  # argparse has printed why
        raise GridError(f"deepspeed_args {list(given)}: the deepspeed launcher refuses them") from exit_
    hostfile = Path(args.hostfile).is_file()
    if not hostfile and args.hostfile != DLTS_HOSTFILE:  # the launcher would only warn, and run every rank here
        raise GridError(f"deepspeed_args: hostfile {args.hostfile} does not exist")
    own_port = not hostfile and not any(a.split("=", 1)[0].startswith("--master_p") for a in given)
    if args.include or args.exclude or args.num_nodes > 0 or args.num_gpus > 0:
        return Placement(given, None, False, own_port, "as deepspeed_args place them")
    if hostfile:
        try:
            hosts = fetch_hostfile(args.hostfile)
        except ValueError as err:
            raise GridError(f"deepspeed_args: hostfile {args.hostfile}: {err}") from None
        found = Placement(given, {h: list(range(n)) for h, n in hosts.items()}, False, False,
                          f"hostfile {args.hostfile} ({', '.join(f'{h}: {n}' for h, n in hosts.items())} slots)")
    else:
        found = _this_machine(given, own_port, env)
    if found.slots is not None:
        short = [c for c in cells if c.clients > found.capacity(c.options.get("ranks_per_client", 1))]
        if short:
            c = short[0]
            raise GridError(
                f"{len(short)} cell(s) need more GPUs than {found.where}, e.g. {c.key}: {c.clients} clients x "
                f"{c.options.get('ranks_per_client', 1)} rank(s), each on a GPU of its own. Give the grid a hostfile "
                "of more nodes (deepspeed_args: [--hostfile, FILE]), or run those cells where they fit (--only)")
    return found


def _this_machine(given: tuple[str, ...], own_port: bool, env: Mapping[str, str]) -> Placement:
    import torch

    if not torch.cuda.is_available():
        return Placement(given, None, True, own_port, "CPU ranks")
    visible = env.get("CUDA_VISIBLE_DEVICES")
    if visible is None:
        ids = list(range(torch.cuda.device_count()))
    elif not all(v.strip().isdigit() for v in visible.split(",")):
        raise GridError(f"CUDA_VISIBLE_DEVICES={visible}: the deepspeed launcher places ranks by GPU index; "
                        "name the GPUs by index")
    else:
        ids = [int(v) for v in visible.split(",")]
    where = f"GPUs {','.join(map(str, ids))} of this machine" + (" (CUDA_VISIBLE_DEVICES)" if visible else "")
    return Placement(given, {"localhost": ids}, False, own_port, where)


def _spread(clients: int, room: list[int]) -> list[int]:
    """Clients per host: the fewest hosts that hold them, as evenly as each host's room allows."""
    n = next(n for n in range(1, len(room) + 1) if sum(room[:n]) >= clients)
    take = [0] * len(room)
    while clients:
        for i in range(n):
            if clients and take[i] < room[i]:
                take[i] += 1
                clients -= 1
    return take


def _free_port() -> int:
    """A port free on this machine now, for the launch's rendezvous (rank 0 binds it a moment later)."""
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]
