"""The paper's loss figures from the finished cells: per task, the training loss of every method over
model update steps (the clients' mean, then the mean over seeds, with a moving average), and the
consensus distance mean_i ‖x_i − x̄‖ over steps (DECA's: of the active block, as the runtime logs it).
Only the main table's cells are drawn: one comparison per task. They are drawn from the curves the
grid's results.json keeps (report.curves), so that the file alone draws them again (--tables-from)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from ..reporting import pyplot, save_figure
from .grid import METHODS, Grid
from .tables import LABELS


def series(curves: list[dict], key: str) -> tuple[np.ndarray, np.ndarray] | None:
    """(steps, mean over the cells' seeds) of `key` at the steps every seed logged it."""
    runs = [dict(zip(c[key]["step"], c[key]["value"])) if key in c else {} for c in curves]
    steps = sorted(set.intersection(*(set(r) for r in runs))) if runs else []
    if not steps:
        return None
    return np.array(steps), np.array([np.mean([r[s] for r in runs]) for s in steps])


def smooth(values: np.ndarray, window: int) -> np.ndarray:
    """Trailing moving average (shorter at the start, so the curve keeps its first steps)."""
    cumulative = np.cumsum(np.insert(values, 0, 0.0))
    idx = np.arange(1, len(values) + 1)
    lo = np.maximum(0, idx - window)
    return (cumulative[idx] - cumulative[lo]) / (idx - lo)


def write_figures(grid: Grid, *, window: int = 8) -> list[Path]:
    """The figures of the results.json in grid.results_dir (write_report's), of the main table's
    cells that keep their curves (a results.json written before 2026-11-29 keeps none)."""
    out = grid.results_dir
    kept = {e["key"]: e["curves"] for e in json.loads((out / "results.json").read_text())["cells"] if "curves" in e}
    done = [c for c in grid.cells if "main" in c.tables and c.key in kept]
    if not done:
        return []
    plt = pyplot()
    written = []
    for task in dict.fromkeys(c.task for c in done):
        by_method = {m: [c for c in done if c.task == task and c.method == m] for m in METHODS}
        by_method = {m: cs for m, cs in by_method.items() if cs}
        first = next(iter(by_method.values()))[0]
        setting = (f"{first.topology}, N={first.clients}, {first.layers_per_block} layers/block, "
                   f"{len({c.seed for c in done})} seed(s)")
        for key, ylabel, name, log in (("loss", "training loss (mean over clients)", "loss", False),
                                       ("consensus_distance", "mean ‖x_i − x̄‖", "consensus", True)):
            fig, ax = plt.subplots(figsize=(7, 4.2))
            drawn = False
            for method, cells in by_method.items():
                s = series([kept[c.key] for c in cells], key)
                if s is None:
                    continue
                steps, values = s
                ax.plot(steps, smooth(values, window) if key == "loss" else values, label=LABELS[method],
                        linewidth=2.2 if method == "deca" else 1.3)
                drawn = True
            if not drawn:
                plt.close(fig)
                continue
            # no log scale for distances that are 0 throughout (two clients on a ring agree after each mix)
            if log and any(y > 0 for line in ax.get_lines() for y in line.get_ydata()):
                # a distance of 0 (the clients agree: at step 0, and on DECA's first visit of a block, as
                # a step begins) leaves a gap in its line, not a drop to the axis' edge
                ax.set_yscale("log", nonpositive="mask")
            ax.set_xlabel("model update step")
            ax.set_ylabel(ylabel)
            what = f"{window}-step moving average" if key == "loss" else "every consensus_interval steps"
            ax.set_title(f"{grid.name}: {task} ({setting}; {what})", fontsize=9)
            ax.legend(fontsize="small")
            ax.grid(alpha=0.3)
            path = out / f"{name}_{task}.png"
            save_figure(fig, path, dpi=110)
            written.append(path)
    return written
