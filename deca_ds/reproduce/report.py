"""The paper's tables from the finished cells: Markdown and CSV, plus one JSON of every cell.

Every number is mean ± sample standard deviation (ddof 1) over the seeds: a percentage, but for
the judge's grades of the generation table (1-10, as the paper prints them); the Average column
averages a seed's tasks first, then takes mean ± std over seeds. In each group of rows (a
topology, a number of clients) the best mean of a column is **bold** and the second best
<u>underlined</u>, as in the paper (ties share the mark). The paired tables set DECA against each
method seed by seed: the differences' mean ± std, the seeds ahead and behind, and the paired
t-test's p.
"""

from __future__ import annotations

import csv
import io
import json
import os
import re
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path

from .. import reporting
from ..files import write_text
from . import paper
from .cells import BASE, FINAL, METRICS, RUN_CONFIG, read_json, saved_settings
from .generation import judged
from .grid import METHODS, NOT_RESULT, Cell, Grid, GridError

LABELS = {"deca": "DECA", "trivial_bma": "w/ trivial BMA", "no_bma": "w/o BMA", "dadam": "D-Adam (full, no blocks)",
          "dec_lora": "Dec-LoRA", "dec_adapter": "Dec-Adapter", "decaf": "DeCAF"}
ABLATION = ("deca", "trivial_bma", "no_bma")
BASELINES = ("dec_adapter", "dec_lora", "decaf", "dadam", "deca")  # the paper's row order, D-Adam added
METRICS_SHOWN = (("accuracy", "Acc."), ("macro_f1", "F1"))
RECORDED = ("provenance", BASE, "run_config", "curves")  # what a cell's entry brings along from a results.json
CURVES = ("loss", "consensus_distance")  # the per-step metrics results.json keeps of a main-table cell (figures)
TOPOLOGY_LABELS = {"ring": "Ring", "erdos_renyi": "ER", "complete_bipartite": "Bipartite"}


@dataclass
class Table:
    """Rows of (group, method) with, per column, the values over seeds (fractions)."""

    name: str
    title: str
    group_name: str | None
    columns: list[str]
    rows: list[tuple[str, str, list[list[float]]]]
    scales: list[float] | None = None  # per column, what a value is multiplied by when shown (default 100: %)

    def scale(self, column: int) -> float:
        return self.scales[column] if self.scales else 100.0


def mean_std(values: list[float]) -> tuple[float, float | None]:
    return statistics.fmean(values), (statistics.stdev(values) if len(values) > 1 else None)


def marks(means: list[float]) -> list[str]:
    """'best', 'second' or '' per value: the largest and second largest distinct values (with fewer
    than two rows nothing is marked)."""
    if len(means) < 2:
        return [""] * len(means)
    ranked = sorted(set(means), reverse=True)
    return ["best" if m == ranked[0] else "second" if len(ranked) > 1 and m == ranked[1] else "" for m in means]


def cell_text(values: list[float], scale: float = 100.0) -> str:
    mean, std = mean_std(values)
    return f"{scale * mean:.2f}" + ("" if std is None else f" ± {scale * std:.2f}")


def _groups(table: Table) -> dict[str, list[int]]:
    groups: dict[str, list[int]] = {}
    for i, (group, _, _) in enumerate(table.rows):
        groups.setdefault(group, []).append(i)
    return groups


def column_marks(table: Table) -> list[list[str]]:
    """Per row, per column: the mark of its mean within its group."""
    out = [[""] * len(table.columns) for _ in table.rows]
    for members in _groups(table).values():
        for c in range(len(table.columns)):
            for i, mark in zip(members, marks([mean_std(table.rows[i][2][c])[0] for i in members])):
                out[i][c] = mark
    return out


def to_markdown(table: Table) -> str:
    head = ([table.group_name] if table.group_name else []) + ["Method"] + table.columns
    lines = [f"### {table.title}", "", "| " + " | ".join(head) + " |",
             "| " + " | ".join([":--"] * (len(head) - len(table.columns)) + ["--:"] * len(table.columns)) + " |"]
    for (group, method, values), row_marks in zip(table.rows, column_marks(table)):
        cells = []
        for c, (v, mark) in enumerate(zip(values, row_marks)):
            text = cell_text(v, table.scale(c))
            cells.append(f"**{text}**" if mark == "best" else f"<u>{text}</u>" if mark == "second" else text)
        lines.append("| " + " | ".join(([group] if table.group_name else []) + [method] + cells) + " |")
    return "\n".join(lines) + "\n"


