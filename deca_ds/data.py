"""The built-in synthetic non-IID classification task and each client's stream of micro-batches.

The task: an example is a bag of words in which `keywords_per_example` keywords of its label
appear together with fewer (`distractors_per_example`) keywords of other labels, among filler
words. The label is the one whose keywords are in the majority, so it is learnable by
construction, and the model has to aggregate over the whole sequence rather than spot one word.
The model reads PROMPT and answers " " + the label's word, followed by eos; the loss is on the
answer only. Non-IID clients come from splitting the training set with `dirichlet_partition`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerBase, PreTrainedTokenizerFast

PROMPT = "{text} =>"
ANSWER = " {word}"  # the answer to a prompt: the label's word after one space

PAD, UNK, EOS = "<pad>", "<unk>", "<eos>"


@dataclass(frozen=True)
class Example:
    text: str
    label: int


@dataclass(frozen=True)
class SyntheticTask:
    num_labels: int = 4
    keywords_per_label: int = 6
    num_fillers: int = 24
    words_per_example: int = 12
    keywords_per_example: int = 3  # of the example's own label
    distractors_per_example: int = 2  # keywords of other labels; fewer than keywords_per_example
    train_size: int = 2000
    test_size: int = 500
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("keywords_per_label", "num_fillers", "keywords_per_example", "train_size", "test_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.num_labels < 2:
            raise ValueError(f"num_labels must be >= 2, got {self.num_labels}")
        if not 0 <= self.distractors_per_example < self.keywords_per_example:
            raise ValueError(
                f"distractors_per_example must be in [0, keywords_per_example={self.keywords_per_example}), "
                f"got {self.distractors_per_example}; otherwise the label is not the majority"
            )
        if self.words_per_example < self.keywords_per_example + self.distractors_per_example:
            raise ValueError(
                f"words_per_example={self.words_per_example} is less than keywords_per_example + "
                f"distractors_per_example = {self.keywords_per_example + self.distractors_per_example}"
            )

    @property
    def label_words(self) -> tuple[str, ...]:
        return tuple(f"label{k}" for k in range(self.num_labels))

    def keywords(self, label: int) -> list[str]:
        return [f"k{label}.{j}" for j in range(self.keywords_per_label)]

    @property
    def fillers(self) -> list[str]:
        return [f"w{j}" for j in range(self.num_fillers)]

    def vocabulary(self) -> list[str]:
        """Every word of every prompt and answer, in a fixed order."""
        keywords = [w for k in range(self.num_labels) for w in self.keywords(k)]
        return [*self.fillers, *keywords, *PROMPT.format(text="").split(), *self.label_words]

    def generate(self) -> tuple[list[Example], list[Example]]:
        """(train, test), label-balanced, deterministic for `seed`."""
        rng = np.random.default_rng(self.seed)
        n = self.train_size + self.test_size
        labels = rng.permutation(np.arange(n) % self.num_labels)
        fillers = self.fillers
        n_fill = self.words_per_example - self.keywords_per_example - self.distractors_per_example
        examples = []
        for label in labels.tolist():
            own = self.keywords(label)
            words = [own[j] for j in rng.integers(len(own), size=self.keywords_per_example)]
            for _ in range(self.distractors_per_example):
                other = (label + 1 + int(rng.integers(self.num_labels - 1))) % self.num_labels
                words.append(self.keywords(other)[int(rng.integers(self.keywords_per_label))])
            words += [fillers[j] for j in rng.integers(len(fillers), size=n_fill)]
            examples.append(Example(" ".join(rng.permutation(words).tolist()), label))
        return examples[: self.train_size], examples[self.train_size:]


def build_word_tokenizer(words: Sequence[str]) -> PreTrainedTokenizerFast:
    """An offline word-level tokenizer: one id per word, split on whitespace; <pad>=0, <unk>=1, <eos>=2."""
    vocab = {token: i for i, token in enumerate(dict.fromkeys([PAD, UNK, EOS, *words]))}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=backend, pad_token=PAD, unk_token=UNK, eos_token=EOS)


def encode(tokenizer: PreTrainedTokenizerBase, prompt: str, answer: str, max_length: int) -> dict[str, list[int]]:
    """Token ids of [bos] + prompt + answer + eos (bos where the tokenizer has one), with labels on
    the answer and eos only.

    Prompt and answer are tokenized separately, so the answer's tokens do not depend on the
    prompt (also for BPE tokenizers, which would otherwise merge across the boundary). Too long
    a sequence loses prompt tokens from the left (after bos); the answer is never cut.
    """
    bos = [tokenizer.bos_token_id] if tokenizer.bos_token_id is not None else []
    eos = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    prompt_ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
    answer_ids = tokenizer(answer, add_special_tokens=False)["input_ids"]
    for what, text, ids in (("prompt", prompt, prompt_ids), ("answer", answer, answer_ids)):
        if text.strip() and not ids:
            # e.g. transformers 5 loading a tokenizer.json as the class its config.json's model type
            # maps to, which rebuilds another tokenizer: an example would hold nothing to learn
            raise ValueError(f"the tokenizer ({type(tokenizer).__name__}) turns the {what} {text[:80]!r} into no "
                             "tokens: it cannot read this text")
    answer_ids += eos
    room = max_length - len(bos) - len(answer_ids)
    if room < 1:
        raise ValueError(
            f"max_length={max_length} cannot hold the answer {answer!r} ({len(answer_ids)} tokens incl. eos) "
            f"after at least one prompt token{' and bos' if bos else ''}: raise max_length (--max-seq-len) or drop "
            "such records (deca_ds.datasets.fits_max_length)"
        )
    prompt_ids = bos + prompt_ids[max(len(prompt_ids) - room, 0):]
    input_ids = prompt_ids + answer_ids
    return {
        "input_ids": input_ids,
        "labels": [-100] * len(prompt_ids) + answer_ids,
        "attention_mask": [1] * len(input_ids),
    }


def encode_examples(
    tokenizer: PreTrainedTokenizerBase, examples: Sequence[Example], label_words: Sequence[str], *, max_length: int
) -> list[dict[str, list[int]]]:
    """`encode` of each example's PROMPT and its label's ANSWER."""
    return [
        encode(tokenizer, PROMPT.format(text=ex.text), ANSWER.format(word=label_words[ex.label]), max_length)
        for ex in examples
    ]


def dirichlet_partition(
    labels: Sequence[int],
    n_clients: int,
    alpha: float = 0.25,
    *,
    seed: int = 0,
    min_size: int = 2,
    max_tries: int = 100,
) -> list[list[int]]:
    """Non-IID split: each label's examples are shared out over clients in Dirichlet(alpha) proportions.

    Small alpha gives each client a few dominant labels; large alpha approaches IID. The whole
    split is redrawn until every client has at least `min_size` examples.
    """
    if n_clients < 1:
        raise ValueError(f"n_clients must be >= 1, got {n_clients}")
    if not alpha > 0:
        raise ValueError(f"alpha must be > 0, got {alpha}")
    labels = np.asarray(labels)
    rng = np.random.default_rng(seed)
    for _ in range(max_tries):
        parts: list[list[int]] = [[] for _ in range(n_clients)]
        for label in np.unique(labels):
            indices = rng.permutation(np.flatnonzero(labels == label))
            shares = rng.dirichlet(np.full(n_clients, alpha))
            cuts = (np.cumsum(shares)[:-1] * len(indices)).astype(int)
            for part, chunk in zip(parts, np.split(indices, cuts)):
                part.extend(chunk.tolist())
        if min(len(p) for p in parts) >= min_size:
            return [sorted(p) for p in parts]
    raise ValueError(
        f"dirichlet_partition: could not give each of {n_clients} clients at least {min_size} of "
        f"{len(labels)} examples in {max_tries} tries at alpha={alpha}; use fewer clients, a larger alpha "
        "(--dirichlet-alpha), an IID split (--iid) or more data"
    )


def iid_partition(n_items: int, n_clients: int, *, seed: int = 0) -> list[list[int]]:
    """A random split into `n_clients` parts whose sizes differ by at most one."""
    if not 1 <= n_clients <= n_items:
        raise ValueError(f"n_clients must be between 1 and n_items={n_items}, got {n_clients}")
    order = np.random.default_rng(seed).permutation(n_items)
    return [sorted(part.tolist()) for part in np.array_split(order, n_clients)]


def label_histogram(labels: Sequence[int], partition: Sequence[Sequence[int]], num_labels: int) -> np.ndarray:
    """clients × labels example counts."""
    labels = np.asarray(labels)
    return np.stack([np.bincount(labels[list(part)], minlength=num_labels) for part in partition])


def token_range_batches(n_clients: int, steps: int, vocab: int, *, batch: int = 2, seq: int = 8,
                        seed: int = 1) -> list[list[dict[str, torch.Tensor]]]:
    """Per client, `steps` language-modelling batches of random tokens from half the vocabulary,
    each client's half shifted by vocab / (2·n_clients): clients whose data differ (non-IID), for
    the simulator's exactness tests and benchmarks."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n_clients):
        low = (i * vocab) // (2 * n_clients)
        ids = torch.randint(low, low + vocab // 2, (steps, batch, seq), generator=g)
        out.append([{"input_ids": x, "labels": x} for x in ids])
    return out


def collate(features: Sequence[dict[str, list[int]]], pad_id: int) -> dict[str, torch.Tensor]:
    """Right-pad to the longest sequence; padded labels are -100 and masked out."""
    length = max(len(f["input_ids"]) for f in features)

    def pad(key: str, value: int) -> torch.Tensor:
        return torch.tensor([f[key] + [value] * (length - len(f[key])) for f in features], dtype=torch.long)

    return {"input_ids": pad("input_ids", pad_id), "labels": pad("labels", -100),
            "attention_mask": pad("attention_mask", 0)}


class ClientStream:
    """One client's endless, deterministic and resumable stream of micro-batches.

    Epoch e visits the client's examples in a permutation drawn from (seed, client, e) alone, so
    any position can be reached in O(1): resuming from `state_dict()` gives exactly the batches
    an uninterrupted stream would have given.
    """

    def __init__(
        self,
        features: Sequence[dict[str, list[int]]],
        indices: Sequence[int],
        batch_size: int,
        *,
        pad_id: int,
        seed: int,
        client: int,
    ) -> None:
        if not indices:
            raise ValueError(f"client {client} has no examples")
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        self.features = features
        self.indices = list(indices)
        self.batch_size = min(batch_size, len(self.indices))
        # The short tail of an epoch is dropped, so every batch has the same size.
        self.batches_per_epoch = len(self.indices) // self.batch_size
        self.pad_id = pad_id
        self.seed = seed
        self.client = client
        self.position = 0
        self._epoch, self._order = -1, []

    def _epoch_order(self, epoch: int) -> list[int]:
        if epoch != self._epoch:
            generator = torch.Generator().manual_seed(self.seed * 1_000_003 + self.client * 10_007 + epoch)
            self._epoch = epoch
            self._order = torch.randperm(len(self.indices), generator=generator).tolist()
        return self._order

    def __iter__(self) -> ClientStream:
        return self

    def __next__(self) -> dict[str, torch.Tensor]:
        epoch, slot = divmod(self.position, self.batches_per_epoch)
        order = self._epoch_order(epoch)[slot * self.batch_size:(slot + 1) * self.batch_size]
        self.position += 1
        return collate([self.features[self.indices[i]] for i in order], self.pad_id)

    def state_dict(self) -> dict:
        return {"position": self.position}

    def load_state_dict(self, state: dict) -> None:
        self.position = int(state["position"])
