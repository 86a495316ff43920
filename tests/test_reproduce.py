"""deca_ds.reproduce: a tiny grid end to end on a tiny pretrained Llama, resume, the tables' marks
and mean ± std against hand-computed numbers, and the grid's refusals before any run."""

from __future__ import annotations

import csv
import io
import json
import math
import os
import re
import shutil
from pathlib import Path

import matplotlib.image as mpimg
import numpy as np
import pytest
import torch
import yaml
from safetensors.torch import load_file
from transformers import LlamaForCausalLM

from deca_ds.files import sha256
from deca_ds.models import load_model, load_tokenizer
from deca_ds.reporting import commit, kernels_of, pin_cpu_kernels
from deca_ds.reproduce import GridError, PretrainOptions, build_grid, check_finished, pretrain, run_grid
from deca_ds.reproduce.figures import smooth, write_figures
from deca_ds.reproduce.grid import Cell, Grid, load_grid, step_budget
from deca_ds.reproduce.paired import (
    build_granularity_paired,
    build_paired,
    paired_csv,
    paired_markdown,
    paired_p,
    per_seed_markdown,
)
from deca_ds.reproduce.report import REPORT_FILE, write_report
from deca_ds.reproduce.tables import Table, build_table, marks, to_csv, to_markdown
from helpers import assert_umask_modes

ROOT = Path(__file__).resolve().parents[1]


def tiny_grid(model: str, **overrides) -> dict:
    grid = {
        "name": "tiny",
        "options": {"model": model, "dataset": "synthetic", "clients": 3, "steps_per_block": 2, "rounds": 1,
                    "layers_per_block": 1, "micro_batch": 4, "max_seq_len": 32, "eval_limit": 40, "lr": 1e-3,
                    "consensus_interval": 1},
        "tasks": {"synthetic": {}},
        "methods": ["deca", "dec_lora"],
        "seeds": [0, 1],
        "cell_timeout_s": 300,
    }
    grid.update(overrides)
    return grid


@pytest.fixture(scope="module")
def pretrained(tmp_path_factory):
    out = tmp_path_factory.mktemp("pretrained")
    report = pretrain(PretrainOptions(str(out), steps=30, batch=8, seq_len=32, warmup=5,
                                      model={"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
                                             "num_attention_heads": 2, "num_key_value_heads": 1,
                                             "max_position_embeddings": 64, "tie_word_embeddings": False}),
                      log=lambda *_: None)
    return out, report


def test_pretrain_writes_a_loadable_checkpoint_that_learned(pretrained):
    out, report = pretrained
    tokenizer = load_tokenizer(str(out))
    model = load_model(str(out), dtype=torch.float32)
    assert model.config.num_hidden_layers == 2 and model.config.vocab_size == len(tokenizer) == report["vocab"]
    assert_umask_modes(out)
    # the synthetic prompts' words and the label words all have their own ids (no <unk>)
    ids = tokenizer("k0.1 w3 label2 =>", add_special_tokens=False)["input_ids"]
    assert tokenizer.unk_token_id not in ids and len(ids) == 4
    # 30 AdamW steps bring the LM loss down from about ln(vocab)
    assert report["loss_first"] == pytest.approx(math.log(report["vocab"]), rel=0.25)
    assert report["loss_last10"] < report["loss_first"] - 0.15
    # the label words never occur in the unlabelled text: left out of the softmax, their head rows keep
    # their initial directions (AdamW's decay only shrinks them) instead of being pushed down together;
    # a word the text shows has moved
    assert report["unseen_words"] >= 4
    torch.manual_seed(0)
    initial = LlamaForCausalLM(model.config).lm_head.weight
    cosine = torch.nn.functional.cosine_similarity(model.lm_head.weight, initial, dim=1)
    labels = [tokenizer.convert_tokens_to_ids(f"label{k}") for k in range(4)]
    assert cosine[labels].min().item() > 0.9999
    assert cosine[tokenizer.convert_tokens_to_ids("w3")].item() < 0.999


@pytest.mark.parametrize("change, message", [
    ({"device": "gpu"}, r"device must be auto, cpu, cuda or cuda:N, got 'gpu'"),
    ({"device": "meta"}, r"device must be auto, cpu, cuda or cuda:N, got 'meta'"),
    ({"steps": 0}, r"steps must be >= 1, got 0"),
    ({"dtype": "fp16"}, r"dtype must be fp32 or bf16, got 'fp16'"),
    ({"seq_len": 512}, r"seq_len 512 exceeds the model's max_position_embeddings"),
    ({"seq_len": 1}, r"seq_len must be >= 2, got 1"),  # was a NaN loss ("diverged") after reading the text
    ({"lr": float("inf")}, r"lr must be a finite number > 0, got inf"),  # was a NaN loss after the first step
    ({"steps": 10, "warmup": 11}, r"warmup \(11\) is longer than steps \(10\): the learning rate would never"),
    ({"seed": -1}, r"seed must be >= 0, got -1"),
    ({"warmup": -1}, r"warmup must be >= 0, got -1"),
    # LlamaConfig keeps a key it does not define as an attribute: the misspelt width went unused
    ({"model": {"hiden_size": 64}}, r"model: unknown Llama config key 'hiden_size' \(did you mean 'hidden_size'\?\)"),
    ({"model": {"vocab_size": 64}}, r"model: vocab_size comes from the tokenizer \(--vocab-size"),
    ({"model": {"num_hidden_layers": 0}}, r"model: num_hidden_layers must be an integer >= 1, got 0"),
    ({"model": {"hidden_size": 30}}, r"model: The hidden size \(30\) is not a multiple of the number of attention"),
    ({"dataset": "emotion"}, r"emotion"),
    ({"dataset": "files", "data_files": ["train=c{client}.jsonl", "test=t.jsonl"]},
     r"pretraining reads one training file: --data-files train=…\{client\}… names each client's own"),
])
def test_bad_pretrain_options_are_refused(change, message, tmp_path):
    with pytest.raises(ValueError, match=message):
        PretrainOptions(str(tmp_path / "out"), **change)
    assert not any(tmp_path.iterdir())


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is visible")
def test_pretrain_on_a_gpu_is_refused_where_none_is_visible(tmp_path):
    with pytest.raises(ValueError, match="device cuda:0: no GPU is visible"):
        PretrainOptions(str(tmp_path / "out"), device="cuda:0")


def test_tiny_grid_end_to_end_then_resume(pretrained, tmp_path):
    model = str(pretrained[0])
    # two cells at a time, as on this machine's two cores, with ATen's plain kernels (not this process's)
    grid = build_grid(tiny_grid(model, jobs=2, cpu_kernels="default"), runs_dir=tmp_path / "runs",
                      results_dir=tmp_path / "results")
    assert len(grid.cells) == 4
    # DECA's T·B·R = 1 round x 2 blocks (2 layers, 1 per block) x 2 steps; Dec-LoRA gets the same
    assert set(grid.budgets.values()) == {(4, 4)}
    # --only seed=0 first (the tables' first whole seed), then the rest
    status = run_grid(grid, log=lambda *_: None, select=grid.select(["seed=0"]))
    assert status == {c.key: "done" if c.seed == 0 else "not selected" for c in grid.cells}, status
    lines = []
    status = run_grid(grid, log=lines.append)
    assert status == {c.key: "skipped" if c.seed == 0 else "done" for c in grid.cells}, status
    # the first of the two to finish says how long the other has left, at the seed-0 cells' seconds a step
    ends = [line for line in lines if re.search(r": done \(\d+ s\)", line)]
    assert len(ends) == 2 and "cell time left at the finished cells' seconds a step" in ends[0]
    assert ends[1].endswith(" s)"), lines
    written = write_report(grid, command=["test"]) + write_figures(grid)
    names = {p.name for p in written}
    # what check_results_dir guards is every name the report writes
    assert all(REPORT_FILE.fullmatch(name) for name in names), names
    assert {"main.csv", "ablation.csv", "paired.csv", "tables.md", "results.json", "loss_synthetic.png",
            "consensus_synthetic.png"} <= names

    data = json.loads((tmp_path / "results" / "results.json").read_text())
    assert data["provenance"]["command"] == "test" and data["provenance"]["commit"]
    for cell in data["cells"]:
        assert cell["finished"] and cell["run_config"]["n_clients"] == 3
        assert cell["run_config"]["device"] == "cpu"  # where the simulated clients ran (a GPU's where one is)
        assert cell["run_config"]["commit"] == commit() != "unknown"  # the code the cell ran
        assert cell["run_config"]["cpu_kernels"] == "DEFAULT"  # and its kernels, the grid's
        assert cell["run_config"]["options"]["method"] == ("deca" if cell["method"] == "deca" else "dec_lora")
        assert cell["final"]["steps"] == 4 and 0 <= cell["final"]["accuracy"] <= 1
        assert cell["final"]["n"] == 40 and cell["final"]["wall_s"] > 0
        metrics = (tmp_path / "runs" / cell["key"] / "metrics.jsonl").read_text()
        steps = [json.loads(line) for line in metrics.splitlines()]
        clock = [s["wall_s"] for s in steps]  # each step's end, from the cell's start
        assert len(steps) == 4 and 0 < clock[0] and clock == sorted(clock) and clock[-1] < cell["final"]["wall_s"]
        # its log.txt shows progress as deca-train's does in a file: after the first step, each block
        # (DECA's 2), the last step (and each minute), with the clients' mean loss
        log = (tmp_path / "runs" / cell["key"] / "log.txt").read_text()
        shown = dict(re.findall(rf"{cell['method']}: step (\d)/4 \(\d+%\).*, loss (\d\.\d{{4}})", log))
        assert {"1", "4", *(["2"] if cell["method"] == "deca" else [])} <= set(shown), log
        assert shown == {n: f"{steps[int(n) - 1]['loss']:.4f}" for n in shown}
    # the table holds the cells' own numbers: DECA's accuracy is the mean of its two seeds
    deca = [c["final"]["accuracy"] for c in data["cells"] if c["method"] == "deca"]
    rows = list(csv.DictReader(io.StringIO((tmp_path / "results" / "main.csv").read_text())))
    row = next(r for r in rows if r["method"] == "DECA")
    assert float(row["synthetic Acc. mean"]) == pytest.approx(100 * sum(deca) / 2, abs=1e-3)
    image = mpimg.imread(tmp_path / "results" / "loss_synthetic.png")
    assert image.ndim == 3 and image.shape[0] > 100

    # resume: every cell is finished with the same settings, nothing runs again
    stamps = {c.key: (grid.cell_dir(c) / "final.json").stat().st_mtime_ns for c in grid.cells}
    again = build_grid(tiny_grid(model), runs_dir=tmp_path / "runs", results_dir=tmp_path / "results")
    assert set(run_grid(again, log=lambda *_: None).values()) == {"skipped"}
    assert stamps == {c.key: (again.cell_dir(c) / "final.json").stat().st_mtime_ns for c in again.cells}

    # the same cells with another learning rate would overwrite finished results: refused, naming it
    changed = tiny_grid(model)
    changed["options"]["lr"] = 2e-3
    with pytest.raises(GridError, match=r"would be overwritten.*lr"):
        check_finished(build_grid(changed, runs_dir=tmp_path / "runs"))


def test_marks_mean_std_and_markdown_against_hand_computed_numbers():
    assert marks([0.5, 0.9, 0.7, 0.9]) == ["", "best", "second", "best"]
    assert marks([0.4]) == [""]
    table = Table("main", "T", None, ["a Acc."], [
        ("", "A", [[0.80, 0.90]]),  # 85.00 ± 7.07 (sample std: sqrt(0.005) = 0.0707)
        ("", "B", [[0.70, 0.70]]),  # 70.00 ± 0.00
        ("", "C", [[0.90, 0.92]]),  # 91.00 ± 1.41
    ])
    md = to_markdown(table)
    assert "| A | <u>85.00 ± 7.07</u> |" in md
    assert "| B | 70.00 ± 0.00 |" in md
    assert "| C | **91.00 ± 1.41** |" in md
    rows = list(csv.reader(io.StringIO(to_csv(table))))
    assert rows[0] == ["method", "a Acc. mean", "a Acc. std", "a Acc. mark", "seeds"]
    assert rows[1] == ["A", "85.0000", "7.0711", "second", "2"]
    assert rows[3] == ["C", "91.0000", "1.4142", "best", "2"]


