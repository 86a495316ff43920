"""Estimated GPU memory and communication of one DECA client (deca_ds/estimate.py, the deca-estimate
command), with this checkout's defaults: the model configs in profiling/configs, results in
profiling/results.

    python profiling/estimate.py                       # the four shipped configs
    python profiling/estimate.py --config path/to/config.json --layers-per-block 2 --out /tmp/est
"""

import sys
from pathlib import Path

from deca_ds.estimate import main

HERE = Path(__file__).resolve().parent

if __name__ == "__main__":
    configs = sorted(str(p) for p in (HERE / "configs").glob("*.json"))
    sys.exit(main(prog="python profiling/estimate.py", configs=configs, out=str(HERE / "results")))