def to_csv(table: Table) -> str:
    buf = io.StringIO()
    w = csv.writer(buf, lineterminator="\n")
    w.writerow(([table.group_name] if table.group_name else []) + ["method"]
               + [f"{c} {part}" for c in table.columns for part in ("mean", "std", "mark")] + ["seeds"])
    for (group, method, values), row_marks in zip(table.rows, column_marks(table)):
        row = ([group] if table.group_name else []) + [method]
        for c, (v, mark) in enumerate(zip(values, row_marks)):
            mean, std = mean_std(v)
            row += [f"{table.scale(c) * mean:.4f}", "" if std is None else f"{table.scale(c) * std:.4f}", mark]
        w.writerow(row + [len(values[0])])
    return buf.getvalue()


# ---- from cells to tables ----------------------------------------------------------------------------------


def _axis_label(axis: str, value) -> str:
    return TOPOLOGY_LABELS.get(value, value) if axis == "topology" else str(value)


def _axis_rank(value) -> tuple:
    """Numbers ascending; topologies in the paper's order (ring, ER, bipartite), then others."""
    if isinstance(value, str):
        known = list(TOPOLOGY_LABELS)
        return (known.index(value) if value in known else len(known), 0)
    return (0, value)


def _setting(cell: Cell) -> tuple:
    return cell.topology, cell.clients, cell.layers_per_block


def _settings(cells: list[Cell]) -> list[tuple]:
    """The (topology, clients, layers per block) the cells were run with, in the tables' order."""
    return sorted({_setting(c) for c in cells}, key=lambda s: (_axis_rank(s[0]), s[1], s[2]))


def _setting_label(setting: tuple) -> str:
    topology, clients, layers_per_block = setting
    return f"{TOPOLOGY_LABELS.get(topology, topology)}, N={clients}, lpb={layers_per_block}"


GROUP_AXIS = {"main": None, "ablation": None, "topology": ("topology", "Topology"), "clients": ("clients", "N"),
              "granularity": ("layers_per_block", "Layers per block"), "bma": ("betas", "β1, β2")}


def _group_rank(value) -> tuple:
    """A group's place: _axis_rank of its axis value; the main table's settings in _settings' order."""
    if isinstance(value, tuple):
        return (_axis_rank(value[0]), value[1], value[2])
    return _axis_rank(value)


def _group_place(name: str, cell: Cell) -> tuple:
    """Where the cell's row group stands in table `name`: by the table's GROUP_AXIS value, or the
    main table's setting."""
    axis = GROUP_AXIS[name]
    return _group_rank(getattr(cell, axis[0]) if axis else _setting(cell))


def _group_name(name: str, several: bool) -> str | None:
    """The group column's name in table `name` (the main table's: "Setting" where it has several)."""
    axis = GROUP_AXIS[name]
    return axis[1] if axis else "Setting" if several else None


def _table(name: str, title: str, cells: list[Cell], methods: tuple[str, ...], values: dict[Cell, dict],
           columns: list[tuple[str, str]], names: list[str], scales: list[float] | None = None) -> Table | None:
    """Table `name` of `cells`: a row per group (the value of the table's GROUP_AXIS, or the main
    table's setting where its cells have several) and method, in that order, with per column
    (task, column) the values (`values[cell][column]`) over the seeds on which the row has every
    column; a row that has them on no seed is left out."""
    several = len(_settings(cells)) > 1
    found: dict[tuple[str, str], dict[tuple[str, int], dict]] = {}
    rank = {}  # group label -> its place
    for c in cells:
        group = _cell_group(name, c, several)
        rank.setdefault(group, _group_place(name, c))
        found.setdefault((group, c.method), {})[(c.task, c.seed)] = values[c]
    seeds = sorted({c.seed for c in cells})
    order = {m: i for i, m in enumerate(methods)}
    rows = []
    for (group, method), by_seed in sorted(found.items(), key=lambda kv: (rank[kv[0][0]], kv[0][0], order[kv[0][1]])):
        complete = [s for s in seeds if all(column in by_seed.get((t, s), {}) for t, column in columns)]
        if complete:
            rows.append((group, LABELS[method], [[by_seed[(t, s)][column] for s in complete] for t, column in columns]))
    return Table(name, title, _group_name(name, several), names, rows, scales) if rows else None