def test_average_column_and_groups_from_cells():
    def cell(task, method, seed, topology="ring"):
        return Cell(task, method, topology, 4, 1, seed, {}, ("main", "topology"))

    # per seed: the mean over tasks; then mean ± std over seeds
    acc = {("t1", "deca", 0): 0.6, ("t2", "deca", 0): 0.8, ("t1", "deca", 1): 0.7, ("t2", "deca", 1): 0.7,
           ("t1", "dec_lora", 0): 0.5, ("t2", "dec_lora", 0): 0.5,
           ("t1", "dec_lora", 1): 0.6, ("t2", "dec_lora", 1): 0.8}
    results = {cell(t, m, s): {"accuracy": a, "macro_f1": a / 2} for (t, m, s), a in acc.items()}
    results[cell("t1", "deca", 0, "erdos_renyi")] = {"accuracy": 0.1, "macro_f1": 0.1}
    table = build_table("main", "T", results, ("dec_lora", "deca"))
    assert table.columns == ["t1 Acc.", "t1 F1", "t2 Acc.", "t2 F1", "Average Acc.", "Average F1"]
    # two settings in the main cells: one group each; the ER group has DECA's one finished seed
    groups = [(g, m) for g, m, _ in table.rows]
    assert groups == [("Ring, N=4, lpb=1", "Dec-LoRA"), ("Ring, N=4, lpb=1", "DECA")]  # ER: t2 missing -> no row
    deca = table.rows[1][2]
    assert deca[4] == pytest.approx([0.7, 0.7]) and deca[5] == pytest.approx([0.35, 0.35])
    assert "**70.00 ± 0.00**" in to_markdown(table) and "<u>60.00 ± 14.14</u>" in to_markdown(table)
    # the ER row complete too: a Setting column names each row's, Ring (the paper's first topology) before ER
    results[cell("t2", "deca", 0, "erdos_renyi")] = {"accuracy": 0.3, "macro_f1": 0.3}
    table = build_table("main", "T", results, ("dec_lora", "deca"))
    assert table.group_name == "Setting"
    assert [g for g, _, _ in table.rows] == ["Ring, N=4, lpb=1"] * 2 + ["ER, N=4, lpb=1"]
    assert "| ER, N=4, lpb=1 | DECA | 10.00 | 10.00 | 30.00 | 30.00 | 20.00 | 20.00 |" in to_markdown(table)
    topo = build_table("topology", "T", results, ("dec_lora", "deca"))
    assert [g for g, _, _ in topo.rows] == ["Ring", "Ring", "ER"] and topo.group_name == "Topology"


def test_per_seed_table_and_paired_differences_against_hand_computed_numbers():
    def cell(task, method, seed):
        return Cell(task, method, "ring", 4, 1, seed, {}, ("main",))

    acc = {("t1", "deca", 0): 0.60, ("t1", "deca", 1): 0.70, ("t1", "deca", 2): 0.50,
           ("t2", "deca", 0): 0.80, ("t2", "deca", 1): 0.70, ("t2", "deca", 2): 0.90,
           ("t1", "no_bma", 0): 0.50, ("t1", "no_bma", 1): 0.75, ("t1", "no_bma", 2): 0.40,
           ("t2", "no_bma", 0): 0.80, ("t2", "no_bma", 1): 0.60, ("t2", "no_bma", 2): 0.90,
           ("t1", "dec_lora", 0): 0.10, ("t2", "dec_lora", 0): 0.20, ("t1", "dec_lora", 1): 0.30}
    results = {cell(t, m, s): {"accuracy": a, "macro_f1": a / 2} for (t, m, s), a in acc.items()}
    paired = build_paired(results, ("dec_lora", "deca", "no_bma"))
    assert paired.columns == ["t1 Δ Acc.", "t1 Δ F1", "t2 Δ Acc.", "t2 Δ F1", "Average Δ Acc.", "Average Δ F1"]
    # Dec-LoRA finished both tasks on seed 0 only: one pair; w/o BMA on all three seeds
    (_, lora, lora_seeds, lora_values), (_, no_bma, seeds, values) = paired.rows
    assert (lora, lora_seeds) == ("Dec-LoRA", [0]) and lora_values[0] == pytest.approx([0.5])
    assert (no_bma, seeds) == ("w/o BMA", [0, 1, 2])
    assert values[0] == pytest.approx([0.10, -0.05, 0.10])  # t1: DECA − w/o BMA per seed
    assert values[2] == pytest.approx([0.0, 0.10, 0.0])  # t2
    assert values[4] == pytest.approx([0.05, 0.025, 0.05])  # per seed, the mean over tasks
    md = paired_markdown(paired)
    # t1: mean 5.00, sample std sqrt(((0.05)²·2 + (0.10)²)/2) = 0.0866; ahead on 2 seeds, behind on 1;
    # t2: ahead on one seed, tied on two
    assert "| w/o BMA | 3 | 5.00 ± 8.66 | 2.50 ± 4.33 | 3.33 ± 5.77 |" in md
    # the paired t-test, two seeds of freedom, where Student's t has the closed form P(|T| > t) =
    # 1 − t/√(2 + t²): t1's Δ (mean 0.05, std 0.0866) and t2's (mean 0.0333, std 0.0577) both give
    # t = mean/(std/√3) = 1, p = 1 − 1/√3 = 0.42; the Average's (mean 0.04167, std 0.01443) t = 5,
    # p = 1 − 5/√27 = 0.038; Dec-LoRA's one seed has none
    assert md.rstrip().endswith("| 2 / 1 | 1 / 0 | 3 / 0 | 0.42 | 0.42 | 0.038 |")
    assert "| Dec-LoRA | 1 | 50.00 | 25.00 | 60.00 | 30.00 | 55.00 | 27.50 | 1 / 0 | 1 / 0 | 1 / 0 | – | – | – |" in md
    assert "t1 DECA ahead / behind | t2 DECA ahead / behind | Average DECA ahead / behind | t1 p | t2 p | Average p |" \
        in md
    assert paired_p([0.05, 0.025, 0.05]) == pytest.approx(1 - 5 / math.sqrt(27))
    assert paired_p([0.1, 0.1, 0.1]) is None and paired_p([0.7 - 0.6, 0.8 - 0.7]) is None  # no spread
    table = per_seed_markdown(results, ("dec_lora", "deca", "no_bma"))
    assert "| Method | t1 seed 0 | t1 seed 1 | t1 seed 2 | t2 seed 0 | t2 seed 1 | t2 seed 2 |" in table
    assert "| Dec-LoRA | 10.0 / 5.0 | 30.0 / 15.0 | – | 20.0 / 10.0 | – | – |" in table
    assert "| w/o BMA | 50.0 / 25.0 | 75.0 / 37.5 | 40.0 / 20.0 | 80.0 / 40.0 | 60.0 / 30.0 | 90.0 / 45.0 |" in table
    rows = list(csv.DictReader(io.StringIO(paired_csv([paired]))))
    t1 = next(r for r in rows if r["method"] == "w/o BMA" and r["column"] == "t1 Δ Acc.")
    assert (t1["table"], t1["seeds"], t1["mean"], t1["std"], t1["deca_ahead"], t1["deca_behind"], t1["p_paired_t"]) \
        == ("main", "0 1 2", "5.0000", "8.6603", "2", "1", f"{1 - 1 / math.sqrt(3):.4g}")


def test_sweep_cells_paired_with_deca_per_row_of_their_table():
    def cell(method, seed, topology):
        return Cell("t", method, topology, 8, 2, seed, {}, ("topology",))

    acc = {("deca", 0, "ring"): 0.9, ("deca", 1, "ring"): 0.8, ("dec_lora", 0, "ring"): 0.7,
           ("dec_lora", 1, "ring"): 0.85, ("deca", 0, "erdos_renyi"): 0.6, ("dec_lora", 0, "erdos_renyi"): 0.5}
    results = {cell(m, s, topo): {"accuracy": a, "macro_f1": a} for (m, s, topo), a in acc.items()}
    assert build_paired(results, ("dec_lora", "deca")) is None  # no cell of the main table
    paired = build_paired(results, ("dec_lora", "deca"), "topology")
    # rows in the paper's topology order, labelled by topology; ring: Δ 0.2 and −0.05 on seeds 0, 1
    assert [(g, m, s) for g, m, s, _ in paired.rows] == [("Ring", "Dec-LoRA", [0, 1]), ("ER", "Dec-LoRA", [0])]
    assert paired.rows[0][3][0] == pytest.approx([0.2, -0.05])
    md = paired_markdown(paired)
    assert md.startswith("### DECA against each method, seed by seed (percentage points): topologies")
    assert "| Topology | Method | Seeds |" in md
    # one degree of freedom (Cauchy): p = 1 − (2/π)·atan(t), t = 0.075/(0.1768/√2) = 0.6
    p = 1 - 2 / math.pi * math.atan(0.6)
    assert f"| Ring | Dec-LoRA | 2 | 7.50 ± 17.68 | 7.50 ± 17.68 | 1 / 1 | {p:.2f} |" in md
    assert "| ER | Dec-LoRA | 1 | 10.00 | 10.00 | 1 / 0 | – |" in md


def test_granularity_paired_against_the_main_tables_layers_per_block():
    def cell(lpb, seed):
        return Cell("t", "deca", "ring", 8, lpb, seed, {}, ("main", "granularity") if lpb == 2 else ("granularity",))

    acc = {(2, 0): 0.9, (2, 1): 0.7, (1, 0): 0.8, (1, 1): 0.75, (4, 0): 0.6}
    results = {cell(lpb, s): {"accuracy": a, "macro_f1": a} for (lpb, s), a in acc.items()}
    paired = build_granularity_paired(results)
    # lpb 2 − lpb 1: 0.1 and −0.05 (mean 2.50, std |0.15|/√2 = 10.61); lpb 2 − lpb 4 on seed 0: 0.3
    assert [(g, s) for g, _, s, _ in paired.rows] == [("1", [0, 1]), ("4", [0])]
    md = paired_markdown(paired)
    assert "DECA at the main table's 2 layers per block − DECA at the row's" in md
    assert "| Layers per block | Method | Seeds | t Δ Acc. | t Δ F1 | t lpb 2 ahead / behind |" in md
    assert f"| 1 | DECA | 2 | 2.50 ± 10.61 | 2.50 ± 10.61 | 1 / 1 | {1 - 2 / math.pi * math.atan(1 / 3):.1f} |" in md
    assert "| 4 | DECA | 1 | 30.00 | 30.00 | 1 / 0 |" in md
    # without the main table's granularity among the sweep's cells there is nothing to pair with
    assert build_granularity_paired({c: r for c, r in results.items() if "main" not in c.tables}) is None


def test_smooth_is_a_trailing_mean():
    assert smooth(np.array([1.0, 3.0, 5.0, 7.0]), 2) == pytest.approx([1.0, 2.0, 4.0, 6.0])


