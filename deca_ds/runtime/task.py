"""The run's data: tokenizer, encoded training examples, each client's share, and an evaluator.

`--dataset synthetic` is the built-in task; a registered name (nwgi, agnews, tfns, mnli, alpaca)
loads from the hub or its cache; `--dataset files` (or a name plus `--data-files`) reads local
JSON Lines, CSV or Parquet files with the column options. A training path with the `{client}`
field (`train=site/client_{client}.jsonl`) is each client's own file: a process reads only its
client's, there is no split, and the clients' sizes, label counts and data hashes (`share_counts`)
are all of the data that crosses sites.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, replace
from typing import Callable

import numpy as np
import torch.distributed as dist

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
from ..datasets import (
    TASKS,
    LoadedTask,
    load_task,
    partition_keys,
    partition_records,
    resolve_spec,
    to_features,
    vocabulary,
)
from ..evaluation import evaluate_classification, evaluate_records
from ..models import load_tokenizer
from . import token_cache
from .dist import ClientLayout
from .options import RunOptions, client_path
from .rank import launch_rank


@dataclass
class Task:
    tokenizer: object
    features: list  # this process's encoded training examples (input_ids, labels, attention_mask)
    client_indices: list[list[int]]  # per client, its examples in `features` ([] where another process read them)
    key_names: tuple[str, ...]  # what the split is skewed over: labels, or instruction categories
    key_histogram: list[list[int]]  # clients × keys
    evaluate: Callable[..., dict]  # evaluate(model, limit) -> {"accuracy", "macro_f1", "n", "chance"} or {}
    held: tuple[int, ...] | None = None  # per-client files: the clients whose files this process read
    answer_tokens: int | None = None  # the most labelled positions of one example (of every client's)
    # per client, SHA-256 of its encoded examples in order (None: held elsewhere); --resume compares them
    data_fingerprints: list[str | None] | None = None

    def __post_init__(self) -> None:
        if self.answer_tokens is None:
            self.answer_tokens = max((sum(label != -100 for label in f["labels"][1:]) for f in self.features),
                                     default=0)
        if self.data_fingerprints is None:
            self.data_fingerprints = [features_fingerprint(self.features, ix)
                                      if self.held is None or c in self.held else None
                                      for c, ix in enumerate(self.client_indices)]

    @property
    def client_sizes(self) -> list[int]:
        return [sum(row) for row in self.key_histogram]

    def stream(self, opts: RunOptions, client: int) -> ClientStream:
        return ClientStream(self.features, self.client_indices[client], opts.micro_batch,
                            pad_id=self.tokenizer.pad_token_id, seed=opts.seed, client=client)


def features_fingerprint(features: list, indices: list[int]) -> str:
    """SHA-256 of the examples' token ids and labels, in order: what a client's stream draws from."""
    h = hashlib.sha256()
    for i in indices:
        for key in ("input_ids", "labels"):
            h.update(np.asarray(features[i][key], dtype=np.int64).tobytes() + b";")
    return h.hexdigest()


def _tokenizer(opts: RunOptions, words: Callable[[], list[str]]):
    # A pretrained model reads the task with its own tokenizer; the tiny model and models built
    # from a bare config (resource profiling) use a word-level one built from the data, whose ids
    # any vocabulary of at least that size holds.
    if opts.model == "tiny" or opts.from_config:
        return build_word_tokenizer(words())
    return load_tokenizer(opts.model, trust_remote_code=opts.trust_remote_code)


def _cached(opts: RunOptions, tokenizer, texts: list[str], settings: dict, build: Callable[[], list],
            writer: bool | None = None) -> list:
    # Tokenized once per machine (the first local rank, or `writer`), read by the other ranks: see token_cache.
    directory = token_cache.cache_dir(opts.token_cache)
    key = token_cache.cache_key(tokenizer, texts, settings) if directory is not None else ""
    return token_cache.cached_features(directory, key, build, writer=writer, wait_s=opts.timeout)


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
    return Task(tokenizer, features, parts, task.label_words, label_histogram(labels, parts, task.num_labels).tolist(),
                _synthetic_evaluator(opts, tokenizer, task, test))


def _synthetic_evaluator(opts: RunOptions, tokenizer, task: SyntheticTask, test: list) -> Callable[..., dict]:
    def evaluate(model, limit: int | None) -> dict:
        return evaluate_classification(model, tokenizer, test, task.label_words, max_length=opts.max_seq_len,
                                       limit=limit)

    return evaluate


def load_records(opts: RunOptions, client: int = 0) -> LoadedTask:
    """The train and test records of a task that is not the synthetic one, as the options name them
    (with per-client files, `client`'s own training file)."""
    files = {split: client_path(path, client) for split, path in opts.data_file_map().items()} or None
    return load_task(None if opts.dataset == "files" else opts.dataset, data_files=files,
                     text_column=opts.text_column, text_pair_column=opts.text_pair_column,
                     label_column=opts.label_column, label_names=opts.label_names,
                     response_column=opts.response_column, trust_remote_code=opts.trust_remote_code,
                     seed=opts.seed, labels_from="test" if opts.client_data else "train")


def _evaluator(opts: RunOptions, loaded: LoadedTask, tokenizer) -> Callable[..., dict]:
    def evaluate(model, limit: int | None) -> dict:
        if loaded.spec.kind != "classification":
            return {}  # generation quality: deca_ds.evaluation.generate_answers / judge_answers on the export
        return evaluate_records(model, tokenizer, loaded.test, loaded.spec.label_names, max_length=opts.max_seq_len,
                                use_chat_template=opts.chat_template, limit=limit)

    return evaluate


def _features(opts: RunOptions, tokenizer, records: list, writer: bool | None = None) -> list:
    return _cached(opts, tokenizer, [t for r in records for t in (r.prompt, r.answer)],
                   {"task": "records", "max_length": opts.max_seq_len, "chat_template": opts.chat_template},
                   lambda: to_features(tokenizer, records, max_length=opts.max_seq_len,
                                       use_chat_template=opts.chat_template), writer)


def split_records(opts: RunOptions, loaded: LoadedTask, n_clients: int) -> tuple[list[list[int]], list[int], tuple]:
    """The clients' shares of the training records (index lists), and what the split is skewed over:
    each record's key and the keys' names. deca-split writes this split as per-client files."""
    parts = partition_records(loaded.train, n_clients, alpha=opts.dirichlet_alpha, seed=opts.seed,
                              min_size=opts.micro_batch, iid=opts.iid, key=opts.partition_key)
    if loaded.spec.kind == "classification" or opts.partition_key == "category":
        keys, key_names = partition_keys(loaded.train, opts.partition_key, label_names=loaded.spec.label_names)
    else:  # generation split IID: a single key
        keys, key_names = [0] * len(loaded.train), ("all",)
    return parts, list(keys), tuple(key_names)


def _records_tokenizer(opts: RunOptions, loaded: LoadedTask):
    return _tokenizer(opts, lambda: vocabulary(loaded.train + loaded.test, loaded.spec.label_names))


def _loaded(opts: RunOptions, n_clients: int) -> Task:
    loaded = load_records(opts)
    tokenizer = _records_tokenizer(opts, loaded)
    features = _features(opts, tokenizer, loaded.train)
    parts, keys, key_names = split_records(opts, loaded, n_clients)
    return Task(tokenizer, features, parts, key_names, label_histogram(keys, parts, len(key_names)).tolist(),
                _evaluator(opts, loaded, tokenizer))


def _own_files(opts: RunOptions, n_clients: int, held: tuple[int, ...]) -> Task:
    """Per-client files: each held client's examples are its file's, in order (no split). The
    histogram rows of the clients held elsewhere stay zero until `share_counts`."""
    tokenizer = load_tokenizer(opts.model, trust_remote_code=opts.trust_remote_code)
    features, keys, parts, loaded = [], [], [[] for _ in range(n_clients)], None
    # in a distributed run a process reads its own client's file: the client's first rank tokenizes it
    writer = launch_rank() % opts.ranks_per_client == 0
    for client in held:
        loaded = load_records(opts, client)
        if len(loaded.train) < opts.micro_batch:
            raise ValueError(f"client {client}'s training file {loaded.sources['train']} holds {len(loaded.train)} "
                             f"examples, fewer than --micro-batch {opts.micro_batch}")
        mine = _features(opts, tokenizer, loaded.train, writer)
        parts[client] = list(range(len(features), len(features) + len(mine)))
        features += mine
        keys += [0 if r.label is None else r.label for r in loaded.train]  # generation: a single key
    key_names = loaded.spec.label_names if loaded.spec.kind == "classification" else ("all",)
    return Task(tokenizer, features, parts, tuple(key_names), label_histogram(keys, parts, len(key_names)).tolist(),
                _evaluator(opts, loaded, tokenizer), held if len(held) < n_clients else None)


def share_counts(task: Task, layout: ClientLayout) -> Task:
    """With per-client files every process has read its own client's only: the run's record gets
    every client's size and key histogram (counts; no example leaves its site) and the longest
    answer, gathered over the process group (`merge_counts`)."""
    if task.held is None:
        return task
    everyone = [None] * layout.world_size
    dist.all_gather_object(everyone, client_counts(task))
    return merge_counts(task, everyone)


def client_counts(task: Task) -> dict:
    """What a process holding one client's file tells the others: counts, the names it counts by, and
    its data's fingerprint (a hash: no example)."""
    (client,) = task.held
    return {"client": client, "histogram": task.key_histogram[client], "answer_tokens": task.answer_tokens,
            "keys": list(task.key_names), "data": task.data_fingerprints[client]}


def merge_counts(task: Task, everyone: list[dict]) -> Task:
    """`task` with every client's histogram row and the longest answer of all. Every process
    merges the same list, so sites that name other labels (another test file) meet the same
    refusal on every rank, before anything is written. (The tokenizer: same_start.)"""
    differ = sorted({e["client"] for e in everyone if e["keys"] != everyone[0]["keys"]})
    if differ:
        theirs = next(e["keys"] for e in everyone if e["client"] == differ[0])
        raise ValueError(f"--data-files train=…{{client}}…: client(s) {differ} name other labels than client "
                         f"{everyone[0]['client']} ({everyone[0]['keys']} against {theirs}): every site needs the "
                         "same test file")
    histogram, data = [list(row) for row in task.key_histogram], list(task.data_fingerprints)
    for e in everyone:
        histogram[e["client"]], data[e["client"]] = e["histogram"], e["data"]
    return replace(task, key_histogram=histogram, answer_tokens=max(e["answer_tokens"] for e in everyone),
                   data_fingerprints=data)


def task_kind(opts: RunOptions) -> str:
    """"classification" or "generation" (whose evaluate scores nothing: the exported model's answers
    are judged instead), from the options alone, before any data is read."""
    if opts.dataset == "synthetic":
        return "classification"
    return resolve_spec(None if opts.dataset == "files" else opts.dataset, text_column=opts.text_column,
                        text_pair_column=opts.text_pair_column, label_column=opts.label_column,
                        label_names=opts.label_names, response_column=opts.response_column).kind


def check_questions(opts: RunOptions) -> None:
    """--questions, before any step: only after a generation task, and files of questions."""
    from ..evaluation import read_questions

    if not opts.questions:
        return
    if task_kind(opts) != "generation":
        raise ValueError(f"--questions: x̄ answers question sets after a generation task (alpaca, or --response-column "
                         f"with --data-files); --dataset {opts.dataset} is a classification task, scored by label")
    for name, path in opts.question_sets().items():
        try:
            read_questions(path)
        except OSError as err:
            raise ValueError(f"--questions {name}={path}: {err.strerror or err}") from None


def evaluator(opts: RunOptions) -> tuple[object, Callable[..., dict]]:
    """(the task's tokenizer, its evaluate(model, limit)) alone: the test set, without encoding or
    splitting the training data (deca-eval)."""
    if opts.dataset == "synthetic":
        task = SyntheticTask(seed=opts.seed, words_per_example=opts.synthetic_words)
        tokenizer = _tokenizer(opts, task.vocabulary)
        return tokenizer, _synthetic_evaluator(opts, tokenizer, task, task.generate()[1])
    loaded = load_records(opts)
    tokenizer = _records_tokenizer(opts, loaded)
    return tokenizer, _evaluator(opts, loaded, tokenizer)


def own_clients(opts: RunOptions) -> tuple[int, ...] | None:
    """With per-client files (train=…{client}…), the client whose file this process reads (a site
    may hold no other's); None when every process reads the one training file."""
    return (launch_rank() // opts.ranks_per_client,) if opts.client_data else None


def build_task(opts: RunOptions, n_clients: int, held: tuple[int, ...] | None = None) -> Task:
    """The task as `opts` names it; with per-client files, the files of the clients `held` (default: all)."""
    if opts.dataset == "synthetic":
        return _synthetic(opts, n_clients)
    if opts.client_data:
        return _own_files(opts, n_clients, tuple(range(n_clients)) if held is None else held)
    return _loaded(opts, n_clients)


DATASETS = ("synthetic", *TASKS, "files")
