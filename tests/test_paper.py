"""The paper's published numbers beside a grid's (deca_ds.reproduce.paper): the transcribed tables,
the orderings counted against hand-computed ones, and the report's files."""

from __future__ import annotations

import csv
import io
import json
import shutil

import pytest
import yaml

from deca_ds.files import write_json
from deca_ds.reproduce import GridError, build_grid
from deca_ds.reproduce.cell_dir import BASE, FINAL, cell_settings
from deca_ds.reproduce.grid import Cell, load_grid
from deca_ds.reproduce.paper import models, published_cells, reference, reference_tables, to_csv, to_markdown
from deca_ds.reproduce.report import write_report
from deca_ds.reproduce.tables import TABLES, build_comparison, build_generation_comparison


def test_the_papers_tables_as_printed():
    """Numbers read off the paper by hand, and the rows the paper prints twice agree in both places."""
    assert models() == ["qwen2.5-3b", "llama-3.1-8b", "qwen2-1.5b", "llama-2-7b"]
    qwen, llama = reference("qwen2.5-3b"), reference("llama-3.1-8b")
    assert qwen["main"][(None, "deca", "agnews")] == (88.84, 88.79)
    assert qwen["ablation"][(None, "trivial_bma", "nwgi")] == (30.62, 21.38)
    assert qwen["topology"][("complete_bipartite", "decaf", "tfns")] == (72.08, 68.36)
    assert qwen["clients"][(12, "dec_lora", "tfns")] == (89.80, 86.35)
    assert llama["main"][(None, "dec_adapter", "nwgi")] == (12.47, 4.71)
    assert llama["granularity"][(4, "deca", "mnli")] == (86.58, 86.55)
    for model, tables in (("qwen2.5-3b", qwen), ("llama-3.1-8b", llama)):
        main = tables["main"]
        # 4 methods x (4 tasks + Average) in Table 1, DECA and its two variants in the ablation table
        assert len(main) == 20 and len(tables["ablation"]) == 15
        assert all(tables["ablation"][k] == v for k, v in main.items() if k[1] == "deca"), model
    for key, value in qwen["topology"].items():
        if key[0] == "erdos_renyi":  # Table 1's setting: ER, 8 clients (its Average: over four tasks, not three)
            assert value == qwen["clients"][(8, *key[1:])]
            assert key[2] == "average" or value == qwen["main"][(None, *key[1:])]
    for key, value in llama["granularity"].items():
        if key[0] == 1 and key[2] != "average":  # Table 1's Llama-3.1-8B runs at one layer per block
            assert value == llama["main"][(None, *key[1:])]
    # every row's printed Average is the mean of its task columns, to the paper's rounding: a check
    # on each of the row's numbers
    for tables in (qwen, llama):
        for table in tables.values():
            for group, method, task in (k for k in table if k[2] == "average"):
                values = [v for (g, m, t), v in table.items() if (g, m) == (group, method) and t != "average"]
                assert len(values) in (3, 4)
                for i in (0, 1):
                    assert abs(sum(v[i] for v in values) / len(values) - table[(group, method, task)][i]) <= 0.0051
    # each pair is (accuracy, macro-F1) in %, printed to two decimals
    for tables in (qwen, llama):
        assert all(0 < v <= 100 and round(v, 2) == v for table in tables.values() for pair in table.values()
                   for v in pair)


def test_the_papers_generation_table_as_printed():
    qwen, llama = reference("qwen2-1.5b")["generation"], reference("llama-2-7b")["generation"]
    assert set(reference("qwen2-1.5b")) == {"generation", "bma"} and set(reference("llama-2-7b")) == {"generation"}
    assert qwen[(None, "deca", "alpaca")] == {"vicuna": 5.68, "mt_bench-1": 4.88, "mt_bench-2": 3.30, "mt_bench": 4.10}
    assert qwen[(None, "dec_adapter", "alpaca")]["mt_bench-2"] == 2.65
    assert llama[(None, "decaf", "alpaca")] == {"vicuna": 5.91, "mt_bench-1": 4.31, "mt_bench-2": 3.00,
                                                "mt_bench": 3.65}
    assert llama[(None, "dec_lora", "alpaca")]["vicuna"] == 5.60
    bma = reference("qwen2-1.5b")["bma"]
    assert bma[("0.3, 0.444", "deca", "alpaca")]["mt_bench-1"] == 5.23 and bma[("0.2, 0.333", "deca", "alpaca")][
        "vicuna"] == 5.70
    assert bma[("0.3, 0.333", "deca", "alpaca")] == qwen[(None, "deca", "alpaca")]  # printed in both tables
    for table in (qwen, llama, bma):
        assert {k[1:] for k in table} <= {(m, "alpaca") for m in ("dec_adapter", "dec_lora", "decaf", "deca")}
        for grades in table.values():
            # MT. is the mean grade over both turns (80 questions each), to the paper's rounding: a check
            # on each of the three numbers
            assert abs((grades["mt_bench-1"] + grades["mt_bench-2"]) / 2 - grades["mt_bench"]) <= 0.0101
            assert all(1 <= v <= 10 and round(v, 2) == v for v in grades.values())