@pytest.mark.parametrize("change, message", [
    ({"methods": ["deca", "fedavg"]}, r"unknown method\(s\) \['fedavg'\]"),
    ({"tasks": {"emotion": {}}}, r"unknown task 'emotion'"),
    ({"method_options": {"dadam": {"steps": 5}}, "methods": ["deca", "dadam"]},
     r"unequal step budgets.*deca: 8 steps x 4 examples.*dadam: 5 steps"),
    # DECA's embeddings a block more (T·(B + 1)·R), D-Adam's budget its own default T·B·R
    ({"method_options": {"deca": {"train_embeddings": True}}, "methods": ["deca", "dadam"]},
     r"unequal step budgets.*deca: 10 steps x 4 examples.*dadam: 8 steps"),
    ({"options": {"model": "tiny", "seed": 3}}, r"\['seed'\] are set per cell by the grid"),
    # a cell's first start with resume set failed: it holds no run to continue
    ({"options": {"model": "tiny", "resume": True}}, r"options: \['resume'\] are the grid's: it resumes a cell's run"),
    ({"options": {"model": "tiny", "time_limit": 60}}, r"options: time_limit stops a run before its end, and a grid's"),
    ({"speed": 3}, r"unknown key\(s\) \['speed'\]"),
    ({"options": {"model": "tiny", "lrr": 1}}, r"options: unknown option 'lrr' \(did you mean 'lr'\?\)"),
    ({"tasks": {"synthetic": {"max_seq_len": 1.5}}}, r"tasks.synthetic: max_seq_len: expected an integer, got 1.5"),
    ({"options": {"model": "tiny", "clients": 3, "dirichlet_alpha": 0}}, r"dirichlet_alpha must be > 0"),
    ({"options": {"model": "tiny"}}, r"clients must be integers >= 1, got \[None\]"),
    # no erdos_renyi cell to take it: every cell would have been a ring whatever er_p said
    ({"options": {"model": "tiny", "clients": 3, "topology": "ring", "er_p": 0.3}},
     r"cell synthetic/ring-n3-lpb2/deca/seed0: --topology ring does not read --er-p \(read by --topology erdos_renyi "
     r"only\): leave it at its default \(in a grid, they go to its erdos_renyi cells only\)"),
    ({"seeds": []}, r"seeds is empty"),
    ({"seeds": [0, "a"]}, r"seeds must be integers >= 0, got \['a'\]"),
    # numpy's generators take no negative seed: the cell failed at its start with "expected non-negative integer"
    ({"seeds": [0, -1]}, r"seeds must be integers >= 0, got \[-1\]"),
    # the default runs_dir is runs/NAME: this one's cells went outside it
    ({"name": "../elsewhere"}, r"grid: name must be a name, not a path, got '../elsewhere'"),
    ({"name": ""}, r"grid: name must be a name, not a path, got ''"),
    # a repeat adds no cell (cells are keyed by their values): one seed where two were meant
    ({"seeds": [0, 1, 0, 1, 2]}, r"grid: seeds lists 0, 1 more than once; give each value once"),
    ({"methods": ["deca", "dec_lora", "deca"]}, r"grid: methods lists 'deca' more than once"),
    ({"sweeps": [{"table": "clients", "clients": [3, 3]}]}, r"sweeps\[0\].clients lists 3 more than once"),
    ({"sweeps": [{"table": "bma", "methods": ["deca"], "bma_betas": [[0.3, 0.2], [0.3, 0.2]]}]},
     r"sweeps\[0\].bma_betas lists \(0.3, 0.2\) more than once"),
    ({"results_dir": 5}, r"results_dir must be text, got \[5\]"),
    ({"jobs": 0}, r"jobs must be an integer >= 1, got 0"),
    # YAML's .inf: a cell would be waited for without end (every wait has a timeout)
    ({"cell_timeout_s": float("inf")}, r"cell_timeout_s must be a finite number > 0, got inf"),
    ({"options": {"model": "tiny", "clients": 3, "lr": float("nan")}}, r"lr must be a finite number, got nan"),
    ({"cpu_kernels": "AVX2"}, r"cpu_kernels must be one of default, avx2, avx512 .* got 'AVX2'"),
    ({"pretrain": {"output_dir": "x"}}, r"pretrain: unknown key\(s\) \['output_dir'\]"),
    ({"pretrain": {}}, r"pretrain makes the one model every cell fine-tunes.*\['tiny'\]"),
    # each cell was refused at its start, once the base was pretrained (SMALL_LLAMA: 256 positions)
    ({"options": {"model": "base", "clients": 3, "max_seq_len": 300}, "pretrain": {}},
     r"grid: 4 cell\(s\) take examples longer than the context of the model pretrain makes \(max_position_embeddings "
     r"256\): synthetic/erdos_renyi-n3-lpb2/dec_lora/seed0 \(max_seq_len 300\), .*; lower their max_seq_len"),
    ({"sweeps": [{"table": "bma", "bma_betas": [[0.3, 0.2]]}]}, r"bma_betas: BMA's betas are DECA's; the sweep's "
                                                                r"methods \['dec_lora'\] have none"),
    ({"sweeps": [{"table": "bma", "methods": ["deca"], "bma_betas": [0.3, 0.2]}]},
     r"bma_betas must be \[β1, β2\] pairs, e.g. .*, got \[0.3, 0.2\]"),
    ({"sweeps": [{"table": "bma", "methods": ["deca"], "bma_betas": [[0.3, 1.5]]}]},
     r"deca-bma0.3-1.5/seed0: bma_betas must be two numbers in \[0, 1\]"),
])
def test_bad_grids_are_refused_before_any_run(change, message, tmp_path):
    with pytest.raises(GridError, match=message):
        build_grid(tiny_grid("tiny", **change), runs_dir=tmp_path)
    assert not any(tmp_path.iterdir())  # nothing was written


def test_the_embeddings_block_counts_in_the_budget_as_the_runs_count_it(tmp_path):
    """DECA and D-Adam both training the embeddings: T·(B + 1)·R steps each, as their runs take, and
    DECA's simulated cell runs them, the embeddings' block first."""
    from deca_ds.models import tiny_llama
    from deca_ds.optimizer import model_partition
    from deca_ds.reproduce import cells, simulated
    from deca_ds.runtime.options import RunOptions
    from helpers import torch_threads

    both = {"train_embeddings": True}
    grid = build_grid(tiny_grid("tiny", methods=["deca", "dadam"], seeds=[0],
                                method_options={"deca": both, "dadam": both}), runs_dir=tmp_path)
    assert set(grid.budgets.values()) == {(1 * (4 + 1) * 2, 4)}
    for cell in grid.cells:
        opts = RunOptions(**cell.options)
        assert opts.total_steps(model_partition(tiny_llama(64), opts.deca_config())) == 10, cell.method
    deca = next(c for c in grid.cells if c.method == "deca")
    d = grid.cell_dir(deca)
    cells._prepare(grid, deca, d, None)
    with torch_threads():
        simulated.run_simulated(d)
    steps = [json.loads(line) for line in (d / "metrics.jsonl").read_text().splitlines()]
    assert [s["block"] for s in steps] == [0, 0, 1, 1, 2, 2, 3, 3, 4, 4]
    config = json.loads((d / "run_config.json").read_text())
    assert config["options"]["train_embeddings"] is True and config["blocks"][0]["name"] == "embeddings"
    # a hub model's depth, unknown offline: the budget in symbols, the head's block among them
    hub = {"model": "org/hub-model", "rounds": 4, "layers_per_block": 2, "steps_per_block": 48, "train_lm_head": True}
    assert step_budget(hub, "deca") == ("4·(⌈L/2⌉ + 1)·48", 1)


def test_a_presets_clipping_and_schedule_are_a_cells_settings(tmp_path):
    """gradient_clipping and a scheduler change what a step computes: each cell carries them, on
    either backend, so a finished cell run without them is not taken for one with them; a schedule
    DeepSpeed cannot build is refused when the grid is read, before any cell runs."""
    preset = json.loads((ROOT / "ds_configs" / "cpu_demo.json").read_text())
    from deca_ds.reproduce.cell_dir import settings_changed

    runs = tmp_path / "runs"
    keys = {"gradient_clipping": 0.5, "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 4}}}
    path = tmp_path / "clipped.json"
    path.write_text(json.dumps({**preset, **keys}))
    plain = build_grid(tiny_grid("tiny", backend="simulate", ds_config="cpu_demo"), runs_dir=runs).cells[0]
    for backend in ("simulate", "deepspeed"):
        cell = build_grid(tiny_grid("tiny", backend=backend, ds_config=str(path)), runs_dir=runs).cells[0]
        assert cell.settings()["deepspeed"] == keys
        assert settings_changed(plain.settings(), cell.settings()) == [
            "the preset's gradient_clipping", "the preset's scheduler"]
    assert "deepspeed" not in plain.settings()  # the settings of cells saved before the keys were compare alike
    path.write_text(json.dumps({**preset, "scheduler": {"type": "WarmupLR", "params": {"warmup_steps": 4}}}))
    with pytest.raises(GridError, match=r"ds_config: .*scheduler .*unexpected keyword argument 'warmup_steps'"):
        build_grid(tiny_grid("tiny", backend="simulate", ds_config=str(path)), runs_dir=runs)
    assert not runs.exists()


def test_a_topology_sweep_gives_the_graph_options_to_its_erdos_renyi_cells(tmp_path):
    """er_p and topology_seed in a grid's options reach its erdos_renyi cells only (deca-train refuses
    them with another graph), so the ring cells are the ring a grid without them runs."""
    sweeps = [{"table": "topology", "topology": ["ring", "erdos_renyi"], "methods": ["deca"], "seeds": [0]}]
    grid = tiny_grid("tiny", sweeps=sweeps)
    grid["options"].update(er_p=0.3, topology_seed=5)
    cells = {c.topology: c for c in build_grid(grid, runs_dir=tmp_path).cells}
    assert (cells["erdos_renyi"].options["er_p"], cells["erdos_renyi"].options["topology_seed"]) == (0.3, 5)
    assert (cells["ring"].options["er_p"], cells["ring"].options["topology_seed"]) == (0.5, 0)  # the defaults
    plain = tiny_grid("tiny", sweeps=sweeps)
    assert [c.options for c in build_grid(plain, runs_dir=tmp_path).cells if c.topology == "ring"] == [
        cells["ring"].options]


def test_a_client_of_several_ranks_is_refused_on_the_simulate_backend(tmp_path):
    """ranks_per_client > 1 averages a client's gradient over its ranks (an all-reduce), which one
    process per cell does not: refused before any cell runs; accumulating micro-batches is not."""
    grid = tiny_grid("tiny", backend="simulate")
    grid["options"].update(ranks_per_client=2)
    with pytest.raises(GridError, match=r"the simulate backend runs each client as one rank \(ranks_per_client 1, "
                                        r"not 2\); use the deepspeed backend"):
        build_grid(grid, runs_dir=tmp_path / "runs")
    grid["options"].update(ranks_per_client=1, grad_accum=2)
    assert build_grid(grid, runs_dir=tmp_path / "runs").cells[0].options["grad_accum"] == 2
    assert not (tmp_path / "runs").exists()


def test_a_grids_directory_that_is_a_file_is_refused(tmp_path):
    """runs_dir or results_dir naming a file: refused when the grid is read (it was a traceback when
    the first cell or the first table was written), and the file left as it was."""
    mine = tmp_path / "notes.txt"
    mine.write_text("mine")
    for key, what in (("runs_dir", "cells run in"), ("results_dir", "tables and figures go to")):
        with pytest.raises(GridError, match=rf"{key} {mine} is a file: give the directory the grid's {what}"):
            build_grid(tiny_grid("tiny"), **{key: mine})
    assert mine.read_text() == "mine" and [p.name for p in tmp_path.iterdir()] == ["notes.txt"]


def test_a_results_dir_of_other_files_or_another_grids_report_is_refused_and_left_alone(tmp_path, capsys):
    """The report writes tables.md, results.json, the tables' CSVs and the figures: into a directory
    that holds such files of the user's, or another grid's report, it wrote over them. Refused before
    anything runs; this grid's own earlier report is replaced, and a user's other files stay beside it."""
    from deca_ds.reproduce.cli import main

    (tmp_path / "grid.yaml").write_text(yaml.safe_dump(tiny_grid("tiny", runs_dir=str(tmp_path / "runs"))))
    mine, theirs = tmp_path / "mine", tmp_path / "theirs"
    mine.mkdir()
    (mine / "tables.md").write_text("# my tables")
    (mine / "main.csv").write_text("a,b\n")
    theirs.mkdir()
    (theirs / "results.json").write_text(json.dumps({"grid": "other", "cells": []}))
    for out, holds in ((mine, "files no report of this grid wrote (main.csv, tables.md)"),
                       (theirs, "grid 'other''s report (results.json)")):
        before = {p.name: p.read_text() for p in out.iterdir()}
        for mode in ("--report-only", "--dry-run"):
            assert main([str(tmp_path / "grid.yaml"), mode, "--results-dir", str(out)]) == 2
            assert (f"error: results_dir {out} holds {holds}, which this grid's report would write over: give "
                    "another --results-dir") in capsys.readouterr().err
        assert {p.name: p.read_text() for p in out.iterdir()} == before
    assert not (tmp_path / "runs").exists()
    ours = tmp_path / "ours"
    ours.mkdir()
    (ours / "README.md").write_text("how these were made")
    for _ in range(2):  # the second time over the first's report
        assert main([str(tmp_path / "grid.yaml"), "--report-only", "--results-dir", str(ours)]) == 0
    assert json.loads((ours / "results.json").read_text())["grid"] == "tiny"
    assert (ours / "README.md").read_text() == "how these were made"


def test_no_judge_on_a_grid_that_judges_nothing_is_refused(tmp_path, capsys):
    """--no-judge leaves a generation grid's answers unjudged: on a grid without a judge it did nothing."""
    from deca_ds.reproduce.cli import main

    (tmp_path / "grid.yaml").write_text(yaml.safe_dump(tiny_grid("tiny", runs_dir=str(tmp_path / "runs"))))
    assert main([str(tmp_path / "grid.yaml"), "--no-judge", "--dry-run"]) == 2
    assert "error: --no-judge: this grid judges no answers (it has no generation.judge section)" in \
        capsys.readouterr().err
    assert not (tmp_path / "runs").exists()


def test_a_grid_file_that_is_not_yaml_is_named(tmp_path):
    (tmp_path / "grid.yaml").write_text("name: [x\n")
    with pytest.raises(GridError, match=r"grid.yaml is not valid YAML: while parsing a flow sequence"):
        load_grid(tmp_path / "grid.yaml")
    # a key given twice: YAML loaders keep the second silently (here: two seeds where the first said one)
    text = yaml.safe_dump(tiny_grid("tiny", seeds=[0]), sort_keys=False) + "seeds: [0, 1]\n"
    (tmp_path / "grid.yaml").write_text(text)
    with pytest.raises(GridError, match=r"grid.yaml is not valid YAML: the key 'seeds' is given twice \(lines \d+ and"):
        load_grid(tmp_path / "grid.yaml")


def test_grid_values_are_typed_as_the_commands_type_them(tmp_path):
    """A grid's options are converted as deca-train converts a run file's, its pretrain section as
    deca-pretrain's: YAML 1.1 reads 3e-3 (no dot) as the string '3e-3'."""
    text = yaml.safe_dump(tiny_grid(str(tmp_path / "base"), pretrain={"lr": "3e-3", "steps": "20"}))
    data = yaml.safe_load(text.replace("lr: 0.001", "lr: 3e-4"))
    assert data["options"]["lr"] == "3e-4"
    grid = build_grid(data, runs_dir=tmp_path / "runs")
    assert {c.options["lr"] for c in grid.cells} == {3e-4}
    assert (grid.pretrain.lr, grid.pretrain.steps) == (3e-3, 20)
    with pytest.raises(GridError, match=r"pretrain: steps: expected an integer, got 'many'"):
        build_grid({**data, "pretrain": {"steps": "many"}}, runs_dir=tmp_path / "runs")


TINY_PRETRAIN = {"steps": 2, "batch": 8, "seq_len": 32, "warmup": 1,
                 "model": {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
                           "num_attention_heads": 2, "num_key_value_heads": 1, "max_position_embeddings": 64}}


def test_a_grid_pretrains_its_model_once_and_refuses_another_in_its_place(tmp_path, capsys):
    from deca_ds.reproduce.cells import base_state, claim, pretrain_base
    from deca_ds.reproduce.cli import main

    base = tmp_path / "base"
    grid = build_grid(tiny_grid(str(base), pretrain=TINY_PRETRAIN), runs_dir=tmp_path / "runs")
    # the budget reads the depth the section gives the model (2 layers, 1 per block), before it exists
    assert set(grid.budgets.values()) == {(4, 4)}
    (tmp_path / "grid.yaml").write_text(yaml.safe_dump(tiny_grid(str(base), pretrain=TINY_PRETRAIN)))
    assert main([str(tmp_path / "grid.yaml"), "--runs-dir", str(tmp_path / "runs"), "--dry-run"]) == 0
    assert f"model {base}: to pretrain (2 steps, before the first cell)" in capsys.readouterr().out

    pretrain_base(grid, log=lambda *_: None)
    assert base_state(grid) == "pretrained" and load_model(str(base), dtype=torch.float32).config.num_hidden_layers == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == [".base.lock", "base", "grid.yaml"]  # no partial copy
    # the record names the weights, and the same options give them again (deterministic kernels)
    weights = json.loads((base / "pretrain.json").read_text())["weights_sha256"]
    assert weights == sha256(base / "model.safetensors")
    assert pretrain(PretrainOptions(str(tmp_path / "again"), **TINY_PRETRAIN), log=lambda *_: None)[
        "weights_sha256"] == weights
    # bf16 autocast: other weights, still stored in fp32
    bf16 = pretrain(PretrainOptions(str(tmp_path / "bf16"), dtype="bf16", **TINY_PRETRAIN), log=lambda *_: None)
    assert bf16["weights_sha256"] != weights
    assert {t.dtype for t in load_file(tmp_path / "bf16" / "model.safetensors").values()} == {torch.float32}
    stamp = (base / "model.safetensors").stat().st_mtime_ns
    pretrain_base(grid, log=lambda *_: None)  # made earlier with the same options: not again
    assert (base / "model.safetensors").stat().st_mtime_ns == stamp

    other = tiny_grid(str(base), pretrain={**TINY_PRETRAIN, "lr": 0.01})
    with pytest.raises(GridError, match=r"was pretrained with other settings \(lr: 0\.003 -> 0\.01\)"):
        base_state(build_grid(other, runs_dir=tmp_path / "runs"))
    # a model directory the grid did not make is neither used for the recipe nor written over
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "model.safetensors").write_text("theirs")
    grid = build_grid(tiny_grid(str(foreign), pretrain=TINY_PRETRAIN), runs_dir=tmp_path / "runs")
    with pytest.raises(GridError, match="foreign holds files but no pretrain.json"):
        pretrain_base(grid, log=lambda *_: None)
    assert (foreign / "model.safetensors").read_text() == "theirs"
    # another run pretraining the model: waited for, at most cell_timeout_s
    grid = build_grid(tiny_grid(str(tmp_path / "later"), pretrain=TINY_PRETRAIN, cell_timeout_s=0.01),
                      runs_dir=tmp_path / "runs")
    with claim(tmp_path / "later") as held:
        assert held is None
        with pytest.raises(GridError, match=r"later is still being pretrained by pid \d+ on .* after 0.01 s"):
            pretrain_base(grid, log=lambda *_: None, poll_s=0.01)
    assert not (tmp_path / "later").exists()


