"""The grid's generation cells: a tiny grid on a generation task end to end through deca-reproduce
(training, each consensus model's answers, a fake judge's grades, the generation table against
hand-computed means), judging resumed without a request twice, and the refusals before any run."""

from __future__ import annotations

import csv
import io
import json
import re

import pytest
import yaml

from deca_ds.reproduce import GridError, build_grid, check_finished
from deca_ds.reproduce.cli import main as reproduce
from helpers import assert_only_run_outputs

WORDS = "the cat sat on a mat and dog ran to park by red blue green".split()


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


@pytest.fixture
def files(tmp_path):
    """An instruction/response task, MT-Bench-like questions (a two-turn one and a single) and
    Vicuna-like ones with a reference answer each (ROUGE-L)."""
    rows = [{"instruction": f"{WORDS[i % 15]} {WORDS[(3 * i) % 15]}", "input": "",
             "output": f"{WORDS[(i + 1) % 15]} {WORDS[(i + 2) % 15]}"} for i in range(24)]
    return {
        "train": write_jsonl(tmp_path / "train.jsonl", rows[:20]),
        "test": write_jsonl(tmp_path / "test.jsonl", rows[20:]),
        "mt": write_jsonl(tmp_path / "mt.jsonl", [
            {"question_id": 81, "category": "writing", "turns": ["the cat sat", "and the dog"]},
            {"question_id": 82, "category": "roleplay", "turns": ["a red park"]}]),
        "vic": write_jsonl(tmp_path / "vic.jsonl", [{"question_id": 1, "text": "the dog ran", "reference": "to park"}]),
    }


def generation_grid(files, tmp_path, **generation) -> dict:
    return {
        "name": "tiny_generation",
        "runs_dir": str(tmp_path / "runs"),
        "results_dir": str(tmp_path / "results"),
        "options": {"model": "tiny", "clients": 2, "steps_per_block": 1, "rounds": 1, "layers_per_block": 1,
                    "micro_batch": 2, "max_seq_len": 32, "lr": 1e-3, "iid": True},
        "tasks": {"instruct": {"dataset": "files", "data_files": [f"train={files['train']}", f"test={files['test']}"],
                               "response_column": "output"}},
        "methods": ["deca", "dec_lora"],
        "seeds": [0],
        "cell_timeout_s": 300,
        "generation": {"questions": {"mt": files["mt"], "vic": files["vic"]}, "max_new_tokens": 3, **generation},
    }


def test_generation_cells_answer_then_a_judge_grades_them_once(files, tmp_path, judges, capsys):
    # per cell, in the grid's order (the cells run at once; the judging waits for both): mt question 81
    # turns 1 and 2, question 82, then vic question 1
    judge = judges([f"Rating: [[{r}]]" for r in (8, 6, 4, 9, 5, 3, 2, 1)])
    data = generation_grid(files, tmp_path, judge={"url": judge.url, "model": "judge-1", "key_env": "JUDGE_KEY",
                                                   "allow_http": True})
    data["jobs"] = 2
    grid_file = tmp_path / "grid.yaml"
    grid_file.write_text(yaml.safe_dump(data))
    assert reproduce([str(grid_file)]) == 0, capsys.readouterr()
    assert len(judge.seen) == 8

    for key, (mt, vic) in {"instruct/erdos_renyi-n2-lpb1/deca/seed0": ((8, 6, 4), 9),
                           "instruct/erdos_renyi-n2-lpb1/dec_lora/seed0": ((5, 3, 2), 1)}.items():
        d = tmp_path / "runs" / key
        final = json.loads((d / "final.json").read_text())
        assert final["answered"]["mt"] == {"questions": 2, "turns": 3}
        assert final["answered"]["vic"]["questions"] == 1 and 0 <= final["answered"]["vic"]["rouge_l"] <= 1
        answers = [json.loads(line) for line in (d / "answers" / "mt.jsonl").read_text().splitlines()]
        assert [len(a["answers"]) for a in answers] == [2, 1]
        scores = json.loads((d / "scores.json").read_text())["judge-1"]
        assert scores["mt"]["per_turn"] == {"1": (mt[0] + mt[2]) / 2, "2": mt[1]}
        assert scores["mt"]["mean"] == pytest.approx(sum(mt) / 3) and scores["vic"]["mean"] == vic
        assert len((d / "answers" / "mt.judge-1.judgments.jsonl").read_text().splitlines()) == 3

    rows = {r["method"]: r for r in csv.DictReader(io.StringIO((tmp_path / "results" / "generation.csv").read_text()))}
    assert float(rows["DECA"]["mt-1 mean"]) == 6 and float(rows["DECA"]["mt-2 mean"]) == 6
    assert float(rows["Dec-LoRA"]["mt-1 mean"]) == 3.5
    assert float(rows["Dec-LoRA"]["mt mean"]) == pytest.approx(10 / 3, abs=1e-4)
    assert rows["DECA"]["vic mean"] == "9.0000" and rows["DECA"]["vic mark"] == "best"
    rouge = json.loads((tmp_path / "runs" / "instruct/erdos_renyi-n2-lpb1/deca/seed0/final.json").read_text())
    assert float(rows["DECA"]["vic ROUGE-L mean"]) == pytest.approx(100 * rouge["answered"]["vic"]["rouge_l"], abs=1e-4)
    tables = (tmp_path / "results" / "tables.md").read_text()
    assert "### Generation: the judge's grades (1-10)" in tables and "Accuracy" not in tables
    assert "| Method | mt-1 | mt-2 | mt | vic | vic ROUGE-L |" in tables
    assert "| DECA | **6.00** | **6.00** | **6.00** | **9.00** | " in tables  # each column's best
    assert not (tmp_path / "results" / "main.csv").exists()  # no classification cell
    recorded = json.loads((tmp_path / "results" / "results.json").read_text())
    assert all(c["final"]["judged"]["vic"]["n"] == 1 for c in recorded["cells"])
    assert (tmp_path / "results" / "loss_instruct.png").is_file()

    # again: every cell finished and judged; no request is sent, the table is the same
    before = (tmp_path / "results" / "generation.csv").read_text()
    assert reproduce([str(grid_file)]) == 0
    assert len(judge.seen) == 8 and (tmp_path / "results" / "generation.csv").read_text() == before
    # the tables again from the results.json alone
    assert reproduce([str(grid_file), "--tables-from", str(tmp_path / "results" / "results.json")]) == 0
    assert (tmp_path / "results" / "generation.csv").read_text() == before

    # other questions would make other answers: the finished cells are not overwritten
    (tmp_path / "vic.jsonl").write_text(json.dumps({"question_id": 1, "text": "a blue mat"}) + "\n")
    with pytest.raises(GridError, match="would be overwritten.*the questions answered"):
        check_finished(build_grid(data))