def judge_files(root):
    """The FastChat llm_judge files the paper's generation grids name, one line each, under `root`."""
    for bench in ("vicuna_bench", "mt_bench"):
        (root / "data/llm_judge" / bench / "reference_answer").mkdir(parents=True)
        (root / "data/llm_judge" / bench / "question.jsonl").write_text(
            json.dumps({"question_id": 1, "category": "math", "turns": ["1 + 1?", "times 3?"]}) + "\n")
        (root / "data/llm_judge" / bench / "reference_answer" / "gpt-4.jsonl").write_text(
            json.dumps({"question_id": 1, "choices": [{"turns": ["2", "6"]}]}) + "\n")


def test_the_paper_generation_grids_run_the_papers_cells(tmp_path, monkeypatch):
    """The generation grids name FastChat's questions and reference answers relative to where they run,
    and run the paper's four methods on Alpaca with its settings."""
    monkeypatch.chdir(tmp_path)
    with pytest.raises(GridError, match=r"generation.questions: no such file: data/llm_judge/vicuna_bench/question"):
        load_grid("paper_qwen2-1.5b")
    judge_files(tmp_path)
    for name, model, preset in (("paper_qwen2-1.5b", "qwen2-1.5b", "Qwen/Qwen2-1.5B"),
                                ("paper_llama-2-7b", "llama-2-7b", "meta-llama/Llama-2-7b-hf")):
        grid = load_grid(name)
        assert grid.paper == model and published_cells(grid.cells, model) == grid.cells
        needed = {("generation" if t == "main" else t, (c.betas if t == "bma" else None, c.method, c.task))
                  for c in grid.cells for t in c.tables}
        assert needed == {(t, k) for t, table in reference(model).items() for k in table}, name
        assert grid.generation.judge.model == "gpt-4" and set(grid.generation.judge.references) == {"vicuna",
                                                                                                  "mt_bench"}
        for c in grid.cells:
            o = c.options
            assert (o["model"], o["clients"], o["dirichlet_alpha"], o["partition_key"]) == (preset, 8, 0.25, "category")
            assert (o["rounds"], o["steps_per_block"], o["layers_per_block"], o["lr"]) == (4, 48, 2, 5e-5)
            assert o["questions"] == ["vicuna=data/llm_judge/vicuna_bench/question.jsonl",
                                      "mt_bench=data/llm_judge/mt_bench/question.jsonl"]
            assert o["max_new_tokens"] == 1024
            if c.method != "deca":
                assert tuple(o["bma_betas"]) == (0.9, 0.999)  # the default, which the baselines do not read
            elif "main" in c.tables:
                assert tuple(o["bma_betas"]) == (0.3, 0.333) and c.tables == ("main", "bma")[:len(c.tables)]
    # the BMA betas' table: five DECA cells, its (0.3, 0.333) row the main table's cell
    grid = load_grid("paper_qwen2-1.5b")
    bma = [c for c in grid.cells if "bma" in c.tables]
    assert [c.betas for c in bma] == ["0.3, 0.333", "0.3, 0.222", "0.3, 0.444", "0.2, 0.333", "0.4, 0.333"]
    assert bma[0].tables == ("main", "bma") and bma[0].key == "alpaca/erdos_renyi-n8-lpb2/deca/seed0"
    assert bma[1].key == "alpaca/erdos_renyi-n8-lpb2/deca-bma0.3-0.222/seed0" and bma[1].tables == ("bma",)


def test_the_paper_grids_run_exactly_the_papers_cells(tmp_path):
    """Every cell of the shipped paper grids has the paper's number in each table it feeds, and
    every number of the paper's classification tables has a cell."""
    for name, model in (("paper_qwen2.5-3b", "qwen2.5-3b"), ("paper_llama-3.1-8b", "llama-3.1-8b")):
        grid = load_grid(name, runs_dir=tmp_path)
        assert grid.paper == model
        published = reference(model)
        needed = set()
        for c in grid.cells:
            for table in c.tables:
                name_ = "ablation" if table == "main" and c.method in ("trivial_bma", "no_bma") else table
                group = {"topology": c.topology, "clients": c.clients, "granularity": c.layers_per_block}.get(name_)
                needed.add((name_, (group, c.method, c.options["dataset"])))
                if name_ == "main" and c.method == "deca":
                    needed.add(("ablation", (None, "deca", c.options["dataset"])))
        assert needed == {(t, k) for t, table in published.items() for k in table if k[2] != "average"}, name
        assert published_cells(grid.cells, model) == grid.cells


def cell(method, task="agnews", seed=0, topology="erdos_renyi", clients=8, lpb=2, tables=("main",)):
    return Cell(task, method, topology, clients, lpb, seed, {"dataset": task}, tables)


