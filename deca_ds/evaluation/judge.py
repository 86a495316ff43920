"""MT-Bench single-answer grading by an LLM judge behind an OpenAI-compatible chat-completions
endpoint, with FastChat's judge prompts (`single-v1`, and `single-math-v1` with the reference
answer for the math, reasoning and coding categories; their multi-turn forms for later turns).

Every judgment is appended to a JSONL file as it arrives, so an interrupted run resumes where it
stopped; transient HTTP errors (429, 5xx, timeouts, dropped connections) are retried with
exponential backoff. The API key is read from the environment, sent only in the Authorization
header of requests to the configured https endpoint (plain http only to localhost, and only when
allowed), never across a redirect, and never logged, returned or written.
"""

from __future__ import annotations

import hashlib
import http.client
import json
import logging
import os
import re
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

from ..files import write_text
from .endpoint import RedirectRefused, judge_api_key, judge_url, safe_opener
from .generation import read_jsonl

log = logging.getLogger(__name__)

NEED_REFERENCE = frozenset({"math", "reasoning", "coding"})  # FastChat's NEED_REF_CATS for MT-Bench
TRANSIENT_HTTP = frozenset({408, 409, 425, 429})  # and every 5xx

_RATING_RULE = ("After providing your explanation, you must rate the response on a scale of 1 to 10 by strictly "
                "following this format: \"[[rating]]\", for example: \"Rating: [[5]]\".")
_GENERAL = ("Your evaluation should consider factors such as the helpfulness, relevance, accuracy, depth, creativity, "
            "and level of detail of the response.")
_WITH_REFERENCE = ("Your evaluation should consider correctness and helpfulness. You will be given a reference answer "
                   "and the assistant's answer.")
_COMPARE = ("Begin your evaluation by comparing the assistant's answer with the reference answer. Identify and "
            "correct any mistakes.")
_ORDINALS = ("first", "second", "third", "fourth", "fifth")

_RATING = re.compile(r"\[\[\s*(\d+(?:\.\d+)?)\s*\]\]")
_RATING_LOOSE = re.compile(r"Rating:\s*\[?\s*(\d+(?:\.\d+)?)")


def parse_rating(judgment: str) -> float | None:
    """The score of an MT-Bench style judgment: the last "[[x]]", else "Rating: x"; None if absent."""
    for pattern in (_RATING, _RATING_LOOSE):
        found = pattern.findall(judgment)
        if found:
            return float(found[-1])
    return None


def _ordinal(turn: int) -> str:
    return _ORDINALS[turn] if turn < len(_ORDINALS) else f"{turn + 1}th"


def judge_prompt(turns: Sequence[str], answers: Sequence[str], turn: int,
                 reference: Sequence[str] | None = None) -> tuple[str, str, str]:
    """(prompt name, system message, user message) for answer `turn` (0-based), in FastChat's
    single-answer grading format: `single-v1` / `single-math-v1` (with `reference`) for the first
    turn, their `-multi-turn` forms, which show the conversation so far, for later ones."""
    name = "single-math-v1" if reference is not None else "single-v1"
    if turn == 0:
        rule = (f"{_WITH_REFERENCE} {_COMPARE}" if reference is not None
                else f"{_GENERAL} Begin your evaluation by providing a short explanation.")
        text = ("[Instruction]\nPlease act as an impartial judge and evaluate the quality of the response provided "
                f"by an AI assistant to the user question displayed below. {rule} Be as objective as possible. "
                f"{_RATING_RULE}\n\n[Question]\n{turns[0]}\n\n")
        if reference is not None:
            text += f"[The Start of Reference Answer]\n{reference[0]}\n[The End of Reference Answer]\n\n"
        text += f"[The Start of Assistant's Answer]\n{answers[0]}\n[The End of Assistant's Answer]"
        return name, "You are a helpful assistant.", text
    # FastChat's words, its typo ("You evaluation") included, so scores compare with published MT-Bench ones
    focus = f"You evaluation should focus on the assistant's answer to the {_ordinal(turn)}"
    focus += " question." if reference is not None else " user question."
    if reference is not None:
        system = ("Please act as an impartial judge and evaluate the quality of the response provided by an AI "
                  f"assistant to the user question. {_WITH_REFERENCE} {focus} {_COMPARE} Be as objective as "
                  f"possible. {_RATING_RULE}\n\n")
    else:
        system = ("Please act as an impartial judge and evaluate the quality of the response provided by an AI "
                  f"assistant to the user question displayed below. {_GENERAL} {focus} Begin your evaluation by "
                  f"providing a short explanation. Be as objective as possible. {_RATING_RULE}\n\n")
    text = ""
    if reference is not None:
        text += "<|The Start of Reference Answer|>\n\n"
        for k in range(turn + 1):
            text += f"### User:\n{turns[k]}\n\n### Reference answer:\n{reference[k]}\n\n"
        text += "<|The End of Reference Answer|>\n\n\n"
    text += "<|The Start of Assistant A's Conversation with User|>\n\n"
    for k in range(turn + 1):
        text += f"### User:\n{turns[k]}\n\n### Assistant A:\n{answers[k]}\n\n"
    text += "<|The End of Assistant A's Conversation with User|>"
    return name + "-multi-turn", system, text


