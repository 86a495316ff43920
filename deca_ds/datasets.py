"""The paper's tasks by name or from local files, their prompts and client partitions (evaluation:
`deca_ds.evaluation`).

Tasks (`TASKS`): `nwgi`, `agnews`, `tfns`, `mnli` (classification) and `alpaca` (generation). `load_task`
reads one from the Hugging Face hub (or the local `datasets` cache; `HF_DATASETS_OFFLINE=1` /
`HF_HUB_OFFLINE=1` are honoured even when set after `datasets` was imported) or from local
JSONL / JSON / CSV / Parquet files, and turns every row into a `Record`: an instruction-style
prompt, the answer the model is trained to give, and the label index (classification).

Column mapping: a registered task's columns are those of its hub dataset; `text_column`,
`text_pair_column`, `label_column`, `response_column` and `label_names` override them (for local
copies whose columns are named differently). For a generation task `text_column` is the
instruction, `text_pair_column` the optional input and `response_column` the output.
"""

from __future__ import annotations

import codecs
import contextlib
import inspect
import json
import logging
import math
import os
import re
from collections import Counter
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Literal

import numpy as np

from .data import dirichlet_partition, encode, iid_partition, label_histogram

log = logging.getLogger(__name__)


# ---------------------------------------------------------------------------------------------
# Task specs
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class TaskSpec:
    """Where a task's data lives and how a row becomes a prompt and an answer.

    `text_columns`: one text column, or (premise, hypothesis) for a pair task; for a generation
    task (instruction, input) with the input optional. `label_names` verbalize the labels: label
    k is answered " " + label_names[k]. `test_split=None`: the task has no held-out split and
    `load_task` holds out part of the training split.
    """

    name: str
    hub_id: str | None
    config_name: str | None
    train_split: str
    test_split: str | None
    text_columns: tuple[str, ...]
    label_column: str | None
    label_names: tuple[str, ...] | None
    kind: Literal["classification", "generation"]
    instruction: str
    response_column: str | None = None  # generation: the column holding the answer

    def __post_init__(self) -> None:
        if self.kind not in ("classification", "generation"):
            raise ValueError(f"task {self.name!r}: kind must be 'classification' or 'generation', got {self.kind!r}")
        if not self.text_columns or len(self.text_columns) > 2:
            raise ValueError(f"task {self.name!r}: text_columns must name 1 or 2 columns, got {self.text_columns}")
        if self.kind == "classification" and not self.label_column:
            raise ValueError(f"task {self.name!r}: a classification task needs a label column")
        if self.kind == "generation" and not self.response_column:
            raise ValueError(f"task {self.name!r}: a generation task needs a response column")

    @property
    def is_pair(self) -> bool:
        return self.kind == "classification" and len(self.text_columns) == 2


def _choose(task: str, names: Sequence[str]) -> str:
    return f"{task} Answer with one of: {', '.join(names)}."


_NWGI_LABELS = ("strong negative", "moderately negative", "mildly negative", "neutral",
                "mildly positive", "moderately positive", "strong positive")
_AGNEWS_LABELS = ("World", "Sports", "Business", "Sci/Tech")
_TFNS_LABELS = ("Bearish", "Bullish", "Neutral")
_MNLI_LABELS = ("entailment", "neutral", "contradiction")

TASKS: dict[str, TaskSpec] = {
    # News With GPT Instructions (FinGPT): column "news", string labels as below (7 levels),
    # splits train / test.
    "nwgi": TaskSpec(
        "nwgi", "oliverwang15/news_with_gpt_instructions", None, "train", "test", ("news",), "label",
        _NWGI_LABELS, "classification", _choose("What is the sentiment of this financial news?", _NWGI_LABELS)),
    "agnews": TaskSpec(
        "agnews", "fancyzhx/ag_news", None, "train", "test", ("text",), "label", _AGNEWS_LABELS,
        "classification", _choose("What is the topic of this news article?", _AGNEWS_LABELS)),
    # Twitter Financial News Sentiment: labels 0 Bearish, 1 Bullish, 2 Neutral; splits train / validation.
    "tfns": TaskSpec(
        "tfns", "zeroshot/twitter-financial-news-sentiment", None, "train", "validation", ("text",), "label",
        _TFNS_LABELS, "classification", _choose("What is the sentiment of this financial tweet?", _TFNS_LABELS)),
    # GLUE MNLI: its test split is unlabeled, so the matched validation split is the test set.
    "mnli": TaskSpec(
        "mnli", "nyu-mll/glue", "mnli", "train", "validation_matched", ("premise", "hypothesis"), "label",
        _MNLI_LABELS, "classification",
        _choose("Does the premise entail the hypothesis, contradict it, or neither?", _MNLI_LABELS)),
    # Alpaca has a train split only: load_task holds out `holdout` rows of it as the test set.
    "alpaca": TaskSpec(
        "alpaca", "tatsu-lab/alpaca", None, "train", None, ("instruction", "input"), None, None,
        "generation", "", response_column="output"),
}


