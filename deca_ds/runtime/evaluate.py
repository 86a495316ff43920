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

import torch

from ..datasets import TASKS, generate_answers, judge_answers, rouge_l_of_answers
from ..models import load_model, load_tokenizer
from .options import RunOptions
from .task import build_task


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="launch/evaluate.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, help="exported model directory (or hub id)")
    p.add_argument("--dataset", default=None, choices=("synthetic", *TASKS, "files"),
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
    p.add_argument("--trust-remote-code", action="store_true")
    p.add_argument("--out", required=True, help="JSON file of the results")
    return p


def evaluate(args: argparse.Namespace) -> dict:
    if args.dataset is None and args.questions is None:
        raise ValueError("nothing to evaluate: give --dataset (classification) and/or --questions (generation)")
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    model = load_model(args.model, dtype=torch.bfloat16 if device.type == "cuda" else torch.float32,
                       trust_remote_code=args.trust_remote_code).to(device)
    results: dict = {"model": args.model}
    if args.dataset is not None:
        opts = RunOptions(model=args.model, dataset=args.dataset, data_files=args.data_files,
                          text_column=args.text_column, text_pair_column=args.text_pair_column,
                          label_column=args.label_column, label_names=args.label_names,
                          response_column=args.response_column, chat_template=args.chat_template,
                          max_seq_len=args.max_seq_len, eval_limit=args.eval_limit, seed=args.seed,
                          iid=True, micro_batch=1, trust_remote_code=args.trust_remote_code)
        results["classification"] = build_task(opts, 1).evaluate(model, args.eval_limit or None)
    if args.questions is not None:
        answers = Path(args.answers or Path(args.out).with_suffix(".answers.jsonl"))
        tokenizer = load_tokenizer(args.model, trust_remote_code=args.trust_remote_code)
        rows = generate_answers(model, tokenizer, args.questions, answers, max_new_tokens=args.max_new_tokens)
        results["answers"] = str(answers)
        results["rouge"] = rouge_l_of_answers(rows)
        if args.judge_url:
            results["judge"] = judge_answers(answers, endpoint_url=args.judge_url, model=args.judge_model,
                                             api_key_env=args.judge_key_env)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(results, indent=2))
    print(json.dumps(results, indent=2))
    return results


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    try:
        evaluate(args)
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        sys.exit(1)
