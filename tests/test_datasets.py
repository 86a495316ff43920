"""Tasks by name and from local files, prompts and features, client partitions (generation
evaluation and the judge: test_evaluation.py).

Offline: every fixture is written here under tmp_path and hub access is switched off.
"""

import csv
import json
import time
from pathlib import Path

import datasets  # noqa: F401 - imported before the offline variables are set: load_task must honour them anyway
import numpy as np
import pandas as pd
import pytest

from deca_ds.data import build_word_tokenizer, encode, label_histogram
from deca_ds.datasets import (
    TASKS,
    Record,
    alpaca_prompt,
    fits_max_length,
    label_skew,
    load_task,
    partition_keys,
    partition_records,
    to_features,
    vocabulary,
    write_partition_report,
)
from deca_ds.evaluation import evaluate_records
from deca_ds.models import tiny_llama

SENTIMENT = ("negative", "neutral", "positive")
WORDS = [f"w{i}" for i in range(20)]


@pytest.fixture(autouse=True)
def offline(monkeypatch, tmp_path):
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf_home"))
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "hf_home" / "datasets"))


def _classification_rows(n=30, seed=0):
    rng = np.random.default_rng(seed)
    return [{"text": " ".join(rng.choice(WORDS, 5)), "label": int(i % 3)} for i in range(n)]


def _write(rows, path, *, string_labels=None):
    df = pd.DataFrame(rows)
    if string_labels is not None:
        df["label"] = [string_labels[k] for k in df["label"]]
    suffix = path.suffix
    if suffix == ".jsonl":
        df.to_json(path, orient="records", lines=True)
    elif suffix == ".csv":
        df.to_csv(path, index=False)
    elif suffix == ".parquet":
        df.to_parquet(path, index=False)
    else:
        path.write_text(df.to_json(orient="records"))
    return str(path)


@pytest.fixture
def alpaca_file(tmp_path):
    verbs = ["Write", "List", "Explain", "write", "Translate", "Give", "List", "Write", "Explain", "Name"]
    rows = [{"instruction": f"{verbs[i % len(verbs)]} something about w{i % 20}",
             "input": "" if i % 2 else f"w{(i + 1) % 20} w{(i + 2) % 20}",
             "output": f"w{i % 20} w{(i + 3) % 20} w{(i + 5) % 20}"} for i in range(60)]
    return _write(rows, tmp_path / "alpaca.jsonl")


def _load(tmp_path, **kwargs):
    return load_task(cache_dir=str(tmp_path / "cache"), **kwargs)


# ---- loading --------------------------------------------------------------------------------


@pytest.mark.parametrize("suffix,strings", [(".jsonl", True), (".json", False), (".csv", False), (".parquet", True)])
def test_each_format_loads(tmp_path, suffix, strings):
    labels = SENTIMENT if strings else None
    train = _write(_classification_rows(30), tmp_path / f"train{suffix}", string_labels=labels)
    test = _write(_classification_rows(9, seed=1), tmp_path / f"test{suffix}", string_labels=labels)
    task = _load(tmp_path, data_files={"train": train, "test": test}, label_names=SENTIMENT)
    assert len(task.train) == 30 and len(task.test) == 9
    rows = _classification_rows(30)
    for record, row in zip(task.train, rows):
        assert record.label == row["label"]
        assert record.answer == " " + SENTIMENT[row["label"]]
        assert record.prompt.endswith(f"\n\nText: {row['text']}\n\nAnswer:")
        assert record.prompt.startswith("Classify the text. Answer with one of: negative, neutral, positive.")
    assert task.spec.kind == "classification" and task.spec.label_names == SENTIMENT


def test_string_labels_without_names_are_inferred(tmp_path):
    train = _write(_classification_rows(12), tmp_path / "t.jsonl", string_labels=SENTIMENT)
    task = _load(tmp_path, data_files={"train": train})
    assert task.spec.label_names == SENTIMENT  # sorted distinct values
    assert len(task.test) == 1 and len(task.train) == 11  # no test file: a tenth held out


def test_named_task_reads_a_local_copy_with_column_mapping(tmp_path):
    rows = [{"body": f"w{i} w{i + 1}", "topic": i % 4} for i in range(16)]
    train = _write(rows, tmp_path / "agnews.csv")
    task = _load(tmp_path, name="agnews", data_files={"train": train, "test": train},
                 text_column="body", label_column="topic")
    assert task.spec.name == "agnews" and task.spec.hub_id == "fancyzhx/ag_news"
    assert [r.answer for r in task.train[:4]] == [" World", " Sports", " Business", " Sci/Tech"]
    assert task.train[0].prompt == TASKS["agnews"].instruction + "\n\nText: w0 w1\n\nAnswer:"