def test_generation_grades_against_the_papers():
    """The generation table's comparison: each column the paper prints, ordered by hand."""
    def graded(vicuna, mt1, mt2):
        return {"answered": {}, "judged": {"vicuna": {"mean": vicuna, "per_turn": {"1": vicuna}},
                                           "mt_bench": {"mean": (mt1 + mt2) / 2, "per_turn": {"1": mt1, "2": mt2}}}}
    results = {cell("deca", task="alpaca"): graded(5.0, 4.0, 3.0),
               cell("dec_lora", task="alpaca"): graded(6.0, 3.5, 2.5),
               cell("dec_lora", task="alpaca", seed=1): graded(6.0, 3.5, 2.5),
               cell("dadam", task="alpaca"): graded(9.0, 9.0, 9.0)}  # not in the paper: no row
    comparison = build_generation_comparison("main", "Generation", results, ("dec_lora", "dadam", "deca"),
                                             reference("qwen2-1.5b")["generation"])
    assert [r.method for r in comparison.rows] == ["Dec-LoRA", "DECA"]
    assert comparison.columns == [("alpaca", c) for c in ("vicuna", "mt_bench-1", "mt_bench-2", "mt_bench")]
    # the paper: DECA above Dec-LoRA in all four; here below in vicuna (5 < 6) only
    order = comparison.order()
    assert (order["pairs_in_order"], order["pairs"], order["best_as_paper"], order["columns"]) == (3, 4, 3, 4)
    assert order["out_of_order"] == ["Dec-LoRA above DECA in alpaca vicuna"]
    md = to_markdown(comparison, "qwen2-1.5b")
    assert md.startswith("### Against the paper (Qwen2-1.5B): Generation")
    assert "| DECA | 5.00 (5.68) | 4.00 (4.88) | 3.00 (3.30) | 3.50 (4.10) |" in md
    assert "| Dec-LoRA | 6.00 ± 0.00 (5.52) | 3.50 ± 0.00 (4.43) |" in md
    rows = list(csv.DictReader(io.StringIO(to_csv([comparison]))))
    assert rows[-1] == {"table": "generation", "group": "", "method": "DECA", "task": "alpaca", "metric": "mt_bench",
                        "seeds": "1", "mean": "3.5000", "std": "", "paper": "4.10", "difference": "-0.6000"}
    # the main table at a second setting: rows of its own, named, not a second seed of the first's
    results[cell("deca", task="alpaca", topology="ring")] = graded(7.0, 7.0, 7.0)
    comparison = build_generation_comparison("main", "Generation", results, ("dec_lora", "dadam", "deca"),
                                             reference("qwen2-1.5b")["generation"])
    assert comparison.group_name == "Setting"
    assert [(r.group, r.method) for r in comparison.rows] == [
        ("Ring, N=8, lpb=2", "DECA"), ("ER, N=8, lpb=2", "Dec-LoRA"), ("ER, N=8, lpb=2", "DECA")]
    assert comparison.rows[-1].here[("alpaca", "vicuna")] == [5.0]


def test_orderings_against_hand_counted_pairs():
    # here: Dec-Adapter 50, Dec-LoRA 70 (two seeds: 60, 80), DECA 60; the paper: 50, 60, 70
    results = {cell("dec_adapter"): {"accuracy": 0.5, "macro_f1": 0.4},
               cell("dec_lora"): {"accuracy": 0.6, "macro_f1": 0.3},
               cell("dec_lora", seed=1): {"accuracy": 0.8, "macro_f1": 0.3},
               cell("deca"): {"accuracy": 0.6, "macro_f1": 0.3},
               cell("dadam"): {"accuracy": 0.9, "macro_f1": 0.9}}  # not in the paper: no row
    ref = {(None, "dec_adapter", "agnews"): (50.0, 40.0), (None, "dec_lora", "agnews"): (60.0, 40.0),
           (None, "deca", "agnews"): (70.0, 45.0)}
    comparison = build_comparison("main", "T", results, ("dec_adapter", "dec_lora", "dadam", "deca"), ref)
    assert [r.method for r in comparison.rows] == ["Dec-Adapter", "Dec-LoRA", "DECA"]
    assert comparison.columns == [("agnews", "Acc."), ("agnews", "F1")]
    assert comparison.rows[1].here[("agnews", "Acc.")] == [0.6, 0.8]
    # Acc.: (A, L) in order, (A, D) in order, (L, D) not (70 > 60 here, 60 < 70 there): 2 of 3.
    # F1: the paper ties A and L (left out); (A, D): 40 > 30 here, 40 < 45 there; (L, D): 30 = 30 here: 0 of 2.
    # Best: Acc. the paper's DECA, here Dec-LoRA; F1 the paper's DECA, here Dec-Adapter.
    order = comparison.order()
    assert (order["pairs_in_order"], order["pairs"], order["best_as_paper"], order["columns"]) == (2, 5, 0, 2)
    assert order["unlike"] == ["agnews Acc.: here Dec-LoRA, the paper DECA",
                               "agnews F1: here Dec-Adapter, the paper DECA"]
    md = to_markdown(comparison, "qwen2.5-3b")
    assert md.startswith("### Against the paper (Qwen2.5-3B): T")
    assert "| Dec-LoRA | 70.00 ± 14.14 (60.00) | 30.00 ± 0.00 (40.00) |" in md
    assert "| DECA | 60.00 (70.00) | 30.00 (45.00) |" in md
    # out of order: Acc. (L, D); F1 (A, D), and (L, D) level here
    assert order["out_of_order"] == ["Dec-LoRA above DECA in agnews Acc.", "Dec-Adapter above DECA in agnews F1",
                                     "Dec-LoRA level with DECA in agnews F1"]
    assert ("In the paper's order: 2 of 5 pairs of rows, column by column (not: Dec-LoRA above DECA in agnews Acc.; "
            "Dec-Adapter above DECA in agnews F1; Dec-LoRA level with DECA in agnews F1); the paper's best is the "
            "best here in 0 of 2 columns (not in agnews Acc.: here Dec-LoRA, the paper DECA; agnews F1: here "
            "Dec-Adapter, the paper DECA).") in md
    rows = list(csv.DictReader(io.StringIO(to_csv([comparison]))))
    assert len(rows) == 6
    assert rows[2] == {"table": "main", "group": "", "method": "Dec-LoRA", "task": "agnews", "metric": "Acc.",
                       "seeds": "2", "mean": "70.0000", "std": "14.1421", "paper": "60.00", "difference": "10.0000"}