def build_table(name: str, title: str, results: dict[Cell, dict], methods: tuple[str, ...]) -> Table | None:
    """The table `name` from the finished cells tagged with it (the ablation table: the main table's
    cells of DECA's variants): accuracy and macro-F1 per task, and with several tasks the paper's
    Average column (per seed, the mean over the tasks). Cells that miss a seed or a task of their
    row are left out of it."""
    tag = "main" if name == "ablation" else name
    cells = [c for c in results if tag in c.tables and c.method in methods]
    tasks = list(dict.fromkeys(c.task for c in cells))
    values = {c: {short: results[c][key] for key, short in METRICS_SHOWN} for c in cells}
    columns = [(t, short) for t in tasks for _, short in METRICS_SHOWN]
    table = _table(name, title, cells, methods, values, columns, [f"{t} {short}" for t, short in columns])
    if table and len(tasks) > 1:
        k = len(METRICS_SHOWN)
        for _, _, row in table.rows:  # row: the tasks' columns, metric by metric within each task
            row += [[statistics.fmean(seed) for seed in zip(*row[m::k])] for m in range(k)]
        table.columns += [f"Average {short}" for _, short in METRICS_SHOWN]
    return table


GENERATION_TITLE = "Generation: the judge's grades (1-10) of the consensus model's answers (ROUGE-L in %)"


def generation_columns(final: dict) -> dict[str, tuple[float, float]]:
    """A generation cell's values by column, each with its scale: per question set the judge's
    grade of each turn and of all its turns (the paper's MT-1, MT-2 and MT.; a set of single
    questions: one column, as VIC.), and ROUGE-L where the questions carry reference answers."""
    out = {}
    for name, grades in (final.get("judged") or {}).items():
        turns = grades["per_turn"]
        if len(turns) > 1:
            out |= {f"{name}-{t}": (v, 1.0) for t, v in sorted(turns.items(), key=lambda kv: int(kv[0]))}
        if grades["mean"] is not None:
            out[name] = (grades["mean"], 1.0)
    for name, answered in final.get("answered", {}).items():
        if "rouge_l" in answered:
            out[f"{name} ROUGE-L"] = (answered["rouge_l"], 100.0)
    return out


def build_generation_table(name: str, title: str, results: dict[Cell, dict], methods: tuple[str, ...]) -> Table | None:
    """Table `name`'s generation cells (those whose final result holds "answered") with
    generation_columns' columns (per task where there are several); a cell not yet judged lacks
    the judge's and waits."""
    cells = [c for c in results if "answered" in results[c] and name in c.tables and c.method in methods]
    found = {c: generation_columns(results[c]) for c in cells}
    scales: dict[tuple[str, str], float] = {}  # (task, column) -> its scale, in the cells' order
    for c in cells:
        for column, (_, scale) in found[c].items():
            scales.setdefault((c.task, column), scale)
    several_tasks = len({t for t, _ in scales}) > 1
    return _table(name, title, cells, methods, {c: {k: v for k, (v, _) in found[c].items()} for c in cells},
                  list(scales), [f"{t} {column}" if several_tasks else column for t, column in scales],
                  list(scales.values()))


def _compared(name: str, table: str, cells: list[Cell], methods: tuple[str, ...], reference: dict,
              here: dict[Cell, dict[str, float]]) -> tuple[dict[tuple[str, str], paper.Row], dict, str | None]:
    """The rows of table `name` that the paper's `table` also has (`reference`: {paper.row_key:
    {column: the paper's number}}), a row per group and method as in `_table`, with per (task,
    column) both have the values over the seeds (`here[cell][column]`) and the paper's. Returns
    the rows, the cells behind each row and the group column's name."""
    several = len(_settings(cells)) > 1
    order = {m: i for i, m in enumerate(methods)}
    rows: dict[tuple[str, str], paper.Row] = {}
    members: dict[tuple[str, str], list[Cell]] = {}
    for c in sorted(cells, key=lambda c: (_group_place(name, c), _cell_group(name, c, several), order[c.method],
                                          c.seed)):
        published = reference.get(paper.row_key(table, c))
        if published is None:
            continue
        group = _cell_group(name, c, several)
        row = rows.setdefault((group, c.method), paper.Row(group, LABELS[c.method], {}, {}))
        members.setdefault((group, c.method), []).append(c)
        for column, value in published.items():
            if column in here[c]:
                row.here.setdefault((c.task, column), []).append(here[c][column])
                row.paper[(c.task, column)] = value
    return rows, members, _group_name(name, several)


def _columns(rows) -> list[tuple[str, str]]:
    return list(dict.fromkeys(column for row in rows for column in row.here))


