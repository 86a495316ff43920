"""Classification by answer likelihood: each label is scored by how likely the model finds its answer."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
from torch import nn
from transformers import PreTrainedTokenizerBase

from ..data import ANSWER, PROMPT, Example, collate, encode
from ..datasets import Record, to_features, verbalize
from ..models import labelled_logits

SCORE_BATCH = 32  # (prompt, label) sequences per scoring forward (deca_ds.memory's eval_batch)


@torch.no_grad()
def score_labels(
    model: nn.Module,
    tokenizer: PreTrainedTokenizerBase,
    prompts: Sequence[str],
    label_words: Sequence[str],
    *,
    max_length: int,
    batch_size: int = SCORE_BATCH,
) -> torch.Tensor:
    """(len(prompts), len(label_words)) log-likelihoods log p(answer | prompt), in float32.

    The answer is scored exactly as `data.encode` lays it out for training: ANSWER's tokens plus
    eos, summed over every position whose label is not -100. So a label's score is minus the
    training loss of that (prompt, answer) pair, and multi-token label words are compared fairly
    as whole sequences. `batch_size` counts (prompt, label) sequences per forward pass.
    """
    pairs = [encode(tokenizer, p, ANSWER.format(word=w), max_length) for p in prompts for w in label_words]
    return score_answers(model, pairs, tokenizer.pad_token_id, batch_size=batch_size).view(
        len(prompts), len(label_words))


@torch.no_grad()
def score_answers(model: nn.Module, pairs: Sequence[dict[str, list[int]]], pad_id: int, *,
                  batch_size: int = SCORE_BATCH) -> torch.Tensor:
    """log p(answer | prompt) of encoded sequences (labels -100 outside the answer), in float32."""
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    try:
        scores = []
        for start in range(0, len(pairs), batch_size):
            batch = {k: v.to(device) for k, v in collate(pairs[start:start + batch_size], pad_id).items()}
            logits, targets = labelled_logits(model, batch)
            answer = targets != -100
            log_probs = logits[answer].float().log_softmax(-1)
            picked = log_probs.gather(-1, targets[answer].unsqueeze(-1)).squeeze(-1)
            rows = answer.nonzero()[:, 0]
            scores.append(torch.zeros(len(targets), device=device).index_add_(0, rows, picked).cpu())
    finally:
        model.train(was_training)
    return torch.cat(scores)


def classification_metrics(y_true: Sequence[int], y_pred: Sequence[int], num_labels: int) -> dict:
    """Accuracy and macro-F1. As scikit-learn's macro average, F1 is averaged over the labels that
    occur in y_true or y_pred; a label never predicted but present has F1 = 0."""
    y_true, y_pred = np.asarray(y_true), np.asarray(y_pred)
    if y_true.shape != y_pred.shape or y_true.size == 0:
        raise ValueError(f"y_true and y_pred must be non-empty and of one length, got {y_true.size} and {y_pred.size}")
    hits = y_true == y_pred
    tp = np.bincount(y_true[hits], minlength=num_labels)
    fp = np.bincount(y_pred[~hits], minlength=num_labels)
    fn = np.bincount(y_true[~hits], minlength=num_labels)
    present = tp + fp + fn > 0
    f1 = 2 * tp[present] / (2 * tp[present] + fp[present] + fn[present])
    return {"accuracy": float(hits.mean()), "macro_f1": float(f1.mean())}


def evaluate_classification(
    model: nn.Module,
    tokenizer: PreTrainedTokenizerBase,
    examples: Sequence[Example],
    label_words: Sequence[str],
    *,
    max_length: int,
    batch_size: int = SCORE_BATCH,
    limit: int | None = None,
) -> dict:
    """Predict each example's label as the argmax of `score_labels`: accuracy, macro-F1, n, chance."""
    examples = examples[:limit]
    scores = score_labels(model, tokenizer, [PROMPT.format(text=ex.text) for ex in examples], label_words,
                          max_length=max_length, batch_size=batch_size)
    y_pred = scores.argmax(-1).numpy()
    metrics = classification_metrics([ex.label for ex in examples], y_pred, len(label_words))
    return {**metrics, "n": len(examples), "chance": 1 / len(label_words)}


@torch.no_grad()
def evaluate_records(model, tokenizer, records: Sequence[Record], label_names: Sequence[str], *, max_length: int,
                     use_chat_template: bool = False, batch_size: int = SCORE_BATCH, limit: int | None = None) -> dict:
    """Classification by answer likelihood, with prompts and answers laid out exactly as
    `to_features` trains them: each label's answer is scored by log p(answer + eos | prompt),
    the argmax is the prediction. Returns accuracy, macro-F1, n, chance."""
    records = list(records)[:limit]
    candidates = [Record(r.prompt, verbalize(name)) for r in records for name in label_names]
    pairs = to_features(tokenizer, candidates, max_length=max_length, use_chat_template=use_chat_template)
    scores = score_answers(model, pairs, tokenizer.pad_token_id, batch_size=batch_size)
    y_pred = scores.view(len(records), len(label_names)).argmax(-1).numpy()
    metrics = classification_metrics([r.label for r in records], y_pred, len(label_names))
    return {**metrics, "n": len(records), "chance": 1 / len(label_names)}