def test_average_column_over_the_papers_tasks_on_the_seeds_that_finished_them():
    acc = {("t1", "deca", 0): 0.6, ("t2", "deca", 0): 0.8, ("t1", "deca", 1): 0.7,  # t2 of seed 1 unfinished
           ("t1", "decaf", 0): 0.5, ("t2", "decaf", 0): 0.3, ("t1", "decaf", 1): 0.4, ("t2", "decaf", 1): 0.2,
           ("t1", "dec_lora", 0): 0.9}  # Dec-LoRA has no t2: no Average
    results = {cell(m, task=t, seed=s): {"accuracy": a, "macro_f1": a / 2} for (t, m, s), a in acc.items()}
    ref = {(None, m, t): v for m, t, v in (
        ("deca", "t1", (70.0, 60.0)), ("deca", "t2", (80.0, 70.0)), ("deca", "average", (75.0, 65.0)),
        ("decaf", "t1", (40.0, 30.0)), ("decaf", "t2", (20.0, 10.0)), ("decaf", "average", (30.0, 20.0)),
        ("dec_lora", "t1", (60.0, 50.0)), ("dec_lora", "t2", (50.0, 40.0)), ("dec_lora", "average", (55.0, 45.0)))}
    comparison = build_comparison("main", "T", results, ("dec_lora", "decaf", "deca"), ref)
    assert comparison.columns == [("t1", "Acc."), ("t1", "F1"), ("t2", "Acc."), ("t2", "F1"),
                                  ("Average", "Acc."), ("Average", "F1")]
    lora, decaf, deca = comparison.rows
    assert deca.here[("Average", "Acc.")] == pytest.approx([0.7])  # seed 0 only: (0.6 + 0.8) / 2
    assert decaf.here[("Average", "F1")] == pytest.approx([0.2, 0.15])  # (0.25 + 0.15) / 2, (0.2 + 0.1) / 2
    assert ("Average", "Acc.") not in lora.here
    md = to_markdown(comparison, "qwen2.5-3b")
    assert "| DeCAF | 45.00 ± 7.07 (40.00) | 22.50 ± 3.54 (30.00) | 25.00 ± 7.07 (20.00) | 12.50 ± 3.54 (10.00) " \
           "| 35.00 ± 7.07 (30.00) | 17.50 ± 3.54 (20.00) |" in md
    assert "| Dec-LoRA | 90.00 (60.00) | 45.00 (50.00) | – | – | – | – |" in md
    # the counts take the task columns only: t1 three pairs, t2 one, in each metric; out of the paper's order
    # only Dec-LoRA above DECA in t1 (90 > 65 here, 60 < 70 there; F1 45 > 32.5, 50 < 60)
    order = comparison.order()
    assert (order["pairs_in_order"], order["pairs"]) == (6, 8) and order["columns"] == 4
    assert order["out_of_order"] == ["Dec-LoRA above DECA in t1 Acc., t1 F1"]


