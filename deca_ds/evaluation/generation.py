"""Generation evaluation: answers to a questions file (Vicuna-80 / MT-Bench JSONL) and ROUGE-L
against the reference answers the questions carry."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator, Mapping, Sequence
from functools import lru_cache
from pathlib import Path
from typing import Any

import torch

from ..datasets import alpaca_prompt, render_chat
from ..files import write_text


@lru_cache(maxsize=1)
def _scorer():
    from rouge_score import rouge_scorer

    return rouge_scorer.RougeScorer(["rougeL"], use_stemmer=False)


def rouge_l(prediction: str, reference: str) -> float:
    """ROUGE-L F-measure as the `rouge-score` library computes it (Lin 2004): text lower-cased,
    split into runs of ASCII letters and digits (punctuation dropped), no stemming; 0 when either
    side has no token. Non-ASCII letters are not tokens for this tokenizer."""
    return _scorer().score(reference, prediction)["rougeL"].fmeasure


def read_questions(path: str | os.PathLike) -> list[dict]:
    """Vicuna-80 / MT-Bench style questions: one JSON object a line with "question_id" and
    "turns": [str, ...] (MT-Bench) or "text": str (Vicuna); "category" is kept where present. Each
    question_id once: answers, references and judgments are matched by it."""
    questions, lines = [], {}
    for n, q in read_jsonl(path):
        turns = q.get("turns", [q["text"]] if "text" in q else None) if isinstance(q, dict) else None
        if not turns or "question_id" not in q or not all(isinstance(t, str) for t in turns):
            raise ValueError(f"{path}:{n}: a question needs 'question_id' and 'turns' (list of str) or 'text'")
        qid = q["question_id"]
        if isinstance(qid, bool) or not isinstance(qid, (int, str)):
            raise ValueError(f"{path}:{n}: question_id must be an integer or a string, got {qid!r}")
        if qid in lines:
            raise ValueError(f"{path}:{n}: question_id {qid!r} is also line {lines[qid]}'s: give each question its "
                             "own (answers and judgments are matched by it)")
        lines[qid] = n
        reference = q.get("reference")
        if isinstance(reference, str):
            reference = [reference]
        if reference is not None and (len(reference) > len(turns) or not all(isinstance(r, str) for r in reference)):
            raise ValueError(f"{path}:{n}: 'reference' must be a string or one string per turn")
        questions.append({"question_id": q["question_id"], "turns": list(turns),
                          **({"category": q["category"]} if "category" in q else {}),
                          **({"reference": list(reference)} if reference is not None else {})})
    if not questions:
        raise ValueError(f"{path}: holds no questions")
    return questions


def read_jsonl(path: str | os.PathLike) -> Iterator[tuple[int, Any]]:
    """(line number, value) of every non-blank line of a JSON-lines file (questions, answers,
    reference answers); a line that is not JSON raises, naming the file and the line."""
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if line.strip():
                try:
                    value = json.loads(line)
                except json.JSONDecodeError as e:
                    raise ValueError(f"{path}:{n}: not JSON: {e}") from e
                yield n, value


def conversation_prompt(tokenizer, turns: Sequence[str], answers: Sequence[str], *, use_chat_template: bool) -> str:
    """The prompt for the next answer: with a chat template, the conversation as messages; without,
    the Alpaca prompt of the first turn followed by "### Instruction:/### Response:" exchanges."""
    if use_chat_template:
        messages = []
        for k, turn in enumerate(turns):
            messages.append({"role": "user", "content": turn})
            if k < len(answers):
                messages.append({"role": "assistant", "content": answers[k]})
        return render_chat(tokenizer, messages)
    text = alpaca_prompt(turns[0])
    for k in range(1, len(turns)):
        text += f"{answers[k - 1]}\n\n### Instruction:\n{turns[k]}\n\n### Response:\n"
    return text


@torch.no_grad()
def generate_answers(model, tokenizer, questions_jsonl_path: str | os.PathLike, out_jsonl_path: str | os.PathLike, *,
                     max_new_tokens: int = 512, batch_size: int = 8,
                     use_chat_template: bool | None = None) -> list[dict]:
    """Greedy answers to every turn of every question; turn k sees the earlier turns and the
    model's own earlier answers. Writes {"question_id", "turns", "answers"} (and "category") per
    line to `out_jsonl_path` and returns the rows. `use_chat_template=None`: use the tokenizer's
    chat template where it has one."""
    questions = read_questions(questions_jsonl_path)
    if use_chat_template is None:
        use_chat_template = bool(getattr(tokenizer, "chat_template", None))
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    if pad is None:
        raise ValueError("generate_answers: the tokenizer has neither a pad nor an eos token")
    bos = [tokenizer.bos_token_id] if tokenizer.bos_token_id is not None else []
    limit = getattr(getattr(model, "config", None), "max_position_embeddings", None)
    device = next(model.parameters()).device
    answers: list[list[str]] = [[] for _ in questions]
    was_training = model.training
    model.eval()
    try:
        for turn in range(max(len(q["turns"]) for q in questions)):
            todo = [i for i, q in enumerate(questions) if len(q["turns"]) > turn]
            for start in range(0, len(todo), batch_size):
                chunk = todo[start:start + batch_size]
                ids = []
                for i in chunk:
                    prompt = conversation_prompt(tokenizer, questions[i]["turns"][:turn + 1], answers[i],
                                                 use_chat_template=use_chat_template)
                    body = tokenizer(prompt, add_special_tokens=False)["input_ids"]
                    if limit is not None:  # keep the end of a long conversation
                        body = body[max(len(body) - (limit - max_new_tokens - len(bos)), 0):]
                    ids.append(bos + body)
                length = max(map(len, ids))  # left padding: every prompt ends where generation starts
                input_ids = torch.tensor([[pad] * (length - len(x)) + x for x in ids], device=device)
                mask = torch.tensor([[0] * (length - len(x)) + [1] * len(x) for x in ids], device=device)
                out = model.generate(input_ids=input_ids, attention_mask=mask, max_new_tokens=max_new_tokens,
                                     do_sample=False, pad_token_id=pad, eos_token_id=tokenizer.eos_token_id)
                for i, row in zip(chunk, out[:, length:].tolist()):
                    answers[i].append(tokenizer.decode(row, skip_special_tokens=True).strip())
    finally:
        model.train(was_training)
    rows = [{"question_id": q["question_id"], "turns": q["turns"], "answers": a,
             **{k: q[k] for k in ("category", "reference") if k in q}} for q, a in zip(questions, answers)]
    write_text(Path(out_jsonl_path), "".join(json.dumps(r, ensure_ascii=False, allow_nan=False) + "\n" for r in rows))
    return rows


def answer_sets(model, tokenizer, questions: Mapping[str, str | os.PathLike], out_dir: str | os.PathLike, *,
                max_new_tokens: int = 512) -> dict:
    """generate_answers for each question set {name: questions JSONL} into out_dir/NAME.jsonl; per
    set the questions and turns answered and, where the questions carry reference answers, their
    ROUGE-L (deca-train --questions, the reproduction grid's generation cells)."""
    results = {}
    for name, path in questions.items():
        rows = generate_answers(model, tokenizer, path, Path(out_dir) / f"{name}.jsonl", max_new_tokens=max_new_tokens)
        rouge = rouge_l_of_answers(rows)
        results[name] = {"questions": len(rows), "turns": sum(len(r["answers"]) for r in rows),
                         **({"rouge_l": rouge["rouge_l"]} if rouge else {})}
    return results


def rouge_l_of_answers(rows: Sequence[dict]) -> dict | None:
    """Mean ROUGE-L F over every answered turn that has a reference answer (offline, no judge);
    None when no question carries a "reference"."""
    scores = [rouge_l(answer, reference) for row in rows
              for answer, reference in zip(row["answers"], row.get("reference", []))]
    return {"rouge_l": sum(scores) / len(scores), "n": len(scores)} if scores else None