def build_generation_comparison(name: str, title: str, results: dict[Cell, dict], methods: tuple[str, ...],
                                reference: dict) -> paper.Comparison | None:
    """Generation table `name`'s rows the paper also has (`reference`: paper.reference(model)'s
    "generation" table for the main one, "bma" for the betas), in the columns it prints (a grid's
    question sets `vicuna` and `mt_bench`: VIC., MT-1, MT-2, MT.)."""
    table = "generation" if name == "main" else name
    cells = [c for c in results if "answered" in results[c] and name in c.tables and c.method in methods]
    here = {c: {k: v for k, (v, _) in generation_columns(results[c]).items()} for c in cells}
    rows, _, group_name = _compared(name, table, cells, methods, reference, here)
    return paper.Comparison(table, title, group_name, _columns(rows.values()), list(rows.values()),
                            scale=1.0) if rows else None


def build_comparison(name: str, title: str, results: dict[Cell, dict], methods: tuple[str, ...],
                     reference: dict) -> paper.Comparison | None:
    """Table `name`'s rows that the paper also has (`reference`: paper.reference(model)[name]), each
    with its values over the seeds that finished and the paper's, and an Average column where the
    row has every task of the paper's row."""
    tag = "main" if name == "ablation" else name
    cells = [c for c in results if tag in c.tables and c.method in methods]
    here = {c: {short: results[c][metric] for metric, short in METRICS_SHOWN} for c in cells}
    shorts = [short for _, short in METRICS_SHOWN]
    rows, members, group_name = _compared(name, name, cells, methods,
                                          {k: dict(zip(shorts, v)) for k, v in reference.items()}, here)
    for at, row in rows.items():
        paper_row = paper.row_key(name, members[at][0])[:2]
        found = {(paper.row_key(name, c)[2], c.seed): results[c] for c in members[at]}
        tasks = [k[2] for k in reference if k[:2] == paper_row and k[2] != paper.AVERAGE]
        seeds = sorted({s for _, s in found if all((t, s) in found for t in tasks)})
        if (*paper_row, paper.AVERAGE) not in reference or not seeds:
            continue
        for (metric, short), value in zip(METRICS_SHOWN, reference[(*paper_row, paper.AVERAGE)]):
            column = (paper.AVERAGE_LABEL, short)
            row.here[column] = [statistics.fmean(found[(t, s)][metric] for t in tasks) for s in seeds]
            row.paper[column] = value
    columns = sorted(_columns(rows.values()), key=lambda col: col[0] == paper.AVERAGE_LABEL)  # stable: tasks first
    return paper.Comparison(name, title, group_name, columns, list(rows.values())) if rows else None


PAIRED_TITLE = "DECA against each method, seed by seed (percentage points)"
P_NOTE = ("p: the two-sided paired t-test of a zero mean Δ over those seeds (– for one seed, or where every seed's "
          "Δ is the same); with few seeds, weak evidence either way.")
PAIRED_NOTE = ("Δ = DECA − method, mean ± std over the seeds both finished; the cells of one seed share the data "
               "split and the graph, so each seed is a paired comparison. Ahead: the seeds on which DECA's "
               "accuracy is higher (behind: lower). " + P_NOTE)
# the tables whose cells are paired with DECA's, and how their paired table's title names them
PAIRED_TABLES = {"main": "", "topology": "topologies", "clients": "numbers of clients"}
GRANULARITY_TITLE = "DECA's granularity, seed by seed (percentage points)"
GRANULARITY_NOTE = ("Δ = DECA at the main table's {ref} layers per block − DECA at the row's, mean ± std over the "
                    "seeds both finished (one seed: one data split and graph for both). Ahead: the seeds on which "
                    "{ref} layers per block score higher (behind: lower). The step budget T·B·R is not equal across "
                    "rows: B changes with the granularity. " + P_NOTE)


@dataclass
class Paired:
    """Rows (group, method, seeds, per column the per-seed differences) of one paired comparison
    with DECA, drawn from table `name`'s cells; `ahead` names the side whose lead the seeds count."""

    name: str
    title: str
    note: str
    ahead: str
    group_name: str
    columns: list[str]
    rows: list[tuple[str, str, list[int], list[list[float]]]]


def _group_label(name: str, setting: tuple, several: bool) -> str:
    """A row group's label: the value of the table's axis (a topology, a number of clients), or for
    the main table the whole setting where its cells have several."""
    axis = GROUP_AXIS[name]
    if axis:
        return _axis_label(axis[0], dict(zip(("topology", "clients", "layers_per_block"), setting))[axis[0]])
    return _setting_label(setting) if several else ""


