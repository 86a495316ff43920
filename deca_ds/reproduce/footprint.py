"""deca-reproduce --estimate: each cell's GPU memory per client, as deca-train --estimate gives it
for that cell's run, and the cards it fits: before a grid spends GPU-days on cells that cannot run.

Cells that differ only in their seed need the same memory and are listed once. The deepspeed
backend only: it runs one client per rank, the estimate's unit; the simulate backend holds every
client of a cell in one process.
"""

from __future__ import annotations

from collections.abc import Callable

from ..memory import GiB
from .grid import Cell, Grid, GridError


def estimate_cells(grid: Grid, select: Callable[[Cell], bool], *, log=print) -> dict[str, dict[str, bool]]:
    """{cell key without its seed: {card: whether the cell fits it}} of the selected cells, each logged."""
    from ..runtime import footprint
    from ..runtime.options import RunOptions
    from ..runtime.presets import load_ds_config

    if grid.backend != "deepspeed":
        raise GridError(f"--estimate: the {grid.backend} backend holds every client of a cell in one process; "
                        "the estimate is one client's, as the deepspeed backend runs it")
    ds_config, _ = load_ds_config(grid.ds_config)
    found: dict[str, dict[str, bool]] = {}
    for cell in filter(select, grid.cells):
        key = cell.key.rsplit("/seed", 1)[0]
        if key in found:
            continue
        opts = RunOptions(**cell.options)
        try:
            est, setting = footprint.estimate(opts, ds_config)
        except ValueError as err:
            raise GridError(f"--estimate: {key}: {err}") from None
        # the grid's clients_per_gpu may put up to that many of the cell's clients on one card
        sharing = max(setting["clients_per_gpu"], min(grid.clients_per_gpu, cell.clients))
        fits = {name: fit for name, (_, fit) in footprint.card_fits(opts, est, sharing).items()}
        found[key] = fits
        log(f"{key}: {est.process_peak / GiB:.3f} GiB per client ({est.method}"
            + (f", {sharing} clients a GPU" if sharing > 1 else "") + "); "
            + ", ".join(f"{name}: {'yes' if fit else 'no'}" for name, fit in fits.items()))
    for name in next(iter(found.values()), {}):
        short = [key for key, fits in found.items() if not fits[name]]
        log(f"{name}: " + ("every cell fits" if not short else f"{len(short)} of {len(found)} do not fit: "
                           + ", ".join(short)))
    return found