def test_a_base_pretrained_with_other_cpu_kernels_is_named_before_its_cells_run(tmp_path, capsys):
    """ATen's vector kernels decide a CPU-pretrained base's bits: a grid that finds its base made with
    others than this process runs says so (dry run and run) and fine-tunes it as it is."""
    from deca_ds.reproduce.cells import pretrain_base
    from deca_ds.reproduce.cli import main

    base = tmp_path / "base"
    data = tiny_grid(str(base), pretrain=TINY_PRETRAIN)
    grid = build_grid(data, runs_dir=tmp_path / "runs")
    notes = []
    pretrain_base(grid, log=notes.append)  # made here: these kernels, no note
    record = json.loads((base / "pretrain.json").read_text())
    assert f"{torch.backends.cpu.get_cpu_capability()} kernels" in record["provenance"]["device"]
    pretrain_base(grid, log=notes.append)
    assert not [n for n in notes if "kernels" in n]
    here = torch.backends.cpu.get_cpu_capability()
    other = "AVX2" if here != "AVX2" else "AVX512"
    record["provenance"]["device"] = f"CPU (x86_64, Some CPU, {other} kernels, 2 cores)"
    (base / "pretrain.json").write_text(json.dumps(record))
    stamp = (base / "model.safetensors").stat().st_mtime_ns
    pretrain_base(grid, log=notes.append)
    expected = f"note: {base} was pretrained with {other} CPU kernels, not the {here} ones this process runs"
    assert notes[-1].startswith(expected) and (base / "model.safetensors").stat().st_mtime_ns == stamp
    (tmp_path / "grid.yaml").write_text(yaml.safe_dump(data))
    assert main([str(tmp_path / "grid.yaml"), "--runs-dir", str(tmp_path / "runs"), "--dry-run"]) == 0
    assert expected in capsys.readouterr().out


@pytest.mark.skipif(torch.backends.cpu.get_cpu_capability() not in ("AVX2", "AVX512"), reason="an x86-64 CPU with AVX2")
def test_a_grids_cpu_kernels_pretrain_its_base_and_run_its_cells(tmp_path):
    """cpu_kernels: avx2, the committed CPU grids' setting, in a command that sets no
    ATEN_CPU_CAPABILITY: the base pretrained in the command's own process and the cell it starts
    both run AVX2 kernels (on a CPU with AVX-512 too, whose best those are not)."""
    import subprocess
    import sys

    grid = tiny_grid(str(tmp_path / "base"), pretrain=TINY_PRETRAIN, methods=["deca"], seeds=[0],
                     cpu_kernels="avx2")
    (tmp_path / "grid.yaml").write_text(yaml.safe_dump(grid))
    env = {k: v for k, v in os.environ.items() if k != "ATEN_CPU_CAPABILITY"}
    done = subprocess.run([sys.executable, "launch/reproduce.py", str(tmp_path / "grid.yaml"), "--runs-dir",
                           str(tmp_path / "runs")], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "note:" not in done.stdout, done.stdout
    pretrained = json.loads((tmp_path / "base" / "pretrain.json").read_text())
    assert kernels_of(pretrained["provenance"]["device"]) == "AVX2"
    cell = json.loads((tmp_path / "runs" / "results" / "results.json").read_text())["cells"][0]
    assert cell["finished"] and cell["run_config"]["cpu_kernels"] == "AVX2"


def test_a_set_aten_cpu_capability_wins_over_the_grids_kernels_with_a_note(monkeypatch):
    monkeypatch.setenv("ATEN_CPU_CAPABILITY", "avx512")
    note = pin_cpu_kernels("avx2")
    assert note.startswith("note: ATEN_CPU_CAPABILITY=avx512 is set, not the avx2 kernels the grid names")
    assert os.environ["ATEN_CPU_CAPABILITY"] == "avx512"


def test_cells_fine_tuned_from_other_base_weights_never_share_a_table(tmp_path):
    from deca_ds.reproduce.cell_dir import CELL, FINAL, base_weights, cell_settings
    from deca_ds.reproduce.cells import check_finished, pretrain_base

    grid = build_grid(tiny_grid(str(tmp_path / "base"), pretrain=TINY_PRETRAIN), runs_dir=tmp_path / "runs")
    first, second = grid.cells[:2]

    def finished(cell, base):  # what run_grid leaves: the settings it ran with, then final.json
        d = grid.cell_dir(cell)
        d.mkdir(parents=True, exist_ok=True)
        (d / CELL).write_text(json.dumps({"settings": cell_settings(grid, cell, base)}))
        (d / FINAL).write_text("{}")

    finished(first, "a" * 64)
    finished(second, "b" * 64)
    # cells brought together from two machines, the model not made here: they disagree with each other
    with pytest.raises(GridError, match=r"fine-tuned from 2 different weights of .*base \(aaaaaaaaaaaa: 1 cell"):
        check_finished(grid)
    without = build_grid(tiny_grid(str(tmp_path / "base")), runs_dir=tmp_path / "runs")  # `pretrain` dropped
    with pytest.raises(GridError, match=r"fine-tuned from 2 different weights of .*base"):
        check_finished(without)
    # made here, with other weights than both
    pretrain_base(grid, log=lambda *_: None)
    with pytest.raises(GridError, match=r"2 finished cell\(s\) hold results of other settings.*the base model's "
                                        r"weights"):
        check_finished(grid)
    finished(first, base_weights(grid))
    finished(second, base_weights(grid))
    assert check_finished(grid)[1] == [first, second]


def test_pretrain_never_writes_over_files_nor_leaves_half_a_checkpoint(tmp_path, monkeypatch):
    from transformers import PreTrainedTokenizerFast

    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "notes.txt").write_text("mine")
    with pytest.raises(ValueError, match="out already holds files"):
        pretrain(PretrainOptions(str(tmp_path / "out"), **TINY_PRETRAIN), log=lambda *_: None)
    assert [p.name for p in (tmp_path / "out").iterdir()] == ["notes.txt"]

    import importlib

    pretrain_module = importlib.import_module("deca_ds.reproduce.pretrain")  # the package exports the function
    with monkeypatch.context() as nan_loss:  # a diverged run is an error, not a checkpoint
        cross_entropy = pretrain_module.F.cross_entropy
        nan_loss.setattr(pretrain_module.F, "cross_entropy", lambda *a, **k: cross_entropy(*a, **k) * float("nan"))
        with pytest.raises(ValueError, match=r"pretraining diverged: loss nan at step 0 of 2; nothing was written"):
            pretrain(PretrainOptions(str(tmp_path / "new"), **TINY_PRETRAIN), log=lambda *_: None)

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(PreTrainedTokenizerFast, "save_pretrained", interrupted)  # after the weights are written
    with pytest.raises(KeyboardInterrupt):
        pretrain(PretrainOptions(str(tmp_path / "new"), **TINY_PRETRAIN), log=lambda *_: None)
    assert [p.name for p in tmp_path.iterdir()] == ["out"]

    monkeypatch.undo()  # a pretraining killed while it saved, where no cleanup runs, left its directory:
    cut_off = tmp_path / ".new.abcdefgh.partial"  # the next one removes it, saying so
    cut_off.mkdir()
    (cut_off / "model.safetensors").write_text("half")
    said = []
    pretrain(PretrainOptions(str(tmp_path / "new"), **TINY_PRETRAIN), log=lambda *a: said.append(" ".join(map(str, a))))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["new", "out"]
    assert any(line.startswith(f"removing {cut_off}, left by a write of") for line in said), said


def test_only_takes_the_grids_own_keys_and_values(tmp_path):
    grid = build_grid(tiny_grid("tiny"), runs_dir=tmp_path)
    keep = grid.select(["method=dec_lora", "seed=1,0"])
    assert [c.key for c in grid.cells if keep(c)] == [c.key for c in grid.cells if c.method == "dec_lora"]
    with pytest.raises(GridError, match=r"--only seed=0,7: the grid has no seed 7 \(it has 0, 1\)"):
        grid.select(["seed=0,7"])
    with pytest.raises(GridError, match="--only 'lr=1': give KEY=VALUE"):
        grid.select(["lr=1"])
    # a table: the cells that feed it (a cell of two sweeps feeds both)
    sweeps = [{"table": "main"}, {"table": "topology", "topology": ["ring", "complete"], "methods": ["deca"]}]
    swept = build_grid(tiny_grid("tiny", sweeps=sweeps), runs_dir=tmp_path)
    topology = swept.select(["table=topology"])
    assert sorted(c.key for c in swept.cells if topology(c)) == sorted(
        c.key for c in swept.cells if c.method == "deca" and c.topology in ("ring", "complete"))
    assert [c.key for c in swept.cells if swept.select(["table=main"])(c)] == [
        c.key for c in swept.cells if "main" in c.tables]
    with pytest.raises(GridError, match=r"--only table=bma: the grid has no table bma \(it has main, topology\)"):
        swept.select(["table=bma"])


