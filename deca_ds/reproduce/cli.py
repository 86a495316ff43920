"""deca-reproduce (launch/reproduce.py): check a grid file, run its unfinished cells, write the tables and figures."""

from __future__ import annotations

import argparse
import os
import shlex
import signal
import sys
from functools import partial
from typing import Callable

from ..reporting import invocation, pin_cpu_kernels
from ..runtime.fetch import fetch_hub
from .cell_dir import base_weights, is_finished, resume_step, seconds_per_step, steps_done
from .cells import base_state, check_finished, holder, pretrain_base, run_grid
from .compare import compare_cells
from .figures import write_figures
from .footprint import estimate_cells
from .generation import judge_cells
from .grid import BACKENDS, Cell, Grid, GridError, grid_names, load_grid, parse_settings
from .paper import published_cells
from .placement import Placement, placement
from .pretrain import kernels_note
from .report import check_results_dir, recorded_results, write_report
from .time_left import finished_rates, time_left


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="deca-reproduce", description=__doc__)
    p.add_argument("grid", help=f"grid file (YAML), or a shipped grid's name ({', '.join(grid_names())})")
    p.add_argument("--runs-dir", help="where the cells run (default: the grid's runs_dir)")
    p.add_argument("--results-dir", help="where tables and figures go (default: the grid's results_dir)")
    p.add_argument("--jobs", type=int, help="cells run at once, each on GPUs of its own in the deepspeed backend "
                                            "(default: the grid's jobs, else 1)")
    p.add_argument("--backend", choices=BACKENDS,
                   help="run the cells simulated (every client of a cell in one process) or on deca-train's ranks "
                        "(deepspeed, with --ds-config) in place of the grid's backend; a cell computes the same "
                        "either way (docs/reproduce.md)")
    p.add_argument("--ds-config", metavar="PRESET",
                   help="the deepspeed backend's preset (a shipped name or a DeepSpeed JSON file) in place of the "
                        "grid's ds_config")
    p.add_argument("--clients-per-gpu", type=int, metavar="K",
                   help="deepspeed backend: up to K clients (ranks) on one GPU, started by torchrun and talking over "
                        "gloo (default: the grid's clients_per_gpu, else 1: a GPU each)")
    p.add_argument("--deepspeed-args", metavar="ARGS", type=shlex.split,
                   help="the deepspeed launcher's arguments for this run, in place of the grid's deepspeed_args "
                        "(deepspeed backend), e.g. --deepspeed-args='--hostfile hosts.$SLURM_JOB_ID'")
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--dry-run", action="store_true",
                      help="check the grid and list its cells (finished, running where and how far, to run); "
                           "run nothing")
    mode.add_argument("--report-only", action="store_true",
                      help="write tables and figures of the finished cells only")
    mode.add_argument("--tables-from", metavar="RESULTS_JSON", nargs="+", type=os.path.expanduser,
                      help="write the tables and figures from results.json files of this grid (a committed one, ones "
                           "from other machines) instead of the cells' directories, a later file's finished cells "
                           "in place of an earlier one's; run nothing")
    mode.add_argument("--estimate", action="store_true",
                      help="each cell's estimated GPU memory per client (deca-train --estimate) and the cards it "
                           "fits (deepspeed backend); run nothing")
    mode.add_argument("--fetch", action="store_true",
                      help="download the hub models and tasks the cells read into the Hugging Face caches, for "
                           "compute nodes without a network (then HF_HUB_OFFLINE=1); run nothing")
    p.add_argument("--compare", metavar="RESULTS_JSON", type=os.path.expanduser,
                   help="after the run (or with --report-only), each finished cell beside the same cell of this "
                        "results.json of the grid (a committed one: reproduce/results/<grid>/results.json): scored "
                        "the same to the bit or not, and by how much; exit 3 where one differs")
    p.add_argument("--no-judge", action="store_true",
                   help="leave the generation cells' answers unjudged in this run (compute nodes without a network "
                        "or the judge's key); a later run or --report-only judges them")
    p.add_argument("--set", nargs="+", default=[], metavar="KEY=VALUE",
                   help="set an option of every cell in place of the grid file's, e.g. --set compile_layers=true "
                        "(cells then differ from the file's: give them a --runs-dir of their own)")
    p.add_argument("--only", nargs="+", default=[], metavar="KEY=VALUE[,VALUE]",
                   help="run only the cells with these values (task, method, topology, clients, layers_per_block, "
                        "seed, or a table they feed), e.g. --only seed=0 method=deca,dec_lora; the tables still take "
                        "every finished cell")
    return p


