"""The paper's tables from the finished cells, as Markdown and CSV.

Every number is mean ± sample standard deviation (ddof 1) over the seeds: a percentage, but for
the judge's grades of the generation table (1-10, as the paper prints them); the Average column
averages a seed's tasks first, then takes mean ± std over seeds. In each group of rows (a
topology, a number of clients) the best mean of a column is **bold** and the second best
<u>underlined</u>, as in the paper (ties share the mark). Beside each table the paper's own
numbers, where its grid names the paper's model (paper.py).
"""

from __future__ import annotations

import csv
import io
import statistics
from dataclasses import dataclass

from . import paper
from .grid import Cell

LABELS = {"deca": "DECA", "trivial_bma": "w/ trivial BMA", "no_bma": "w/o BMA", "dadam": "D-Adam (full, no blocks)",
          "dec_lora": "Dec-LoRA", "dec_adapter": "Dec-Adapter", "decaf": "DeCAF"}
ABLATION = ("deca", "trivial_bma", "no_bma")
BASELINES = ("dec_adapter", "dec_lora", "decaf", "dadam", "deca")  # the paper's row order, D-Adam added
METRICS_SHOWN = (("accuracy", "Acc."), ("macro_f1", "F1"))
TOPOLOGY_LABELS = {"ring": "Ring", "erdos_renyi": "ER", "complete_bipartite": "Bipartite"}
# the tables: (name, title, the methods of its rows in order)
TABLES = (
    ("main", "Accuracy and macro-F1 of the consensus model (%), DECA against the decentralized baselines", BASELINES),
    ("ablation", "Ablation: DECA's BMA (%)", ABLATION),
    ("topology", "Topologies (%)", BASELINES),
    ("clients", "Numbers of clients (%)", BASELINES),
    ("granularity", "DECA's partitioning granularity (%)", ("deca",)),
    ("bma", "DECA's BMA betas (%)", ABLATION),
)
# the generation tables: (table, file, title); the judge's grades, 1-10
GENERATION_TABLES = (("main", "generation", "Generation: the judge's grades (1-10) of the consensus model's answers "
                                            "(ROUGE-L in %)"),
                     ("bma", "generation_bma", "Generation, DECA's BMA betas: the judge's grades (1-10), ROUGE-L in %"))


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


def setting_of(cell: Cell) -> tuple:
    return cell.topology, cell.clients, cell.layers_per_block


def settings_of(cells: list[Cell]) -> list[tuple]:
    """The (topology, clients, layers per block) the cells were run with, in the tables' order."""
    return sorted({setting_of(c) for c in cells}, key=lambda s: (_axis_rank(s[0]), s[1], s[2]))


def _setting_label(setting: tuple) -> str:
    topology, clients, layers_per_block = setting
    return f"{TOPOLOGY_LABELS.get(topology, topology)}, N={clients}, lpb={layers_per_block}"


GROUP_AXIS = {"main": None, "ablation": None, "topology": ("topology", "Topology"), "clients": ("clients", "N"),
              "granularity": ("layers_per_block", "Layers per block"), "bma": ("betas", "β1, β2")}


def _group_rank(value) -> tuple:
    """A group's place: _axis_rank of its axis value; the main table's settings in settings_of's order."""
    if isinstance(value, tuple):
        return (_axis_rank(value[0]), value[1], value[2])
    return _axis_rank(value)


def _group_place(name: str, cell: Cell) -> tuple:
    """Where the cell's row group stands in table `name`: by the table's GROUP_AXIS value, or the
    main table's setting."""
    axis = GROUP_AXIS[name]
    return _group_rank(getattr(cell, axis[0]) if axis else setting_of(cell))


def _group_name(name: str, several: bool) -> str | None:
    """The group column's name in table `name` (the main table's: "Setting" where it has several)."""
    axis = GROUP_AXIS[name]
    return axis[1] if axis else "Setting" if several else None


def group_label(name: str, setting: tuple, several: bool) -> str:
    """A row group's label: the value of the table's axis (a topology, a number of clients), or for
    the main table the whole setting where its cells have several."""
    axis = GROUP_AXIS[name]
    if axis:
        return _axis_label(axis[0], dict(zip(("topology", "clients", "layers_per_block"), setting))[axis[0]])
    return _setting_label(setting) if several else ""


def _cell_group(name: str, cell: Cell, several: bool) -> str:
    """A cell's row group in table `name`: group_label's, or in the `bma` table the cell's betas."""
    return cell.betas if name == "bma" else group_label(name, setting_of(cell), several)


def _table(name: str, title: str, cells: list[Cell], methods: tuple[str, ...], values: dict[Cell, dict],
           columns: list[tuple[str, str]], names: list[str], scales: list[float] | None = None) -> Table | None:
    """Table `name` of `cells`: a row per group (the value of the table's GROUP_AXIS, or the main
    table's setting where its cells have several) and method, in that order, with per column
    (task, column) the values (`values[cell][column]`) over the seeds on which the row has every
    column; a row that has them on no seed is left out."""
    several = len(settings_of(cells)) > 1
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
    several = len(settings_of(cells)) > 1
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