def test_pair_task_with_column_mapping(tmp_path):
    rows = [{"s1": f"w{i}", "s2": f"w{i + 2}", "gold": ["entailment", "neutral", "contradiction"][i % 3]}
            for i in range(9)]
    path = _write(rows, tmp_path / "mnli.parquet")
    task = _load(tmp_path, name="mnli", data_files={"train": path, "test": path},
                 text_column="s1", text_pair_column="s2", label_column="gold")
    record = task.train[4]
    assert record.label == 1 and record.answer == " neutral"
    assert record.prompt.endswith("\n\nPremise: w4\nHypothesis: w6\n\nAnswer:")
    # files without a name: a pair task from two text columns and given label names
    task = _load(tmp_path, data_files={"train": path}, text_column="s1", text_pair_column="s2",
                 label_column="gold", label_names=["entailment", "neutral", "contradiction"])
    assert "Premise: w0\nHypothesis: w2" in task.train[0].prompt


def test_generation_records(tmp_path, alpaca_file):
    task = _load(tmp_path, name="alpaca", data_files={"train": alpaca_file}, holdout=4)
    assert task.spec.kind == "generation" and len(task.test) == 4 and len(task.train) == 56
    records = {r.instruction: r for r in task.train + task.test}
    with_input, without = records["Write something about w0"], records["List something about w1"]
    assert with_input.prompt == alpaca_prompt("Write something about w0", "w1 w2")
    assert "### Input:\nw1 w2\n\n### Response:\n" in with_input.prompt
    assert "### Input" not in without.prompt and without.prompt.endswith("### Instruction:\nList something about w1"
                                                                          "\n\n### Response:\n")
    assert with_input.answer == "w0 w3 w5" and with_input.label is None
    # the same file as a custom generation task, with the response column named
    custom = _load(tmp_path, data_files={"train": alpaca_file, "test": alpaca_file}, response_column="output")
    assert custom.spec.kind == "generation" and len(custom.train) == 60
    # holdout is deterministic for the seed
    again = _load(tmp_path, name="alpaca", data_files={"train": alpaca_file}, holdout=4)
    assert again.test == task.test


def test_bad_inputs_raise_clear_errors(tmp_path):
    good = _write(_classification_rows(6), tmp_path / "good.jsonl", string_labels=SENTIMENT)
    with pytest.raises(ValueError, match=r"unknown task 'imdb'; known tasks: agnews, alpaca, mnli, nwgi, tfns"):
        load_task("imdb")
    with pytest.raises(ValueError, match="needs a task name"):
        load_task()
    bad_suffix = tmp_path / "data.txt"
    bad_suffix.write_text("x")
    with pytest.raises(ValueError, match=r"unknown suffix '\.txt'.*supported: \.jsonl, \.json, \.csv, \.parquet"):
        _load(tmp_path, data_files={"train": str(bad_suffix)})
    missing = str(tmp_path / "nope.csv")
    with pytest.raises(ValueError, match=f"split 'test' not found: {missing}"):
        _load(tmp_path, data_files={"train": good, "test": missing})
    with pytest.raises(ValueError, match=r"column 'sentence' not found in .*good\.jsonl \(split 'train'\); "
                                         r"available columns: text, label"):
        _load(tmp_path, data_files={"train": good}, text_column="sentence", label_names=SENTIMENT)
    rows = _classification_rows(6)
    rows[4]["label"] = 7
    ints = _write(rows, tmp_path / "ints.csv")
    with pytest.raises(ValueError, match=r"label 7 in row 4 of .*ints\.csv \(split 'train'\).*not in the label set"):
        _load(tmp_path, data_files={"train": ints}, label_names=SENTIMENT)
    strings = _write(_classification_rows(6), tmp_path / "strings.jsonl", string_labels=["negative", "bogus", "x"])
    with pytest.raises(ValueError, match=r"label 'bogus' in row 1 of .*strings\.jsonl"):
        _load(tmp_path, data_files={"train": strings}, label_names=SENTIMENT)
    with pytest.raises(ValueError, match="holds integers; pass label_names"):
        _load(tmp_path, data_files={"train": ints})
    # a missing label (an empty CSV cell: None; null in JSON) or a blank one, with label names given or
    # inferred (it would otherwise name a class "" of its own, or read as a file of integer labels)
    for suffix, missing in ((".csv", ""), (".jsonl", None), (".jsonl", " ")):
        rows = [{**r, "label": SENTIMENT[r["label"]]} for r in _classification_rows(6)]
        rows[3]["label"] = missing
        unlabelled = _write(rows, tmp_path / f"unlabelled{suffix}")
        for names in (SENTIMENT, None):
            with pytest.raises(ValueError, match=rf"row 3 of .*unlabelled\{suffix} \(split 'train'\) has no label "
                                                 r"\(column 'label' is "):
                _load(tmp_path, data_files={"train": unlabelled}, label_names=names)
    with pytest.raises(ValueError, match="'train'"):
        _load(tmp_path, data_files={"test": good})
    # names as a file's labels are matched: without their surrounding spaces (a blank name was an eos-only answer)
    for names in (["positive", "positive"], ["positive", " "], ["positive", "positive "], []):
        with pytest.raises(ValueError, match=r"label_names must be distinct names, none blank"):
            _load(tmp_path, data_files={"train": good}, label_names=names)
    # a line cut short: the parse error that names its row, not only datasets' "an error occurred"
    lines = Path(good).read_text().splitlines()
    (tmp_path / "cut.jsonl").write_text("\n".join([*lines[:3], lines[3][:-3], *lines[4:]]) + "\n")
    with pytest.raises(ValueError, match=r"could not load .*cut\.jsonl \(split 'train'\): DatasetGenerationError: "
                                         r".* \(ArrowInvalid: JSON parse error: .* in row 3\)$"):
        _load(tmp_path, data_files={"train": str(tmp_path / "cut.jsonl")}, label_names=SENTIMENT)


