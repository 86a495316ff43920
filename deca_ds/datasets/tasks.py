"""The paper's tasks (`TASKS`) and what a row becomes: a `Record` with an instruction-style prompt,
the answer the model is trained to give, and the label index (classification)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Literal


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
    # a file's labels are matched without their surrounding spaces: so are the names
    if names is not None and (not names or not all(isinstance(n, str) and n.strip() for n in names)
                              or len({n.strip() for n in names}) != len(names)):
        raise ValueError(f"label_names must be distinct names, none blank (spaces around a name do not count), "
                         f"got {list(names)}")
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
                changes["instruction"] = instruction_for(columns, names)
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
                    "classification", instruction_for(columns, names) if names else "")


def instruction_for(columns: Sequence[str], names: Sequence[str]) -> str:
    """The instruction of a classification task read from files: its question (entailment for a
    pair of text columns) and the label names to answer with."""
    task = ("Does the premise entail the hypothesis, contradict it, or neither?" if len(columns) == 2
            else "Classify the text.")
    return _choose(task, names)
