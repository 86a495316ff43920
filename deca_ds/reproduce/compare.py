"""deca-reproduce --compare: the grid's finished cells beside the same cells of a results.json (a
committed one, another machine's), each scored the same to the bit or not, and by how much.

A few cells of a committed grid check an install in minutes where the whole grid takes hours
(docs/reproduce.md): the same code, base model and CPU kernels give the same bits, and where the
kernels differ, rounding moves a cell by what this shows."""

from __future__ import annotations

from typing import Callable

from .cell_dir import BASE, saved_settings
from .grid import Cell, Grid
from .report import finished_results

SHOWN = (("accuracy", "accuracy"), ("macro_f1", "macro-F1"), ("loss_end", "loss end"))
# what a finished cell holds that no two runs need share: its time, the checkpoints a stopped cell went
# on from (to the same bits), and the grades of the grid's judge (a model outside, not the cell's result)
NOT_COMPARED = {"wall_s", "resumed_from", "judged"}


def _number(value) -> str:
    return f"{value:.6g}" if isinstance(value, float) else str(value)


def compare_cells(grid: Grid, record: dict, name: str, select: Callable[[Cell], bool]) -> tuple[str, int]:
    """Markdown of every selected cell finished both in the grid's runs directory and in `record` (a
    results.json checked against the grid, report.recorded_results; `name` says where it came from):
    its headline scores here and there and the final metrics that differ, then a count. Returns the
    text and the number of cells that differ."""
    entries = {e["key"]: e for e in record["cells"] if "final" in e}
    rows, differ, bases, made = [], 0, 0, set()
    for cell, here in finished_results(grid).items():
        if not select(cell) or cell.key not in entries:
            continue
        provenance = entries[cell.key].get("provenance", record.get("provenance", {}))
        made.add(f"commit {provenance.get('commit')}, {provenance.get('device')}")
        there = entries[cell.key]["final"]
        changed = sorted(k for k in (set(here) | set(there)) - NOT_COMPARED if here.get(k) != there.get(k))
        other_base = (saved_settings(grid.cell_dir(cell)) or {}).get(BASE) != entries[cell.key].get(BASE)
        differ += bool(changed)
        bases += other_base
        shown = [f"{_number(here.get(k))} / {_number(there.get(k))}" for k, _ in SHOWN]
        verdict = "the same" if not changed else "differs: " + ", ".join(changed)
        rows.append(f"| {cell.key} | {' | '.join(shown)} | {verdict}{' (another base)' if other_base else ''} |")
    head = [f"## Finished cells beside {name}", "",
            f"| cell | {' | '.join(f'{label} (here / there)' for _, label in SHOWN)} | final metrics |",
            "| :-- | " + "--: | " * len(SHOWN) + ":-- |"]
    if not rows:
        return f"no cell is finished both here and in {name}", 0
    summary = [f"{len(rows) - differ} of {len(rows)} cells score as in {name}, to the bit"
               + (f"; {differ} differ" if differ else "") + "."]
    if bases:
        summary.append(f"{bases} cell(s) were fine-tuned from other weights of the base model than there: "
                       "pretraining rounds otherwise on other CPU kernels (docs/reproduce.md).")
    summary.append(f"There: {'; '.join(sorted(made))}.")
    return "\n".join(head + rows + [""] + summary), differ
