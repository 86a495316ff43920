"""Generation cells: the question sets a generation task's consensus model answers, and the judge
that grades the answers (the paper's generation table: Vicuna-80 and MT-Bench, judged by GPT-4).

A grid with a generation task (Alpaca, or files with a response column) holds a `generation`
section:

    generation:
      questions: {vicuna: data/vicuna_80.jsonl, mt_bench: data/mt_bench.jsonl}  # set -> questions JSONL
      max_new_tokens: 1024                     # per answered turn (greedy)
      judge:                                   # optional: without it the answers are kept, not graded
        url: https://api.openai.com            # any OpenAI-compatible endpoint
        model: gpt-4
        key_env: OPENAI_API_KEY                # the environment variable holding the key (null: none)
        references: {mt_bench: data/gpt-4.jsonl}  # MT-Bench's reference answers (math, reasoning, coding)

Each generation cell's consensus model answers every set once training has ended (deca-train
--questions, in the cell's process: answers/<set>.jsonl, ROUGE-L where the questions carry
reference answers). Judging is a step of its own (`judge_cells`), after the cells, on the machine
that runs the grid command (compute nodes need no network): every judgment is appended to
answers/<set>.<judge model>.judgments.jsonl as it arrives, so an interrupted run pays for no
judgment twice, and the means go to the cell's scores.json under the judge model's name.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path

from ..files import sha256
from ..runtime.options import SET_NAME

ANSWERS, SCORES = "answers", "scores.json"


class GenerationError(ValueError):
    """A `generation` section that cannot be used as written."""


@dataclass(frozen=True)
class Judge:
    url: str
    model: str
    key_env: str | None = "OPENAI_API_KEY"
    references: dict[str, str] = field(default_factory=dict)  # question set -> reference answers file
    allow_http: bool = False  # plain http to a judge on this machine (a local server)


@dataclass(frozen=True)
class Generation:
    questions: dict[str, str]  # question set -> questions JSONL
    max_new_tokens: int = 512
    judge: Judge | None = None

    def options(self) -> dict:
        """A generation cell's deca-train options: x̄ answers these sets at the end (--questions)."""
        return {"questions": [f"{name}={path}" for name, path in self.questions.items()],
                "max_new_tokens": self.max_new_tokens}

    @cached_property
    def settings(self) -> dict:
        """What decides a cell's answers: each set's questions (by their file's sha256, read once)
        and the length of an answer. The judge is not: its grades are kept per judge model."""
        return {"questions": {name: sha256(Path(path)) for name, path in self.questions.items()},
                "max_new_tokens": self.max_new_tokens}


def _check_keys(where: str, values, known: set) -> None:
    if not isinstance(values, dict):
        raise GenerationError(f"{where} must be a mapping, got {type(values).__name__}")
    unknown = sorted(set(values) - known)
    if unknown:
        raise GenerationError(f"{where}: unknown key(s) {unknown}; known: {sorted(known)}")


def _files(where: str, values) -> dict[str, str]:
    if not isinstance(values, dict) or not values:
        raise GenerationError(f"{where} must map a name to a file, e.g. {{mt_bench: data/mt_bench.jsonl}}")
    bad = [name for name in values if not re.fullmatch(SET_NAME, str(name))]
    if bad:
        raise GenerationError(f"{where}: names {bad} must be letters, digits, '_', '-' or '.' (they name files)")
    missing = [str(path) for path in values.values() if not Path(str(path)).is_file()]
    if missing:
        raise GenerationError(f"{where}: no such file: {', '.join(missing)}")
    return {str(name): str(path) for name, path in values.items()}