def _cell_group(name: str, cell: Cell, several: bool) -> str:
    """A cell's row group in table `name`: _group_label's, or in the `bma` table the cell's betas."""
    return cell.betas if name == "bma" else _group_label(name, _setting(cell), several)


def _table_cells(results: dict[Cell, dict], methods: tuple[str, ...],
                 name: str = "main") -> tuple[list, list, list, dict]:
    """The finished cells of `methods` tagged with table `name`: their tasks, seeds and (group label,
    setting) in the tables' order, and each final result by (*setting, method, task, seed)."""
    cells = [c for c in results if name in c.tables and c.method in methods]
    finals = {(*_setting(c), c.method, c.task, c.seed): results[c] for c in cells}
    settings = _settings(cells)
    groups = [(_group_label(name, s, len(settings) > 1), s) for s in settings]
    return list(dict.fromkeys(c.task for c in cells)), sorted({c.seed for c in cells}), groups, finals


def _paired_columns(tasks: list[str]) -> list[str]:
    columns = [f"{t} Δ {short}" for t in tasks for _, short in METRICS_SHOWN]
    return columns + ([f"Average Δ {short}" for _, short in METRICS_SHOWN] if len(tasks) > 1 else [])


def _differences(finals: dict, tasks: list[str], all_seeds: list[int], a: tuple,
                 b: tuple) -> tuple[list[int], list[list[float]]]:
    """Cell a − cell b ((*setting, method) each), per column and seed, on the seeds both finished
    every task of (the Average column: per seed, the mean over tasks of the difference)."""
    seeds = [s for s in all_seeds if all((*k, t, s) in finals for k in (a, b) for t in tasks)]
    diff = {(t, key, s): finals[(*a, t, s)][key] - finals[(*b, t, s)][key]
            for t in tasks for key, _ in METRICS_SHOWN for s in seeds}
    values = [[diff[(t, key, s)] for s in seeds] for t in tasks for key, _ in METRICS_SHOWN]
    if len(tasks) > 1:
        values += [[statistics.fmean(diff[(t, key, s)] for t in tasks) for s in seeds] for key, _ in METRICS_SHOWN]
    return seeds, values


def build_paired(results: dict[Cell, dict], methods: tuple[str, ...], name: str = "main") -> Paired | None:
    """DECA against each other method of table `name`'s cells, setting by setting."""
    tasks, all_seeds, groups, finals = _table_cells(results, methods, name)
    rows = []
    for group, setting in groups:
        for method in (m for m in methods if m != "deca"):
            seeds, values = _differences(finals, tasks, all_seeds, (*setting, "deca"), (*setting, method))
            if seeds:
                rows.append((group, LABELS[method], seeds, values))
    axis = GROUP_AXIS[name]
    title = PAIRED_TITLE + (f": {PAIRED_TABLES[name]}" if PAIRED_TABLES[name] else "")
    return Paired(name, title, PAIRED_NOTE, "DECA", axis[1] if axis else "Setting", _paired_columns(tasks),
                  rows) if rows else None


def build_granularity_paired(results: dict[Cell, dict]) -> Paired | None:
    """DECA at the main table's layers per block against DECA at each other granularity of the
    granularity table, seed by seed."""
    tasks, all_seeds, groups, finals = _table_cells(results, ("deca",), "granularity")
    main = {_setting(c) for c in results if c.method == "deca" and {"main", "granularity"} <= set(c.tables)}
    if len(main) != 1:  # no granularity sweep, or one that does not contain the main table's setting
        return None
    ref = main.pop()
    rows = []
    for group, setting in groups:
        if setting != ref:
            seeds, values = _differences(finals, tasks, all_seeds, (*ref, "deca"), (*setting, "deca"))
            if seeds:
                rows.append((group, LABELS["deca"], seeds, values))
    return Paired("granularity", GRANULARITY_TITLE, GRANULARITY_NOTE.format(ref=ref[2]), f"lpb {ref[2]}",
                  GROUP_AXIS["granularity"][1], _paired_columns(tasks), rows) if rows else None


def _ahead(diffs: list[float]) -> tuple[int, int]:
    return sum(d > 0 for d in diffs), sum(d < 0 for d in diffs)