# ---------------------------------------------------------------------------------------------
# Records and prompt templates
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Record:
    """One example: the prompt, the answer the model learns to give after it, the label index
    (classification; None for generation) and the row's own instruction (generation; what
    `partition_records(key="category")` groups by)."""

    prompt: str
    answer: str
    label: int | None = None
    instruction: str | None = None


@dataclass
class LoadedTask:
    spec: TaskSpec
    train: list[Record]
    test: list[Record]
    sources: dict[str, str] = field(default_factory=dict)  # split -> where it was read from
    rows: dict[str, object] = field(default_factory=dict)  # split -> its rows as read (datasets.Dataset), by record


ALPACA_PROMPT_INPUT = (
    "Below is an instruction that describes a task, paired with an input that provides further context. "
    "Write a response that appropriately completes the request.\n\n"
    "### Instruction:\n{instruction}\n\n### Input:\n{input}\n\n### Response:\n"
)
ALPACA_PROMPT = (
    "Below is an instruction that describes a task. Write a response that appropriately completes the request.\n\n"
    "### Instruction:\n{instruction}\n\n### Response:\n"
)


def classification_prompt(instruction: str, text: str, text_pair: str | None = None) -> str:
    """f"{instruction}\\n\\nText: {text}\\n\\nAnswer:", or with "Premise: …\\nHypothesis: …" for a pair."""
    body = f"Text: {text}" if text_pair is None else f"Premise: {text}\nHypothesis: {text_pair}"
    return f"{instruction}\n\n{body}\n\nAnswer:"


def alpaca_prompt(instruction: str, input: str = "") -> str:
    """The standard Alpaca prompt, with the input section only where the input is not empty."""
    if input.strip():
        return ALPACA_PROMPT_INPUT.format(instruction=instruction, input=input)
    return ALPACA_PROMPT.format(instruction=instruction)


def verbalize(label_name: str) -> str:
    """The answer to a classification prompt: one space, then the label's name."""
    return " " + label_name


# ---------------------------------------------------------------------------------------------
# Loading
# ---------------------------------------------------------------------------------------------

_LOADERS = {".jsonl": "json", ".json": "json", ".csv": "csv", ".parquet": "parquet"}
_SPLITS = ("train", "test")
_TRUE = {"1", "true", "yes", "on"}


def resolve_spec(
    name: str | None = None,
    *,
    text_column: str | None = None,
    text_pair_column: str | None = None,
    label_column: str | None = None,
    label_names: Sequence[str] | None = None,
    response_column: str | None = None,
) -> TaskSpec:
    """The registered spec `name` with the column options applied, or (name None) a spec for
    local files: generation when `response_column` is given (instruction/input columns default
    to "instruction"/"input"), classification otherwise (columns default to "text"/"label")."""
    names = tuple(label_names) if label_names is not None else None
    if names is not None and (not names or len(set(names)) != len(names)):
        raise ValueError(f"label_names must be non-empty and distinct, got {list(names)}")
    if name is not None:
        if name not in TASKS:
            raise ValueError(f"unknown task {name!r}; known tasks: {', '.join(sorted(TASKS))} "
                             "(or pass data_files for local files)")
        spec = TASKS[name]
        columns = list(spec.text_columns)
        if text_column:
            columns[0] = text_column
        if text_pair_column:
            columns[1:] = [text_pair_column]
        changes: dict = {"text_columns": tuple(columns)}
        if spec.kind == "classification":
            if response_column:
                raise ValueError(f"task {name!r} is a classification task; response_column does not apply")
            changes["label_column"] = label_column or spec.label_column
            if names is not None:
                changes["label_names"] = names
                changes["instruction"] = _instruction_for(columns, names)
        else:
            if label_column or names:
                raise ValueError(f"task {name!r} is a generation task; label_column/label_names do not apply")
            changes["response_column"] = response_column or spec.response_column
        return replace(spec, **changes)
    if response_column:
        if label_column or names:
            raise ValueError("response_column makes a generation task; label_column/label_names do not apply")
        return TaskSpec("files", None, None, "train", "test",
                        (text_column or "instruction", text_pair_column or "input"), None, None, "generation", "",
                        response_column=response_column)
    columns = (text_column or "text",) + ((text_pair_column,) if text_pair_column else ())
    return TaskSpec("files", None, None, "train", "test", columns, label_column or "label", names,
                    "classification", _instruction_for(columns, names) if names else "")