def list_cells(grid: Grid, select: Callable[[Cell], bool], todo: list[Cell], done: list[Cell],
               base: str | None, place: Placement, *, log: Callable[[str], object]) -> None:
    """--dry-run: the base model's state, then each cell's budget, tables and state (finished, running
    where and how far, to run from a checkpoint or afresh), what a run would do and, where cells have
    finished, about how long the rest take at their seconds a step (time_left.time_left)."""
    if base:
        log(f"model {grid.pretrain.output_dir}: {base}" + (f" ({grid.pretrain.steps} steps, before the first "
                                                            "cell)" if base == "to pretrain" else ""))
        if base == "pretrained" and (note := kernels_note(grid.pretrain.output_dir)):
            log(note)
    sha = base_weights(grid)
    left: dict[Cell, int] = {}  # the selected cells not finished, with their steps done
    for cell in grid.cells:
        steps, examples = grid.budgets[cell.key]
        d = grid.cell_dir(cell)
        held = None if cell in done else holder(d)
        if cell in done or not select(cell):
            state = "finished" if cell in done else "not selected"
        elif held:
            left[cell] = steps_done(d)
            state = f"running ({held}), step {left[cell]} of {steps}"
        else:
            resume = resume_step(grid, cell, d, sha)
            left[cell] = resume or 0
            logged = steps_done(d) if resume is None and d.is_dir() else 0  # a stopped run, no checkpoint
            rate = seconds_per_step(d) if logged else None
            state = (f"to run from its checkpoint at step {resume} of {steps}" if resume is not None else
                     f"to run afresh (an earlier run stopped at step {logged} of {steps}"
                     + (f", {rate:.2f} s a step" if rate else "") + ")" if logged else "to run")
        log(f"{cell.key}: {steps} steps x {examples} examples per client step, tables {list(cell.tables)}, {state}")
    if grid.paper:
        log(f"the paper's {grid.paper} numbers beside {len(published_cells(grid.cells, grid.paper))} of the "
            f"{len(grid.cells)} cells")
    log(f"{len(grid.cells)} cells, {sum(map(select, todo))} to run ({grid.backend}, {grid.jobs} at a time, "
        f"timeout {grid.cell_timeout_s:g} s per cell, on {place.where})")
    if left and (line := time_left(grid, left, finished_rates(grid, done))):
        log(line)


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    log = partial(print, flush=True)
    try:
        grid = load_grid(args.grid, runs_dir=args.runs_dir, results_dir=args.results_dir, jobs=args.jobs,
                         clients_per_gpu=args.clients_per_gpu, deepspeed_args=args.deepspeed_args,
                         backend=args.backend, ds_config=args.ds_config, options=parse_settings(args.set))
        if args.compare and (args.tables_from or args.dry_run or args.estimate or args.fetch):
            raise GridError("--compare: with a run of the grid or --report-only (it reads the finished cells)")
        compared = recorded_results(grid, args.compare) if args.compare else None  # checked before any cell runs
        if args.tables_from:  # the results.json alone: the runs directory and the base model are not read
            recorded = recorded_results(grid, *args.tables_from)
        else:
            # before this process's first vector operation, which fixes its kernels (pretraining runs here)
            if grid.cpu_kernels and (note := pin_cpu_kernels(grid.cpu_kernels)):
                log(note)
            select = grid.select(args.only)
            todo, done = check_finished(grid)
            base = base_state(grid)
            # where the cells to run go, checked before pretraining or any cell
            running = not (args.estimate or args.fetch or args.report_only)
            place = placement(grid, [c for c in todo if select(c)]) if running else None
            if args.no_judge and not (grid.generation and grid.generation.judge):
                raise GridError("--no-judge: this grid judges no answers (it has no generation.judge section)")
            judging = bool(grid.generation and grid.generation.judge) and not (
                args.no_judge or args.dry_run or args.estimate or args.fetch)
            if judging and grid.generation.judge.key_env and not os.environ.get(grid.generation.judge.key_env):
                raise GridError(f"generation.judge: the environment variable {grid.generation.judge.key_env} holding "
                                "the judge's API key is not set (or run with --no-judge and judge later)")
        if not (args.estimate or args.fetch):  # the modes that write no report; the results read are checked first
            check_results_dir(grid)
    except GridError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    command = invocation("deca-reproduce", argv)
    if args.tables_from:
        for path in write_report(grid, command=command, recorded=recorded) + write_figures(grid):
            log(f"wrote {path}")
        return 0
    if args.estimate or args.fetch:
        try:
            if args.estimate:
                estimate_cells(grid, select, log=log)
            else:
                fetch_hub([c.options for c in grid.cells if select(c)], log=log)
        except ValueError as err:  # GridError too
            print(f"error: {err}", file=sys.stderr)
            return 2
        return 0
    if args.dry_run:
        list_cells(grid, select, todo, done, base, place, log=log)
        return 0
    # a scheduler's or timeout's SIGTERM unwinds like Ctrl-C: run_grid then stops the running cells. Unblocked
    # first: a mask inherited through exec (a job runner's) would hold it pending for ever.
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM, signal.SIGINT})
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    status = {}
    try:
        if not args.report_only:
            if any(map(select, todo)):
                pretrain_base(grid, log=log, command=command)
            status = run_grid(grid, log=log, select=select, place=place)
    except GridError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    if judging:
        answered = [(c.key, d) for c in grid.cells if grid.generates(c) and is_finished(d := grid.cell_dir(c))]
        status |= judge_cells(answered, grid.generation, log=log)
    for path in write_report(grid, command=command) + write_figures(grid):
        log(f"wrote {path}")
    elsewhere = sum(v.startswith("elsewhere") for v in status.values())
    if elsewhere:
        log(f"{elsewhere} cell(s) were running in other grid runs; their results join the tables once finished "
            "(--report-only)")
    differ = 0
    if compared is not None:
        text, differ = compare_cells(grid, compared, args.compare, select)
        log(text)
    failed = {k: v for k, v in status.items() if v.startswith("failed")}
    for key, why in failed.items():
        log(f"{key}: {why}")
    return 1 if failed else 3 if differ else 0
