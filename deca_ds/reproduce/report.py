"""A grid's report: the tables (tables.py, paired.py) of its finished cells into tables.md and
CSV files, and results.json with every cell's place in the grid, run_config, final metrics and
curves; results.json files read back and merged (--tables-from)."""

from __future__ import annotations

import json
import os
import re
import sys
from pathlib import Path

from .. import reporting
from ..files import write_text
from . import paper
from .cell_dir import BASE, FINAL, METRICS, RUN_CONFIG, read_json, saved_settings
from .generation import judged
from .grid import METHODS, NOT_RESULT, Cell, Grid, GridError
from .paired import (
    PAIRED_TABLES,
    build_granularity_paired,
    build_paired,
    paired_csv,
    paired_markdown,
    per_seed_markdown,
)
from .tables import (
    ABLATION,
    BASELINES,
    GENERATION_TABLES,
    TABLES,
    build_comparison,
    build_generation_comparison,
    build_generation_table,
    build_table,
    to_csv,
    to_markdown,
)

RECORDED = ("provenance", BASE, "run_config", "curves")  # what a cell's entry brings along from a results.json
CURVES = ("loss", "consensus_distance")  # the per-step metrics results.json keeps of a main-table cell (figures)


def provenance(command: list[str] | None = None, *, outputs: Path | None = None) -> dict:
    """deca_ds.reporting.provenance of a grid's results (`outputs`, their directory, aside when
    looking for uncommitted changes)."""
    import torch

    return reporting.provenance(" ".join(command if command is not None else [Path(sys.argv[0]).name, *sys.argv[1:]]),
                                cuda=torch.cuda.is_available(), cpu=f"{os.cpu_count()} cores", exclude=outputs)


def finished_results(grid: Grid) -> dict[Cell, dict]:
    """Each finished cell's final.json; a generation cell's with the grid's judge's grades ("judged")
    once they are all in."""
    results = {}
    for c in grid.cells:
        d = grid.cell_dir(c)
        if (d / FINAL).is_file():
            grades = judged(d, grid.generation.judge.model) if grid.generates(c) and grid.generation.judge else None
            results[c] = read_json(d / FINAL) | ({"judged": grades} if grades else {})
    return results


def _recorded(grid: Grid, path: Path) -> dict:
    try:
        record = json.loads(Path(path).read_text())
    except (OSError, ValueError) as err:
        raise GridError(f"{path}: not a readable results.json ({err})") from None
    if record.get("grid") != grid.name:
        raise GridError(f"{path} holds grid {record.get('grid')!r}'s results, not {grid.name!r}'s")
    source = record.get("source", {})
    changed = sorted(k for k in (set(source) | set(grid.source)) - NOT_RESULT if source.get(k) != grid.source.get(k))
    if changed:
        raise GridError(f"{path}: the grid's {', '.join(changed)} changed since these results were written: they are "
                        "of other settings")
    keys = {c.key for c in grid.cells}
    stray = [e["key"] for e in record.get("cells", []) if e["key"] not in keys]
    if stray:
        raise GridError(f"{path}: cells the grid does not have: {', '.join(stray[:3])}"
                        + (f" and {len(stray) - 3} more" if len(stray) > 3 else ""))
    return record


def recorded_results(grid: Grid, *paths: Path) -> dict:
    """The results.json files this grid wrote, each checked against the grid as it is now (the same
    name, the same settings but for those that change no result, grid.NOT_RESULT: `paper`, `jobs`,
    paths, …, and no cell the grid no longer has), as one record: the first file's, each finished cell
    of a later file in place of the earlier one's (a cell of a grid refreshed in part, or run
    elsewhere). A cell whose results were made elsewhere than the record's names its own `provenance`."""
    record, *later = (_recorded(grid, p) for p in paths)
    entries = {e["key"]: e for e in record["cells"]}
    for other in later:
        for e in other["cells"]:
            if "final" in e:
                made = e.get("provenance", other["provenance"])
                entries[e["key"]] = {k: v for k, v in e.items() if k != "provenance"} | (
                    {"provenance": made} if made != record["provenance"] else {})
    bases = {}
    for e in entries.values():
        if "final" in e and BASE in e:
            bases.setdefault(e[BASE], []).append(e["key"])
    if len(bases) > 1:
        raise GridError("these results were fine-tuned from different weights of the grid's base model: "
                        + "; ".join(f"{len(keys)} cell(s) from {sha[:8]}… ({keys[0]}, …)"
                                    for sha, keys in bases.items()))
    return record | {"cells": list(entries.values())}