def test_set_overrides_every_cells_options_as_the_file_would(tmp_path, capsys):
    """deca-reproduce --set KEY=VALUE: each value read as YAML into every cell's options, checked as
    the grid file's options are, before anything runs."""
    from deca_ds.reproduce.cli import main
    from deca_ds.reproduce.grid import parse_settings

    path = tmp_path / "grid.yaml"
    path.write_text(yaml.safe_dump(tiny_grid("tiny", runs_dir=str(tmp_path / "runs"))))
    grid = load_grid(path, options=parse_settings(["compile_layers=true", "lr=2e-3"]))
    assert {(c.options["compile_layers"], c.options["lr"]) for c in grid.cells} == {(True, 2e-3)}
    assert {c.options["lr"] for c in load_grid(path).cells} == {1e-3}
    for words, error in ((["lr"], "--set 'lr': expected KEY=VALUE"),
                         (["seed=3"], r"\['seed'\] are set per cell by the grid"),
                         (["lrr=1"], r"unknown option 'lrr' \(did you mean 'lr'\?\)")):
        assert main([str(path), "--dry-run", "--set", *words]) == 2
        assert re.search(error, capsys.readouterr().err)
    assert not (tmp_path / "runs").exists()


def test_a_simulated_grid_runs_on_ranks_with_backend_and_ds_config_given(tmp_path, capsys):
    """deca-reproduce --backend deepspeed --ds-config PRESET runs a simulated grid's cells on
    deca-train's ranks (what they compute is the same: the three-way test above); without a preset
    the deepspeed backend is refused, before anything runs."""
    from deca_ds.reproduce.cli import main

    path = tmp_path / "grid.yaml"
    path.write_text(yaml.safe_dump(tiny_grid("tiny", runs_dir=str(tmp_path / "runs"))))
    assert main([str(path), "--dry-run", "--backend", "deepspeed", "--ds-config", "cpu_demo", "--clients-per-gpu",
                 "2"]) == 0
    assert "4 cells, 4 to run (deepspeed, 1 at a time, timeout 300 s per cell, on CPU ranks)" in capsys.readouterr().out
    grid = load_grid(path, backend="deepspeed", ds_config="cpu_demo")
    assert (grid.backend, grid.ds_config, load_grid(path).backend) == ("deepspeed", "cpu_demo", "simulate")
    assert main([str(path), "--dry-run", "--backend", "deepspeed"]) == 2
    assert "the deepspeed backend needs `ds_config`" in capsys.readouterr().err
    assert not (tmp_path / "runs").exists()
    # a deepspeed grid simulated has the same cells: its preset's batch and deca section fill in either way
    ranks = tiny_grid("tiny", backend="deepspeed", ds_config="cpu_demo", runs_dir=str(tmp_path / "runs"))
    del ranks["options"]["micro_batch"]
    path.write_text(yaml.safe_dump(ranks))
    cells = [load_grid(path, **given).cells for given in ({}, {"backend": "simulate"})]
    assert cells[0] == cells[1] and {c.options["micro_batch"] for c in cells[0]} == {16}


def test_generation_tasks_and_stray_sweep_tasks_are_refused(tmp_path):
    with pytest.raises(GridError, match="alpaca is a generation task: .* a `generation` section"):
        build_grid(tiny_grid("tiny", tasks={"alpaca": {"dataset": "alpaca"}}), runs_dir=tmp_path)
    with pytest.raises(GridError, match=r"tasks \['mnli'\] are not in the grid's `tasks`"):
        build_grid(tiny_grid("tiny", sweeps=[{"table": "main", "tasks": ["mnli"]}]), runs_dir=tmp_path)


def test_paper_grids_check_and_launch_one_rank_per_client(tmp_path):
    from deca_ds.reproduce import load_grid
    from deca_ds.reproduce.cells import _deepspeed_command
    from deca_ds.reproduce.placement import placement

    grid = load_grid("reproduce/paper_qwen2.5-3b.yaml", runs_dir=tmp_path)
    # the same file by its shipped name (deca-reproduce paper_qwen2.5-3b), from any directory
    assert load_grid("paper_qwen2.5-3b", runs_dir=tmp_path).source == grid.source
    unknown = r"grid file paper_qwen2\.5: no such file and no shipped grid .*did you mean 'paper_qwen2\.5-3b'"
    with pytest.raises(GridError, match=unknown):
        load_grid("paper_qwen2.5")
    # Table 1 + ablation: 4 tasks x 6 methods; topology: 3 tasks x 4 methods x 2 more graphs; clients: x 2 more N
    assert len(grid.cells) == 24 + 24 + 24
    # the hub model's depth is unknown offline: one symbolic budget, the preset's 4 examples per step
    assert set(grid.budgets.values()) == {("4·⌈L/2⌉·48", 4)}
    cell = next(c for c in grid.cells if c.clients == 12 and c.method == "dec_lora")
    d = tmp_path / "cell"
    d.mkdir()
    with placement(grid, grid.cells, env={}).cell(cell, lambda: False) as launch:
        command = _deepspeed_command(grid, cell, d, launch)
    # deca-train as a module: no checkout's launch/ needed; the preset by its path in the package or checkout
    # (here on CPU ranks, 12 of them: tests/test_placement.py places them on GPUs and hosts)
    assert command[1:4] == ["--num_gpus", "12", "--master_port"] and command[5:7] == ["--module", "deca_ds.train"]
    assert command[7:9] == ["--ds_config", str((ROOT / "ds_configs" / "rtx5090_qwen2.5-3b.json").resolve())]
    written = yaml.safe_load((d / "options.yaml").read_text())
    assert written["method"] == "dec_lora" and written["clients"] == 12 and written["dirichlet_alpha"] == 0.25
    assert written["model"] == "Qwen/Qwen2.5-3B-Instruct" and written["output_dir"].endswith("seed0/train")
    # a cell stopped by a job's time limit goes on from its newest checkpoint (see the resume test below)
    assert written["checkpoint_interval"] == 576 and written["keep_checkpoints"] == 1
    granularity = load_grid("reproduce/paper_llama-3.1-8b.yaml", runs_dir=tmp_path)
    assert {c.layers_per_block for c in granularity.cells if "granularity" in c.tables} == {1, 2, 4}
    synthetic = load_grid("reproduce/cpu_synthetic.yaml", runs_dir=tmp_path)
    # five seeds of: main, 7 methods; 2 more graphs x 4 methods, N = 4 x 4 methods and 2 more granularities
    assert len(synthetic.cells) == len(load_grid("reproduce/cpu_ag_news.yaml", runs_dir=tmp_path).cells) \
        == 5 * (7 + 8 + 4 + 2)
    # seed by seed: the main table's 7 methods at seed 0 come first, whole
    assert [(c.seed, "main" in c.tables) for c in synthetic.cells[:8]] == [(0, True)] * 7 + [(1, True)]
    assert {c.seed for c in synthetic.cells if "topology" in c.tables} == {0, 1, 2, 3, 4}
    for name in ("cpu_synthetic", "cpu_ag_news", "gpu_ag_news"):
        small = load_grid(f"reproduce/{name}.yaml", runs_dir=tmp_path)
        assert {c.clients for c in small.cells if "main" in c.tables} == {8}
        assert {c.options["dirichlet_alpha"] for c in small.cells} == {0.25}
    assert (small.jobs, len(small.cells)) == (4, 14)


@pytest.mark.parametrize("results", sorted(p.name for p in (ROOT / "reproduce" / "results").iterdir()))
def test_results_readmes_quote_their_generated_tables(results):
    """Every mean ± std and every per-seed accuracy / macro-F1 of a results README's tables is one
    that the grid's report wrote into tables.md (the README may order and label rows its own way),
    and a paired row's Δ, seeds ahead / behind and p (paired t) are those of one of its paired rows."""
    folder = ROOT / "reproduce" / "results" / results
    tables = " ".join((folder / "tables.md").read_text().split())
    rows = [line for line in (folder / "README.md").read_text().splitlines() if line.startswith("|")]
    quoted = [n for line in rows for n in re.findall(r"\d+\.\d+ ± \d+\.\d+|\d+\.\d / \d+\.\d", line)]
    assert quoted, f"{results}/README.md quotes no numbers of its tables"
    assert [n for n in quoted if n not in tables] == []
    row_p = re.compile(r"\| (-?\d+\.\d+ ± \d+\.\d+) \| (\d+ / \d+) \| (< 0\.001|\d[\d.e-]*) \|$")
    paired = [m.groups() for line in rows if (m := row_p.search(line))]
    assert len(paired) == 6 or "p (paired t)" not in " ".join(rows)  # one for each method but DECA
    reported = (folder / "tables.md").read_text().splitlines()
    for delta, ahead, p in paired:
        assert any(f"| {delta} |" in line and line.endswith(f"| {ahead} | {p} |") for line in reported), (delta, p)


def started_cell(grid, cell) -> Path:
    """The cell's directory as a grid run starts the cell, before its first step."""
    from deca_ds.reproduce.cell_dir import base_weights
    from deca_ds.reproduce.cells import _prepare

    assert _prepare(grid, cell, grid.cell_dir(cell), base_weights(grid)) is None
    return grid.cell_dir(cell)


def test_a_cell_directory_no_grid_run_wrote_is_refused_and_kept(tmp_path):
    """Starting a cell afresh removes its directory (an unfinished attempt's): one that holds files
    but no cell.json is someone else's, and the grid stops before any cell runs, naming it."""
    grid = build_grid(tiny_grid("tiny", methods=["deca"], seeds=[0, 1]), runs_dir=tmp_path)
    mine = grid.cell_dir(grid.cells[1]) / "notes.txt"
    mine.parent.mkdir(parents=True)
    mine.write_text("keep me")
    grid.cell_dir(grid.cells[0]).mkdir()  # empty: as a run killed before its cell.json leaves it
    before = sorted(tmp_path.rglob("*"))
    with pytest.raises(GridError, match=rf"1 cell directory\(ies\) hold files but no cell.json.*{grid.cells[1].key}"):
        run_grid(grid, log=lambda *_: None)
    assert mine.read_text() == "keep me" and sorted(tmp_path.rglob("*")) == before


def test_a_run_checking_the_cells_while_another_starts_one_does_not_take_it_for_a_users(tmp_path, monkeypatch):
    """Two grid runs on one runs_dir: while one starts a cell afresh (over an unfinished attempt),
    the other checks the cells. It must find the cell's directory absent or with its cell.json, never
    a directory of files without one, which it would refuse as a user's (this stopped a second run
    of test_two_grid_runs_on_one_runs_dir_run_each_cell_once now and then). What an earlier start
    killed as it wrote left beside the directory is removed."""
    from deca_ds.files import atomic_write
    from deca_ds.reproduce import cells

    grid = build_grid(tiny_grid("tiny", methods=["deca"], seeds=[0]), runs_dir=tmp_path)
    attempt = started_cell(grid, grid.cells[0])
    (attempt / "metrics.jsonl").write_text('{"step": 0}\n')  # an attempt stopped without a checkpoint
    killed = attempt.parent / f".{attempt.name}.a1b2c3d4.partial"  # a start of the cell killed as it wrote
    (killed / "cell.json").parent.mkdir()
    (killed / "cell.json").write_text("{}")
    seen = []

    def write_json_checked_meanwhile(path, obj):  # the other run checks while cell.json is being written
        atomic_write(path, lambda tmp: (seen.append(check_finished(grid)), Path(tmp).write_text(json.dumps(obj))))

    monkeypatch.setattr(cells, "write_json", write_json_checked_meanwhile)
    d = started_cell(grid, grid.cells[0])
    assert seen == [(grid.cells, [])]
    assert sorted(p.name for p in d.iterdir()) == ["cell.json"] and not killed.exists()
    assert [p.name for p in d.parent.iterdir() if not p.name.endswith(".lock")] == [d.name]


