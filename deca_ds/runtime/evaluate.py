"""launch/evaluate.py: evaluate an exported model (e.g. <output>/consensus) on one process.

Classification: accuracy and macro-F1 by label likelihood on the task's test split, with the
same data options as training. Generation: answers to a questions file (Vicuna-80 / MT-Bench
JSONL), ROUGE-L where the questions carry reference answers, and optionally an LLM judge behind
an OpenAI-compatible endpoint (off unless --judge-url is given; the key is read from the
environment and never written).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from .options import TASK_NAMES, RunOptions

if TYPE_CHECKING:
    import torch

# torch, transformers and the tasks load in the functions that use them: `--help` and a refused
# argument answer at once.


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="launch/evaluate.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, help="exported model directory (or hub id)")
    p.add_argument("--dataset", default=None, choices=("synthetic", *TASK_NAMES, "files"),
                   help="classification task to score (as in launch/train.py)")
    p.add_argument("--data-files", nargs="+", default=None, help="split=path, as in launch/train.py")
    for col in ("text-column", "text-pair-column", "label-column", "response-column"):
        p.add_argument(f"--{col}", default=None)
    p.add_argument("--label-names", nargs="+", default=None)
    p.add_argument("--chat-template", action="store_true")
    p.add_argument("--max-seq-len", type=int, default=512)
    p.add_argument("--eval-limit", type=int, default=0, help="test examples scored (0 = all)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--questions", help="questions JSONL (generation)")
    p.add_argument("--answers", help="where the answers JSONL goes (default: beside --out)")
    p.add_argument("--max-new-tokens", type=int, default=512)
    p.add_argument("--judge-url", default=None, help="OpenAI-compatible endpoint of a judge (off by default)")
    p.add_argument("--judge-model", default="gpt-4o")
    p.add_argument("--judge-key-env", default="OPENAI_API_KEY", help="environment variable holding the key")
    p.add_argument("--judge-references", default=None,
                   help="reference answers (FastChat reference_answer JSONL) for math/reasoning/coding questions")
    p.add_argument("--judge-allow-http", action="store_true",
                   help="allow a plain http judge URL, only to localhost / 127.0.0.1 (https otherwise)")
    p.add_argument("--trust-remote-code", action="store_true")
    p.add_argument("--out", required=True, help="JSON file of the results")
    return p


def load_export(path: str, *, dtype: torch.dtype, trust_remote_code: bool = False):
    """An exported model (consensus/ or clients/client_NNN/) as it computes: a Dec-Adapter
    export is its base plus the adapters in its adapter/ folder; every other export is complete."""
    from ..methods import load_adapters, saved_adapters
    from ..models import load_model

    model = load_model(path, dtype=dtype, trust_remote_code=trust_remote_code)
    adapters = saved_adapters(path)
    return model if adapters is None else load_adapters(model, adapters)


def evaluate(args: argparse.Namespace) -> dict:
    import torch

    from ..evaluation import generate_answers, judge_answers, judge_api_key, judge_url, rouge_l_of_answers
    from ..models import load_tokenizer
    from .task import evaluator

    if args.dataset is None and args.questions is None:
        raise ValueError("nothing to evaluate: give --dataset (classification) and/or --questions (generation)")
    if args.judge_url:  # a bad judge URL or a missing key is reported before any model is loaded
        if args.questions is None:
            raise ValueError("--judge-url grades generated answers: give --questions too")
        judge_url(args.judge_url, allow_http=args.judge_allow_http)
        judge_api_key(args.judge_key_env)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    model = load_export(args.model, dtype=torch.bfloat16 if device.type == "cuda" else torch.float32,
                        trust_remote_code=args.trust_remote_code).to(device)
    results: dict = {"model": args.model}
    if args.dataset is not None:
        opts = RunOptions(model=args.model, dataset=args.dataset, data_files=args.data_files,
                          text_column=args.text_column, text_pair_column=args.text_pair_column,
                          label_column=args.label_column, label_names=args.label_names,
                          response_column=args.response_column, chat_template=args.chat_template,
                          max_seq_len=args.max_seq_len, eval_limit=args.eval_limit, seed=args.seed,
                          trust_remote_code=args.trust_remote_code)
        results["classification"] = evaluator(opts)(model, args.eval_limit or None)
    if args.questions is not None:
        answers = Path(args.answers or Path(args.out).with_suffix(".answers.jsonl"))
        tokenizer = load_tokenizer(args.model, trust_remote_code=args.trust_remote_code)
        rows = generate_answers(model, tokenizer, args.questions, answers, max_new_tokens=args.max_new_tokens)
        results["answers"] = str(answers)
        results["rouge"] = rouge_l_of_answers(rows)
        if args.judge_url:
            results["judge"] = judge_answers(answers, endpoint_url=args.judge_url, model=args.judge_model,
                                             api_key_env=args.judge_key_env, references=args.judge_references,
                                             allow_http=args.judge_allow_http)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    text = json.dumps(results, indent=2, allow_nan=False)
    Path(args.out).write_text(text)
    print(text)
    return results


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    try:
        evaluate(args)
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        sys.exit(1)
