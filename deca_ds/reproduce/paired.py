"""DECA against each method seed by seed: the cells of one seed share the data split and the
graph, so each seed is a paired comparison. The paired tables give the differences' mean ± std, the
seeds ahead and behind, and the paired t-test's p; the per-seed table lists the main table's cells
one by one.
"""

from __future__ import annotations

import csv
import io
import statistics
from dataclasses import dataclass

from .grid import Cell
from .tables import GROUP_AXIS, LABELS, METRICS_SHOWN, cell_text, group_label, mean_std, setting_of, settings_of

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


def _table_cells(results: dict[Cell, dict], methods: tuple[str, ...],
                 name: str = "main") -> tuple[list, list, list, dict]:
    """The finished cells of `methods` tagged with table `name`: their tasks, seeds and (group label,
    setting) in the tables' order, and each final result by (*setting, method, task, seed)."""
    cells = [c for c in results if name in c.tables and c.method in methods]
    finals = {(*setting_of(c), c.method, c.task, c.seed): results[c] for c in cells}
    settings = settings_of(cells)
    groups = [(group_label(name, s, len(settings) > 1), s) for s in settings]
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
    main = {setting_of(c) for c in results if c.method == "deca" and {"main", "granularity"} <= set(c.tables)}
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
