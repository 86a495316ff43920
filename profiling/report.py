"""What every profiling tool writes: <name>.md, .csv and .json side by side, and an Agg pyplot."""

from __future__ import annotations

import csv
import json
import platform
import sys
from datetime import datetime, timezone
from pathlib import Path


def write_results(out: Path, name: str, *, markdown: str, rows: list[dict], payload: dict) -> None:
    """<out>/<name>.md (the table), .csv (one line per row) and .json (`payload`, rows included)."""
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{name}.md").write_text(markdown)
    with (out / f"{name}.csv").open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    (out / f"{name}.json").write_text(json.dumps(payload, indent=2))


def provenance(tool: str, argv: list[str] | None, *, cuda: bool = False, threads: int | None = None) -> dict:
    """What every result names: the command that made it (`argv`: the tool's arguments, default
    sys.argv's), the UTC date, the device (CPU: with `threads` when given) and the versions."""
    import torch

    cpu = f"CPU ({platform.processor() or platform.machine()}" + (f", {threads} threads)" if threads else ")")
    return {"command": " ".join([f"python profiling/{tool}", *(sys.argv[1:] if argv is None else argv)]),
            "date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
            "device": torch.cuda.get_device_name() if cuda else cpu,
            "versions": {"torch": torch.__version__, "python": platform.python_version()}}


def pyplot():
    """matplotlib.pyplot on the file-only Agg backend (no display needed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def setting(row: dict) -> str:
    """A result row's offload mode, with the decoder layers it keeps resident."""
    return row["offload"] + (f", keep {row['offload_keep']}" if row.get("offload_keep") else "")
