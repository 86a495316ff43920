"""Each client's own data file (`--data-files train=…{client}…`): the options' rules, one process
reading every client's file (the simulator), and the counts the sites share. The distributed run
across two sites that see only their own files is tests/test_transport.py's two-node test."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from deca_ds.datasets import load_task, to_features
from deca_ds.models import load_model, load_tokenizer
from deca_ds.runtime.options import RunOptions, client_path, per_client
from deca_ds.runtime.parsing import parse_args
from deca_ds.runtime.split import main as split_main
from deca_ds.runtime.split import write_split
from deca_ds.runtime.task import build_task, client_counts, load_records, merge_counts
from helpers import SITE_LABELS, client_rows, write_jsonl, write_site

SIZES = {0: 6, 1: 9, 2: 7}


@pytest.fixture(autouse=True)
def offline(monkeypatch, tmp_path):
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf_home"))


@pytest.fixture
def site(tmp_path):
    return write_site(tmp_path / "site", list(SIZES), SIZES)


def options(site, **kw) -> RunOptions:
    return RunOptions(**{"model": str(site / "model"), "dataset": "files", "micro_batch": 2, "max_seq_len": 48,
                         "data_files": [f"train={site}/data/client_{{client}}.jsonl", f"test={site}/data/test.jsonl"],
                         **kw})


def test_a_client_field_names_each_clients_file():
    assert per_client("data/client_{client}.jsonl") and per_client("data/c{client:03d}.csv")
    assert not per_client("data/train.jsonl") and not per_client("data/{{literal}}.jsonl")
    assert client_path("data/c{client:03d}.csv", 7) == "data/c007.csv"
    assert client_path("data/{{literal}}.jsonl", 3) == "data/{literal}.jsonl"
    for path, why in (("data/{site}.jsonl", "holds {site}"), ("data/{}.jsonl", "holds {}"),
                      ("data/{client", "expected '}'"), ("data/{client:q}.jsonl", "Unknown format code 'q'")):
        with pytest.raises(ValueError, match="the only field a path may hold is {client}") as e:
            per_client(path)
        assert why in str(e.value)


def test_what_each_site_cannot_derive_is_refused_as_options(site):
    good = options(site)
    assert good.client_data and not RunOptions(dataset="files", data_files=["train=a.jsonl"]).client_data
    train = f"train={site}/data/client_{{client}}.jsonl"
    with pytest.raises(ValueError, match="needs test=PATH, a test file every site has"):
        RunOptions(model="m", dataset="files", data_files=[train])
    with pytest.raises(ValueError, match=r"test=… is the test set every client is evaluated on: \{client\} belongs"):
        RunOptions(model="m", dataset="files", data_files=[train, "test=t_{client}.jsonl"])
    for kw, why in ((dict(model="tiny"), "a tokenizer every site shares"),
                    (dict(from_config=True), "a tokenizer every site shares"),
                    (dict(iid=True), "no --iid: the files are the split"),
                    (dict(partition_key="category"), "--partition-key label")):
        with pytest.raises(ValueError, match="each client reads only its own file") as e:
            options(site, **kw)
        assert why in str(e.value)


def test_one_process_reads_every_clients_file_unsplit(site):
    """The simulator's view: each client's examples are its file's, in order, encoded with the
    model's tokenizer; sizes and label counts are the files'; the labels are named from the test
    file, although client 0's file holds two of the four."""
    opts = options(site)
    task = build_task(opts, 3)
    tokenizer = load_tokenizer(str(site / "model"))
    assert task.key_names == SITE_LABELS and task.held is None
    assert task.client_sizes == [SIZES[c] for c in range(3)]
    for c in range(3):
        own = load_task(data_files={"train": f"{site}/data/client_{c}.jsonl"}, label_names=SITE_LABELS)
        assert [task.features[i] for i in task.client_indices[c]] == to_features(tokenizer, own.train, max_length=48)
        counts = np.bincount([SITE_LABELS.index(r["label"]) for r in client_rows(c, SIZES[c])], minlength=4)
        assert task.key_histogram[c] == counts.tolist()
    assert task.answer_tokens == 2  # the label word and eos
    assert len(task.stream(opts, 1).indices) == SIZES[1]
    assert set(task.evaluate(_model(site), 8)) >= {"accuracy", "macro_f1"}


def _model(site):
    return load_model(str(site / "model"), dtype=torch.float32)


def test_a_process_holding_one_client_reads_only_its_file(site):
    """A site's rank: client 1's file alone (client 0's may be absent there); the other rows wait
    for share_counts. Its batches are those the simulator's one process draws for client 1."""
    everything = build_task(options(site), 3)
    (site / "data" / "client_0.jsonl").unlink()
    task = build_task(options(site), 3, held=(1,))
    assert task.held == (1,) and len(task.features) == SIZES[1]
    assert task.client_indices == [[], list(range(SIZES[1])), []]
    assert task.client_sizes == [0, SIZES[1], 0]
    mine, simulated = task.stream(options(site), 1), everything.stream(options(site), 1)
    for _ in range(2 * SIZES[1]):  # two epochs and more
        a, b = next(mine), next(simulated)
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    with pytest.raises(ValueError, match="data file for split 'train' not found: .*/client_0.jsonl"):
        build_task(options(site), 3, held=(0,))


