"""What deca-estimate and the profiling tools write: <name>.md, .csv and .json side by side, and an
Agg pyplot."""

from __future__ import annotations

import csv
import json
from pathlib import Path


def write_results(out: Path, name: str, *, markdown: str, rows: list[dict], payload: dict) -> None:
    """<out>/<name>.md (the table), .csv (one line per row) and .json (`payload`, rows included)."""
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{name}.md").write_text(markdown)
    with (out / f"{name}.csv").open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    (out / f"{name}.json").write_text(json.dumps(payload, indent=2, allow_nan=False))


def pyplot():
    """matplotlib.pyplot on the file-only Agg backend (no display needed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def setting(row: dict) -> str:
    """A result row's offload mode, with the decoder layers it keeps resident."""
    return row["offload"] + (f", keep {row['offload_keep']}" if row.get("offload_keep") else "")