def test_unjudged_answers_wait_for_the_judge(files, tmp_path, judges, capsys, monkeypatch):
    """--no-judge (compute nodes without a network) keeps the answers; the judge's key is checked
    before any cell runs; a later --report-only judges them."""
    judge = judges()
    data = generation_grid(files, tmp_path, judge={"url": judge.url, "model": "judge-1", "key_env": "JUDGE_KEY",
                                                   "allow_http": True})
    data["methods"] = ["deca"]
    grid_file = tmp_path / "grid.yaml"
    grid_file.write_text(yaml.safe_dump(data))
    monkeypatch.delenv("JUDGE_KEY")
    assert reproduce([str(grid_file)]) == 2
    assert "JUDGE_KEY holding the judge's API key is not set" in capsys.readouterr().err
    assert not (tmp_path / "runs").exists()
    assert reproduce([str(grid_file), "--no-judge"]) == 0 and not judge.seen
    d = tmp_path / "runs" / "instruct/erdos_renyi-n2-lpb1/deca/seed0"
    assert (d / "answers" / "mt.jsonl").is_file() and not (d / "scores.json").exists()
    # unjudged, the table has the ROUGE-L of the questions with references only
    rows = list(csv.DictReader(io.StringIO((tmp_path / "results" / "generation.csv").read_text())))
    assert [k for k in rows[0] if k.endswith(" mean")] == ["vic ROUGE-L mean"]
    monkeypatch.setenv("JUDGE_KEY", "sk-later")
    assert reproduce([str(grid_file), "--report-only"]) == 0 and len(judge.seen) == 4
    assert judge.seen[0]["auth"] == "Bearer sk-later"
    assert json.loads((d / "scores.json").read_text())["judge-1"]["mt"]["mean"] == 7