def test_a_client_file_smaller_than_a_micro_batch_is_refused(site):
    with pytest.raises(ValueError, match=r"client 0's training file .*client_0.jsonl .* holds 6 examples, fewer "
                                         r"than --micro-batch 8"):
        build_task(options(site, micro_batch=8), 3, held=(0,))


def test_the_sites_counts_merge_and_a_disagreement_is_refused(site):
    opts = options(site)
    tasks = [build_task(opts, 3, held=(c,)) for c in range(3)]
    everyone = [client_counts(t) for t in tasks]
    merged = merge_counts(tasks[2], everyone)
    assert merged.key_histogram == build_task(opts, 3).key_histogram
    assert merged.client_sizes == [SIZES[c] for c in range(3)] and merged.features == tasks[2].features
    everyone[1] = {**everyone[1], "keys": ["a", "b"]}
    with pytest.raises(ValueError, match=r"client\(s\) \[1\] name other labels than client 0 "
                                         r"\(\['Business', 'Sports', 'Tech', 'World'\] against \['a', 'b'\]\): "
                                         "every site needs the same test file"):
        merge_counts(tasks[0], everyone)


# ---- deca-split: the run's split as per-client files --------------------------------------------

def test_deca_split_writes_the_runs_split_and_a_run_on_the_files_draws_the_same_batches(tmp_path, site, capsys):
    whole = write_jsonl(tmp_path / "whole" / "train.jsonl", [r for c in range(4) for r in client_rows(c, 12)])
    test = f"{site}/data/test.jsonl"
    run = ["--model", str(site / "model"), "--dataset", "files", "--clients", "3", "--micro-batch", "2",
           "--max-seq-len", "48", "--seed", "3", "--dirichlet-alpha", "0.5"]
    out = tmp_path / "sites"
    split_main([*run, "--data-files", f"train={whole}", f"test={test}", "--out", str(out), "--print-config"])
    assert "clients: 3\n" in capsys.readouterr().out and not out.exists()  # the run it would split for, only
    split_main([*run, "--data-files", f"train={whole}", f"test={test}", "--out", str(out)])
    assert f"--data-files train={out}/client_{{client}}.jsonl test={test}" in capsys.readouterr().out
    split = build_task(parse_args([*run, "--data-files", f"train={whole}", f"test={test}"])[0], 3)
    files_opts = parse_args([*run, "--data-files", f"train={out}/client_{{client}}.jsonl", f"test={test}"])[0]
    files = build_task(files_opts, 3)
    assert files.key_histogram == split.key_histogram and files.client_sizes == split.client_sizes
    for c in range(3):
        a, b = split.stream(files_opts, c), files.stream(files_opts, c)
        for _ in range(2 * len(files.client_indices[c])):
            x, y = next(a), next(b)
            assert all(torch.equal(x[k], y[k]) for k in x), f"client {c}"
    report = json.loads((out / "partition" / "partition.json").read_text())
    assert report["partition"] == split.client_indices  # indices into the source's training rows
    record = json.loads((out / "split.json").read_text())
    assert record["options"]["clients"] == 3 and record["options"]["dirichlet_alpha"] == 0.5
    assert record["sizes"] == split.client_sizes and record["command"].startswith("deca-split --model")

    before = {p: p.read_bytes() for p in out.glob("*.jsonl")}
    with pytest.raises(SystemExit):
        split_main([*run, "--data-files", f"train={whole}", f"test={test}", "--out", str(out)])
    assert "deca-split writes only new files, and these exist: " in capsys.readouterr().err
    assert {p: p.read_bytes() for p in out.glob("*.jsonl")} == before


def test_deca_split_without_a_test_file_writes_the_held_out_rows(tmp_path, site):
    whole = write_jsonl(tmp_path / "train.jsonl", [r for c in range(4) for r in client_rows(c, 30)])
    opts = parse_args(["--model", str(site / "model"), "--dataset", "files", "--data-files", f"train={whole}",
                       "--clients", "2", "--micro-batch", "2", "--label-names", *SITE_LABELS])[0]
    write_split(opts, tmp_path / "sites")
    held_out = load_task(data_files={"train": str(tmp_path / "sites" / "test.jsonl")}, holdout=0,
                         label_names=SITE_LABELS)
    assert held_out.train == load_records(opts).test and len(held_out.train) == 12
    for why, kw in (("the synthetic task is generated by every run", dict(dataset="synthetic", data_files=None,
                                                                           label_names=None)),
                    ("deca-split needs --clients N", dict(clients=None)),
                    ("is split already", dict(data_files=[f"train={tmp_path}/client_{{client}}.jsonl",
                                                          f"test={whole}"]))):
        with pytest.raises(ValueError, match=why):
            write_split(RunOptions(**{**vars(opts), **kw}), tmp_path / "other")
        assert not (tmp_path / "other").exists()


def test_deca_eval_scores_the_test_file_of_a_per_client_run(site, tmp_path):
    """deca-eval takes the run's data options as they are (no split, so no --iid to give) and
    scores the test file as the run does."""
    from deca_ds.runtime import evaluate

    args = ["--model", str(site / "model"), "--dataset", "files", "--max-seq-len", "48", "--eval-limit", "8",
            "--data-files", f"train={site}/data/client_{{client}}.jsonl", f"test={site}/data/test.jsonl"]
    result = evaluate.evaluate(evaluate.build_parser().parse_args([*args, "--out", str(tmp_path / "e.json")]))
    assert result["classification"] == build_task(options(site), 3).evaluate(_model(site), 8)
    assert result["classification"]["n"] == 8