def test_orderings_within_each_group_and_across_granularities():
    results = {cell("deca", clients=8, tables=("clients",)): {"accuracy": 0.9, "macro_f1": 0.9},
               cell("decaf", clients=8, tables=("clients",)): {"accuracy": 0.2, "macro_f1": 0.2},
               cell("deca", clients=12, tables=("clients",)): {"accuracy": 0.1, "macro_f1": 0.1},
               cell("decaf", clients=12, tables=("clients",)): {"accuracy": 0.3, "macro_f1": 0.3}}
    ref = {(n, m, "agnews"): v for n, m, v in ((8, "deca", (80.0, 70.0)), (8, "decaf", (60.0, 50.0)),
                                               (12, "deca", (70.0, 60.0)), (12, "decaf", (65.0, 55.0)))}
    comparison = build_comparison("clients", "N", results, ("decaf", "deca"), ref)
    # within N=8 both columns in order; within N=12 neither; N=8 DECA is never compared with N=12 DeCAF
    order = comparison.order()
    assert (order["pairs_in_order"], order["pairs"], order["best_as_paper"]) == (2, 4, 2)
    assert order["unlike"][0] == "12, agnews Acc.: here DeCAF, the paper DECA"
    assert order["out_of_order"] == ["12, DeCAF above DECA in agnews Acc., agnews F1"]
    granularity = {cell("deca", lpb=n, tables=("granularity",)): {"accuracy": a, "macro_f1": a}
                   for n, a in ((1, 0.5), (2, 0.7), (4, 0.6))}
    ref = {(n, "deca", "agnews"): (v, v) for n, v in ((1, 57.0), (2, 56.0), (4, 54.0))}
    order = build_comparison("granularity", "G", granularity, ("deca",), ref).order()
    # the paper: 1 > 2 > 4; here 2 > 4 > 1: only (2, 4) in order, in each of two columns
    assert (order["pairs_in_order"], order["pairs"], order["best_as_paper"]) == (2, 6, 0)
    assert order["unlike"][0] == "agnews Acc.: here Layers per block 2, the paper Layers per block 1"
    assert order["out_of_order"] == ["Layers per block 2 above Layers per block 1 in agnews Acc., agnews F1",
                                     "Layers per block 4 above Layers per block 1 in agnews Acc., agnews F1"]


def test_a_grid_names_a_paper_model_and_its_report_sets_the_papers_numbers_beside(tmp_path):
    grid = {"name": "g", "options": {"model": "tiny", "clients": 3, "steps_per_block": 2, "rounds": 1,
                                     "layers_per_block": 1}, "tasks": {"agnews": {}}, "methods": ["deca", "no_bma"],
            "seeds": [0], "paper": "qwen2.5-3b"}
    with pytest.raises(GridError, match=r"paper must name one of the paper's models, \['qwen2.5-3b', "
                                        r"'llama-3.1-8b', 'qwen2-1.5b', 'llama-2-7b'\], got 'qwen'"):
        build_grid({**grid, "paper": "qwen"}, runs_dir=tmp_path)
    # a grid none of whose cells the paper has (the synthetic task): naming a paper model is a mistake
    with pytest.raises(GridError, match=r"paper qwen2.5-3b: no cell of the grid is in the paper's tables, whose "
                                        r"tasks are agnews, mnli, nwgi, tfns"):
        build_grid({**grid, "tasks": {"synthetic": {}}}, runs_dir=tmp_path)
    built = build_grid(grid, runs_dir=tmp_path / "runs", results_dir=tmp_path / "results")
    for c, acc in zip(built.cells, (0.8, 0.7)):
        built.cell_dir(c).mkdir(parents=True)
        write_json(built.cell_dir(c) / FINAL, {"accuracy": acc, "macro_f1": acc})
    write_report(built, command=["test"])
    tables = (tmp_path / "results" / "tables.md").read_text()
    assert "| DECA | 80.00 (88.84) | 80.00 (88.79) |" in tables
    assert "| w/o BMA | 70.00 (83.67) | 70.00 (83.46) |" in tables
    rows = list(csv.DictReader((tmp_path / "results" / "paper.csv").open()))
    assert {(r["table"], r["method"], r["metric"]) for r in rows} == {
        (t, m, k) for t in ("main", "ablation") for m in ("DECA",) for k in ("Acc.", "F1")} | {
        ("ablation", "w/o BMA", k) for k in ("Acc.", "F1")}
    record = json.loads((tmp_path / "results" / "results.json").read_text())["paper"]
    assert record["model"] == "qwen2.5-3b"
    assert record["tables"]["ablation"] == {"pairs_in_order": 2, "pairs": 2, "best_as_paper": 2, "columns": 2,
                                            "out_of_order": [], "unlike": []}
    assert set(reference_tables()) == set(models()) and {n for n, _, _ in TABLES} >= set(reference("qwen2.5-3b"))


