"""Running the grid's cells, each in a child process with a time limit, each into its own directory
(cell_dir.py: what it holds). Finished cells with the grid's settings are skipped; one with other
settings, or a directory no grid run wrote, stops the grid before anything runs. A grid run claims a
cell (a lock file beside its directory, .<seed>.lock) before it runs it, so that several runs can
share a grid.

Backends: `simulate` runs the N clients of a cell in one child process (simulated.py) through
deca_ds.simulate (small models, many clients on one device); `deepspeed` runs deca-train
(`deepspeed --module deca_ds.train`) with one rank per client and converts its outputs to the same
files.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait
from pathlib import Path

from ..files import atomic_directory, leftovers, remove, vacant, write_json, write_text
from ..reporting import REPO
from ..runtime.presets import preset_path
from .cell_dir import (
    BASE,
    CELL,
    LOG,
    base_weights,
    cell_settings,
    collect_deepspeed,
    finished_changes,
    read_json,
    resume_step,
    saved_settings,
    steps_done,
)
from .grid import Cell, Grid, GridError
from .placement import Launch, Placement, placement
from .pretrain import kernels_note, pretrain, pretrained_state
from .time_left import Remaining

ANY_NAME = re.compile(".+")  # a cell's directory is the grid's, every entry of it
STOPPED = "stopped: the grid was stopped before this cell started"


def check_finished(grid: Grid) -> tuple[list[Cell], list[Cell]]:
    """(cells to run, cells already finished with the same settings); raises when a finished cell's
    settings differ from the grid's, naming them, so no run overwrites a result, when a cell's
    directory holds files no grid run wrote (a user's, which starting the cell would remove), and when finished
    cells were fine-tuned from different weights of the grid's base model (their results do not
    compare, whichever weights the model now has)."""
    todo, done, conflicts, foreign = [], [], [], []
    base = base_weights(grid)
    for cell in grid.cells:
        changed = finished_changes(grid, cell, base)
        if changed is None:
            d = grid.cell_dir(cell)
            if not (d / CELL).is_file() and not vacant(d):  # _prepare removes an unfinished cell's directory
                foreign.append(str(d))
            todo.append(cell)
        elif changed:
            conflicts.append(f"{grid.cell_dir(cell)} ({', '.join(changed[:6])})")
        else:
            done.append(cell)
    if conflicts:
        raise GridError(f"{len(conflicts)} finished cell(s) hold results of other settings and would be overwritten: "
                        + "; ".join(conflicts[:5]) + ". Give another runs_dir or remove those directories.")
    if foreign:
        raise GridError(f"{len(foreign)} cell directory(ies) hold files but no {CELL}, so no grid run wrote them, and "
                        "starting the cell would remove them: " + "; ".join(foreign[:5])
                        + ". Give another runs_dir or move them.")
    bases: dict[str, list[str]] = {}
    for cell in done:
        sha = (saved_settings(grid.cell_dir(cell)) or {}).get(BASE)
        if sha:
            bases.setdefault(sha, []).append(cell.key)
    if len(bases) > 1:
        detail = "; ".join(f"{sha[:12]}: {len(keys)} cell(s), e.g. {keys[0]}" for sha, keys in bases.items())
        raise GridError(f"the finished cells were fine-tuned from {len(bases)} different weights of "
                        f"{done[0].options['model']} ({detail}); results of different base models do not compare: "
                        "keep one set of cells (pretraining is deterministic on one device type, not across)")
    return todo, done


def run_grid(grid: Grid, *, log=print, select: Callable[[Cell], bool] | None = None,
             place: Placement | None = None) -> dict[str, str]:
    """Run every unfinished cell (of those `select` keeps, e.g. Grid.select), `grid.jobs` at a time,
    each on the GPUs `place` gives it (default: placement.placement's for those cells);
    returns cell key -> 'done' / 'skipped' / 'not selected' / 'elsewhere: who' (another grid run
    holds it) / 'stopped …' (the grid was) / 'failed: why', in the grid's order.

    Several grid runs can work through one runs_dir (terminals, or jobs on nodes that share the file
    system): each cell is claimed before it runs, so each is run by one of them. Interrupted
    (Ctrl-C, or deca-reproduce's SIGTERM), a run stops every cell it runs, with all the cell
    started, before re-raising: a cell left running would go on writing into a directory the next
    run starts afresh."""
    todo, done = check_finished(grid)
    base = base_weights(grid)
    status = {c.key: "skipped" for c in done}
    if select is not None:
        status |= {c.key: "not selected" for c in todo if not select(c)}
        todo = [c for c in todo if select(c)]
    place = placement(grid, todo) if place is None else place
    log(f"{grid.name}: {len(grid.cells)} cells, {len(done)} finished, {len(todo)} to run ({grid.backend}"
        + (f", {grid.jobs} at a time" if grid.jobs > 1 else "") + f", on {place.where})")
    running = Running()
    remaining = Remaining(grid, todo, done)

    def run(i: int, cell: Cell) -> str:
        try:
            return attempt(i, cell)
        finally:
            remaining.end(cell)

    def attempt(i: int, cell: Cell) -> str:
        d = grid.cell_dir(cell)
        with claim(d) as held:
            if held:
                log(f"[{i}/{len(todo)}] {cell.key}: run by {held}")
                return f"elsewhere: run by {held}"
            changed = finished_changes(grid, cell, base)  # by another grid run, since this one looked
            if changed is not None:
                return f"failed: finished meanwhile with other settings ({', '.join(changed[:6])})" if changed \
                    else "skipped"
            with place.cell(cell, lambda: running.stopped) as launch:  # waits for free GPUs where it needs them
                if launch is None:
                    return STOPPED
                resume = _prepare(grid, cell, d, base)
                start = time.perf_counter()
                log(f"[{i}/{len(todo)}] {cell.key} ..." if resume is None else
                    f"[{i}/{len(todo)}] {cell.key} ... (resuming from its checkpoint at step {resume})")
                remaining.start(cell)
                result = _run_one(grid, cell, d, running, launch, resume=resume is not None)
                line = remaining.end(cell, done=result == "done")
                log(f"[{i}/{len(todo)}] {cell.key}: {result} ({time.perf_counter() - start:.0f} s)"
                    + (f"; {line}" if line else ""))
                return result

    # threads only wait: each cell is a process of its own
    with ThreadPoolExecutor(max_workers=grid.jobs) as pool:
        futures = {cell.key: pool.submit(run, i, cell) for i, cell in enumerate(todo, 1)}
        try:
            pending = set(futures.values())
            while pending:
                # Timed waits, so that the main thread runs a signal's handler within a second: a SIGTERM
                # that another thread took sets a flag the main thread reads only between bytecodes, never
                # inside an untimed wait (on a GPU machine a grid ran on for a minute past timeout's SIGTERM).
                finished, pending = wait(pending, timeout=1.0, return_when=FIRST_EXCEPTION)
                for future in finished:
                    future.result()  # an error of the grid's own (not a cell's failure) stops the other cells
            status |= {key: future.result() for key, future in futures.items()}
        except BaseException:
            for future in futures.values():
                future.cancel()
            running.stop_all()
            raise
    return {c.key: status[c.key] for c in grid.cells}


def base_state(grid: Grid) -> str | None:
    """None when the grid fine-tunes a model it does not make; else 'pretrained' (earlier, with the
    grid's `pretrain` options) or 'to pretrain'. GridError for a directory holding anything else."""
    if grid.pretrain is None:
        return None
    try:
        return pretrained_state(grid.pretrain)
    except ValueError as err:
        raise GridError(f"pretrain: {err}") from None


def pretrain_base(grid: Grid, *, log=print, command: list[str] | None = None, poll_s: float = 2.0) -> None:
    """Make the grid's model (its `pretrain` section) unless it has been made. Several runs of one
    grid: the one holding the lock beside the model's directory pretrains; the others wait for it,
    at most cell_timeout_s, then fine-tune what it made. A model made earlier with other CPU kernels
    is fine-tuned as it is, with a note (pretrain.kernels_note)."""
    model = Path(grid.pretrain.output_dir) if grid.pretrain else None
    deadline = time.monotonic() + grid.cell_timeout_s
    waited = False
    while base_state(grid) == "to pretrain":
        with claim(model) as held:
            if held is None:
                if base_state(grid) == "to pretrain":  # not made by the run this one waited for
                    log(f"pretraining {model}")
                    try:
                        pretrain(grid.pretrain, log=log, command=command)
                    except ValueError as err:
                        raise GridError(f"pretrain: {err}") from None
                return
        if time.monotonic() > deadline:
            raise GridError(f"{model} is still being pretrained by {held} after {grid.cell_timeout_s:g} s "
                            "(cell_timeout_s); run the grid again once it has finished")
        if not waited:
            log(f"waiting for {held}, which is pretraining {model}")
            waited = True
        time.sleep(poll_s)
    if model is not None and (note := kernels_note(str(model))):
        log(note)


@contextlib.contextmanager
def claim(cell_dir: Path):
    """Hold the cell (or the model pretrain_base makes) for this grid run (yields None), or yield who
    holds it. The lock file sits beside the cell's directory, which a run deletes when it starts the
    cell afresh; flock's lock goes with its process, so a killed run leaves none behind."""
    import fcntl

    cell_dir.parent.mkdir(parents=True, exist_ok=True)
    with _lock_file(cell_dir).open("a+") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
            holder = None
        except BlockingIOError:
            f.seek(0)
            holder = f.read().strip() or "another grid run"
        if holder is None:
            f.truncate(0)
            f.write(f"pid {os.getpid()} on {socket.gethostname()} since {time.strftime('%Y-%m-%d %H:%M:%S')}\n")
            f.flush()
        yield holder


def _lock_file(cell_dir: Path) -> Path:
    return cell_dir.parent / f".{cell_dir.name}.lock"


def holder(cell_dir: Path) -> str | None:
    """Who holds the cell now (claim's words), or None; writes nothing. A shared lock taken and
    dropped at once: a run claiming the cell in that same instant finds it held and leaves it."""
    import fcntl

    try:
        f = _lock_file(cell_dir).open()
    except FileNotFoundError:
        return None
    with f:
        try:
            fcntl.flock(f, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            return f.read().strip() or "another grid run"
        fcntl.flock(f, fcntl.LOCK_UN)
        return None


class Running:
    """The cells' processes running now. Each has a session of its own (so a cell over its time is
    stopped with every rank it started), which also keeps a terminal's Ctrl-C from reaching it: the
    grid stops them itself."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._procs: set[subprocess.Popen] = set()
        self._stopped = False

    def start(self, command: list[str], **kwargs) -> subprocess.Popen | None:
        """The started process, or None once the grid is stopping."""
        with self._lock:
            if self._stopped:
                return None
            proc = subprocess.Popen(command, start_new_session=True, **kwargs)
            self._procs.add(proc)
            return proc

    def wait(self, proc: subprocess.Popen, timeout_s: float) -> bool:
        """Whether `proc` ended within `timeout_s`; if not, it is stopped with its session."""
        try:
            proc.wait(timeout=timeout_s)
            return True
        except subprocess.TimeoutExpired:
            kill_session(proc)
            return False
        finally:
            with self._lock:
                self._procs.discard(proc)

    @property
    def stopped(self) -> bool:
        return self._stopped

    def stop_all(self) -> None:
        with self._lock:
            self._stopped = True
            procs = list(self._procs)
        for proc in procs:
            kill_session(proc)


def kill_session(proc: subprocess.Popen) -> None:
    if proc.poll() is None:  # once reaped, its pid may be another process's
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:  # its session is gone already
            pass
    proc.wait(timeout=60)


def _prepare(grid: Grid, cell: Cell, d: Path, base: str | None) -> int | None:
    """The cell's directory, ready to run it: afresh, or kept where the cell goes on from a
    checkpoint (resume_step), whose step is returned."""
    resume = resume_step(grid, cell, d, base)
    if resume is None:
        for left in leftovers(d.parent, [d.name]):  # an earlier start of the cell, killed while it wrote
            remove(left)
        # whole, with its cell.json, in place of an unfinished earlier attempt (one without a checkpoint to
        # go on from) in one rename: another grid run checking the cells meanwhile never finds files
        # without a cell.json there, which it would take for a user's and stop
        with atomic_directory(d, replace=True) as new:
            write_json(new / CELL, {"settings": cell_settings(grid, cell, base), "options": cell.options,
                                    "tables": list(cell.tables), "budget": list(grid.budgets[cell.key])})
    else:
        for left in leftovers(d, ANY_NAME):  # a write the stopped run was killed in: its checkpoint's, say
            remove(left)
        saved = read_json(d / CELL)
        write_json(d / CELL, {**saved, "resumed_from": [*saved.get("resumed_from", []), resume]})
    return resume


def _run_one(grid: Grid, cell: Cell, d: Path, running: Running, launch: Launch, *, resume: bool = False) -> str:
    if grid.backend == "simulate":
        command = [sys.executable, "-m", "deca_ds.reproduce.simulated", str(d)]
    else:
        command = _deepspeed_command(grid, cell, d, launch, resume=resume)
    start = time.time()
    # the children import the deca_ds this process runs (a checkout's too, where it is not installed)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
           **launch.env}
    if grid.threads:
        env["OMP_NUM_THREADS"] = str(grid.threads)
    if grid.cpu_kernels:  # where the caller set none (reproduce.cli pins this process's too, for pretraining)
        env.setdefault("ATEN_CPU_CAPABILITY", grid.cpu_kernels)
    with (d / LOG).open("a" if resume else "w") as out:
        # in the caller's directory: the grid's relative paths (runs, models, data) are read from there
        proc = running.start(command, stdout=out, stderr=subprocess.STDOUT, env=env)
        if proc is None:
            return STOPPED
        in_time = running.wait(proc, grid.cell_timeout_s)
    if not in_time:
        return f"failed: over the cell time limit of {grid.cell_timeout_s:g} s (see {d / LOG})"
    if proc.returncode != 0 and running.stopped:  # killed by stop_all, not failed: say how far it came
        resume = resume_step(grid, cell, d, base_weights(grid))
        return (f"stopped with the grid at step {steps_done(d)} of {grid.budgets[cell.key][0]}"
                + (f" (its checkpoint at step {resume} goes on next time)" if resume is not None else ""))
    if proc.returncode != 0:
        tail = (d / LOG).read_text().strip().splitlines()[-1:] or [""]
        return f"failed: exit {proc.returncode}: {tail[0]} (see {d / LOG})"
    if grid.backend == "deepspeed":
        collect_deepspeed(d, wall_s=time.time() - start)
        if (d / "train" / "checkpoints").exists():  # each holds every client's model, and the cell is done
            shutil.rmtree(d / "train" / "checkpoints")
    return "done"


def _deepspeed_command(grid: Grid, cell: Cell, d: Path, launch: Launch, *, resume: bool = False) -> list[str]:
    """The launcher `launch` (Placement.cell's) names, with its arguments, starting deca-train on the cell."""
    import yaml

    options = json.loads(json.dumps(cell.options, allow_nan=False))
    write_text(d / "options.yaml", yaml.safe_dump(options))
    if launch.launcher == "torchrun":
        launcher = [sys.executable, "-m", "torch.distributed.run"]
    else:
        launcher = [shutil.which("deepspeed") or str(Path(sys.executable).parent / "deepspeed")]
    return [*launcher, *launch.args, "--module", "deca_ds.train",
            "--ds_config", str(preset_path(grid.ds_config).resolve()), "--config", str(d / "options.yaml"),
            "--no-export", "--resume" if resume else "--overwrite", *launch.train_args]