def test_named_task_offline_without_cache_fails_fast(tmp_path):
    start = time.monotonic()
    with pytest.raises(ValueError, match=r"could not load fancyzhx/ag_news split 'train' \(offline mode is on and "
                                         r"it is not in the local cache"):
        _load(tmp_path, name="agnews")
    assert time.monotonic() - start < 10


# ---- features -------------------------------------------------------------------------------


@pytest.fixture
def sentiment_task(tmp_path):
    path = _write(_classification_rows(30), tmp_path / "s.jsonl", string_labels=SENTIMENT)
    return _load(tmp_path, data_files={"train": path, "test": path})


@pytest.fixture
def word_tokenizer(sentiment_task):
    return build_word_tokenizer(vocabulary(sentiment_task.train, SENTIMENT) + ["<|user|>", "<|assistant|>"])


def test_answer_last_and_prompt_masked(sentiment_task, word_tokenizer):
    tok = word_tokenizer
    features = to_features(tok, sentiment_task.train, max_length=64)
    for record, f in zip(sentiment_task.train, features):
        answer = tok(record.answer, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
        prompt = tok(record.prompt, add_special_tokens=False)["input_ids"]
        assert f["input_ids"] == prompt + answer
        assert f["labels"] == [-100] * len(prompt) + answer
        assert tok.convert_ids_to_tokens(f["input_ids"][-2]) == SENTIMENT[record.label]
        assert tok.unk_token_id not in f["input_ids"]


def test_truncation_keeps_the_answer(word_tokenizer):
    tok = word_tokenizer
    record = Record("Classify the text.\n\nText: " + " ".join(WORDS * 3) + "\n\nAnswer:", " positive", 2)
    (f,) = to_features(tok, [record], max_length=10)
    assert len(f["input_ids"]) == 10
    assert f["input_ids"][-2:] == [tok.convert_tokens_to_ids("positive"), tok.eos_token_id]
    assert f["input_ids"][-3] == tok.convert_tokens_to_ids("Answer:")  # the prompt lost its start, not its end
    assert f["labels"] == [-100] * 8 + f["input_ids"][-2:]
    long_answer = Record("Text: w1", " " + " ".join(WORDS), None)
    assert fits_max_length(tok, [record, long_answer], max_length=10) == [True, False]
    with pytest.raises(ValueError, match="record 1: max_length=10 cannot hold the answer"):
        to_features(tok, [record, long_answer], max_length=10)


def test_chat_template(sentiment_task, word_tokenizer):
    tok = word_tokenizer
    record = sentiment_task.train[0]
    with pytest.raises(ValueError, match="has no chat template"):
        to_features(tok, [record], max_length=64, use_chat_template=True)
    tok.chat_template = ("{% for m in messages %}<|{{ m.role }}|> {{ m.content }}\n{% endfor %}"
                         "{% if add_generation_prompt %}<|assistant|>{% endif %}")
    (f,) = to_features(tok, [record], max_length=64, use_chat_template=True)
    rendered = f"<|user|> {record.prompt}\n<|assistant|>"
    assert f == encode(tok, rendered, record.answer[1:], 64)
    assert tok.convert_ids_to_tokens(f["input_ids"][:1]) == ["<|user|>"]
    assert tok.convert_ids_to_tokens(f["input_ids"][-3:]) == ["<|assistant|>", SENTIMENT[record.label], "<eos>"]


def test_evaluate_records_on_tiny_model(sentiment_task, word_tokenizer):
    model = tiny_llama(len(word_tokenizer), seed=0)
    result = evaluate_records(model, word_tokenizer, sentiment_task.test, SENTIMENT, max_length=64, limit=10)
    assert result["n"] == 10 and 0 <= result["accuracy"] <= 1 and result["chance"] == pytest.approx(1 / 3)


# ---- partitions -----------------------------------------------------------------------------


def _labelled(n=2000, k=4):
    return [Record(f"p{i}", " x", i % k) for i in range(n)]


def _check_split(partition, n):
    flat = [i for part in partition for i in part]
    assert sorted(flat) == list(range(n)) and len(set(flat)) == n


def test_partition_records_iid_dirichlet_category(tmp_path, alpaca_file):
    records = _labelled(400)
    for iid in (True, False):
        parts = partition_records(records, 5, alpha=0.5, seed=1, min_size=2, iid=iid)
        _check_split(parts, 400)
        assert len(parts) == 5 and min(map(len, parts)) >= 2
    assert partition_records(records, 5, alpha=0.5, seed=1) == partition_records(records, 5, alpha=0.5, seed=1)
    sizes = [len(p) for p in partition_records(records, 5, alpha=0.5, seed=1, iid=True)]
    assert max(sizes) - min(sizes) <= 1

    generation = _load(tmp_path, name="alpaca", data_files={"train": alpaca_file}, holdout=0).train
    _check_split(partition_records(generation, 3, alpha=0.5, seed=0), len(generation))  # no labels: IID
    keys, names = partition_keys(generation, "category", top_k=3)
    assert names == ("write", "explain", "list", "other")  # 18 write, 12 explain, 12 list; ties alphabetical
    assert keys[:4] == [0, 2, 1, 0] and keys[4] == 3  # Write, List, Explain, write, Translate -> other
    parts = partition_records(generation, 3, alpha=0.5, seed=0, key="category", top_k=3)
    _check_split(parts, len(generation))
    with pytest.raises(ValueError, match="key must be"):
        partition_records(records, 2, key="topic")
    # a classification task's records have no instruction: one category for all, and a split not skewed at all
    with pytest.raises(ValueError, match=r"partition key 'category' skews the split by each instruction's first "
                                         r"word, and no record has an instruction"):
        partition_records(records, 2, key="category")


def test_label_skew_falls_with_alpha():
    records = _labelled(2000)
    labels = [r.label for r in records]
    skew = {alpha: np.mean([label_skew(labels, partition_records(records, 8, alpha=alpha, seed=s), 4)
                            for s in range(3)]) for alpha in (0.25, 100)}
    assert skew[0.25] > 0.3
    assert skew[100] < 0.1


def test_partition_report(tmp_path):
    records = _labelled(200)
    labels = [r.label for r in records]
    names = ["World", "Sports", "Business", "Sci/Tech"]
    parts = partition_records(records, 4, alpha=0.25, seed=3)
    hist = label_histogram(labels, parts, 4)
    paths = write_partition_report(tmp_path / "a", hist, names, parts)
    again = write_partition_report(tmp_path / "b", hist.tolist(), names,
                                   partition_records(records, 4, alpha=0.25, seed=3))
    for key, path in paths.items():
        assert path.exists() and path.stat().st_size > 0
        assert path.read_bytes() == again[key].read_bytes(), key
    report = json.loads(paths["json"].read_text())
    assert report["partition"] == parts and report["label_names"] == names and report["n_clients"] == 4
    assert report["mean_tv_distance"] == round(label_skew(labels, parts, 4), 6)
    with open(paths["csv"]) as f:
        table = list(csv.reader(f))
    assert table[0] == ["client", *names, "total"] and len(table) == 5
    assert [int(row[-1]) for row in table[1:]] == [len(p) for p in parts]
    assert sum(int(v) for row in table[1:] for v in row[1:-1]) == 200
    assert paths["md"].read_text().startswith("| client | World | Sports | Business | Sci/Tech | total |")
    assert paths["png"].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    other_parts = partition_records(records, 4, alpha=0.25, seed=4)
    other = write_partition_report(tmp_path / "c", label_histogram(labels, other_parts, 4), names, other_parts)
    assert other["json"].read_bytes() != paths["json"].read_bytes()
    # per-client data files: the counts alone, no indices (no process holds every client's data)
    counts = write_partition_report(tmp_path / "d", hist, names)
    assert json.loads(counts["json"].read_text()) == {k: v for k, v in report.items() if k != "partition"}
    assert counts["csv"].read_bytes() == paths["csv"].read_bytes()
