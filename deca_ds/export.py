"""deca-export (also `python -m deca_ds.export`): write x̄ of a run's checkpoint (or, with --client,
one client's model of it) as a model directory, the way the run writes its consensus/ at its end,
for a run stopped before its end or a step a finished run kept. deca-eval --model, from_pretrained
and peft load it as they load consensus/.

The directory is written under a temporary name beside --out and renamed when complete, so --out
is a whole export or absent; an --out that holds anything is refused, never written into."""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

# torch and the model load in export(): `--help` and a refused argument answer at once.

MARKER = "deca_export.json"  # where the export came from: the run, its step, the method and clients


def build_parser() -> argparse.ArgumentParser:
    from .runtime.evaluate import checkpoint_arg

    p = argparse.ArgumentParser(prog="deca-export", description=__doc__.split("\n\n")[0])
    p.add_argument("--run", required=True, metavar="OUTPUT_DIR", type=os.path.expanduser,
                   help="a deca-train output directory")
    p.add_argument("--checkpoint", required=True, metavar="STEP", type=checkpoint_arg,
                   help="the step whose checkpoints form x̄ ('latest': the newest complete for every client)")
    p.add_argument("--client", metavar="N", type=int, help="client N's own model of that step instead of x̄")
    p.add_argument("--out", required=True, metavar="DIR", type=os.path.expanduser,
                   help="the model directory to write (new or empty)")
    p.add_argument("--trust-remote-code", action="store_true",
                   help="let the run's model repo run its own code (never taken from the run)")
    return p


def export(args: argparse.Namespace) -> Path:
    import torch

    from .files import atomic_directory, remove_leftovers, vacant, write_json
    from .runtime.checkpoint_consensus import checkpoint_model

    run, out = Path(args.run), Path(args.out)
    if not vacant(out):
        raise ValueError(f"--out {out} holds files (or is one); deca-export writes only a new or empty directory")
    remove_leftovers(out, say=lambda line: print(line, file=sys.stderr))
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    x = checkpoint_model(run, args.checkpoint, device, args.trust_remote_code, args.client)
    with atomic_directory(out) as partial:
        x.method.save_consensus(x.model, partial, x.tokenizer)
        write_json(partial / MARKER, {"run": str(run.resolve()), "checkpoint": x.step, "client": args.client,
                                      "method": x.opts.method, "n_clients": x.n_clients,
                                      "working_dtype": x.opts.working_dtype})
    return out


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    try:
        out = export(args)
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        sys.exit(1)
    print(json.dumps({"out": str(out), **json.loads((out / MARKER).read_text())}, indent=2, allow_nan=False))


if __name__ == "__main__":
    main()
