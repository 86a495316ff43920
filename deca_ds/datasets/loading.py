"""Reading a task's rows, from the Hugging Face hub (or the local `datasets` cache) or from local
JSONL / JSON / CSV / Parquet files, into train and test `Record`s."""

from __future__ import annotations

import codecs
import contextlib
import inspect
import math
import os
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Literal

import numpy as np

from .tasks import (
    TASKS,
    LoadedTask,
    Record,
    TaskSpec,
    alpaca_prompt,
    classification_prompt,
    instruction_for,
    resolve_spec,
    verbalize,
)

_LOADERS = {".jsonl": "json", ".json": "json", ".csv": "csv", ".parquet": "parquet"}
_SPLITS = ("train", "test")
_TRUE = {"1", "true", "yes", "on"}


@contextlib.contextmanager
def _offline_from_env() -> Iterator[None]:
    """`datasets` reads HF_DATASETS_OFFLINE / HF_HUB_OFFLINE once, at import; honour them as
    they are now, so a process that sets them later never waits on the network."""
    import datasets

    offline = any(os.environ.get(v, "").strip().lower() in _TRUE for v in ("HF_DATASETS_OFFLINE", "HF_HUB_OFFLINE"))
    before = datasets.config.HF_HUB_OFFLINE
    if offline:
        datasets.config.HF_HUB_OFFLINE = True
    try:
        yield
    finally:
        datasets.config.HF_HUB_OFFLINE = before


def _load_dataset(path: str, *, what: str, trust_remote_code: bool, **kwargs):
    import datasets

    if trust_remote_code and "trust_remote_code" in inspect.signature(datasets.load_dataset).parameters:
        kwargs["trust_remote_code"] = True  # datasets >= 4 runs no dataset scripts and has no such option
    try:
        with _offline_from_env():
            return datasets.load_dataset(path, **kwargs)
    except Exception as e:  # ConnectionError, FileNotFoundError, DatasetNotFoundError, pyarrow errors, ...
        offline = "offline mode is on and " if datasets.config.HF_HUB_OFFLINE or any(
            os.environ.get(v, "").strip().lower() in _TRUE for v in ("HF_DATASETS_OFFLINE", "HF_HUB_OFFLINE")) else ""
        hint = (f" ({offline}it is not in the local cache: download it once with network access, or pass "
                "data_files with local JSONL/CSV/Parquet files)") if path not in _LOADERS.values() else ""
        raise ValueError(f"could not load {what}{hint}: {type(e).__name__}: {e}{_root_cause(e)}") from e


def _root_cause(error: BaseException) -> str:
    """' (Type: message)' of the error `error` was raised from, the innermost: datasets raises a
    DatasetGenerationError that says only that one happened from a file's parse error, which names
    its row. (Not the errors met while handling it: its JSON reader's fallback to pandas has one.)"""
    cause = error
    while cause.__cause__ is not None and cause.__cause__ is not error:
        cause = cause.__cause__
    return "" if cause is error else f" ({type(cause).__name__}: {cause})"


def _check_file(split: str, path: str) -> str:
    p = Path(path).expanduser()
    suffix = p.suffix.lower()
    if suffix not in _LOADERS:
        raise ValueError(f"data file for split {split!r} has an unknown suffix {suffix or '(none)'!r}: {path}; "
                         f"supported: {', '.join(_LOADERS)}")
    if not p.is_file():
        raise ValueError(f"data file for split {split!r} not found: {path}")
    if p.stat().st_size == 0:
        raise ValueError(f"data file for split {split!r} is empty: {path}")
    if suffix != ".parquet":
        _check_utf8(split, p)
    return str(p)


def _check_utf8(split: str, p: Path, chunk: int = 1 << 20) -> None:
    """Text data files are read as UTF-8; say so (and where) instead of the loader's generic failure."""
    decoder = codecs.getincrementaldecoder("utf-8")()
    offset = 0
    with open(p, "rb") as f:
        while True:
            data = f.read(chunk)
            try:
                decoder.decode(data, final=not data)
            except UnicodeDecodeError as e:
                raise ValueError(f"data file for split {split!r} is not UTF-8 text (encoding error at byte "
                                 f"{offset + e.start}): {p}; re-save it with UTF-8 encoding (from Latin-1, say: "
                                 f"iconv -f latin1 -t utf-8)") from None
            if not data:
                return
            offset += len(data)