# every file write_report and write_figures may write into a results_dir
REPORT_FILE = re.compile(r"tables\.md|results\.json|paired\.csv|paper\.csv|pretrain_.+\.json|"
                         r"(?:loss|consensus)_.+\.png|"
                         rf"(?:{'|'.join(t[0] for t in TABLES)}|{'|'.join(t[1] for t in GENERATION_TABLES)})\.csv")


def check_results_dir(grid: Grid) -> None:
    """Before any cell runs: the report replaces files only in a results_dir that is new, holds none
    of the names it writes, or holds this grid's earlier report (its results.json). A directory of
    the user's (`--results-dir .`, say) with a tables.md or a results.json of its own, or another
    grid's report, is refused and left as it is."""
    out = grid.results_dir
    if not out.is_dir():
        return
    clashes = sorted(p.name for p in out.iterdir() if REPORT_FILE.fullmatch(p.name))
    if not clashes:
        return
    try:
        record = json.loads((out / "results.json").read_text())
        owner = record.get("grid") if isinstance(record.get("cells"), list) else None
    except (OSError, ValueError, AttributeError):  # absent, not JSON, or not an object
        owner = None
    if owner == grid.name:
        return
    holds = f"grid {owner!r}'s report" if isinstance(owner, str) else "files no report of this grid wrote"
    raise GridError(f"results_dir {out} holds {holds} ({', '.join(clashes[:5])}{', …' if len(clashes) > 5 else ''}), "
                    "which this grid's report would write over: give another --results-dir (nothing there is "
                    "touched)")


def write_report(grid: Grid, *, command: list[str] | None = None, recorded: dict | None = None) -> list[Path]:
    """Tables (Markdown, CSV) and results.json into grid.results_dir; returns the files written.

    `recorded` (recorded_results): the tables from that record's cells instead of the cells'
    directories; its provenance stays the results', and this report's is added as `tabulated`. A
    cell entry keeps its curves (report.curves, the main table's cells: what the figures draw) and
    the base weights' sha256 it was fine-tuned from, where the grid pretrains its base."""
    out = grid.results_dir
    out.mkdir(parents=True, exist_ok=True)
    entries = {e["key"]: e for e in recorded["cells"]} if recorded else {}
    results = ({c: entries[c.key]["final"] for c in grid.cells if "final" in entries.get(c.key, {})}
               if recorded else finished_results(grid))
    generated = {c: r for c, r in results.items() if "answered" in r}
    classified = {c: r for c, r in results.items() if c not in generated}
    written = []

    def put(name: str, text: str) -> None:
        written.append(out / name)
        write_text(written[-1], text)

    markdown = [f"# {grid.name}: reproduced tables", "",
                f"{len(results)} of {len(grid.cells)} cells finished. "
                + ("Accuracy and macro-F1 of the consensus model x̄ on the test split, in %, "
                   if classified or not generated else "")
                + "mean ± std over seeds (ddof 1); **best**, <u>second</u> per group.", ""]
    main_methods = tuple(m for m in (*BASELINES, *ABLATION[1:]) if m in METHODS)
    tables = [(build_table(name, title, classified, tuple(m for m in methods if m in METHODS)), name)
              for name, title, methods in TABLES]
    tables += [(build_generation_table(name, title, generated, main_methods), file)
               for name, file, title in GENERATION_TABLES]
    for table, file in tables:  # into tables.md and its own CSV
        if table is not None:
            markdown.append(to_markdown(table))
            put(f"{file}.csv", to_csv(table))
    seeds = per_seed_markdown(classified, main_methods)
    if seeds is not None:
        markdown.append(seeds)
    baselines = tuple(m for m in BASELINES if m in METHODS)
    paired = [p for p in (*(build_paired(classified, main_methods if name == "main" else baselines, name)
                            for name in PAIRED_TABLES), build_granularity_paired(classified)) if p is not None]
    markdown += [paired_markdown(p) for p in paired]
    if paired:
        put("paired.csv", paired_csv(paired))
    comparisons = paper_comparisons(grid.paper, classified, generated, main_methods) if grid.paper else []
    if comparisons:
        generation = any(c.scale != 100 for c in comparisons)
        markdown += [paper.NOTE + (" " + paper.GENERATION_NOTE if generation else ""), ""]
        markdown += [paper.to_markdown(c, grid.paper) for c in comparisons]
    if grid.paper:
        put("paper.csv", paper.to_csv(comparisons))
    put("tables.md", "\n".join(markdown))
    cells = [cell_entry(grid, c, results.get(c), entries.get(c.key, {}) if recorded else None) for c in grid.cells]
    for model in dict.fromkeys(c.options.get("model", "") for c in grid.cells if not recorded):
        made = Path(model) / "pretrain.json"  # the scaled protocol's checkpoint: how it was trained
        if made.is_file():
            put(f"pretrain_{Path(model).name}.json", made.read_text())
    now = provenance(command, outputs=out)
    record = {"grid": grid.name, "source": grid.source, "provenance": recorded["provenance"] if recorded else now,
              **({"tabulated": now} if recorded else {}), "cells": cells}
    if grid.paper:
        record["paper"] = {"model": grid.paper, "tables": {c.name: c.order() for c in comparisons}}
    put("results.json", dumps(record))
    return written


