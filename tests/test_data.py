"""The synthetic task, word tokenizer, encoding, client partitions and resumable client streams."""

from collections import Counter

import numpy as np
import pytest
from transformers import AutoTokenizer

from deca_ds.data import (
    ANSWER,
    PROMPT,
    ClientStream,
    SyntheticTask,
    build_word_tokenizer,
    collate,
    dirichlet_partition,
    encode,
    encode_examples,
    iid_partition,
    label_histogram,
)

TASK = SyntheticTask(train_size=400, test_size=100)


@pytest.fixture(scope="module")
def data():
    return TASK.generate()


@pytest.fixture(scope="module")
def tokenizer():
    return build_word_tokenizer(TASK.vocabulary())


def test_task_is_deterministic_and_balanced(data):
    train, test = data
    assert (train, test) == TASK.generate()
    assert SyntheticTask(train_size=400, test_size=100, seed=1).generate()[0] != train
    assert len(train) == 400 and len(test) == 100
    counts = Counter(ex.label for ex in train + test)
    assert set(counts.values()) == {500 // TASK.num_labels}


def test_label_is_the_majority_keyword(data):
    keyword_label = {w: k for k in range(TASK.num_labels) for w in TASK.keywords(k)}
    for ex in data[0] + data[1]:
        words = ex.text.split()
        assert len(words) == TASK.words_per_example
        counts = Counter(keyword_label[w] for w in words if w in keyword_label)
        assert counts[ex.label] == TASK.keywords_per_example
        assert all(n < counts[ex.label] for k, n in counts.items() if k != ex.label)
        assert sum(counts.values()) == TASK.keywords_per_example + TASK.distractors_per_example


def test_task_rejects_a_distractor_majority():
    with pytest.raises(ValueError, match="distractors_per_example"):
        SyntheticTask(keywords_per_example=2, distractors_per_example=2)


def test_tokenizer_covers_the_task_and_round_trips(data, tokenizer, tmp_path):
    assert len(set(TASK.label_words)) == TASK.num_labels
    texts = [PROMPT.format(text=ex.text) + ANSWER.format(word=TASK.label_words[ex.label]) for ex in data[0] + data[1]]
    ids = tokenizer(texts, add_special_tokens=False)["input_ids"]
    assert all(tokenizer.unk_token_id not in seq for seq in ids)
    assert [len(seq) for seq in ids] == [len(t.split()) for t in texts]  # one token per word
    for word in TASK.label_words:
        assert len(tokenizer(ANSWER.format(word=word), add_special_tokens=False)["input_ids"]) == 1

    tokenizer.save_pretrained(tmp_path)
    loaded = AutoTokenizer.from_pretrained(tmp_path)
    assert loaded(texts, add_special_tokens=False)["input_ids"] == ids
    assert (loaded.pad_token_id, loaded.unk_token_id, loaded.eos_token_id) == (0, 1, 2)
    assert len(loaded) == len(tokenizer) == len(TASK.vocabulary()) + 3


def test_encode_masks_the_prompt(tokenizer):
    prompt, answer = "w1 k0.2 w3 =>", " label0"
    f = encode(tokenizer, prompt, answer, max_length=32)
    prompt_ids = tokenizer.convert_tokens_to_ids(prompt.split())
    answer_ids = tokenizer.convert_tokens_to_ids(["label0"]) + [tokenizer.eos_token_id]
    assert f["input_ids"] == prompt_ids + answer_ids
    assert f["labels"] == [-100] * len(prompt_ids) + answer_ids
    assert f["attention_mask"] == [1] * len(prompt_ids + answer_ids)


def test_truncation_cuts_the_prompt_from_the_left_only(tokenizer):
    prompt = "w1 w2 w3 w4 w5 =>"
    f = encode(tokenizer, prompt, " label3", max_length=4)
    assert tokenizer.convert_ids_to_tokens(f["input_ids"]) == ["w5", "=>", "label3", "<eos>"]
    assert f["labels"][:2] == [-100, -100] and f["labels"][2:] == f["input_ids"][2:]
    with pytest.raises(ValueError, match="cannot hold the answer"):
        encode(tokenizer, prompt, " label0 label1", max_length=3)


def test_truncation_keeps_bos():
    tok = build_word_tokenizer(TASK.vocabulary())
    tok.add_special_tokens({"bos_token": "<bos>"})
    f = encode(tok, "w1 w2 w3 =>", " label1", max_length=5)
    assert tok.convert_ids_to_tokens(f["input_ids"]) == ["<bos>", "w3", "=>", "label1", "<eos>"]
    assert f["labels"][:3] == [-100] * 3


def test_text_the_tokenizer_reads_as_no_tokens_is_refused():
    """A BPE tokenizer without an unknown token drops what its vocabulary lacks (transformers 5 also
    loads a word-level tokenizer.json beside a Qwen2 config.json as such a tokenizer): an example
    would hold no token to learn, and the first step's loss would be NaN. An empty answer is not such
    text (a generation example may end at once: eos is its answer)."""
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.BPE(vocab={"<eos>": 0, "a": 1}, merges=[]))
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<eos>")
    assert encode(tok, "a", "", max_length=8)["input_ids"] == [1, 0]
    with pytest.raises(ValueError, match=r"the tokenizer \(\w+\) turns the prompt 'w1 w2 =>' "
                                         "into no tokens"):
        encode(tok, "w1 w2 =>", "a", max_length=8)
    with pytest.raises(ValueError, match="turns the answer ' yes' into no tokens"):
        encode(tok, "a", " yes", max_length=8)