def test_deepspeed_generation_cells_answer_on_rank_0_side_by_side(files, tmp_path, capsys):
    """The deepspeed backend: deca-train --questions answers with x̄ on rank 0 at the end, and the
    cell's files are a simulated cell's (answers/, final.json's counts, the table). The two cells run
    at once (jobs 2), each launch at a rendezvous port of its own: at the launcher's one default
    port the second would fail to bind it."""
    data = generation_grid(files, tmp_path)
    data.update(backend="deepspeed", ds_config="ds_configs/cpu_demo.json", jobs=2)
    grid_file = tmp_path / "grid.yaml"
    grid_file.write_text(yaml.safe_dump(data))
    assert reproduce([str(grid_file)]) == 0
    out = capsys.readouterr().out
    assert "tiny_generation: 2 cells, 0 finished, 2 to run (deepspeed, 2 at a time, on CPU ranks)" in out, out
    built = build_grid(data)
    logs = {cell.method: (built.cell_dir(cell) / "log.txt").read_text() for cell in built.cells}
    assert len({re.search(r"--master_port=(\d+)", log).group(1) for log in logs.values()}) == 2
    answered = {}
    for cell in built.cells:
        d = built.cell_dir(cell)
        assert d == tmp_path / "runs" / f"instruct/ring-n2-lpb1/{cell.method}/seed0"  # the preset's ring
        summary = json.loads((d / "train" / "summary.json").read_text())
        assert_only_run_outputs(d / "train")  # answers/ too
        answered[cell.method] = json.loads((d / "final.json").read_text())["answered"]
        assert answered[cell.method] == summary["consensus_answers"]
        assert answered[cell.method]["mt"] == {"questions": 2, "turns": 3}
        rows = [json.loads(line) for line in (d / "answers" / "vic.jsonl").read_text().splitlines()]
        assert rows[0]["question_id"] == 1 and len(rows[0]["answers"]) == 1
        assert "consensus model: answered 2 questions (3 turns) of mt" in logs[cell.method]
    table = {r["method"]: r for r in csv.DictReader(io.StringIO((tmp_path / "results" / "generation.csv").read_text()))}
    assert sorted(table) == ["DECA", "Dec-LoRA"]
    assert float(table["DECA"]["vic ROUGE-L mean"]) == pytest.approx(100 * answered["deca"]["vic"]["rouge_l"], abs=1e-4)


def test_deca_train_answers_only_after_a_generation_task(files):
    from deca_ds.runtime.options import RunOptions
    from deca_ds.runtime.task import check_questions

    with pytest.raises(ValueError, match="--questions: x̄ answers question sets after a generation task"):
        check_questions(RunOptions(questions=[f"mt={files['mt']}"]))  # the synthetic task: classification
    generation = {"dataset": "files", "data_files": [f"train={files['train']}"], "response_column": "output"}
    with pytest.raises(ValueError, match=r"--questions mt=missing.jsonl: No such file"):
        check_questions(RunOptions(questions=["mt=missing.jsonl"], **generation))
    with pytest.raises(ValueError, match=r"train.jsonl:1: a question needs"):
        check_questions(RunOptions(questions=[f"mt={files['train']}"], **generation))
    for bad in ("mt", "=x.jsonl", "m/t=x.jsonl"):
        with pytest.raises(ValueError, match="--questions takes NAME=FILE"):
            RunOptions(questions=[bad])
    with pytest.raises(ValueError, match="--questions takes NAME=FILE, each NAME once"):
        RunOptions(questions=["a=x.jsonl", "a=y.jsonl"])
    check_questions(RunOptions(questions=[f"mt={files['mt']}"], **generation))


@pytest.mark.parametrize("change, message", [
    ({"generation": None}, r"instruct is a generation task: .*name them in a `generation` section"),
    ({"tasks": {"synthetic": {}}}, r"generation: the grid has no generation task"),
    ({"options": {"model": "tiny", "questions": ["mt={mt}"]}}, r"\['questions'\] are the `generation` section's"),
    ({"generation": {"questions": {"mt": "missing.jsonl"}}}, r"generation.questions: no such file: missing.jsonl"),
    ({"generation": {"questions": {"m t": "{mt}"}}}, r"names \['m t'\] must be letters"),
    ({"generation": {"questions": {"mt": "{train}"}}}, r"generation.questions: .*train.jsonl:1: a question needs"),
    ({"generation": {"questions": {"mt": "{mt}"}, "max_new_tokens": 0}}, r"max_new_tokens must be an integer >= 1"),
    ({"generation": {"questions": {"mt": "{mt}"}, "judge": {"url": "http://judge.example", "model": "m"}}},
     r"generation.judge: judge endpoint 'http://judge.example' is plain http"),
    ({"generation": {"questions": {"mt": "{mt}"}, "judge": {"url": "https://j", "model": "m",
                                                             "references": {"vic": "{vic}"}}}},
     r"references: \['vic'\] are not question sets"),
    ({"generation": {"questions": {"mt": "{mt}"}, "judge": {"url": "https://j"}}}, r"judge.model must be text"),
])
def test_bad_generation_grids_are_refused(files, tmp_path, change, message):
    data = generation_grid(files, tmp_path)
    for key, value in change.items():
        data[key] = json.loads(json.dumps(value).replace("{mt}", files["mt"]).replace("{vic}", files["vic"])
                               .replace("{train}", files["train"]))
    if data["generation"] is None:
        del data["generation"]
    with pytest.raises(GridError, match=message):
        build_grid(data)
    assert not (tmp_path / "runs").exists()