def test_a_cell_over_its_time_limit_is_stopped_and_left_unfinished(tmp_path):
    grid = build_grid(tiny_grid("tiny", methods=["deca"], seeds=[0], cell_timeout_s=0.5), runs_dir=tmp_path)
    status = run_grid(grid, log=lambda *_: None)
    assert list(status.values()) == [f"failed: over the cell time limit of 0.5 s (see {grid.cell_dir(grid.cells[0])}"
                                     "/log.txt)"]
    assert not (grid.cell_dir(grid.cells[0]) / "final.json").exists()
    todo, done = check_finished(grid)
    assert todo == grid.cells and done == []  # the next run tries it again


def test_a_simulated_cell_skips_nonfinite_steps_as_ranks_do_then_stops_when_it_diverges(tmp_path):
    """skip_nonfinite (deca-train's --skip-nonfinite) in a simulated cell: every client skips the step,
    its log counts the skips as a rank's does, and a run that stays non-finite stops once
    MAX_CONSECUTIVE_SKIPS are skipped in a row (test_safety: the same on ranks, and simulate's skip
    against a run without the skipped batches, to the bit)."""
    from deca_ds.finite import MAX_CONSECUTIVE_SKIPS

    spec = tiny_grid("tiny", methods=["deca"], seeds=[0])
    spec["options"].update(lr=1e30, skip_nonfinite=True)  # step 0 moves the weights to ~1e30: then NaN
    grid = build_grid(spec, runs_dir=tmp_path)
    [status] = run_grid(grid, log=lambda *_: None).values()
    assert status.startswith(f"failed: exit 1: error: {MAX_CONSECUTIVE_SKIPS + 1} consecutive steps non-finite up "
                             "to step 1"), status
    log = (grid.cell_dir(grid.cells[0]) / "log.txt").read_text()
    every = "; ".join(f"non-finite loss on client {i}" for i in range(3))
    skips = re.findall(rf"skip_nonfinite: skipped step (\d+): {every}; (\d+) skipped so far", log)
    assert skips == [("1", str(k)) for k in range(1, MAX_CONSECUTIVE_SKIPS + 1)], log[-2000:]


def start_reproduce(grid_file, log):
    """launch/reproduce.py on `grid_file` in its own process, its output in the file `log`."""
    import subprocess
    import sys

    from test_runtime import ROOT

    with open(log, "w") as out:
        return subprocess.Popen([sys.executable, "launch/reproduce.py", str(grid_file)], cwd=ROOT, stdout=out,
                                stderr=subprocess.STDOUT)


def stopped_when(argv: list[str], ready, *, poll_s: float, timeout_s: float = 120) -> tuple[int, bool]:
    """deca-reproduce's main(argv) here, stopped by a SIGTERM that a thread of its own sends (and so
    takes itself) once ready() is true, or after timeout_s: (the exit code, whether ready() was)."""
    import signal
    import threading
    import time

    from deca_ds.reproduce.cli import main

    came = threading.Event()

    def stopper():
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if ready():
                came.set()
                break
            time.sleep(poll_s)
        signal.pthread_kill(threading.get_ident(), signal.SIGTERM)

    handler = signal.getsignal(signal.SIGTERM)
    thread = threading.Thread(target=stopper)
    try:
        thread.start()
        with pytest.raises(SystemExit) as stopped:
            main(argv)
        thread.join(timeout=60)
    finally:
        signal.signal(signal.SIGTERM, handler)
    return stopped.value.code, came.is_set()


def test_a_stopped_grid_stops_its_running_cells(tmp_path, capsys):
    """deca-reproduce under SIGTERM (a scheduler's, or Ctrl-C's KeyboardInterrupt the same way) stops
    both cells it runs at once, although each has a session of its own, and exits 143; also when
    another thread than the main one takes the signal (on a GPU machine, a grid went on until a cell
    ended: the main thread's wait for the cells must be a timed one)."""
    import contextlib
    import os
    import signal

    import psutil

    from helpers import descendants

    grid = tiny_grid("tiny", seeds=[0], jobs=2, runs_dir=str(tmp_path / "runs"), results_dir=str(tmp_path / "res"),
                     cell_timeout_s=240)
    grid["options"]["steps_per_block"] = 100_000  # runs until stopped
    (tmp_path / "grid.yaml").write_text(yaml.safe_dump(grid))
    cells = []

    def both_run() -> bool:
        cells[:] = descendants(os.getpid(), "deca_ds.reproduce.simulated", recursive=False)
        return len(cells) == 2

    try:
        code, ran = stopped_when([str(tmp_path / "grid.yaml")], both_run, poll_s=0.2)
        left = [p for p in cells if p.is_running()]
    finally:  # whatever failed, no cell outlives the test
        for p in cells + descendants(os.getpid(), "deca_ds.reproduce.simulated", recursive=False):
            with contextlib.suppress(psutil.Error):
                p.kill()
    out = capsys.readouterr().out
    assert ran, out
    assert code == 128 + signal.SIGTERM
    assert not left
    assert "over the cell time limit" not in out  # stopped by the signal, not by their time limit
    assert "failed" not in out  # a stopped cell has not failed; the log says how far it came
    assert len(re.findall(r": stopped with the grid at step \d+ of \d+ \(", out)) == 2, out
    assert not list((tmp_path / "runs").rglob("final.json"))


@pytest.mark.parametrize("method", ["dec_lora", "decaf"])
def test_a_cell_computes_the_same_simulated_or_on_ranks_that_share_a_gpu(tmp_path, method):
    """A Dec-LoRA cell (dropout on) and a DeCAF one (its consensus is no mean), simulated in one
    process and with clients_per_gpu 2 on two ranks torchrun starts on one GPU (here CPU ranks,
    which ignore its --device-map) over gloo: every step's loss and the scores and the final
    consensus distance are the same, so where a grid's cells run changes no result (one thread
    each: torchrun's default). The preset clips the gradient and warms the lr up, which DeepSpeed's
    engine applies on ranks and the simulated cell itself (they changed the losses: the same cell
    simulated without them), and each step accumulates two micro-batches. (A cell on the deepspeed
    launcher's ranks, one client each, is held to its simulated twin in
    test_an_interrupted_deepspeed_cell_resumes_from_its_checkpoint: the same engine, another launcher.)"""
    from deca_ds.reproduce.cells import run_grid
    from deca_ds.reproduce.placement import Placement

    preset = tmp_path / "clipped.json"
    preset.write_text(json.dumps({**json.loads((ROOT / "ds_configs" / "cpu_demo.json").read_text()),
                                  "gradient_clipping": 0.5, "scheduler": {"type": "WarmupLR", "params": {
                                      "warmup_min_lr": 1e-4, "warmup_max_lr": 1e-3, "warmup_num_steps": 4,
                                      "warmup_type": "linear"}}}))
    cells = {}
    for name in ("plain", "simulated", "shared"):
        shared = name == "shared"
        grid = tiny_grid("tiny", backend="deepspeed" if shared else "simulate", methods=[method], seeds=[0], threads=1,
                         runs_dir=str(tmp_path / name), ds_config="cpu_demo" if name == "plain" else str(preset),
                         **({"clients_per_gpu": 2} if shared else {}))
        grid["options"].update(clients=2, topology="ring", eval_limit=8, micro_batch=2, grad_accum=2)
        (tmp_path / f"{name}.yaml").write_text(yaml.safe_dump(grid))
        built = load_grid(str(tmp_path / f"{name}.yaml"))
        if shared:
            place = Placement("GPU 0", {"localhost": ["0"]}, per_gpu=2)
            assert run_grid(built, place=place, log=lambda *_: None) == {built.cells[0].key: "done"}
        else:
            run_simulated_here(built)
        cells[name] = built.cell_dir(built.cells[0])
    assert json.loads((cells["simulated"] / "run_config.json").read_text())["options"]["lora_dropout"] == 0.05
    placed = json.loads((cells["shared"] / "train" / "run_config.json").read_text())["options"]
    assert (placed["device_map"], placed["transport"]) == ("0,0", "gloo")
    read = lambda d: [{k: v for k, v in json.loads(line).items() if k != "wall_s"}  # noqa: E731
                      for line in (d / "metrics.jsonl").read_text().splitlines()]
    final = lambda d: {k: v for k, v in json.loads((d / "final.json").read_text()).items()  # noqa: E731
                       if k != "wall_s"}
    assert read(cells["shared"]) == read(cells["simulated"])
    assert final(cells["shared"]) == final(cells["simulated"])
    changed = [a["loss"] != b["loss"] for a, b in zip(read(cells["plain"]), read(cells["simulated"]))]
    assert not changed[0] and all(changed[1:])  # the first loss is the model's before any step


def reference_and_stopped(tmp_path, grid: dict, **reference) -> tuple[dict, Grid]:
    """`grid` as two grid files with runs directories of their own: 'reference' (updated by
    `reference`, where None removes a key; simulated) run to its end (run_simulated_here), and
    'stopped' (returned loaded, with both files) for a test to stop and resume."""
    files = {}
    for name, changes in (("reference", reference), ("stopped", {})):
        files[name] = tmp_path / f"{name}.yaml"
        settings = {key: value for key, value in {**grid, **changes}.items() if value is not None}
        files[name].write_text(yaml.safe_dump({**settings, "runs_dir": str(tmp_path / name)}))
    run_simulated_here(load_grid(str(files["reference"])))
    return files, load_grid(str(files["stopped"]))


def run_simulated_here(built: Grid) -> None:
    """Every cell of the simulated grid `built` run to its end in this process, at one thread, as
    the grid's cell processes run them at `threads: 1` (a cell process's imports were most of its
    time); the grid's own way of running cells is tested with the grid runs above."""
    from deca_ds.reproduce import cells, simulated
    from helpers import torch_threads

    assert built.backend == "simulate"
    with pytest.MonkeyPatch.context() as env, torch_threads():
        env.setenv("OMP_NUM_THREADS", "1")
        for cell in built.cells:
            d = built.cell_dir(cell)
            cells._prepare(built, cell, d, None)
            simulated.run_simulated(d)


def assert_resumed_as_reference(d: Path, reference: Path, step: int, distance_rtol: float = 0.0) -> None:
    """A cell resumed from `step` logged every step once with the reference's numbers, and ended with
    its scores (the wall times aside); its consensus distances (to `distance_rtol`) too."""
    def read(path: Path) -> tuple[list[dict], list[float]]:
        records = [{k: v for k, v in json.loads(line).items() if k != "wall_s"}
                   for line in path.read_text().splitlines()]
        return records, [r.pop("consensus_distance") for r in records if "consensus_distance" in r]

    (records, distances), (want_records, want_distances) = read(d / "metrics.jsonl"), read(reference / "metrics.jsonl")
    assert records == want_records
    assert len(distances) == len(want_distances)
    assert distances == pytest.approx(want_distances, rel=distance_rtol, abs=0)
    final, want = (json.loads((x / "final.json").read_text()) for x in (d, reference))
    assert final.pop("resumed_from") == [step] and "resumed_from" not in want
    distance = "final_consensus_distance"
    assert final.pop(distance) == pytest.approx(want.pop(distance), rel=distance_rtol, abs=0)
    assert {k: v for k, v in final.items() if k != "wall_s"} == {k: v for k, v in want.items() if k != "wall_s"}