def load_task(
    name: str | None = None,
    *,
    data_files: Mapping[str, str] | None = None,
    text_column: str | None = None,
    text_pair_column: str | None = None,
    label_column: str | None = None,
    label_names: Sequence[str] | None = None,
    response_column: str | None = None,
    trust_remote_code: bool = False,
    cache_dir: str | None = None,
    holdout: int = 500,
    seed: int = 0,
    labels_from: Literal["train", "test"] = "train",
) -> LoadedTask:
    """A task's train and test records, by registered name (from the hub or its cache) and/or
    from local files `data_files={"train": path, "test": path}` (loader from the suffix:
    .jsonl/.json, .csv, .parquet). With both, the files are read with the named task's columns,
    labels and instruction (a local copy of that dataset).

    Labels may be ints (indices into label_names) or strings (exactly one of label_names). Without
    label_names a ClassLabel column gives its names, and string labels their sorted distinct
    values in the `labels_from` split (the test split when each client reads only its own
    training file, so that every client names the same labels). Where there is no test split
    (Alpaca, or files without "test"), `holdout` rows (at most a tenth) of the training split,
    picked with `seed`, become the test set.
    """
    if name is None and not data_files:
        raise ValueError(f"load_task needs a task name ({', '.join(sorted(TASKS))}) or data_files "
                         "({'train': path, 'test': path})")
    spec = resolve_spec(name, text_column=text_column, text_pair_column=text_pair_column,
                        label_column=label_column, label_names=label_names, response_column=response_column)
    explicit_pair = text_pair_column is not None
    raw: dict[str, tuple[object, str]] = {}
    if data_files:
        unknown = set(data_files) - set(_SPLITS)
        if unknown or "train" not in data_files:
            raise ValueError("data_files must map 'train' (and optionally 'test') to a file, "
                             f"got keys {sorted(data_files)}")
        for split, path in data_files.items():
            path = _check_file(split, path)
            loader = _LOADERS[Path(path).suffix.lower()]
            ds = _load_dataset(loader, what=f"{path} (split {split!r})", trust_remote_code=False,
                               data_files={split: path}, split=split, cache_dir=cache_dir)
            raw[split] = (ds, f"{path} (split {split!r})")
    else:
        for split, hub_split in (("train", spec.train_split), ("test", spec.test_split)):
            if hub_split is None:
                continue
            where = f"{spec.hub_id}{f' ({spec.config_name})' if spec.config_name else ''} split {hub_split!r}"
            ds = _load_dataset(spec.hub_id, what=where, trust_remote_code=trust_remote_code,
                               name=spec.config_name, split=hub_split, cache_dir=cache_dir)
            raw[split] = (ds, where)

    if spec.kind == "classification" and spec.label_names is None:
        if labels_from not in raw:
            raise ValueError(f"the labels are named from the {labels_from} split, which is missing; "
                             "pass label_names")
        spec = replace(spec, label_names=_infer_label_names(spec, *raw[labels_from]))
        if not spec.instruction:
            spec = replace(spec, instruction=instruction_for(spec.text_columns, spec.label_names))
    records = {split: _records(spec, ds, where, explicit_pair) for split, (ds, where) in raw.items()}
    rows = {split: ds for split, (ds, _) in raw.items()}
    if "test" not in records:
        n_test = min(holdout, len(records["train"]) // 10)
        order = np.random.default_rng(seed).permutation(len(records["train"]))
        held = sorted(order[:n_test].tolist())
        kept = sorted(set(range(len(records["train"]))) - set(held))
        for split, picked in (("test", held), ("train", kept)):  # test first: it is picked from the whole split
            records[split] = [records["train"][i] for i in picked]
            rows[split] = rows["train"].select(picked)
    if not records["train"]:
        raise ValueError(f"task {spec.name!r}: the training split is empty ({raw['train'][1]})")
    return LoadedTask(spec, records["train"], records["test"], {split: where for split, (_, where) in raw.items()},
                      rows)


def _column(ds, column: str, where: str, optional: bool = False) -> list | None:
    if column not in ds.column_names:
        if optional:
            return None
        raise ValueError(f"column {column!r} not found in {where}; available columns: {', '.join(ds.column_names)}")
    return list(ds[column])


def _text(value) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return ""
    return str(value)


def _infer_label_names(spec: TaskSpec, ds, where: str) -> tuple[str, ...]:
    feature = getattr(ds, "features", {}).get(spec.label_column)
    if feature is not None and getattr(feature, "names", None):
        return tuple(feature.names)  # a ClassLabel
    values = _column(ds, spec.label_column, where)
    for row, value in enumerate(values):
        _check_present(value, row, where, spec.label_column)
    if values and all(isinstance(v, str) for v in values):
        return tuple(sorted({v.strip() for v in values}))
    raise ValueError(f"label column {spec.label_column!r} of {where} holds integers; pass label_names to name them")


def _check_present(label, row: int, where: str, column: str) -> None:
    """A missing label (an empty CSV cell, null, NaN) or a blank one is refused, naming its row:
    as a label name it would be a class of its own, or pass for a file of integer labels."""
    if label is None or (isinstance(label, float) and math.isnan(label)) or (isinstance(label, str)
                                                                             and not label.strip()):
        raise ValueError(f"row {row} of {where} has no label (column {column!r} is {label!r}): give every row one")


def _label_index(value, names: Sequence[str], row: int, where: str, column: str) -> int:
    _check_present(value, row, where, column)
    if isinstance(value, str):
        if value.strip() in names:
            return names.index(value.strip())
    elif isinstance(value, (int, np.integer)) and not isinstance(value, bool):
        if 0 <= int(value) < len(names):
            return int(value)
    elif isinstance(value, (float, np.floating)) and float(value).is_integer() and 0 <= value < len(names):
        return int(value)  # an int column that pandas widened to float
    raise ValueError(f"label {value!r} in row {row} of {where} (column {column!r}) is not in the label set: "
                     f"ints 0..{len(names) - 1} or one of {list(names)}")


def _records(spec: TaskSpec, ds, where: str, explicit_pair: bool) -> list[Record]:
    if spec.kind == "generation":
        instructions = _column(ds, spec.text_columns[0], where)
        inputs = (_column(ds, spec.text_columns[1], where, optional=not explicit_pair)
                  if len(spec.text_columns) > 1 else None)
        outputs = _column(ds, spec.response_column, where)
        inputs = inputs if inputs is not None else [""] * len(instructions)
        return [Record(alpaca_prompt(_text(i), _text(x)), _text(o), None, _text(i))
                for i, x, o in zip(instructions, inputs, outputs)]
    texts = [_column(ds, c, where) for c in spec.text_columns]
    labels = _column(ds, spec.label_column, where)
    names = spec.label_names
    out = []
    for row, label in enumerate(labels):
        k = _label_index(label, names, row, where, spec.label_column)
        parts = [_text(t[row]) for t in texts]
        out.append(Record(classification_prompt(spec.instruction, *parts), verbalize(names[k]), k))
    return out