def load_references(path: str | os.PathLike) -> dict:
    """Reference answers by question id from FastChat's `reference_answer/<model>.jsonl`
    ({"question_id", "choices": [{"turns": [...]}]}) or {"question_id", "reference": str | [str]} lines."""
    refs = {}
    for n, row in read_jsonl(path):
        try:
            turns = row["choices"][0]["turns"] if "choices" in row else row["reference"]
            refs[row["question_id"]] = [turns] if isinstance(turns, str) else list(turns)
        except (KeyError, IndexError, TypeError) as e:
            raise ValueError(f"{path}:{n}: not a reference answer line ({type(e).__name__}: {e}); expected "
                             '{"question_id", "choices": [{"turns": [...]}]} or '
                             '{"question_id", "reference"}') from None
    return refs


def read_judgments(path: Path) -> list[dict]:
    """The judgments already written to `path`; a last line cut off by a crash is dropped from the file."""
    if not path.exists():
        return []
    text = path.read_text(encoding="utf-8")
    if text and not text.endswith("\n"):
        text = text[:text.rfind("\n") + 1]
        write_text(path, text)
    rows = []
    for n, line in enumerate(text.splitlines(), 1):
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}:{n}: not a judgment line ({e}); move the file away to judge again") from None
    return rows


def _post(url: str, body: dict, key: str | None, *, opener, sleep: Callable[[float], None], timeout: float,
          retries: int, backoff: float, what: str) -> str:
    headers = {"Content-Type": "application/json"}
    if key:
        headers["Authorization"] = f"Bearer {key}"
    data = json.dumps(body, allow_nan=False).encode()
    for attempt in range(retries + 1):
        request = urllib.request.Request(url, data=data, headers=headers, method="POST")
        try:
            with opener.open(request, timeout=timeout) as response:
                reply = json.loads(response.read().decode("utf-8"))
            return reply["choices"][0]["message"]["content"] or ""
        except RedirectRefused:
            raise
        except urllib.error.HTTPError as e:
            detail = e.read().decode("utf-8", "replace")[:500]
            if not (e.code in TRANSIENT_HTTP or e.code >= 500) or attempt == retries:
                raise ValueError(f"judge endpoint {url} answered HTTP {e.code} for {what}"
                                 f"{f' after {attempt + 1} attempts' if attempt else ''}: {detail}") from None
            delay = backoff * 2**attempt
            retry_after = e.headers.get("Retry-After", "") if e.headers else ""
            if retry_after.strip().isdigit():
                delay = max(delay, min(float(retry_after), 60.0))
            log.warning("judge: HTTP %d for %s, retrying in %.1f s", e.code, what, delay)
        except (urllib.error.URLError, http.client.HTTPException, OSError) as e:
            if attempt == retries:
                raise ValueError(f"judge endpoint {url} failed for {what} after {attempt + 1} attempts: "
                                 f"{type(e).__name__}: {e}") from None
            delay = backoff * 2**attempt
            log.warning("judge: %s for %s, retrying in %.1f s", type(e).__name__, what, delay)
        except (KeyError, IndexError, TypeError, json.JSONDecodeError) as e:
            raise ValueError(f"judge endpoint {url} sent a reply without choices[0].message.content for {what}: "
                             f"{type(e).__name__}: {e}") from None
        sleep(delay)
    raise AssertionError("unreachable")