def test_an_interrupted_deepspeed_cell_resumes_from_its_checkpoint(tmp_path, capsys):
    """A deepspeed cell that writes checkpoints (deca-train's checkpoint_interval), stopped by the
    grid's SIGTERM after its first checkpoint, goes on from it in the next run of the grid instead of
    starting afresh, and ends with the metrics and scores of an uninterrupted run of the same cell:
    simulated, whose numbers a deepspeed cell's are (test_a_cell_computes_the_same_simulated_or_on_ranks...),
    here in bf16 working weights mixed in bf16 and with the loss in chunks, which the simulated
    cell takes from its options as deca-train does (it had computed the whole loss and mixed exactly;
    the clients' models differ then, and so the distance is not 0)."""
    import contextlib
    import signal

    import psutil

    from deca_ds.reproduce.cell_dir import resume_step
    from deca_ds.reproduce.cli import main

    grid = tiny_grid("tiny", backend="deepspeed", ds_config="ds_configs/cpu_demo.json", methods=["deca"], seeds=[0],
                     threads=1, results_dir=str(tmp_path / "res"), cell_timeout_s=600)
    # two clients (ranks), 4 blocks x R = 16 x T = 1: 64 steps, of which 56 come after the first checkpoint
    grid["options"].update(clients=2, topology="ring", steps_per_block=16, rounds=1, checkpoint_interval=8,
                           consensus_interval=4, eval_limit=16, working_dtype="bf16", mix_dtype="working",
                           loss_chunk=5)
    files, built = reference_and_stopped(tmp_path, grid, backend="simulate", ds_config=None)
    cell = built.cells[0]
    d = built.cell_dir(cell)

    def cell_processes() -> list:  # the launcher and its ranks: their command lines name the cell's directory
        return [q for q in psutil.process_iter(["cmdline"]) if str(d) in " ".join(q.info["cmdline"] or [])]

    def checkpointed() -> bool:
        if resume_step(built, cell, d, None) is None:
            return (d / "final.json").exists()
        for q in cell_processes():  # frozen at once: the grid's SIGTERM reaches them within a second
            with contextlib.suppress(psutil.Error):
                q.suspend()
        return True

    code, _ = stopped_when([str(files["stopped"])], checkpointed, poll_s=0.05, timeout_s=300)
    out = capsys.readouterr().out
    assert code == 128 + signal.SIGTERM, out
    assert not (d / "final.json").exists(), "the cell ended before it was stopped: nothing to resume"
    # a rank its launcher's death left behind would be init's child by now: look at every process
    left = [q.pid for q in cell_processes()]
    assert not left, f"the stopped cell left processes running: {left}"
    step = resume_step(built, cell, d, None)
    assert step is not None and step < 64, out
    assert re.search(rf": stopped with the grid at step \d+ of 64 \(its checkpoint at step {step} goes on next time\)",
                     out), out
    assert main([str(files["stopped"]), "--dry-run"]) == 0
    assert f"{cell.key}: 64 steps x 4 examples per client step, tables ['main'], to run from its checkpoint at step " \
           f"{step} of 64" in capsys.readouterr().out

    assert main([str(files["stopped"])]) == 0
    out = capsys.readouterr().out
    assert f"{cell.key} ... (resuming from its checkpoint at step {step})" in out, out
    # the ranks' distance is a mean their all-reduce sums in fp32, the simulated cell's one in double
    assert_resumed_as_reference(d, load_grid(str(files["reference"])).cell_dir(cell), step, distance_rtol=1e-6)
    assert not (d / "train" / "checkpoints").exists()  # a finished cell's checkpoints are removed
    placed = json.loads((d / "train" / "run_config.json").read_text())["options"]
    assert (placed["device_map"], placed["transport"]) == ("auto", "auto")  # one client per rank


def test_an_interrupted_simulated_cell_goes_on_from_its_checkpoint_to_the_same_bits(tmp_path, monkeypatch, capsys):
    """A simulated cell with checkpoint_interval, stopped between its first and second checkpoint
    (the first mid-block for DECA; LoRA's dropout draws from each client's saved generators), goes on from
    the first in the next run of the grid, logs the steps after it again, and ends with the metrics
    and scores of an uninterrupted run, to the bit; its preset's torch schedule (each lr computed
    from the one before) goes on from where it was."""
    from deca_ds.reproduce import cell_dir, cells, simulated
    from deca_ds.reproduce.cli import main
    from helpers import torch_threads

    preset = tmp_path / "cosine.json"
    preset.write_text(json.dumps({**json.loads((ROOT / "ds_configs" / "cpu_demo.json").read_text()),
                                  "scheduler": {"type": "CosineAnnealingLR", "params": {"T_max": 12}}}))
    grid = tiny_grid("tiny", methods=["deca", "dec_lora"], seeds=[0], results_dir=str(tmp_path / "res"),
                     ds_config=str(preset), jobs=2)
    # 4 blocks x R = 3 x T = 1: 12 steps; the checkpoint at step 4 is DECA's second block after one step
    grid["options"].update(steps_per_block=3, checkpoint_interval=4)
    files, built = reference_and_stopped(tmp_path, grid)

    class Stop(Exception):
        pass

    def save_or_stop(d, step, *rest):
        if step > 4:  # killed while it wrote the second, before its cleanup: the next run removes this
            (d / ".checkpoint.pt.abcdefgh.tmp").write_bytes(b"half")
            raise Stop
        save(d, step, *rest)

    save = simulated.save_checkpoint
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # the thread count the grid gives its cells' processes
    for cell in built.cells:  # run here, in this process, up to the second checkpoint, which is not written
        d = built.cell_dir(cell)
        cells._prepare(built, cell, d, None)
        with monkeypatch.context() as stopped, torch_threads(), pytest.raises(Stop):
            stopped.setattr(simulated, "save_checkpoint", save_or_stop)
            simulated.run_simulated(d)
        assert cell_dir.resume_step(built, cell, d, None) == 4
        assert len((d / "metrics.jsonl").read_text().splitlines()) == 8
    capsys.readouterr()
    assert main([str(files["stopped"]), "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert out.count("to run from its checkpoint at step 4 of 12") == 2, out

    assert main([str(files["stopped"])]) == 0
    out = capsys.readouterr().out
    reference = load_grid(str(files["reference"]))
    for cell in built.cells:
        d = built.cell_dir(cell)
        assert f"{cell.key} ... (resuming from its checkpoint at step 4)" in out, out
        assert_resumed_as_reference(d, reference.cell_dir(cell), 4)
        lrs = [json.loads(line)["lr"] for line in (d / "metrics.jsonl").read_text().splitlines()]
        lr = grid["options"]["lr"]  # each step's, as the cosine schedule gives it after that many steps
        assert lrs == pytest.approx([lr * (1 + math.cos(math.pi * t / 12)) / 2 for t in range(12)], rel=1e-12, abs=0)
        assert not (d / "checkpoint.pt").exists() and not (d / "checkpoint.json").exists()
        assert not list(d.glob(".*")), list(d.glob(".*"))
    # a checkpoint whose clients drew their masks from one generator (older code) is not gone on from
    old = tmp_path / "old"
    old.mkdir()
    (old / "checkpoint.pt").write_bytes(b"x")
    (old / "checkpoint.json").write_text(json.dumps({"step": 4, "bytes": 1}))
    assert cell_dir.simulated_checkpoint(old) is None
    (old / "checkpoint.json").write_text(json.dumps({"step": 4, "bytes": 1, "rng": cell_dir.RNG}))
    assert cell_dir.simulated_checkpoint(old) == 4


def test_a_simulated_cell_compiles_its_layers_where_asked(tmp_path, monkeypatch):
    """compile_layers in a simulated cell, as deca-train's --compile-layers: the clients' decoder
    layers run compiled, one compiled forward for every layer of every client (a graph where the
    layer's input needs no gradient, the first layer's, and one where it does; not one per layer or
    client, which would recompile past Dynamo's limit of 8 and run eager in a GPU grid's cells of 8
    clients of 12 layers), and the cell trains as the eager cell does, to fp32 rounding, LoRA's
    dropout included."""
    from torch._dynamo.utils import counters

    from deca_ds.reproduce import cells, simulated
    from helpers import torch_threads

    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    losses = {}
    for compiled in (False, True):
        # LoRA on one projection keeps dropout and an adapter in the compiled graph; on all seven, the
        # test took 59 s with Inductor's cache empty (as in CI), 33 s so
        data = tiny_grid("tiny", methods=["dec_lora"], seeds=[0],
                         method_options={"dec_lora": {"lora_targets": ["q_proj"]}})
        data["options"]["compile_layers"] = compiled
        grid = build_grid(data, runs_dir=tmp_path / str(compiled))
        cell = grid.cells[0]
        d = grid.cell_dir(cell)
        cells._prepare(grid, cell, d, None)
        graphs = counters["stats"]["unique_graphs"]
        with torch_threads():
            simulated.run_simulated(d)
        assert counters["stats"]["unique_graphs"] - graphs == (2 if compiled else 0), dict(counters["stats"])
        losses[compiled] = [json.loads(line)["loss"] for line in (d / "metrics.jsonl").read_text().splitlines()]
    assert len(losses[True]) == 8
    np.testing.assert_allclose(losses[True], losses[False], rtol=1e-5)


def test_fetch_names_the_hub_models_and_tasks_a_grid_reads(tmp_path):
    from deca_ds.runtime.fetch import CONFIG_FILES, WEIGHTS, hub_needs

    def needs(grid) -> tuple[dict, list]:
        models, tasks = hub_needs([c.options for c in grid.cells])
        return models, list(tasks)

    assert needs(load_grid("paper_qwen2.5-3b", runs_dir=tmp_path)) == (
        {"Qwen/Qwen2.5-3B-Instruct": sorted({*CONFIG_FILES, WEIGHTS})}, ["nwgi", "agnews", "tfns", "mnli"])
    for scaled in ("cpu_synthetic", "cpu_ag_news", "gpu_ag_news"):  # built-in task or local files, a local model
        assert needs(load_grid(scaled, runs_dir=tmp_path)) == ({}, [])
    drawn = tiny_grid("org/model", options={**tiny_grid("")["options"], "model": "org/model", "from_config": True,
                                             "trust_remote_code": True})
    assert needs(build_grid(drawn, runs_dir=tmp_path)) == ({"org/model": sorted({*CONFIG_FILES, "*.py"})}, [])


def test_fetch_fills_the_cache_that_cells_read_offline(tmp_path):
    """deca-reproduce --fetch through the real snapshot_download and task loader, offline: a model
    in the hub cache (a tiny Llama the test writes under a hub id) is found, and load_model then
    reads it by its id; a model that is not cached, and a hub task that is not, are named with
    why. The commands run one after another in a process of their own, whose Hugging Face caches
    (read when the hub libraries are imported) are the test's."""
    import subprocess
    import sys

    commit = "0" * 40
    snapshot = tmp_path / "hf" / "hub" / "models--deca-test--tiny" / "snapshots" / commit
    from deca_ds.models import tiny_llama

    tiny_llama(64).save_pretrained(snapshot, safe_serialization=True)
    (snapshot.parents[1] / "refs").mkdir()
    (snapshot.parents[1] / "refs" / "main").write_text(commit)
    grids = {}
    for name, model, dataset in (("cached", "deca-test/tiny", "synthetic"),
                                 ("missing", "deca-test/absent", "synthetic"), ("task", "deca-test/tiny", "agnews")):
        grid = tiny_grid(model, methods=["deca"], seeds=[0], runs_dir=str(tmp_path / "runs"))
        grid["options"]["dataset"] = dataset
        grids[name] = str(tmp_path / f"{name}.yaml")
        Path(grids[name]).write_text(yaml.safe_dump(grid))
    script = """if True:
        import contextlib, io, json, sys
        import torch
        from deca_ds.models import load_model
        from deca_ds.reproduce.cli import main as reproduce
        from deca_ds.train import main as train

        def run(command, argv):  # the command's exit status and output
            out, err = io.StringIO(), io.StringIO()
            with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
                try:
                    code = command(argv)
                except SystemExit as done:
                    code = done.code
            return {"code": code or 0, "out": out.getvalue(), "err": err.getvalue()}

        done = {name: run(reproduce, [grid, "--fetch"]) for name, grid in json.loads(sys.argv[1]).items()}
        done["train"] = run(train, ["--model", "deca-test/tiny", "--fetch"])  # deca-train --fetch: one run's
        done["params"] = sum(p.numel() for p in load_model("deca-test/tiny", dtype=torch.float32).parameters())
        print(json.dumps(done))"""
    env = {**os.environ, "HF_HOME": str(tmp_path / "hf"), "HF_HUB_OFFLINE": "1"}
    ran = subprocess.run([sys.executable, "-c", script, json.dumps(grids)], env=env, cwd=tmp_path,
                         capture_output=True, text=True, stdin=subprocess.DEVNULL, timeout=300)
    assert ran.returncode == 0, ran.stderr
    done = json.loads(ran.stdout.splitlines()[-1])
    for name in ("cached", "train"):
        assert done[name]["code"] == 0, done[name]
        assert f"model deca-test/tiny: 0.00 GiB in {snapshot}" in done[name]["out"], done[name]
    assert "runs without a network read them with HF_HUB_OFFLINE=1" in done["cached"]["out"]
    assert done["params"] == sum(p.numel() for p in tiny_llama(64).parameters())
    assert done["missing"]["code"] == 2
    assert "error: --fetch: model deca-test/absent: LocalEntryNotFoundError" in done["missing"]["err"], done["missing"]
    assert done["task"]["code"] == 2
    assert "error: --fetch: task agnews: could not load fancyzhx/ag_news split 'train' (offline mode is on and it " \
           "is not in the local cache" in done["task"]["err"], done["task"]
    assert not (tmp_path / "runs").exists()


def test_a_cell_another_grid_run_holds_is_left_to_it(tmp_path, capsys):
    """Grid runs sharing a runs_dir split its cells: a cell claimed by one is neither run nor started
    afresh (its directory deleted) by another, which names the holder; the claim ends with its holder."""
    import os

    from deca_ds.reproduce.cells import claim
    from deca_ds.reproduce.cli import main

    grid = build_grid(tiny_grid("tiny", methods=["deca"], seeds=[0]), runs_dir=tmp_path / "runs")
    d = started_cell(grid, grid.cells[0])
    (d / "metrics.jsonl").write_text("{}\n")  # the holder's cell, one step in
    (tmp_path / "grid.yaml").write_text(yaml.safe_dump(tiny_grid("tiny", methods=["deca"], seeds=[0])))
    with claim(d) as held:
        assert held is None
        status = run_grid(grid, log=lambda *_: None)
        assert main([str(tmp_path / "grid.yaml"), "--runs-dir", str(tmp_path / "runs"), "--dry-run"]) == 0
    me = f"pid {os.getpid()} on {os.uname().nodename} since "
    assert list(status.values()) == [f"elsewhere: run by {me}" + status[grid.cells[0].key].split(" since ")[1]]
    assert sorted(p.name for p in d.iterdir()) == ["cell.json", "metrics.jsonl"]
    # the dry run says where the cell runs and how far it is
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith(grid.cells[0].key))
    assert line.startswith(f"{grid.cells[0].key}: 8 steps x 4 examples per client step, tables ['main'], "
                           f"running ({me}") and line.endswith("), step 1 of 8"), line
    with claim(d) as held:  # the claim ended with its holder
        assert held is None


def test_two_grid_runs_on_one_runs_dir_run_each_cell_once(tmp_path):
    """However the two runs interleave, each cell is started by exactly one of them and finishes."""
    grid = tiny_grid("tiny", seeds=[0], runs_dir=str(tmp_path / "runs"), results_dir=str(tmp_path / "res"))
    grid["options"].update(steps_per_block=1, eval_limit=8)
    (tmp_path / "grid.yaml").write_text(yaml.safe_dump(grid))
    logs = [tmp_path / f"run{i}.log" for i in range(2)]
    runs = [start_reproduce(tmp_path / "grid.yaml", log) for log in logs]
    try:
        codes = [run.wait(timeout=600) for run in runs]
    finally:
        for run in runs:
            if run.poll() is None:
                run.kill()
    text = "".join(log.read_text() for log in logs)
    assert codes == [0, 0], text
    keys = [c.key for c in build_grid(grid).cells]
    started = [line.split("] ")[1].removesuffix(" ...") for line in text.splitlines() if line.endswith(" ...")]
    assert sorted(started) == sorted(keys), text
    assert all((tmp_path / "runs" / key / "final.json").is_file() for key in keys)


def test_deepspeed_outputs_become_the_cell_files(tmp_path):
    from deca_ds.reproduce.cell_dir import collect_deepspeed

    train = tmp_path / "train"
    (train / "metrics").mkdir(parents=True)
    (train / "run_config.json").write_text(json.dumps({"n_clients": 2, "method": "deca"}))
    for client, (losses, distance) in enumerate((([3.0, 1.0], 0.2), ([5.0, 2.0], 0.4))):
        records = [{"step": s, "round": 0, "block": 0, "r": s, "loss": loss, "t_forward": 0.1}
                   | ({"consensus_distance": distance} if s == 0 else {"nonfinite_skipped": 1})  # a skip before step 1
                   for s, loss in enumerate(losses)]
        (train / "metrics" / f"client_{client:03d}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    (train / "summary.json").write_text(json.dumps({
        "consensus_eval": {"accuracy": 0.75, "macro_f1": 0.5, "n": 8, "chance": 0.25},
        "final_consensus_distance": [0.1, 0.3]}))
    (tmp_path / "cell.json").write_text(json.dumps({"settings": {}, "resumed_from": [1]}))  # resumed once
    collect_deepspeed(tmp_path, wall_s=12.0)
    steps = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert steps == [{"step": 0, "round": 0, "block": 0, "r": 0, "loss": 4.0, "consensus_distance": pytest.approx(0.3)},
                     {"step": 1, "round": 0, "block": 0, "r": 1, "loss": 1.5, "nonfinite_skipped": 1}]
    final = json.loads((tmp_path / "final.json").read_text())
    assert final["accuracy"] == 0.75 and final["final_consensus_distance"] == pytest.approx(0.2)
    assert final["loss_start"] == 4.0 and final["loss_end"] == 1.5 and final["steps"] == 2 and final["wall_s"] == 12.0
    assert final["resumed_from"] == [1] and final["nonfinite_skipped"] == 1


