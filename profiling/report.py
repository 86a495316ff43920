"""What every profiling tool writes, from deca_ds.reporting: the result files, the plot backend and
the provenance, its command line a profiling tool's."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from deca_ds import reporting
from deca_ds.reporting import pyplot, save_figure, setting, write_results

__all__ = ["emit", "provenance", "pyplot", "save_figure", "setting", "write_results"]


def provenance(tool: str, argv: list[str] | None, *, cuda: bool = False, threads: int | None = None) -> dict:
    """deca_ds.reporting.provenance for `python profiling/<tool>` with `argv` (default sys.argv's
    arguments); on CPU with `threads` when given."""
    command = " ".join([f"python profiling/{tool}", *(sys.argv[1:] if argv is None else argv)])
    return reporting.provenance(command, cuda=cuda, cpu=f"{threads} threads" if threads else None)


def emit(result: dict, out: str | None, *, indent: int = 2) -> None:
    """Print `result` as JSON, and write it to the file `out` when one is named."""
    text = json.dumps(result, indent=indent, allow_nan=False)
    if out:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        Path(out).write_text(text + "\n")
    print(text)
