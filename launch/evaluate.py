"""deca-eval from a checkout: evaluate an exported model, e.g. `python launch/evaluate.py --run outputs/run
--out eval.json` (the run's consensus on its test set) or `--questions mt_bench.jsonl` (generation).
`--help` lists the options."""

from deca_ds.runtime.evaluate import main

if __name__ == "__main__":
    main()