def judge_answers(
    answers_path: str | os.PathLike,
    *,
    endpoint_url: str,
    model: str,
    api_key_env: str | None = "OPENAI_API_KEY",
    out_path: str | os.PathLike | None = None,
    references: str | os.PathLike | Mapping | None = None,
    allow_http: bool = False,
    timeout: float = 120.0,
    retries: int = 6,
    backoff: float = 2.0,
    max_tokens: int = 2048,
    temperature: float = 0.0,
    opener: urllib.request.OpenerDirector | None = None,
    sleep: Callable[[float], None] = time.sleep,
) -> dict:
    """Score every answer of `generate_answers`' output (one judgment per turn).

    Reference answers come from `references` (a FastChat reference-answer JSONL or a mapping
    question id -> [answer per turn]) or from the answers' own "reference"; questions of the
    categories in `NEED_REFERENCE` are graded against them and refused (before any request) when
    they have none. Judgments are appended to `out_path` (default: <answers>.judgments.jsonl) as
    {"question_id", "turn", "score", "judgment", "judge_model", "prompt", "asked"} lines, each
    flushed to disk as it arrives ("asked": SHA-256 of the judge model and the prompt sent). A turn
    judged there before with the same prompt is skipped; one whose answer or reference changed
    since is judged again, and the newer line wins. Returns
    {"mean", "n", "n_unparsed", "per_turn", "out_path"} over every judgment of these answers.

    A transient failure (HTTP 408/409/425/429/5xx, timeout, dropped connection) is retried up to
    `retries` times after `backoff` * 2**attempt seconds (at least a server's Retry-After, at most
    60 s of it), waited with `sleep`. `opener` sends the requests (default: `endpoint.safe_opener()`,
    which refuses redirects).
    """
    url = judge_url(endpoint_url, allow_http=allow_http)
    key = judge_api_key(api_key_env)
    opener = opener if opener is not None else safe_opener()
    answers_path = Path(answers_path)
    out_path = Path(out_path) if out_path is not None else answers_path.with_suffix(".judgments.jsonl")
    rows = [row for _, row in read_jsonl(answers_path)]
    if not isinstance(references, Mapping):
        references = load_references(references) if references is not None else {}

    def reference_of(row: dict) -> list[str] | None:
        if row.get("category") not in NEED_REFERENCE:
            return None
        ref = references.get(row["question_id"], row.get("reference"))
        if ref is None or len(ref) < len(row["answers"]):
            raise ValueError(f"judge: question {row['question_id']} ({row['category']}) is graded against a "
                             f"reference answer for each turn and has {0 if ref is None else len(ref)} of "
                             f"{len(row['answers'])} (give them with references=/--judge-references)")
        return list(ref)

    plan = [(row, reference_of(row)) for row in rows]  # every missing reference is reported before a request

    def scrub(text: str) -> str:
        return text.replace(key, "***") if key else text

    done = {}
    for n, j in enumerate(read_judgments(out_path), 1):
        if j.get("judge_model") != model:
            raise ValueError(f"{out_path}:{n}: judged by {j.get('judge_model')!r}, not {model!r}; "
                             "give another out_path to judge with another model")
        done[(j["question_id"], j["turn"])] = j
    out_path.parent.mkdir(parents=True, exist_ok=True)
    with open(out_path, "a", encoding="utf-8") as out:
        for row, reference in plan:
            for turn in range(len(row["answers"])):
                name, system, prompt = judge_prompt(row["turns"], row["answers"], turn, reference)
                asked = hashlib.sha256(f"{model}\0{system}\0{prompt}".encode()).hexdigest()
                if done.get((row["question_id"], turn + 1), {}).get("asked") == asked:
                    continue  # judged before, on this very question, answer and reference
                body = {"model": model, "temperature": temperature, "max_tokens": max_tokens,
                        "messages": [{"role": "system", "content": system}, {"role": "user", "content": prompt}]}
                what = f"question {row['question_id']} turn {turn + 1}"
                try:
                    judgment = _post(url, body, key, opener=opener, sleep=sleep, timeout=timeout, retries=retries,
                                     backoff=backoff, what=what)
                except (ValueError, RedirectRefused) as e:
                    reason = e.reason if isinstance(e, RedirectRefused) else str(e)
                    raise ValueError(scrub(f"{reason} ({len(done)} judgments are kept in {out_path}; run again to "
                                           "resume)")) from None
                score = parse_rating(judgment)
                if score is None:
                    log.warning("judge: no rating in the judgment of %s", what)
                record = {"question_id": row["question_id"], "turn": turn + 1, "score": score,
                          "judgment": scrub(judgment), "judge_model": model, "prompt": name, "asked": asked}
                # one write of a whole line in append mode, then to disk: a crash loses at most this line
                out.write(json.dumps(record, ensure_ascii=False, allow_nan=False) + "\n")
                out.flush()
                os.fsync(out.fileno())
                done[(row["question_id"], turn + 1)] = record
    results = [done[(row["question_id"], t + 1)] for row in rows for t in range(len(row["answers"]))]
    scored = [r for r in results if r["score"] is not None]
    per_turn = {}
    for t in sorted({r["turn"] for r in scored}):
        s = [r["score"] for r in scored if r["turn"] == t]
        per_turn[t] = sum(s) / len(s)
    return {"mean": sum(r["score"] for r in scored) / len(scored) if scored else None, "n": len(scored),
            "n_unparsed": len(results) - len(scored), "per_turn": per_turn, "out_path": str(out_path)}
