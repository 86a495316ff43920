"""deca-eval (also launch/evaluate.py): evaluate an exported model (e.g. <output>/consensus) on one process.

Classification: accuracy and macro-F1 by label likelihood on the task's test split. The data
options are deca-train's own (RunOptions: the same names, types, help and checks), and `--run`
takes them from a training run's run_config.json, so an export is scored on the test set its run
scored, encoded the same way. Generation: answers to a questions file (Vicuna-80 / MT-Bench
JSONL), ROUGE-L where the questions carry reference answers, and optionally an LLM judge behind
an OpenAI-compatible endpoint (off unless --judge-url is given; the key is read from the
environment and never written).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from .options import RunOptions, read_options
from .parsing import add_option, convert_options

if TYPE_CHECKING:
    import torch

# torch, transformers and the tasks load in the functions that use them: `--help` and a refused
# argument answer at once.

# What fixes the test set and how it is encoded: `--run` takes these from the run. Not
# trust_remote_code: running a model repo's own code is asked for on each command.
TEST_SET = ("dataset", "data_files", "text_column", "text_pair_column", "label_column", "label_names",
            "response_column", "chat_template", "max_seq_len", "synthetic_words", "seed")
# deca-train's options deca-eval takes as flags: the test set's, how much of it to score, and whether
# the model repo's own code may run
FLAGS = (*TEST_SET, "eval_limit", "trust_remote_code")
# deca-eval's own defaults: no task unless one is named (a questions file alone is generation
# only), and the whole test split (deca-train's evaluations during a run score the first 512)
DEFAULTS = {"dataset": None, "eval_limit": 0}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="deca-eval", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", type=os.path.expanduser,
                   help="exported model directory (or hub id); default with --run: its consensus/")
    p.add_argument("--run", metavar="OUTPUT_DIR", type=os.path.expanduser,
                   help="a deca-train output directory: its consensus/ (unless --model) scored on the run's test "
                        "set, with the run's data options (run_config.json; the command line wins)")
    p.add_argument("--checkpoint", metavar="STEP", type=checkpoint_arg,
                   help="with --run: x̄ of the clients' checkpoints at STEP ('latest': the newest complete for every "
                        "client), formed as the run forms it at its end, in place of its consensus/: a run stopped "
                        "early, or one step of a finished run's (as many as --keep-checkpoints kept)")
    p.add_argument("--client", metavar="N", type=int,
                   help="with --checkpoint: client N's own model of that step instead of x̄")
    p.add_argument("--out", required=True, type=os.path.expanduser, help="JSON file of the results")
    fields = {f.name: f for f in dataclasses.fields(RunOptions)}
    p.add_argument("--working-dtype", choices=fields["working_dtype"].metadata["choices"],
                   help="dtype the model computes in (default: the run's with --run, else bf16 on a GPU and fp32 "
                        "on a CPU)")
    data = p.add_argument_group("classification (deca-train's data options; with --run, the run's)")
    add_option(data, fields["dataset"], default=None, help="the task whose test split is scored, as deca-train "
               "names it; none: no classification")
    for name in FLAGS[1:]:
        add_option(data, fields[name], default=DEFAULTS.get(name, fields[name].default))
    gen = p.add_argument_group("generation")
    gen.add_argument("--questions", type=os.path.expanduser, help="questions JSONL (generation)")
    gen.add_argument("--answers", type=os.path.expanduser, help="where the answers JSONL goes (default: beside --out)")
    gen.add_argument("--max-new-tokens", type=int, default=512, help="tokens per answer (default: %(default)s)")
    gen.add_argument("--judge-url", default=None, help="OpenAI-compatible endpoint of a judge (off by default)")
    gen.add_argument("--judge-model", default="gpt-4o", help="the judge's model (default: %(default)s)")
    gen.add_argument("--judge-key-env", default="OPENAI_API_KEY",
                     help="environment variable holding the key (default: %(default)s)")
    gen.add_argument("--judge-references", default=None, type=os.path.expanduser,
                     help="reference answers (FastChat reference_answer JSONL) for math/reasoning/coding questions")
    gen.add_argument("--judge-allow-http", action="store_true",
                     help="allow a plain http judge URL, only to localhost / 127.0.0.1 (https otherwise)")
    return p


def checkpoint_arg(value: str) -> int | str:
    if value == "latest":
        return value
    try:
        step = int(value)
    except ValueError:
        step = 0
    if step < 1:
        raise argparse.ArgumentTypeError(f"a checkpoint's step (an integer >= 1) or 'latest', got {value!r}")
    return step


def resolve(args: argparse.Namespace) -> tuple[str, str | None, RunOptions | None, str | None]:
    """(the model to score, the dtype it computes in (None: the device's), the options of its test
    set (None: no classification), its attention (None: transformers' default)) of parsed arguments:
    deca-eval's defaults < the run's (--run) < the command line."""
    given = {name: value for name, value in vars(args).items() if name in FLAGS}
    if args.client is not None and args.checkpoint is None:
        raise ValueError("--client N takes client N's model of a checkpoint: give --run and --checkpoint")
    values, model, dtype, tokenizer_of, attention = dict(DEFAULTS), args.model, args.working_dtype, None, None
    if args.run is not None:
        run = Path(args.run)
        config = run / "run_config.json"
        if not config.is_file():
            raise ValueError(f"--run {run}: no run_config.json there (not a deca-train output directory)")
        try:
            recorded = json.loads(config.read_text())
            saved = recorded["options"]
        except (json.JSONDecodeError, KeyError, TypeError) as err:
            raise ValueError(f"--run {run}: {config} is not a deca-train run's record ({err!r})") from None
        ran = convert_options({k: v for k, v in read_options(saved).items() if k in (*TEST_SET, "working_dtype")},
                              str(config))
        # the run scored x̄ in its working dtype: the same number needs the same dtype
        dtype = dtype or ran.pop("working_dtype", "fp32")
        values.update(ran)
        if args.checkpoint is not None:
            if model is not None:
                raise ValueError("--checkpoint forms x̄ from the run's checkpoints: give --model or --checkpoint, "
                                 "not both")
            model, tokenizer_of = str(run / "checkpoints"), saved.get("model", "tiny")
        elif model is None:
            if not (run / "consensus").is_dir():
                from .checkpoint import step_dirs

                newest = "--checkpoint latest scores x̄ of its newest checkpoint, or " if step_dirs(run) else ""
                raise ValueError(f"--run {run}: the run exported no consensus/ (run with --no-export, stopped by "
                                 f"--time-limit, or not finished): {newest}give --model")
            # the attention the run scored x̄ with (its export's config.json does not say; older runs: the default)
            model, attention = str(run / "consensus"), recorded.get("attn_implementation")
    elif args.checkpoint is not None:
        raise ValueError("--checkpoint takes the checkpoints of a run: give --run (its output directory)")
    if model is None:
        raise ValueError("give --model (an exported model directory or hub id) or --run (a deca-train output "
                         "directory)")
    values.update(given)
    # the model's tokenizer encodes the test set; a checkpoint's is its run's model's
    options = None if values["dataset"] is None else RunOptions(model=tokenizer_of or model, **values)
    return model, dtype, options, attention


def load_export(path: str, *, dtype: torch.dtype, trust_remote_code: bool = False, attention: str | None = None):
    """An exported model (consensus/ or clients/client_NNN/) as it computes: a Dec-Adapter
    export is its base plus the adapters in its adapter/ folder; every other export is complete.
    `attention`: its attn_implementation (None: transformers' default)."""
    from ..methods import load_adapters, saved_adapters
    from ..models import load_model

    model = load_model(path, dtype=dtype, trust_remote_code=trust_remote_code, attention=attention)
    adapters = saved_adapters(path)
    return model if adapters is None else load_adapters(model, adapters)


def evaluate(args: argparse.Namespace) -> dict:
    import torch

    from ..config import parse_dtype
    from ..evaluation import generate_answers, judge_answers, judge_api_key, judge_url, rouge_l_of_answers
    from ..files import write_json
    from ..models import check_positions, load_tokenizer
    from .footprint import model_config
    from .task import evaluator, task_kind

    path, dtype, opts, attention = resolve(args)
    answers = Path(args.answers or Path(args.out).with_suffix(".answers.jsonl"))
    check_replaceable(Path(args.out), _is_result, "--out", "results")
    if args.questions is not None:
        check_replaceable(answers, _is_answers, "--answers" if args.answers else "the answers file", "answers")
    if opts is not None and task_kind(opts) == "generation":  # its quality is judged on answers, not scored by label
        if args.questions is None:
            raise ValueError(f"--dataset {opts.dataset}: a generation task; deca-eval scores its model's answers "
                             "to --questions (ROUGE-L, and the judge with --judge-url)")
        opts = None
    if opts is None and args.questions is None:
        raise ValueError("nothing to evaluate: give --dataset or --run (classification) and/or --questions "
                         "(generation)")
    if args.judge_url:  # a bad judge URL or a missing key is reported before any model is loaded
        if args.questions is None:
            raise ValueError("--judge-url grades generated answers: give --questions too")
        judge_url(args.judge_url, allow_http=args.judge_allow_http)
        judge_api_key(args.judge_key_env)
    trust = getattr(args, "trust_remote_code", False)
    if opts is not None:  # the test set, and the model's context from its config, before its weights load
        encoder, score = evaluator(opts)  # (minutes for an 8B model); a checkpoint's model is its run's
        check_positions(model_config(opts, len(encoder)), opts.max_seq_len)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = dtype or ("bf16" if device.type == "cuda" else "fp32")
    if args.checkpoint is None:
        model = load_export(path, dtype=parse_dtype(dtype), trust_remote_code=trust, attention=attention).to(device)
        results: dict = {"model": path, "working_dtype": dtype}
    else:
        from .checkpoint_consensus import checkpoint_model

        model, _, tokenizer, step, *_ = checkpoint_model(Path(args.run), args.checkpoint, device, trust, args.client)
        model.to(parse_dtype(dtype))
        results = {"model": path, "checkpoint": step, "client": args.client, "working_dtype": dtype}
    if opts is not None:
        results["options"] = {name: getattr(opts, name) for name in (*TEST_SET, "eval_limit")}
        results["classification"] = score(model, opts.eval_limit or None)
    if args.questions is not None:
        if args.checkpoint is None:
            tokenizer = load_tokenizer(path, trust_remote_code=trust)
        rows = generate_answers(model, tokenizer, args.questions, answers, max_new_tokens=args.max_new_tokens)
        results["answers"] = str(answers)
        results["rouge"] = rouge_l_of_answers(rows)
        if args.judge_url:
            results["judge"] = judge_answers(answers, endpoint_url=args.judge_url, model=args.judge_model,
                                             api_key_env=args.judge_key_env, references=args.judge_references,
                                             allow_http=args.judge_allow_http)
    write_json(Path(args.out), results)  # whole or not at all
    print(json.dumps(results, indent=2, allow_nan=False))
    return results


def check_replaceable(path: Path, ours, what: str, noun: str) -> None:
    """A file deca-eval is to write is new, empty, or its own from an earlier evaluation (`ours` of
    the text), which it replaces; any other file there is a user's and is left as it is."""
    if path.is_dir():
        raise ValueError(f"{what} {path} is a directory: give the path of a file")
    if not path.exists():
        return
    try:
        text = path.read_text(encoding="utf-8")
        replaceable = not text.strip() or ours(text)
    except (UnicodeDecodeError, ValueError):
        replaceable = False
    if not replaceable:
        raise ValueError(f"{what} {path} holds a file that is not deca-eval's {noun}: it is left as it is; give "
                         "another path")


def _is_result(text: str) -> bool:
    result = json.loads(text)
    return isinstance(result, dict) and {"model", "working_dtype"} <= result.keys()


def _is_answers(text: str) -> bool:
    rows = [json.loads(line) for line in text.splitlines() if line.strip()]
    return all(isinstance(row, dict) and {"question_id", "answers"} <= row.keys() for row in rows)


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    try:
        evaluate(args)
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        sys.exit(1)