def test_a_generation_grids_report_sets_the_papers_grades_beside(tmp_path):
    judge_files(tmp_path)
    bench = tmp_path / "data/llm_judge"
    grid = build_grid({"name": "g", "options": {"model": "tiny", "clients": 2, "steps_per_block": 1, "rounds": 1},
                       "tasks": {"alpaca": {}}, "methods": ["deca", "dec_lora"], "seeds": [0], "paper": "qwen2-1.5b",
                       "method_options": {"deca": {"bma_betas": [0.3, 0.333]}},
                       "sweeps": [{"table": "main"},
                                  {"table": "bma", "methods": ["deca"], "bma_betas": [[0.3, 0.222], [0.3, 0.333]]}],
                       "generation": {"questions": {"vicuna": str(bench / "vicuna_bench/question.jsonl"),
                                                    "mt_bench": str(bench / "mt_bench/question.jsonl")},
                                      "judge": {"url": "https://judge.example", "model": "gpt-4"}}},
                      runs_dir=tmp_path / "runs", results_dir=tmp_path / "results")
    assert [(c.method, c.betas, c.tables) for c in grid.cells] == [
        ("deca", "0.3, 0.333", ("main", "bma")), ("dec_lora", "0.9, 0.999", ("main",)),
        ("deca", "0.3, 0.222", ("bma",))]
    for c, (vicuna, mt1, mt2) in zip(grid.cells, ((6.0, 5.0, 3.0), (5.0, 4.0, 3.0), (5.5, 4.5, 3.5))):
        d = grid.cell_dir(c)
        d.mkdir(parents=True)
        write_json(d / FINAL, {"answered": {"vicuna": {"questions": 1, "turns": 2}}})
        write_json(d / "scores.json", {"gpt-4": {
            "vicuna": {"mean": vicuna, "n": 2, "n_unparsed": 0, "per_turn": {"1": vicuna}},
            "mt_bench": {"mean": (mt1 + mt2) / 2, "n": 2, "n_unparsed": 0, "per_turn": {"1": mt1, "2": mt2}}}})
    write_report(grid, command=["test"])
    tables = (tmp_path / "results" / "tables.md").read_text()
    assert "### Against the paper (Qwen2-1.5B): Generation" in tables
    assert "| DECA | 6.00 (5.68) | 5.00 (4.88) | 3.00 (3.30) | 4.00 (4.10) |" in tables
    # the betas' table, a row per (β1, β2), and beside the paper's tab:gen_hyper
    assert "| β1, β2 | Method | vicuna | mt_bench-1 | mt_bench-2 | mt_bench |" in tables
    assert "| 0.3, 0.222 | DECA | 5.50 | 4.50 | 3.50 | 4.00 |" in tables
    assert "| 0.3, 0.222 | DECA | 5.50 (5.66) | 4.50 (4.74) | 3.50 (3.25) | 4.00 (3.99) |" in tables
    record = json.loads((tmp_path / "results" / "results.json").read_text())["paper"]["tables"]
    # DECA above Dec-LoRA in vicuna, MT-1 and MT. as in the paper; level in MT-2 (3.30 > 2.95 there)
    assert (record["generation"]["pairs_in_order"], record["generation"]["pairs"]) == (3, 4)
    # (0.3, 0.333) above (0.3, 0.222) in all four there; here in vicuna and MT-1, below in MT-2, level in MT.
    assert (record["bma"]["pairs_in_order"], record["bma"]["pairs"]) == (2, 4)
    assert {r["metric"] for r in csv.DictReader((tmp_path / "results" / "paper.csv").open())} == {
        "vicuna", "mt_bench-1", "mt_bench-2", "mt_bench"}
    assert (tmp_path / "results" / "generation_bma.csv").is_file()


def test_tables_from_a_results_json_equal_the_cells_and_refuse_a_changed_grid(tmp_path, capsys):
    """--tables-from: the same tables as from the cells' directories, the results' provenance kept;
    refused for another grid's file or a grid whose settings changed since."""
    from deca_ds.reproduce.cli import main

    grid = {"name": "g", "runs_dir": str(tmp_path / "runs"), "results_dir": str(tmp_path / "first"),
            "options": {"model": "tiny", "clients": 3, "steps_per_block": 2, "rounds": 1, "layers_per_block": 1},
            "tasks": {"agnews": {}}, "methods": ["deca", "dec_lora", "no_bma"], "seeds": [0, 1]}
    path = tmp_path / "g.yaml"
    path.write_text(yaml.safe_dump(grid))
    built = load_grid(path)
    for i, c in enumerate(built.cells[:5]):  # one cell unfinished
        built.cell_dir(c).mkdir(parents=True)
        write_json(built.cell_dir(c) / FINAL, {"accuracy": 0.5 + i / 20, "macro_f1": 0.4})
        write_json(built.cell_dir(c) / "run_config.json", {"seed": c.seed, "blocks": []})
    write_report(built, command=["first"])
    first = tmp_path / "first"
    shutil.rmtree(tmp_path / "runs")
    # the paper's rows join in: `paper` changes no cell, nor do `jobs` or the time limit
    path.write_text(yaml.safe_dump({**grid, "paper": "qwen2.5-3b", "jobs": 3, "cell_timeout_s": 60}))
    assert main([str(path), "--dry-run"]) == 0
    assert "the paper's qwen2.5-3b numbers beside 6 of the 6 cells" in capsys.readouterr().out
    # a runs directory that a run would refuse (a finished cell of other settings) does not matter here
    built.cell_dir(built.cells[0]).mkdir(parents=True)
    write_json(built.cell_dir(built.cells[0]) / FINAL, {"accuracy": 0.1, "macro_f1": 0.1})
    assert main([str(path), "--dry-run"]) == 2
    assert "would be overwritten" in capsys.readouterr().err
    again = tmp_path / "again"
    assert main([str(path), "--tables-from", str(first / "results.json"), "--results-dir", str(again)]) == 0
    assert (again / "tables.md").read_text().startswith((first / "tables.md").read_text())
    assert "### Against the paper (Qwen2.5-3B)" in (again / "tables.md").read_text()
    assert (again / "main.csv").read_text() == (first / "main.csv").read_text()
    old, new = (json.loads((d / "results.json").read_text()) for d in (first, again))
    assert new["provenance"] == old["provenance"] and new["tabulated"]["command"].endswith(
        f"--tables-from {first / 'results.json'} --results-dir {again}")
    assert new["cells"] == old["cells"] and sum(c["finished"] for c in new["cells"]) == 5
    assert not list(again.glob("*.png"))  # these cells logged no steps: no curves to draw
    path.write_text(yaml.safe_dump({**grid, "options": {**grid["options"], "lr": 0.5}, "threads": 2}))
    assert main([str(path), "--tables-from", str(first / "results.json")]) == 2
    assert "the grid's options, threads changed since these results were written" in capsys.readouterr().err
    path.write_text(yaml.safe_dump({**grid, "name": "h"}))
    assert main([str(path), "--tables-from", str(first / "results.json")]) == 2
    assert "holds grid 'g''s results, not 'h''s" in capsys.readouterr().err
    # a cell keyed as this deca-ds no longer keys it (a results.json of another version)
    path.write_text(yaml.safe_dump(grid))
    old["cells"][0]["key"] = "agnews/ring-n3/deca/seed0"
    (first / "results.json").write_text(json.dumps(old))
    assert main([str(path), "--tables-from", str(first / "results.json")]) == 2
    assert "cells the grid does not have: agnews/ring-n3/deca/seed0" in capsys.readouterr().err