def _instruction_for(columns: Sequence[str], names: Sequence[str]) -> str:
    task = ("Does the premise entail the hypothesis, contradict it, or neither?" if len(columns) == 2
            else "Classify the text.")
    return _choose(task, names)


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
        raise ValueError(f"could not load {what}{hint}: {type(e).__name__}: {e}") from e


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
            spec = replace(spec, instruction=_instruction_for(spec.text_columns, spec.label_names))
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
    if values and all(isinstance(v, str) for v in values):
        return tuple(sorted({v.strip() for v in values}))
    raise ValueError(f"label column {spec.label_column!r} of {where} holds integers; pass label_names to name them")


def _label_index(value, names: Sequence[str], row: int, where: str, column: str) -> int:
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


def vocabulary(records: Sequence[Record], label_names: Sequence[str] | None = None) -> list[str]:
    """Every whitespace word of the records' prompts and answers (and of the label names), in
    first-seen order: the word list for `deca_ds.data.build_word_tokenizer` with the tiny model."""
    words: dict[str, None] = {}
    for r in records:
        words.update(dict.fromkeys(r.prompt.split()))
        words.update(dict.fromkeys(r.answer.split()))
    for name in label_names or ():
        words.update(dict.fromkeys(verbalize(name).split()))
    return list(words)


# ---------------------------------------------------------------------------------------------
# Features
# ---------------------------------------------------------------------------------------------


def render(tokenizer, record: Record, *, use_chat_template: bool = False) -> tuple[str, str]:
    """(prompt, answer) as the model reads them: as is, or the prompt as the user's message in
    the tokenizer's chat template (with the generation prompt) and the answer without its leading space."""
    if not use_chat_template:
        return record.prompt, record.answer
    return render_chat(tokenizer, [{"role": "user", "content": record.prompt}]), record.answer.removeprefix(" ")


def render_chat(tokenizer, messages: list[dict]) -> str:
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError(f"use_chat_template: the tokenizer {type(tokenizer).__name__} "
                         f"({getattr(tokenizer, 'name_or_path', '') or 'unnamed'}) has no chat template")
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    bos = tokenizer.bos_token
    if bos and tokenizer.bos_token_id is not None and text.startswith(bos):
        text = text[len(bos):]  # encode() adds bos itself
    return text


def to_features(tokenizer, records: Sequence[Record], *, max_length: int,
                use_chat_template: bool = False) -> list[dict[str, list[int]]]:
    """`deca_ds.data.encode` of each record: loss on the answer (and eos) only; a long prompt
    loses tokens from the left, the answer is never cut, and a record whose answer cannot fit
    raises a ValueError naming it."""
    features = []
    for i, record in enumerate(records):
        prompt, answer = render(tokenizer, record, use_chat_template=use_chat_template)
        try:
            features.append(encode(tokenizer, prompt, answer, max_length))
        except ValueError as e:
            raise ValueError(f"record {i}: {e}; raise max_length or drop such records "
                             "(fits_max_length)") from e
    return features


def fits_max_length(tokenizer, records: Sequence[Record], *, max_length: int,
                    use_chat_template: bool = False) -> list[bool]:
    """Whether each record's answer (plus eos, bos and one prompt token) fits in max_length."""
    extra = int(tokenizer.bos_token_id is not None) + int(tokenizer.eos_token_id is not None) + 1
    return [len(tokenizer(render(tokenizer, r, use_chat_template=use_chat_template)[1],
                          add_special_tokens=False)["input_ids"]) + extra <= max_length for r in records]


# ---------------------------------------------------------------------------------------------
# Client partitions
# ---------------------------------------------------------------------------------------------


def instruction_category(instruction: str | None) -> str:
    """The first word of the instruction, lower-cased, without surrounding punctuation ("" if none)."""
    words = (instruction or "").split()
    return re.sub(r"^\W+|\W+$", "", words[0]).lower() if words else ""


def partition_keys(records: Sequence[Record], key: str = "label", *, top_k: int = 8,
                   label_names: Sequence[str] | None = None) -> tuple[list[int], tuple[str, ...]]:
    """What a partition is skewed over: (per-record key index, key names).

    key="label": the records' labels (names from `label_names`, else "0", "1", …).
    key="category": the first word of each record's instruction, lower-cased; the `top_k` most
    frequent words (ties broken alphabetically) are categories 0..K-1 and every other word
    (and an empty instruction) is "other" (index K, present only when used).
    """
    if key == "label":
        if any(r.label is None for r in records):
            raise ValueError("key='label': some records have no label (a generation task); use key='category' or iid")
        labels = [int(r.label) for r in records]
        n = max(labels, default=-1) + 1
        names = tuple(label_names) if label_names is not None else tuple(str(k) for k in range(n))
        return labels, names
    if key == "category":
        if top_k < 1:
            raise ValueError(f"top_k must be >= 1, got {top_k}")
        words = [instruction_category(r.instruction) for r in records]
        counts = Counter(w for w in words if w)
        top = [w for w, _ in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))[:top_k]]
        index = {w: k for k, w in enumerate(top)}
        keys = [index.get(w, len(top)) for w in words]
        return keys, tuple(top) + (("other",) if len(top) in keys else ())
    raise ValueError(f"key must be 'label' or 'category', got {key!r}")


