"""The paper's published numbers (paper_tables.yaml) beside a grid's own, cell by cell, and how often
the methods come out in the paper's order.

A grid that names one of the paper's models (`paper: qwen2.5-3b`) gets, for every row of its tables
that the paper also has (same table, topology / number of clients / layers per block, method and
task), its mean ± std over seeds with the paper's number beside it, and the Average column where
the grid has every task of the paper's row. Two counts say whether the ordering agrees, task column
by task column (a task's accuracy or macro-F1) among the rows the paper compares (the methods of a
group; the granularities of the granularity table):

    pairs in order   pairs of rows whose difference here has the sign of the paper's (the pairs the
                     paper ties are left out; a tie here is not in order)
    best as paper    columns in which the paper's best row is the best here too (ties share it)

On the paper's own model and settings both the numbers and the orderings compare; on another model
(the scaled protocol) only the orderings do.
"""

from __future__ import annotations

import csv
import io
import statistics
from dataclasses import dataclass
from itertools import combinations
from pathlib import Path

import yaml

REFERENCE = Path(__file__).with_name("paper_tables.yaml")
MODEL_LABELS = {"qwen2.5-3b": "Qwen2.5-3B", "llama-3.1-8b": "Llama-3.1-8B", "qwen2-1.5b": "Qwen2-1.5B",
                "llama-2-7b": "Llama-2-7B"}
# the table whose rows are ordered across its groups rather than within each
ACROSS_GROUPS = {"granularity", "bma"}
# the cell field that a table's groups are (the main and ablation tables have one group)
GROUP_FIELD = {"topology": "topology", "clients": "clients", "granularity": "layers_per_block", "bma": "betas"}
# the task key of a row's Average column in paper_tables.yaml, and the column's label
AVERAGE, AVERAGE_LABEL = "average", "Average"


def reference_tables() -> dict:
    return yaml.safe_load(REFERENCE.read_text())


def models() -> list[str]:
    return list(reference_tables())


def reference(model: str) -> dict[str, dict]:
    """table -> {(group value or None, method, task): (accuracy, macro-F1)} of the paper's `model`, in %;
    the generation table's values are {column: the judge's grade} (report.generation_columns' names)."""
    out: dict[str, dict] = {}
    for table, body in reference_tables()[model].items():
        groups = {None: body} if table in ("main", "ablation", "generation") else body
        out[table] = {(group, method, task): dict(values) if isinstance(values, dict) else tuple(values)
                      for group, methods in groups.items() for method, tasks in methods.items()
                      for task, values in tasks.items()}
    return out


def row_key(table: str, cell) -> tuple:
    """Where a cell of `table` stands in the paper's: (group value or None, method, task)."""
    return (getattr(cell, GROUP_FIELD[table]) if table in GROUP_FIELD else None, cell.method,
            cell.options["dataset"])


def published_cells(cells, model: str) -> list:
    """The cells with a number in one of the paper's tables they feed (the main table's cells
    feed the ablation and the generation table too)."""
    tables = reference(model)
    return [c for c in cells if any(row_key(t, c) in tables.get(t, {})
                                    for t in (*c.tables, *(("ablation", "generation") if "main" in c.tables else ())))]


@dataclass
class Row:
    """One row of a grid's table against the paper: a group, a method, and per (task, metric) the
    values here over seeds (fractions) and the paper's (%)."""

    group: str
    method: str
    here: dict[tuple[str, str], list[float]]
    paper: dict[tuple[str, str], float]


