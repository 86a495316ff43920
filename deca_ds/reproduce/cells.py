"""Running the grid's cells, each in a child process with a time limit, each into its own directory.

A cell directory holds cell.json (its settings, written first), run_config.json (what the run
resolved: topology, client sizes, trainable parameters, budget), metrics.jsonl (one record per
model update step: the clients' mean training loss, the consensus distance every
`consensus_interval` steps and, in simulated cells, the seconds since the cell started) and, once
it has finished, final.json (accuracy and macro-F1 of the consensus model x̄, losses, wall time).
A simulated cell with `checkpoint_interval` also holds checkpoint.pt (every client's model and
optimizer, the data streams' positions and each client's random state) and checkpoint.json (its
step and size, written after it) while it runs: a stopped cell goes on from there, to the same bits.
A cell with final.json and the same settings is skipped; one with other settings stops the grid
before anything runs. Where the grid makes its base model
(`pretrain`), the settings include the sha256 of its weights: cells fine-tuned from other weights
(pretrained again elsewhere, on another device) never share a table. A grid run claims a cell (a lock
file beside its directory, .<seed>.lock) before it runs it, so that several runs can share a grid.

Backends: `simulate` runs the N clients of a cell in one child process (simulated.py) through
deca_ds.simulate (small models, many clients on one device); `deepspeed` runs deca-train
(`deepspeed --module deca_ds.train`) with one rank per client and converts its outputs to the same
files.
"""

from __future__ import annotations

import contextlib
import functools
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

from ..files import atomic_directory, leftovers, remove, sha256, vacant, write_json, write_text
from ..reporting import REPO
from ..runtime.metrics import loss_ends
from ..runtime.presets import preset_path
from .generation import ANSWERS
from .grid import Cell, Grid, GridError
from .placement import Launch, Placement, placement
from .pretrain import WEIGHTS, kernels_note, pretrain, pretrained_state

CELL, RUN_CONFIG, METRICS, FINAL, LOG = "cell.json", "run_config.json", "metrics.jsonl", "final.json", "log.txt"
ANY_NAME = re.compile(".+")  # a cell's directory is the grid's, every entry of it
CHECKPOINT, CHECKPOINT_META = "checkpoint.pt", "checkpoint.json"  # a simulated cell's
# how the checkpoint's clients drew their dropout masks: from generators of their own (rng.ClientGenerators);
# an older checkpoint, whose clients drew from one, is not gone on from (the cell starts afresh)
RNG = "per client"
STOPPED = "stopped: the grid was stopped before this cell started"


def read_json(path: Path):
    return json.loads(path.read_text())


def is_finished(cell_dir: Path) -> bool:
    return (cell_dir / FINAL).is_file()


BASE = "base_sha256"  # settings' key: the weights of the model the grid's `pretrain` made
ANSWERED = "answered"  # settings' key: the question sets a generation cell's model answers


def settings_changed(saved: dict | None, now: dict) -> list[str]:
    """The options in which a finished cell's saved settings and the grid's differ in what they
    compute. Options that change no result (runtime.options.NOT_RESULT, and those the cell's method
    does not read) are not compared, and an option the cell's code did not have yet counts as its
    default: a new option's default keeps the old behaviour. The base model's weights are compared
    where both settings know them, and the preset's keys that change a step (presets.STEP_KEYS)."""
    from ..runtime.options import NOT_RESULT, option_defaults, unread_in

    if saved is None or saved.get("key") != now["key"]:
        return ["no settings saved" if saved is None else "key"]
    defaults = json.loads(json.dumps(option_defaults(), allow_nan=False))
    old, new = saved["options"], now["options"]
    changed = sorted(k for k in (set(old) | set(new)) - NOT_RESULT - unread_in(new)
                     if old.get(k, defaults.get(k)) != new.get(k, defaults.get(k)))
    old_ds, new_ds = saved.get("deepspeed", {}), now.get("deepspeed", {})
    changed += [f"the preset's {k}" for k in sorted(set(old_ds) | set(new_ds)) if old_ds.get(k) != new_ds.get(k)]
    if None not in (saved.get(BASE), now.get(BASE)) and saved[BASE] != now[BASE]:
        changed.append("the base model's weights")
    if saved.get(ANSWERED) != now.get(ANSWERED):
        changed.append("the questions answered")
    return changed


def cell_settings(grid: Grid, cell: Cell, base: str | None) -> dict:
    """What decides the cell's result: its options, where the grid makes its base model the sha256
    `base` of that model's weights (None while it is not made), and for a generation cell the
    questions its model answers (Generation.settings)."""
    answered = {ANSWERED: grid.generation.settings} if grid.generates(cell) else {}
    return cell.settings() | ({BASE: base} if base else {}) | answered