def parse_generation(section, where: str) -> Generation:
    """The grid's `generation` section, every file read and checked (questions, reference answers)
    and the judge's URL checked, before any cell runs. The judge's key is read only when judging."""
    from ..evaluation import judge_url, load_references, read_questions

    at = f"{where}: generation"
    _check_keys(at, section, {"questions", "max_new_tokens", "judge"})
    questions = _files(f"{at}.questions", section.get("questions"))
    try:
        for path in questions.values():
            read_questions(path)
    except ValueError as err:  # read_questions names the file and line
        raise GenerationError(f"{at}.questions: {err}") from None
    tokens = section.get("max_new_tokens", 512)
    if not isinstance(tokens, int) or isinstance(tokens, bool) or tokens < 1:
        raise GenerationError(f"{at}.max_new_tokens must be an integer >= 1, got {tokens!r}")
    judge = section.get("judge")
    if judge is not None:
        _check_keys(f"{at}.judge", judge, {"url", "model", "key_env", "references", "allow_http"})
        for key in ("url", "model"):
            if not isinstance(judge.get(key), str) or not judge[key]:
                raise GenerationError(f"{at}.judge.{key} must be text, got {judge.get(key)!r}")
        references = _files(f"{at}.judge.references", judge["references"]) if "references" in judge else {}
        stray = sorted(set(references) - set(questions))
        if stray:
            raise GenerationError(f"{at}.judge.references: {stray} are not question sets (those are "
                                  f"{sorted(questions)})")
        key_env = judge.get("key_env", "OPENAI_API_KEY")
        if key_env is not None and not isinstance(key_env, str):
            raise GenerationError(f"{at}.judge.key_env must be an environment variable's name or null, got {key_env!r}")
        try:
            judge_url(judge["url"], allow_http=bool(judge.get("allow_http", False)))
            for path in references.values():
                load_references(path)
        except ValueError as err:
            raise GenerationError(f"{at}.judge: {err}") from None
        judge = Judge(judge["url"], judge["model"], key_env, references, bool(judge.get("allow_http", False)))
    return Generation(questions, tokens, judge)


# ---- after the cells: the judge -----------------------------------------------------------------------------


def judgments_path(cell_dir: Path, question_set: str, judge_model: str) -> Path:
    return cell_dir / ANSWERS / f"{question_set}.{re.sub(r'[^A-Za-z0-9_.-]+', '_', judge_model)}.judgments.jsonl"


def judged(cell_dir: Path, judge_model: str) -> dict | None:
    """The cell's grades by `judge_model`: {set: {"mean", "n", "n_unparsed", "per_turn"}} once
    every set is judged, else None."""
    path = cell_dir / SCORES
    return json.loads(path.read_text()).get(judge_model) if path.is_file() else None


def judge_cells(cells: list[tuple[str, Path]], generation: Generation, *, log=print, **judge_options) -> dict[str, str]:
    """Judge every answer of the finished generation cells `cells` ((key, directory)) that this
    judge has not graded; returns key -> 'judged' / 'judged before' / 'failed: why' / 'not judged:
    …' (after a failure, which judge_answers has already retried, the cells left wait for the next
    run). The key is read (and a missing one refused) before any request. `judge_options` go to
    judge_answers (tests: opener, sleep)."""
    from ..evaluation import judge_answers, judge_api_key
    from ..files import write_json

    judge = generation.judge
    judge_api_key(judge.key_env)  # ValueError, naming the variable, before the first request
    status = {}
    for i, (key, d) in enumerate(cells, 1):
        if judged(d, judge.model) is not None:
            status[key] = "judged before"
            continue
        if any(s.startswith("failed") for s in status.values()):
            status[key] = "not judged: the judge failed on an earlier cell"
            continue
        try:
            grades = {}
            for name in generation.questions:
                result = judge_answers(d / ANSWERS / f"{name}.jsonl", endpoint_url=judge.url, model=judge.model,
                                       api_key_env=judge.key_env, out_path=judgments_path(d, name, judge.model),
                                       references=judge.references.get(name), allow_http=judge.allow_http,
                                       **judge_options)
                grades[name] = {k: result[k] for k in ("mean", "n", "n_unparsed")} | {
                    "per_turn": {str(t): s for t, s in result["per_turn"].items()}}
        except (OSError, ValueError) as err:
            status[key] = f"failed: {err}"
            log(f"[judge {i}/{len(cells)}] {key}: {status[key]}")
            continue
        scores = json.loads((d / SCORES).read_text()) if (d / SCORES).is_file() else {}
        write_json(d / SCORES, scores | {judge.model: grades})
        status[key] = "judged"
        log(f"[judge {i}/{len(cells)}] {key}: " + ", ".join(f"{name} {g['mean']:.2f}" for name, g in grades.items()
                                                            if g["mean"] is not None))
    return status
