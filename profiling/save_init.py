"""The random initialisation a profiling run draws (launch/train.py --from-config), saved as a model
directory the trainer loads like any checkpoint: the weights in the working dtype as safetensors,
and the word-level tokenizer the run builds from its data. A profiling run given `--model DIR` in
place of `--from-config --model CONFIG` then trains the same model from a real checkpoint, so its
memory is that of loading one (issue 17, target 1: a checkpoint and a config must both fit).

    python profiling/save_init.py --out /tmp/llama-3.1-8b-init --train-args \\
        --ds_config ds_configs/profile_bf16.json --from-config --model profiling/configs/llama-3.1-8b-instruct.json
    python profiling/profile_memory.py --ds-config ds_configs/profile_bf16.json --ranks 1 \\
        --layers-per-block 1 --offload none frozen --train-args --model /tmp/llama-3.1-8b-init

The model is drawn where the run would draw it (the GPU, unless --offload frozen) from the run's
seed, and written from there tensor by tensor.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from deca_ds.runtime.checkpoint import save_hf_model
from deca_ds.runtime.parsing import parse_args as parse_run_args
from deca_ds.runtime.plan import build_model, build_task


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="the model directory to write (must not exist)")
    p.add_argument("--train-args", nargs=argparse.REMAINDER, default=[],
                   help="launch/train.py's options of the run whose initialisation to save (with --from-config)")
    args = p.parse_args(argv)
    opts, _ = parse_run_args(args.train_args)
    if not opts.from_config:
        p.error("--train-args must hold --from-config --model CONFIG: what is saved is the random "
                "initialisation of a config")
    return args, opts


def main(argv=None) -> Path:
    args, opts = parse_args(argv)
    out = Path(args.out)
    if out.exists():
        raise SystemExit(f"save_init.py: --out {out} exists; give a new directory")
    tokenizer = build_task(opts, 1).tokenizer
    save_hf_model(build_model(opts, len(tokenizer)), out, tokenizer)
    print(f"wrote {out}")
    return out


if __name__ == "__main__":
    main()