def base_weights(grid: Grid) -> str | None:
    """sha256 of the weights the grid's `pretrain` made; None without the section or the model."""
    path = Path(grid.pretrain.output_dir) / WEIGHTS if grid.pretrain else None
    if path is None or not path.is_file():
        return None
    stat = path.stat()
    return _sha256(str(path.resolve()), stat.st_mtime_ns, stat.st_size)


@functools.lru_cache(maxsize=8)
def _sha256(path: str, mtime_ns: int, size: int) -> str:
    """Once per version of the file (the grid checks its cells several times a run)."""
    return sha256(Path(path))


def finished_changes(grid: Grid, cell: Cell, base: str | None) -> list[str] | None:
    """None while the cell is unfinished; once finished, the settings in which its results differ
    from the grid's ([] when they are the grid's); `base` as cell_settings."""
    d = grid.cell_dir(cell)
    if not is_finished(d):
        return None
    return settings_changed(saved_settings(d), cell_settings(grid, cell, base))


def saved_settings(cell_dir: Path) -> dict | None:
    return read_json(cell_dir / CELL)["settings"] if (cell_dir / CELL).is_file() else None


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


class Remaining:
    """The cells a grid run has yet to end, for the time left whenever one has finished (time_left, at
    the rates of the cells finished before the run and in it). The cells' threads report to it."""

    def __init__(self, grid: Grid, todo: list[Cell], done: list[Cell]) -> None:
        self.grid, self.lock = grid, threading.Lock()
        self.todo, self.started, self.finished = set(todo), set(), list(done)

    def start(self, cell: Cell) -> None:
        with self.lock:
            self.started.add(cell)

    def end(self, cell: Cell, *, done: bool = False) -> str | None:
        """`cell` has ended (again: nothing); if `done`, time_left of the others."""
        with self.lock:
            if cell not in self.todo:
                return None
            self.todo.remove(cell)
            if not done or not self.todo:
                return None
            self.finished.append(cell)
            # a cell that has started counts the steps it has logged in this run as done
            cells = {c: steps_done(self.grid.cell_dir(c)) if c in self.started else 0 for c in self.todo}
            rates = finished_rates(self.grid, self.finished)
        return time_left(self.grid, cells, rates)


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


def steps_done(cell_dir: Path) -> int:
    """Model update steps a cell has logged: its metrics.jsonl (simulate), or deca-train's
    first client's metrics (deepspeed) while it runs."""
    from ..runtime.metrics import metrics_path

    for path in (cell_dir / METRICS, metrics_path(cell_dir / "train", 0)):
        if path.is_file():
            return sum(1 for line in path.read_text().splitlines() if line)
    return 0


def seconds_per_step(cell_dir: Path) -> float | None:
    """A simulated cell's mean seconds per step so far, from its metrics' `wall_s` (None without)."""
    path = cell_dir / METRICS
    lines = path.read_text().splitlines() if path.is_file() else []
    last = json.loads(lines[-1]) if lines else {}
    return last["wall_s"] / len(lines) if "wall_s" in last else None


def _alike(cell: Cell) -> tuple:
    """What a cell's seconds a step are taken from first: finished cells of its method, task, clients and
    layers per block (otherwise of its method)."""
    return cell.method, cell.task, cell.clients, cell.layers_per_block


def finished_rates(grid: Grid, finished: list[Cell]) -> dict:
    """The mean seconds a step took in the `finished` cells (final.json's wall_s, setup and scoring
    included, over the steps it timed), by _alike and by method: what time_left counts at. They are
    what those cells took where they ran (machine, backend, cells at a time), nothing more."""
    rates: dict = {}
    for cell in finished:
        d = grid.cell_dir(cell)
        final = read_json(d / FINAL)
        steps = grid.budgets[cell.key][0]
        if final.get("resumed_from") and (d / "train").is_dir():  # deca-train's wall_s: its last attempt's (finish)
            steps -= final["resumed_from"][-1]
        if final.get("wall_s") and steps > 0:
            for key in (_alike(cell), cell.method):
                rates.setdefault(key, []).append(final["wall_s"] / steps)
    return {key: sum(r) / len(r) for key, r in rates.items()}


def time_left(grid: Grid, cells: dict[Cell, int], rates: dict) -> str | None:
    """`cells` (each with the steps it has done) still to run, as a line: their seconds at `rates`
    (finished_rates) one after another, and `grid.jobs` at a time (no less than the longest cell), and
    how many no finished cell of their method times; None without a rate."""
    if not rates:
        return None
    seconds, unknown = [], 0
    for cell, done in cells.items():
        rate = rates.get(_alike(cell), rates.get(cell.method))
        if rate is None:
            unknown += 1
        else:
            seconds.append(rate * (grid.budgets[cell.key][0] - done))
    text = f"about {_duration(sum(seconds))} of cell time left at the finished cells' seconds a step"
    if grid.jobs > 1 and len(seconds) > 1:
        text += f" ({_duration(max(sum(seconds) / grid.jobs, max(seconds)))} at {grid.jobs} at a time)"
    return text + (f"; {unknown} cell(s) of a method with no finished cell not counted" if unknown else "")


