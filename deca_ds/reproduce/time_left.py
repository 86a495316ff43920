"""How long a grid's cells still take: each cell to run at the seconds a step of the finished cells
like it, for deca-reproduce --dry-run and the line a grid run prints whenever a cell finishes.
"""

from __future__ import annotations

import threading

from .cell_dir import FINAL, read_json, steps_done
from .grid import Cell, Grid


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