def paired_p(diffs: list[float]) -> float | None:
    """The two-sided p-value of the paired t-test that the seeds' mean Δ is zero (Student's t with
    n − 1 degrees of freedom); None for one seed, or where every seed's Δ is the same (the seeds' Δ
    within 1e-9 of each other: rounding leaves equal differences of scores that far apart, not more)."""
    if len(diffs) < 2 or max(diffs) - min(diffs) <= 1e-9:
        return None
    from scipy import stats

    return float(stats.ttest_1samp(diffs, 0.0).pvalue)


def _p_text(p: float | None) -> str:
    return "–" if p is None else "< 0.001" if p < 0.001 else f"{p:.2g}"


def paired_markdown(paired: Paired) -> str:
    """Each Δ column as mean ± std, then per accuracy column the seeds ahead and behind, and the
    paired t-test's p."""
    grouped = any(group for group, _, _, _ in paired.rows)
    accuracy = [i for i, c in enumerate(paired.columns) if c.endswith(METRICS_SHOWN[0][1])]
    head = ([paired.group_name] if grouped else []) + ["Method", "Seeds"] + paired.columns + [
        paired.columns[i].replace("Δ Acc.", f"{paired.ahead} ahead / behind") for i in accuracy] + [
        paired.columns[i].replace("Δ Acc.", "p") for i in accuracy]
    lines = [f"### {paired.title}", "", paired.note, "", "| " + " | ".join(head) + " |",
             "| " + " | ".join([":--"] * (2 + grouped) + ["--:"] * (len(head) - 2 - grouped)) + " |"]
    for group, method, seeds, values in paired.rows:
        cells = ([cell_text(v) for v in values] + ["{} / {}".format(*_ahead(values[i])) for i in accuracy]
                 + [_p_text(paired_p(values[i])) for i in accuracy])
        lines.append("| " + " | ".join(([group] if grouped else []) + [method, str(len(seeds))] + cells) + " |")
    return "\n".join(lines) + "\n"


def paired_csv(tables: list[Paired]) -> str:
    """One row per (table, group, method, column) of the paired tables."""
    buf = io.StringIO()
    w = csv.writer(buf, lineterminator="\n")
    w.writerow(["table", "setting", "method", "seeds", "column", "mean", "std", "deca_ahead", "deca_behind",
                "p_paired_t"])
    for paired in tables:
        for group, method, seeds, values in paired.rows:
            for column, v in zip(paired.columns, values):
                mean, std = mean_std(v)
                p = paired_p(v)
                w.writerow([paired.name, group, method, " ".join(map(str, seeds)), column, f"{100 * mean:.4f}",
                            "" if std is None else f"{100 * std:.4f}", *_ahead(v), "" if p is None else f"{p:.4g}"])
    return buf.getvalue()


def per_seed_markdown(results: dict[Cell, dict], methods: tuple[str, ...]) -> str | None:
    """The main table's cells one by one: accuracy / macro-F1 (%) per task and seed, '–' where a cell
    has not finished."""
    tasks, seeds, groups, finals = _table_cells(results, methods)
    if not finals:
        return None
    grouped = len(groups) > 1
    head = (["Setting"] if grouped else []) + ["Method"] + [f"{t} seed {s}" for t in tasks for s in seeds]
    lines = ["### Per seed: accuracy / macro-F1 (%)", "", "| " + " | ".join(head) + " |",
             "| " + " | ".join([":--"] * (1 + grouped) + ["--:"] * (len(head) - 1 - grouped)) + " |"]
    for label, setting in groups:
        group = [label] if grouped else []
        for method in methods:
            found = [finals.get((*setting, method, t, s)) for t in tasks for s in seeds]
            text = ["–" if f is None else f"{100 * f['accuracy']:.1f} / {100 * f['macro_f1']:.1f}" for f in found]
            if any(found):
                lines.append("| " + " | ".join(group + [LABELS[method]] + text) + " |")
    return "\n".join(lines) + "\n"


TABLES = (
    ("main", "Accuracy and macro-F1 of the consensus model (%), DECA against the decentralized baselines", BASELINES),
    ("ablation", "Ablation: DECA's BMA (%)", ABLATION),
    ("topology", "Topologies (%)", BASELINES),
    ("clients", "Numbers of clients (%)", BASELINES),
    ("granularity", "DECA's partitioning granularity (%)", ("deca",)),
    ("bma", "DECA's BMA betas (%)", ABLATION),
)
# the generation tables: (table, file, title); the judge's grades, 1-10
GENERATION_TABLES = (("main", "generation", GENERATION_TITLE),
                     ("bma", "generation_bma", "Generation, DECA's BMA betas: the judge's grades (1-10), ROUGE-L in %"))


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