def test_settings_changed_compares_what_changes_a_result():
    from deca_ds.reproduce.cell_dir import settings_changed

    now = {"key": "k", "options": {"method": "deca", "lr": 1e-3, "transport": "auto", "skip_nonfinite": False,
                                   "eval_limit": 100}}
    old = {"key": "k", "options": {"method": "deca", "lr": 1e-3, "eval_limit": 50}}  # before transport/skip_nonfinite
    assert settings_changed(old, now) == []  # new options at their defaults; eval_limit changes no result
    assert settings_changed(old, {**now, "options": {**now["options"], "skip_nonfinite": True}}) == ["skip_nonfinite"]
    assert settings_changed({**old, "options": {**old["options"], "lr": 2e-3}}, now) == ["lr"]
    assert settings_changed(None, now) == ["no settings saved"]
    # an option the method does not read (a cell saved before such options were refused)
    steps = {**old, "options": {**old["options"], "steps": 16}}
    assert settings_changed(steps, now) == []
    dadam = {"key": "k", "options": {**now["options"], "method": "dadam"}}
    assert settings_changed({**steps, "options": {**steps["options"], "method": "dadam"}}, dadam) == ["steps"]


def test_estimate_gives_each_cells_memory_as_deca_train_does(tmp_path, capsys):
    """deca-reproduce --estimate: one line per cell (its seeds share it) with deca-train --estimate's
    peak for the cell's run, the cards every cell fits, and nothing run or written; a simulated
    grid holds all clients in one process and is refused."""
    import re

    from deca_ds.reproduce.cli import main as reproduce_main
    from deca_ds.train import main as train_main

    config = str(ROOT / "profiling" / "configs" / "qwen2.5-3b-instruct.json")
    grid = tiny_grid(config, backend="deepspeed", ds_config="ds_configs/rtx5090_qwen2.5-3b.json",
                     methods=["deca", "dadam"], runs_dir=str(tmp_path / "runs"))
    grid["options"].update(from_config=True, clients=4, topology="ring", micro_batch=2, max_seq_len=128)
    path = tmp_path / "grid.yaml"
    path.write_text(yaml.safe_dump(grid))
    assert reproduce_main([str(path), "--estimate"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [line.split(":")[0] for line in lines[:2]] == [f"synthetic/ring-n4-lpb1/{m}" for m in ("deca", "dadam")]
    for line, method in zip(lines, ("deca", "dadam")):
        train_main(["--ds_config", "ds_configs/rtx5090_qwen2.5-3b.json", "--model", config, "--from-config",
                    "--method", method, "--clients", "4", "--topology", "ring", "--micro-batch", "2",
                    "--max-seq-len", "128", "--steps-per-block", "2", "--rounds", "1", "--layers-per-block", "1",
                    "--eval-limit", "40", "--lr", "1e-3", "--consensus-interval", "1", "--estimate"])
        peak = re.search(r"peak of the process\s+([\d.]+) GiB", capsys.readouterr().out).group(1)
        assert f": {peak} GiB per client ({method}); RTX 5090: " in line
    assert "RTX 5090: 1 of 2 do not fit: synthetic/ring-n4-lpb1/dadam" in lines
    assert "RTX PRO 6000: every cell fits" in lines
    # up to 4 of a cell's clients on one card (clients_per_gpu): each needs its own peak and reserve
    deca = float(re.search(r"deca: ([\d.]+) GiB", lines[0]).group(1))
    assert 4 * (deca + 1) > 32607 / 1024 > 4 * deca  # RTX 5090's 32607 MiB, the estimator's 1 GiB reserve
    assert reproduce_main([str(path), "--estimate", "--clients-per-gpu", "4"]) == 0
    shared = capsys.readouterr().out.splitlines()
    assert shared[0].startswith(f"synthetic/ring-n4-lpb1/deca: {deca:.3f} GiB per client (deca, 4 clients a GPU); "
                                "RTX 5090: no, RTX PRO 6000: yes")
    assert not (tmp_path / "runs").exists()
    grid.update(backend="simulate")
    path.write_text(yaml.safe_dump(grid))
    assert reproduce_main([str(path), "--estimate"]) == 2
    assert "the simulate backend holds every client of a cell in one process" in capsys.readouterr().err


def test_dry_run_says_a_stopped_cell_without_a_checkpoint_starts_afresh(tmp_path, capsys):
    """A simulated cell stopped part way (a lease or a time limit ran out) keeps no checkpoint: the
    dry run says how far it had come, how fast, and that it starts again from step 0."""
    from deca_ds.reproduce.cli import main

    path = tmp_path / "tiny.yaml"
    path.write_text(yaml.safe_dump(tiny_grid("tiny", runs_dir=str(tmp_path / "runs"))))
    grid = load_grid(str(path))
    stopped, fresh = grid.cells[:2]
    started_cell(grid, stopped)
    rows = [{"step": i, "loss": 1.0, "wall_s": 0.75 * (i + 1)} for i in range(3)]  # seconds since the cell began
    (grid.cell_dir(stopped) / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert main([str(path), "--dry-run"]) == 0
    out = capsys.readouterr().out
    steps = grid.budgets[stopped.key][0]
    assert f"{stopped.key}: {steps} steps x 4 examples per client step, tables ['main'], to run afresh (an earlier " \
           f"run stopped at step 3 of {steps}, 0.75 s a step)\n" in out
    assert f"{fresh.key}: {steps} steps x 4 examples per client step, tables ['main'], to run\n" in out


def test_time_left_counts_the_cells_to_run_at_the_finished_cells_seconds_a_step(tmp_path, capsys):
    """Each cell to run takes the seconds a step of the finished cells like it (method, task, clients,
    layers per block), else of its method, over the steps it has left; the dry run says so, and a
    cell of a method with no finished cell is named as not counted."""
    from deca_ds.reproduce.cli import main
    from deca_ds.reproduce.time_left import finished_rates, time_left

    path = tmp_path / "tiny.yaml"
    path.write_text(yaml.safe_dump(tiny_grid("tiny", runs_dir=str(tmp_path / "runs"), seeds=[0, 1, 2], jobs=2,
                                             sweeps=[{"table": "main"}, {"table": "clients", "methods": ["deca"],
                                                                         "clients": [2, 3]}])))
    grid = load_grid(str(path))
    cell = {(c.method, c.clients, c.seed): c for c in grid.cells}
    assert {grid.budgets[c.key][0] for c in grid.cells} == {8}
    # DECA with 3 clients: 1600 and 2400 s over 8 steps, 250 s a step on average; with 2 clients, 100 s
    finished = [cell["deca", 3, 0], cell["deca", 3, 1], cell["deca", 2, 0]]
    for c, wall_s in zip(finished, (1600.0, 2400.0, 800.0)):
        (started_cell(grid, c) / "final.json").write_text(json.dumps({"wall_s": wall_s}))
    rates = finished_rates(grid, finished)
    assert rates == {("deca", "synthetic", 3, 1): 250.0, ("deca", "synthetic", 2, 1): 100.0, "deca": 200.0}
    # a deepspeed cell (deca-train's train/) resumed from step 4 timed its last attempt only: 1200 s over 4
    # steps; a simulated one (no train/) timed every step
    resumed = started_cell(grid, cell["deca", 3, 2])
    (resumed / "final.json").write_text(json.dumps({"wall_s": 1200.0, "resumed_from": [2, 4]}))
    assert finished_rates(grid, [cell["deca", 3, 2]]) == {("deca", "synthetic", 3, 1): 150.0, "deca": 150.0}
    (resumed / "train").mkdir()
    assert finished_rates(grid, [cell["deca", 3, 2]]) == {("deca", "synthetic", 3, 1): 300.0, "deca": 300.0}
    shutil.rmtree(resumed)
    # to run: DECA, 3 clients, seed 2, from step 2: 6 x 250 s; 2 clients, seed 1, afresh: 8 x 100 s;
    # Dec-LoRA's three cells: no finished cell of the method
    left = {cell["deca", 3, 2]: 2, cell["deca", 2, 1]: 0, **{cell["dec_lora", 3, s]: 0 for s in (0, 1, 2)}}
    assert time_left(grid, left, rates) == (  # 2300 s; two at a time max(2300 / 2, 1500) s
        "about 38 min of cell time left at the finished cells' seconds a step (25 min at 2 at a time); 3 cell(s) "
        "of a method with no finished cell not counted")
    assert time_left(grid, {cell["deca", 3, 2]: 0}, rates) == (  # one cell: 2000 s
        "about 33 min of cell time left at the finished cells' seconds a step")
    assert time_left(grid, left, {}) is None  # nothing finished, nothing to go by

    # the dry run: DECA's cells with 2 clients left to run, seeds 1 and 2, at 100 s a step
    assert main([str(path), "--dry-run", "--only", "method=deca", "clients=2"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[-1] == "about 27 min of cell time left at the finished cells' seconds a step (13 min at 2 at a time)"