def test_results_json_files_merge_into_one_report_with_figures_and_refuse_other_base_weights(tmp_path, capsys):
    """--tables-from A B: B's finished cells in place of A's (a grid refreshed in part), each naming its
    provenance where it differs from the record's; the figures drawn from the curves the files keep,
    the cell directories gone; refused when the cells were fine-tuned from different base weights."""
    from deca_ds.reproduce.cli import main

    grid = {"name": "g", "runs_dir": str(tmp_path / "a"), "results_dir": str(tmp_path / "first"),
            "options": {"model": "tiny", "clients": 3, "steps_per_block": 2, "rounds": 1, "layers_per_block": 1},
            "tasks": {"agnews": {}}, "methods": ["deca", "dec_lora"], "seeds": [0, 1]}
    path = tmp_path / "g.yaml"
    path.write_text(yaml.safe_dump(grid))

    def run(runs: str, results: str, accuracy: dict, base: str, command: str) -> None:
        built = load_grid(path, runs_dir=tmp_path / runs, results_dir=tmp_path / results)
        for c in built.cells:
            if c.key not in accuracy:
                continue
            d = built.cell_dir(c)
            d.mkdir(parents=True)
            write_json(d / "cell.json", {"settings": {"key": c.key, "base_sha256": base}})
            write_json(d / FINAL, {"accuracy": accuracy[c.key], "macro_f1": 0.4})
            steps = [{"step": i, "loss": accuracy[c.key] + 1 / 3 + i, **({"consensus_distance": 0.1 * (i + 1)}
                                                                         if i % 2 == 0 else {})} for i in range(4)]
            (d / "metrics.jsonl").write_text("".join(json.dumps(m) + "\n" for m in steps))
        write_report(built, command=[command])
        shutil.rmtree(tmp_path / runs)

    keys = [c.key for c in load_grid(path).cells]
    lora = [k for k in keys if "/dec_lora/" in k]
    run("a", "first", {k: 0.5 for k in keys}, "a" * 64, "first")
    run("b", "second", {lora[0]: 0.7, lora[1]: 0.9}, "a" * 64, "second")  # Dec-LoRA again, the rest unrun
    first, second, merged = (tmp_path / d / "results.json" for d in ("first", "second", "merged"))
    old = json.loads(first.read_text())
    entry = next(e for e in old["cells"] if e["key"] == lora[0])
    assert entry["curves"] == {"loss": {"step": [0, 1, 2, 3], "value": [0.833333, 1.83333, 2.83333, 3.83333]},
                               "consensus_distance": {"step": [0, 2], "value": [0.1, 0.3]}}
    assert entry["base_sha256"] == "a" * 64
    assert '"value": [0.833333, 1.83333, 2.83333, 3.83333]' in first.read_text()  # one line a curve

    assert main([str(path), "--tables-from", str(first), str(second), "--results-dir", str(merged.parent)]) == 0
    rows = {r["method"]: r for r in csv.DictReader((merged.parent / "main.csv").open())}
    assert float(rows["Dec-LoRA"]["agnews Acc. mean"]) == pytest.approx(80.0)  # the second file's seeds
    assert float(rows["DECA"]["agnews Acc. mean"]) == pytest.approx(50.0)  # the first's, not erased by unrun cells
    record = json.loads(merged.read_text())
    assert record["provenance"] == old["provenance"] and record["provenance"]["command"] == "first"
    made = {e["key"]: e.get("provenance", {}).get("command") for e in record["cells"]}
    assert made == {k: "second" if k in lora else None for k in keys}
    assert next(e for e in record["cells"] if e["key"] == lora[1])["curves"]["loss"]["value"][0] == 1.23333
    assert {p.name for p in merged.parent.glob("*.png")} == {"loss_agnews.png", "consensus_agnews.png"}

    run("b", "second", {lora[0]: 0.7}, "b" * 64, "second")
    assert main([str(path), "--tables-from", str(first), str(second), "--results-dir", str(tmp_path / "x")]) == 2
    assert (f"fine-tuned from different weights of the grid's base model: 3 cell(s) from aaaaaaaa… ({keys[0]}, …); "
            f"1 cell(s) from bbbbbbbb… ({lora[0]}, …)") in capsys.readouterr().err
    assert not (tmp_path / "x").exists()