@dataclass
class Comparison:
    name: str
    title: str
    group_name: str | None
    columns: list[tuple[str, str]]  # (task, metric label)
    rows: list[Row]
    scale: float = 100.0  # what the values here are multiplied by to read as the paper's (fractions -> %)

    def sets(self) -> list[list[Row]]:
        """The rows whose order the paper shows: a group's, or all of them (granularity)."""
        if self.name in ACROSS_GROUPS:
            return [self.rows]
        groups: dict[str, list[Row]] = {}
        for row in self.rows:
            groups.setdefault(row.group, []).append(row)
        return list(groups.values())

    def order(self) -> dict:
        """Pairs of rows in the paper's order and columns whose best is the paper's, over every set
        and task column (the Average columns summarize those); `out_of_order` names the pairs that
        are not (with their columns), `unlike` the columns whose best differs."""
        pairs = in_order = columns = best = 0
        out_of_order: dict[str, list[str]] = {}
        unlike = []
        for rows in self.sets():
            for col in (c for c in self.columns if c[0] != AVERAGE_LABEL):
                both = [(statistics.fmean(r.here[col]), r.paper[col], r) for r in rows
                        if col in r.here and col in r.paper]
                if len(both) < 2:
                    continue
                for (ha, pa, a), (hb, pb, b) in combinations(both, 2):
                    if pa == pb:
                        continue
                    pairs += 1
                    if (ha - hb) * (pa - pb) > 0:
                        in_order += 1
                        continue
                    low, high = (a, b) if pa < pb else (b, a)  # the paper's lower row is level or above here
                    relation = "level with" if ha == hb else "above"
                    out_of_order.setdefault(f"{self._where(low)}{self._name(low)} {relation} {self._name(high)}",
                                            []).append(" ".join(col))
                top_paper = max(p for _, p, _ in both)
                if sum(p == top_paper for _, p, _ in both) > 1:
                    continue  # the paper ties for best
                columns += 1
                top_here = max(h for h, _, _ in both)
                paper_best = next(r for _, p, r in both if p == top_paper)
                if statistics.fmean(paper_best.here[col]) == top_here:
                    best += 1
                else:
                    here_best = next(r for h, _, r in both if h == top_here)
                    unlike.append(f"{self._where(here_best)}{' '.join(col)}: here {self._name(here_best)}, "
                                  f"the paper {self._name(paper_best)}")
        return {"pairs_in_order": in_order, "pairs": pairs, "best_as_paper": best, "columns": columns,
                "out_of_order": [f"{pair} in {', '.join(cols)}" for pair, cols in out_of_order.items()],
                "unlike": unlike}

    def _name(self, row: Row) -> str:
        return f"{self.group_name} {row.group}" if self.name in ACROSS_GROUPS else row.method

    def _where(self, row: Row) -> str:
        """The group a row's comparison is made in, as a prefix ('' in a table of one group)."""
        return f"{row.group}, " if row.group and self.name not in ACROSS_GROUPS else ""


def _text(values: list[float], scale: float) -> str:
    mean = scale * statistics.fmean(values)
    return f"{mean:.2f}" + (f" ± {scale * statistics.stdev(values):.2f}" if len(values) > 1 else "")


def to_markdown(comparison: Comparison, model: str) -> str:
    grouped = comparison.group_name is not None
    head = ([comparison.group_name] if grouped else []) + ["Method"] + [f"{t} {m}" for t, m in comparison.columns]
    lines = [f"### Against the paper ({MODEL_LABELS.get(model, model)}): {comparison.title}", "",
             "| " + " | ".join(head) + " |",
             "| " + " | ".join([":--"] * (1 + grouped) + ["--:"] * len(comparison.columns)) + " |"]
    for row in comparison.rows:
        cells = [(_text(row.here[c], comparison.scale) if c in row.here else "–")
                 + (f" ({row.paper[c]:.2f})" if c in row.paper else "") for c in comparison.columns]
        lines.append("| " + " | ".join(([row.group] if grouped else []) + [row.method] + cells) + " |")
    order = comparison.order()
    if order["pairs"]:
        lines += ["", f"In the paper's order: {order['pairs_in_order']} of {order['pairs']} pairs of rows, column by "
                  "column" + (f" (not: {'; '.join(order['out_of_order'])})" if order["out_of_order"] else "")
                  + f"; the paper's best is the best here in {order['best_as_paper']} of {order['columns']} columns"
                  + (f" (not in {'; '.join(order['unlike'])})" if order["unlike"] else "") + "."]
    return "\n".join(lines) + "\n"


NOTE = ("Here: mean ± std over the seeds that finished (%); in brackets the paper's number for the same table, "
        "setting, method and task. Average: per seed over the tasks of the paper's row, on the seeds that finished "
        "them all, beside the paper's Average column (no Average where the grid lacks one of those tasks). Pairs in "
        "order: pairs of rows of a group (granularity: of the table) whose difference here has the sign of the "
        "paper's, over every task's accuracy and macro-F1 column (pairs the paper ties are left out). The numbers "
        "compare only on the paper's model and settings; on another model or scale only the orderings do.")
GENERATION_NOTE = ("The generation tables: the judge's grades (1-10) as the paper prints them, over each of their "
                   "columns; they compare with the paper's only where GPT-4 judged.")


def to_csv(comparisons: list[Comparison]) -> str:
    buf = io.StringIO()
    w = csv.writer(buf, lineterminator="\n")
    w.writerow(["table", "group", "method", "task", "metric", "seeds", "mean", "std", "paper", "difference"])
    for comparison in comparisons:
        for row in comparison.rows:
            for col in comparison.columns:
                if col not in row.here or col not in row.paper:
                    continue
                values, scale = row.here[col], comparison.scale
                mean = scale * statistics.fmean(values)
                std = f"{scale * statistics.stdev(values):.4f}" if len(values) > 1 else ""
                w.writerow([comparison.name, row.group, row.method, *col, len(values), f"{mean:.4f}", std,
                            f"{row.paper[col]:.2f}", f"{mean - row.paper[col]:.4f}"])
    return buf.getvalue()