def _duration(seconds: float) -> str:
    minutes = round(seconds / 60)
    return (f"{minutes // 60} h {minutes % 60:02d} min" if minutes >= 60 else f"{minutes} min" if minutes
            else f"{seconds:.0f} s")


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


def resume_step(grid: Grid, cell: Cell, d: Path, base: str | None) -> int | None:
    """The checkpoint step an unfinished cell goes on from, where it was started with the grid's
    settings: a simulated cell's checkpoint (simulated_checkpoint), or for the deepspeed backend the
    newest one complete for every client in its train/ (deca-train's --checkpoint-interval; files
    checked by size here, deca-train --resume checks their sha256 as well and goes back to an older
    step where one fails). None: the cell starts afresh."""
    from ..runtime.checkpoint import complete_steps

    train = d / "train"
    ran = (d if grid.backend == "simulate" else train) / RUN_CONFIG
    if not ran.is_file() or settings_changed(saved_settings(d), cell_settings(grid, cell, base)):
        return None
    if grid.backend == "simulate":
        return simulated_checkpoint(d)
    common = set.intersection(*(set(complete_steps(train, c, cell.ranks_per_client, hashes=False))
                                for c in range(cell.clients)))
    return max(common, default=None)


def simulated_checkpoint(d: Path) -> int | None:
    """The step of a simulated cell's checkpoint, None without a whole one of this code's (RNG):
    checkpoint.json, written after checkpoint.pt and removed before it is replaced, must give
    checkpoint.pt's size."""
    try:
        meta = read_json(d / CHECKPOINT_META)
        whole = (d / CHECKPOINT).stat().st_size == meta["bytes"] and meta.get("rng") == RNG
        return int(meta["step"]) if whole else None
    except (OSError, ValueError, KeyError, TypeError):
        return None


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


def collect_deepspeed(d: Path, *, wall_s: float) -> None:
    """deca-train's outputs (train/) as the cell's files: mean loss over clients per step, the step's
    lr and the mean consensus distance, the run config and the consensus model's metrics."""
    from ..runtime.metrics import read_client_metrics

    train = d / "train"
    config = read_json(train / RUN_CONFIG)
    records = [read_client_metrics(train, c) for c in range(config["n_clients"])]
    lines = []
    for step_records in zip(*records):
        first = step_records[0]
        rec = {k: first[k] for k in ("step", "round", "block", "r")}
        rec["loss"] = sum(r["loss"] for r in step_records) / len(step_records)
        if "lr" in first:  # the step's, every client's alike (deca-train logs it since b11fff9)
            rec["lr"] = first["lr"]
        if "consensus_distance" in first:
            rec["consensus_distance"] = sum(r["consensus_distance"] for r in step_records) / len(step_records)
        if "nonfinite_skipped" in first:  # skip_nonfinite: steps every client skipped so far
            rec["nonfinite_skipped"] = first["nonfinite_skipped"]
        lines.append(json.dumps(rec, allow_nan=False) + "\n")
    write_text(d / METRICS, "".join(lines))
    write_json(d / RUN_CONFIG, config)
    summary = read_json(train / "summary.json")
    evaluation = summary["consensus_eval"]
    if "consensus_answers" in summary:  # a generation cell: its answers beside a simulated cell's
        shutil.copytree(train / ANSWERS, d / ANSWERS, dirs_exist_ok=True)
        evaluation = {"answered": summary["consensus_answers"]}
    finish(d, evaluation, wall_s=wall_s,
           final_distance=sum(summary["final_consensus_distance"]) / len(summary["final_consensus_distance"]))


def finish(d: Path, evaluation: dict, *, wall_s: float, final_distance: float) -> dict:
    """final.json from the cell's metrics and the consensus model's evaluation. A resumed deepspeed
    cell's wall_s is that of its last attempt (a simulated one's, of every attempt's steps up to its
    checkpoint), and `resumed_from` names the checkpoint steps it went on from."""
    records = [json.loads(line) for line in (d / METRICS).read_text().splitlines() if line]
    loss_start, loss_end = loss_ends([r["loss"] for r in records])
    final = {**evaluation, "loss_start": loss_start, "loss_end": loss_end, "steps": len(records),
             "final_consensus_distance": final_distance, "wall_s": wall_s}
    skipped = records[-1].get("nonfinite_skipped") if records else None
    if skipped:  # skip_nonfinite: the steps taken again on other batches
        final["nonfinite_skipped"] = skipped
    resumed = read_json(d / CELL).get("resumed_from")
    if resumed:
        final["resumed_from"] = resumed
    write_json(d / FINAL, final)
    return final