def test_compare_sets_each_finished_cell_beside_a_results_json_and_exits_3_where_one_differs(tmp_path, capsys):
    """--compare: every finished cell (of --only's) beside the same cell of a results.json, the same to
    the bit or the final metrics that differ, and the cells fine-tuned from another base named; exit 3
    where one differs. Checked before anything runs: not with a mode that reads no cells, nor a file of
    other settings."""
    from deca_ds.reproduce.cli import main

    grid = {"name": "g", "runs_dir": str(tmp_path / "runs"), "results_dir": str(tmp_path / "first"),
            "options": {"model": "tiny", "clients": 3, "steps_per_block": 2, "rounds": 1, "layers_per_block": 1},
            "tasks": {"agnews": {}}, "methods": ["deca", "no_bma"], "seeds": [0, 1]}
    path = tmp_path / "g.yaml"
    path.write_text(yaml.safe_dump(grid))
    built = load_grid(path)
    deca0, deca1, no_bma0, no_bma1 = sorted(built.cells, key=lambda c: (c.method, c.seed))

    def finish(c: Cell, accuracy: float, loss_end: float, base: str, **extra) -> None:
        d = built.cell_dir(c)
        d.mkdir(parents=True, exist_ok=True)
        write_json(d / "cell.json", {"settings": cell_settings(built, c, None) | {BASE: base}})
        write_json(d / FINAL, {"accuracy": accuracy, "macro_f1": 0.4, "loss_end": loss_end, "wall_s": 60.0, **extra})

    for c in (deca0, deca1, no_bma0):  # no_bma at seed 1 unfinished there
        finish(c, 0.5, 0.25, "a" * 64)
    write_report(built, command=["there"])
    committed = str(tmp_path / "first" / "results.json")
    finish(deca0, 0.5, 0.25, "a" * 64, wall_s=59.0, resumed_from=[4])  # stopped, gone on from a checkpoint
    finish(deca1, 0.5, 0.25 + 2**-40, "a" * 64)  # its loss moved by rounding, its score not
    finish(no_bma1, 0.7, 0.2, "a" * 64)  # nothing there to set it beside

    def compare(*extra: str) -> tuple[int, str]:
        code = main([str(path), "--report-only", "--compare", committed, "--results-dir", str(tmp_path / "here"),
                     *extra])
        seen = capsys.readouterr()
        assert code != 2, seen.err
        return code, seen.out

    code, out = compare("--only", "method=deca")
    assert code == 3
    assert f"| {deca0.key} | 0.5 / 0.5 | 0.4 / 0.4 | 0.25 / 0.25 | the same |" in out  # its time is no result
    assert f"| {deca1.key} | 0.5 / 0.5 | 0.4 / 0.4 | 0.25 / 0.25 | differs: loss_end |" in out
    assert "1 of 2 cells score as in " + committed + ", to the bit; 1 differ." in out
    assert no_bma0.key not in out and "other weights" not in out
    assert "There: commit " in out

    for c in (deca0, deca1, no_bma0, no_bma1):  # the same numbers from another base (its cells all alike)
        finish(c, 0.5, 0.25, "b" * 64)
    code, out = compare("--only", "method=no_bma")
    assert code == 0 and deca0.key not in out.split("## Finished cells beside")[1]
    assert f"| {no_bma0.key} | 0.5 / 0.5 | 0.4 / 0.4 | 0.25 / 0.25 | the same (another base) |" in out
    assert "1 of 1 cells score as in" in out and "1 cell(s) were fine-tuned from other weights" in out

    for mode in ("--dry-run", "--estimate"):
        assert main([str(path), mode, "--compare", committed]) == 2
        assert "--compare: with a run of the grid or --report-only" in capsys.readouterr().err
    path.write_text(yaml.safe_dump({**grid, "options": {**grid["options"], "lr": 0.5}}))
    assert main([str(path), "--compare", committed, "--results-dir", str(tmp_path / "none")]) == 2
    assert "the grid's options changed since these results were written" in capsys.readouterr().err
    assert not (tmp_path / "none").exists()