def test_collate_pads_right():
    batch = collate([{"input_ids": [5, 6, 7], "labels": [-100, 6, 7], "attention_mask": [1, 1, 1]},
                     {"input_ids": [8], "labels": [8], "attention_mask": [1]}], pad_id=0)
    assert batch["input_ids"].tolist() == [[5, 6, 7], [8, 0, 0]]
    assert batch["labels"].tolist() == [[-100, 6, 7], [8, -100, -100]]
    assert batch["attention_mask"].tolist() == [[1, 1, 1], [1, 0, 0]]


def _labels(n=400, num_labels=4):
    return np.random.default_rng(5).integers(num_labels, size=n).tolist()


def test_dirichlet_partition_is_a_deterministic_split():
    labels = _labels()
    parts = dirichlet_partition(labels, 5, 0.25, seed=3, min_size=10)
    assert parts == dirichlet_partition(labels, 5, 0.25, seed=3, min_size=10)
    assert parts != dirichlet_partition(labels, 5, 0.25, seed=4, min_size=10)
    assert sorted(i for p in parts for i in p) == list(range(len(labels)))  # disjoint and complete
    assert all(p == sorted(p) and len(p) >= 10 for p in parts)
    assert label_histogram(labels, parts, 4).sum(0).tolist() == np.bincount(labels, minlength=4).tolist()


def test_dirichlet_partition_gives_up_with_a_message():
    with pytest.raises(ValueError, match=r"at least 101 of 400 examples in 7 tries"):
        dirichlet_partition(_labels(), 4, 0.25, min_size=101, max_tries=7)


def _mean_label_skew(alpha):
    labels = _labels(2000)
    hist = label_histogram(labels, dirichlet_partition(labels, 8, alpha, seed=0), 4)
    client = hist / hist.sum(1, keepdims=True)
    overall = hist.sum(0) / hist.sum()
    return 0.5 * np.abs(client - overall).sum(1).mean()  # total-variation distance


def test_small_alpha_skews_labels():
    skewed, near_iid = _mean_label_skew(0.25), _mean_label_skew(100.0)
    assert skewed > 0.3 > 0.1 > near_iid


def test_iid_partition():
    parts = iid_partition(10, 3, seed=1)
    assert sorted(len(p) for p in parts) == [3, 3, 4]
    assert sorted(i for p in parts for i in p) == list(range(10))
    assert parts == iid_partition(10, 3, seed=1) != iid_partition(10, 3, seed=2)


def _features(n):
    # input_ids [i] identify the example a batch row came from.
    return [{"input_ids": [i], "labels": [i], "attention_mask": [1]} for i in range(n)]


def _take(stream, k):
    return [next(stream)["input_ids"][:, 0].tolist() for _ in range(k)]


def test_client_stream_epochs_are_permutations():
    indices = list(range(3, 13))  # 10 examples, batch 3: 3 batches an epoch, one example dropped
    batches = _take(ClientStream(_features(20), indices, 3, pad_id=0, seed=0, client=0), 6)
    for epoch in (batches[:3], batches[3:]):
        seen = [i for b in epoch for i in b]
        assert len(seen) == len(set(seen)) == 9 and set(seen) <= set(indices)
    assert batches[:3] != batches[3:]
    small = ClientStream(_features(20), [4, 7], 5, pad_id=0, seed=0, client=0)
    assert all(sorted(b) == [4, 7] for b in _take(small, 3))


def test_client_stream_is_deterministic_per_client():
    def stream(seed=0, client=0):
        return ClientStream(_features(30), list(range(30)), 4, pad_id=0, seed=seed, client=client)

    assert _take(stream(), 10) == _take(stream(), 10)
    assert _take(stream(), 10) != _take(stream(client=1), 10)
    assert _take(stream(), 10) != _take(stream(seed=1), 10)


@pytest.mark.parametrize("k", [0, 2, 3, 7])  # 3 batches an epoch: 3 and 7 sit past epoch boundaries
def test_client_stream_resumes_exactly(k):
    features, indices = _features(10), list(range(10))
    reference = ClientStream(features, indices, 3, pad_id=0, seed=2, client=1)
    expected = _take(reference, k + 5)[k:]
    resumed = ClientStream(features, indices, 3, pad_id=0, seed=2, client=1)
    resumed.load_state_dict({"position": k})
    assert _take(resumed, 5) == expected
    assert resumed.state_dict() == reference.state_dict() == {"position": k + 5}


def test_client_stream_over_encoded_examples(data, tokenizer):
    train = data[0]
    features = encode_examples(tokenizer, train, TASK.label_words, max_length=32)
    batch = next(ClientStream(features, list(range(len(train))), 8, pad_id=tokenizer.pad_token_id, seed=0, client=0))
    assert batch["input_ids"].shape == (8, TASK.words_per_example + 3)  # words, "=>", label, eos
    assert ((batch["labels"] != -100).sum(1) == 2).all()
