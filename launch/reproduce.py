"""Reproduce the paper's tables and loss figures: `python launch/reproduce.py reproduce/<grid>.yaml`, the
same as the deca-reproduce command (deca_ds.reproduce; --help lists the options). Resumable: finished
cells are skipped."""

import sys

from deca_ds.reproduce.cli import main

if __name__ == "__main__":
    sys.exit(main())
