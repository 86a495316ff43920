"""Evaluate an exported model: `python launch/evaluate.py --model outputs/run/consensus --dataset agnews
--out eval.json` (classification) or `--questions mt_bench.jsonl` (generation). `--help` lists the options."""

from deca_ds.runtime.evaluate import main

if __name__ == "__main__":
    main()