def partition_records(
    records: Sequence[Record],
    n_clients: int,
    *,
    alpha: float = 0.25,
    seed: int = 0,
    min_size: int = 2,
    iid: bool = False,
    key: str = "label",
    top_k: int = 8,
) -> list[list[int]]:
    """Each client's record indices (disjoint, together all records).

    iid=True: a random split of near-equal sizes. key="label": Dirichlet(alpha) over the labels
    (`deca_ds.data.dirichlet_partition`); records without labels (generation) are split IID.
    key="category": Dirichlet(alpha) over `partition_keys(records, "category", top_k=top_k)`.
    """
    if iid or (key == "label" and any(r.label is None for r in records)):
        return iid_partition(len(records), n_clients, seed=seed)
    keys, _ = partition_keys(records, key, top_k=top_k)
    return dirichlet_partition(keys, n_clients, alpha, seed=seed, min_size=min_size)


def label_skew(labels: Sequence[int], partition: Sequence[Sequence[int]], num_labels: int | None = None) -> float:
    """Mean over clients of the total variation distance between the client's label
    distribution and the global one (0 = IID; 1 = disjoint supports)."""
    return histogram_skew(label_histogram(labels, partition, num_labels or max(labels) + 1))


def histogram_skew(histogram) -> float:
    """`label_skew` from the clients × labels counts alone (all that per-client data files share)."""
    hist = np.asarray(histogram, dtype=float)
    glob = hist.sum(0) / hist.sum()
    local = hist / np.maximum(hist.sum(1, keepdims=True), 1)
    return float(0.5 * np.abs(local - glob).sum(1).mean())


def write_partition_report(out_dir: str | os.PathLike, histogram, label_names: Sequence[str],
                           partition: Sequence[Sequence[int]] | None = None) -> dict[str, Path]:
    """partition.json (sizes, clients × labels histogram, mean TV distance and, where one process
    split the data, each client's indices), label_histogram.csv and .md (the counts) and
    label_histogram.png (a heatmap). The same inputs give byte-identical files."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    names = [str(n) for n in label_names]
    hist = np.asarray(histogram, dtype=np.int64)
    paths = {k: out / f for k, f in (("json", "partition.json"), ("csv", "label_histogram.csv"),
                                      ("md", "label_histogram.md"), ("png", "label_histogram.png"))}
    paths["json"].write_text(json.dumps({
        "n_clients": len(hist), "label_names": names, "sizes": hist.sum(1).tolist(),
        "label_histogram": hist.tolist(), "mean_tv_distance": round(histogram_skew(hist), 6),
        **({"partition": [[int(i) for i in p] for p in partition]} if partition is not None else {}),
    }, indent=1, allow_nan=False) + "\n")

    def cell(s: str) -> str:
        return s.replace(",", " ").replace("|", "/")

    rows = [["client", *map(cell, names), "total"]]
    rows += [[str(c), *map(str, h.tolist()), str(int(h.sum()))] for c, h in enumerate(hist)]
    paths["csv"].write_text("".join(",".join(r) + "\n" for r in rows))
    md = ["| " + " | ".join(rows[0]) + " |", "|" + " ---: |" * len(rows[0])]
    md += ["| " + " | ".join(r) + " |" for r in rows[1:]]
    paths["md"].write_text("\n".join(md) + "\n")

    fig = Figure(figsize=(1.2 + 0.6 * len(names), 1.0 + 0.35 * len(hist)), dpi=100)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    image = ax.imshow(hist, aspect="auto", cmap="viridis")
    ax.set_xticks(range(len(names)), names, rotation=45, ha="right", fontsize=7)
    ax.set_yticks(range(len(hist)), [str(c) for c in range(len(hist))], fontsize=7)
    ax.set_xlabel("label")
    ax.set_ylabel("client")
    if hist.size <= 400:
        top = hist.max() or 1
        for (c, k), v in np.ndenumerate(hist):
            ax.text(k, c, str(v), ha="center", va="center", fontsize=6, color="black" if v > top / 2 else "white")
    fig.colorbar(image, ax=ax)
    fig.tight_layout()
    fig.savefig(paths["png"], format="png", metadata={"Software": None})
    return paths
