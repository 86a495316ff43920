"""The run's data: tokenizer, encoded training examples, each client's share, and an evaluator.

`--dataset synthetic` is the built-in task; a registered name (nwgi, agnews, tfns, mnli, alpaca)
loads from the hub or its cache; `--dataset files` (or a name plus `--data-files`) reads local
JSON Lines, CSV or Parquet files with the column options.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from ..data import (
    ANSWER,
    PROMPT,
    ClientStream,
    SyntheticTask,
    build_word_tokenizer,
    dirichlet_partition,
    encode_examples,
    iid_partition,
    label_histogram,
)
from ..datasets import TASKS, LoadedTask, load_task, partition_keys, partition_records, to_features, vocabulary
from ..evaluation import evaluate_classification, evaluate_records
from ..models import load_tokenizer
from . import token_cache
from .options import RunOptions


@dataclass
class Task:
    tokenizer: object
    features: list  # encoded training examples (input_ids, labels, attention_mask)
    client_indices: list[list[int]]
    keys: list[int]  # per training example, the key the split is skewed over
    key_names: tuple[str, ...]  # what the split is skewed over: labels, or instruction categories
    key_histogram: list[list[int]]  # clients × keys
    evaluate: Callable[..., dict]  # evaluate(model, limit) -> {"accuracy", "macro_f1", "n", "chance"} or {}

    def stream(self, opts: RunOptions, client: int) -> ClientStream:
        return ClientStream(self.features, self.client_indices[client], opts.micro_batch,
                            pad_id=self.tokenizer.pad_token_id, seed=opts.seed, client=client)


def _tokenizer(opts: RunOptions, words: Callable[[], list[str]]):
    # A pretrained model reads the task with its own tokenizer; the tiny model and models built
    # from a bare config (resource profiling) use a word-level one built from the data, whose ids
    # any vocabulary of at least that size holds.
    if opts.model == "tiny" or opts.from_config:
        return build_word_tokenizer(words())
    return load_tokenizer(opts.model, trust_remote_code=opts.trust_remote_code)


def _cached(opts: RunOptions, tokenizer, texts: list[str], settings: dict, build: Callable[[], list]) -> list:
    # Tokenized once per machine (the first local rank), read by the other ranks: see token_cache.
    directory = token_cache.cache_dir(opts.token_cache)
    key = token_cache.cache_key(tokenizer, texts, settings) if directory is not None else ""
    return token_cache.cached_features(directory, key, build, wait_s=opts.timeout)


def _synthetic(opts: RunOptions, n_clients: int) -> Task:
    task = SyntheticTask(seed=opts.seed, words_per_example=opts.synthetic_words)
    train, test = task.generate()
    tokenizer = _tokenizer(opts, task.vocabulary)
    features = _cached(opts, tokenizer, [t for ex in train for t in (ex.text, str(ex.label))],
                       {"task": "synthetic", "label_words": list(task.label_words), "prompt": PROMPT, "answer": ANSWER,
                        "max_length": opts.max_seq_len},
                       lambda: encode_examples(tokenizer, train, task.label_words, max_length=opts.max_seq_len))
    labels = [ex.label for ex in train]
    parts = (iid_partition(len(train), n_clients, seed=opts.seed) if opts.iid else
             dirichlet_partition(labels, n_clients, opts.dirichlet_alpha, seed=opts.seed, min_size=opts.micro_batch))

    def evaluate(model, limit: int | None) -> dict:
        return evaluate_classification(model, tokenizer, test, task.label_words, max_length=opts.max_seq_len,
                                       limit=limit)

    return Task(tokenizer, features, parts, labels, task.label_words,
                label_histogram(labels, parts, task.num_labels).tolist(), evaluate)


def load_records(opts: RunOptions) -> LoadedTask:
    """The train and test records of a task that is not the synthetic one, as the options name them."""
    files = dict(item.split("=", 1) for item in opts.data_files) if opts.data_files else None
    return load_task(None if opts.dataset == "files" else opts.dataset, data_files=files,
                     text_column=opts.text_column, text_pair_column=opts.text_pair_column,
                     label_column=opts.label_column, label_names=opts.label_names,
                     response_column=opts.response_column, trust_remote_code=opts.trust_remote_code,
                     seed=opts.seed)


def _loaded(opts: RunOptions, n_clients: int) -> Task:
    loaded = load_records(opts)
    label_names = loaded.spec.label_names
    tokenizer = _tokenizer(opts, lambda: vocabulary(loaded.train + loaded.test, label_names))
    features = _cached(opts, tokenizer, [t for r in loaded.train for t in (r.prompt, r.answer)],
                       {"task": "records", "max_length": opts.max_seq_len, "chat_template": opts.chat_template},
                       lambda: to_features(tokenizer, loaded.train, max_length=opts.max_seq_len,
                                           use_chat_template=opts.chat_template))
    parts = partition_records(loaded.train, n_clients, alpha=opts.dirichlet_alpha, seed=opts.seed,
                              min_size=opts.micro_batch, iid=opts.iid, key=opts.partition_key)
    if loaded.spec.kind == "classification" or opts.partition_key == "category":
        keys, key_names = partition_keys(loaded.train, opts.partition_key, label_names=label_names)
    else:  # generation split IID: a single key
        keys, key_names = [0] * len(features), ("all",)

    def evaluate(model, limit: int | None) -> dict:
        if loaded.spec.kind != "classification":
            return {}  # generation quality: deca_ds.evaluation.generate_answers / judge_answers on the export
        return evaluate_records(model, tokenizer, loaded.test, label_names, max_length=opts.max_seq_len,
                                use_chat_template=opts.chat_template, limit=limit)

    return Task(tokenizer, features, parts, list(keys), tuple(key_names),
                label_histogram(keys, parts, len(key_names)).tolist(), evaluate)


def build_task(opts: RunOptions, n_clients: int) -> Task:
    return _synthetic(opts, n_clients) if opts.dataset == "synthetic" else _loaded(opts, n_clients)


DATASETS = ("synthetic", *TASKS, "files")