def paper_comparisons(model: str, classified: dict, generated: dict, main_methods: tuple[str, ...]) -> list:
    """The tables of the paper's `model` beside the grid's: each one the grid has cells of."""
    reference = paper.reference(model)
    found = [build_comparison(name, title, classified, tuple(m for m in methods if m in METHODS), reference[name])
             for name, title, methods in TABLES if name in reference]
    for name, _, title in GENERATION_TABLES:
        table = "generation" if name == "main" else name
        if table in reference:
            found.append(build_generation_comparison(name, title, generated, main_methods, reference[table]))
    return [c for c in found if c is not None]


def cell_entry(grid: Grid, c: Cell, final: dict | None, recorded: dict | None) -> dict:
    """A cell as results.json holds it: its place in the grid, budget and final metrics (None: not
    finished), with what `recorded` (its entry of an earlier record) kept, or else what its
    directory holds: the base's sha256, its run_config, the main table's curves."""
    entry = {"key": c.key, "task": c.task, "method": c.method, "topology": c.topology, "clients": c.clients,
             "layers_per_block": c.layers_per_block, "seed": c.seed, "tables": list(c.tables),
             "budget": {"steps": grid.budgets[c.key][0], "examples_per_client_step": grid.budgets[c.key][1]},
             "finished": final is not None}
    if recorded is not None:
        entry |= {k: v for k, v in recorded.items() if k in RECORDED}
    else:
        d = grid.cell_dir(c)
        if base := (saved_settings(d) or {}).get(BASE):  # the weights of the base the cell was fine-tuned from
            entry[BASE] = base
        if (d / RUN_CONFIG).is_file():
            config = read_json(d / RUN_CONFIG)
            # each block by name and size; its parameters' names are the model's, in the cell's run_config.json
            config["blocks"] = [{k: b[k] for k in ("index", "name", "numel")} for b in config.get("blocks", [])]
            entry["run_config"] = config
        if final is not None and "main" in c.tables:
            entry["curves"] = curves(losses(grid, c))
    if final is not None:
        entry["final"] = final
    return entry


def curves(metrics: list[dict]) -> dict[str, dict[str, list]]:
    """What the figures draw of a cell, from its per-step metrics: each curve's steps and values, the
    values to 6 significant digits (more than a figure shows), so that results.json alone draws them."""
    return {key: {"step": [m["step"] for m in metrics if key in m],
                  "value": [float(f"{m[key]:.6g}") for m in metrics if key in m]}
            for key in CURVES if any(key in m for m in metrics)}


def dumps(record: dict) -> str:
    """JSON indented for reading, but each curve's lists on one line (a results.json stays a few
    hundred lines per cell, not one per step)."""
    lists = []

    def mark(values: list) -> str:
        lists.append(json.dumps(values, allow_nan=False))
        return f"@list{len(lists) - 1}@"

    cells = [e | {"curves": {k: {n: mark(v) for n, v in c.items()} for k, c in e["curves"].items()}}
             if "curves" in e else e for e in record["cells"]]
    text = json.dumps(record | {"cells": cells}, indent=1, allow_nan=False)
    return re.sub(r'"@list(\d+)@"', lambda m: lists[int(m.group(1))], text)


def losses(grid: Grid, cell: Cell) -> list[dict]:
    """The cell's per-step metrics (runtime.metrics' metrics.jsonl), [] before its first step."""
    path = grid.cell_dir(cell) / METRICS
    return [json.loads(line) for line in path.read_text().splitlines() if line] if path.is_file() else []
