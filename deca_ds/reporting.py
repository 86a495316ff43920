"""What deca-estimate, the profiling tools, the reproduction grid and a run's summary write:
<name>.md, .csv and .json side by side, figures (Agg pyplot), and the provenance every result names."""

from __future__ import annotations

import csv
import io
import json
import os
import platform
import re
import subprocess
import sys
from datetime import datetime, timezone
from pathlib import Path

from .files import atomic_write, write_text

REPO = Path(__file__).resolve().parents[1]  # the checkout: its commit, its launch/ scripts


def write_results(out: Path, name: str, *, markdown: str, rows: list[dict], payload: dict) -> None:
    """<out>/<name>.md (the table), .csv (one line per row) and .json (`payload`, rows included)."""
    write_text(out / f"{name}.md", markdown)
    table = io.StringIO(newline="")
    writer = csv.DictWriter(table, fieldnames=list(rows[0]))
    writer.writeheader()
    writer.writerows(rows)
    write_text(out / f"{name}.csv", table.getvalue())
    write_text(out / f"{name}.json", json.dumps(payload, indent=2, allow_nan=False))


def pyplot():
    """matplotlib.pyplot on the file-only Agg backend (no display needed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_figure(fig, path: Path, *, dpi: int = 120) -> None:
    """Laid out, written whole (files.atomic_write: a reader never sees half a PNG, and two
    writers leave one of theirs) and closed."""
    fig.tight_layout()
    atomic_write(Path(path), lambda tmp: fig.savefig(tmp, dpi=dpi, format="png"))
    pyplot().close(fig)


def setting(row: dict) -> str:
    """A result row's offload mode, with the decoder layers it keeps resident."""
    return row["offload"] + (f", keep {row['offload_keep']}" if row.get("offload_keep") else "")


def commit(exclude: Path | None = None) -> str:
    """HEAD's short hash, "+dirty" when tracked files differ from it (aside from those under
    `exclude`, the result's own directory, where it lies inside the checkout: git refuses a
    pathspec outside it); "unknown" outside a checkout."""

    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True, timeout=30,
                              check=True).stdout.strip()

    inside = exclude is not None and Path(exclude).resolve().is_relative_to(REPO.resolve())
    skip = [f":(exclude){Path(exclude).resolve()}"] if inside else []
    try:
        head = git("rev-parse", "--short=7", "HEAD")
        return head + ("+dirty" if git("status", "--porcelain", "--untracked-files=no", "--", str(REPO), *skip) else "")
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def invocation(command: str, argv: list[str] | None) -> list[str]:
    """The command line a result records: `python launch/X.py …` as typed in a checkout, else the
    console command (`argv` given: an in-process call, as the console command)."""
    if argv is None and sys.argv[0].endswith(".py"):
        return ["python", sys.argv[0], *sys.argv[1:]]
    return [command, *(sys.argv[1:] if argv is None else argv)]


def cpu_model() -> str | None:
    """The CPU's model name (Linux's /proc/cpuinfo), or None."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return None
    return next((line.split(":", 1)[1].strip() for line in lines if line.startswith("model name")), None)


def cpu_kernels() -> str:
    """The vector kernels ATen runs in this process (AVX2, AVX512, DEFAULT, …): the CPU's best
    unless ATEN_CPU_CAPABILITY says otherwise."""
    import torch

    return torch.backends.cpu.get_cpu_capability()


# The values of ATEN_CPU_CAPABILITY that x86-64 builds of ATen take (another value, or another case, is ignored).
CPU_KERNELS = ("default", "avx2", "avx512")


def pin_cpu_kernels(name: str) -> str | None:
    """Have this process, and the processes it starts, run ATen's `name` CPU kernels (one of
    CPU_KERNELS) through ATEN_CPU_CAPABILITY, unless the variable is set already: the caller's
    choice wins. A note where this process runs others: the variable set otherwise, or ATen's
    kernels fixed before this call (at its first vector operation), or a CPU without them."""
    given = os.environ.setdefault("ATEN_CPU_CAPABILITY", name)
    here = cpu_kernels()
    if given != name:
        why = f"ATEN_CPU_CAPABILITY={given} is set"
    elif here.lower() != name:
        why = f"this CPU or process runs {here} ones"
    else:
        return None
    return (f"note: {why}, not the {name} kernels the grid names (cpu_kernels): results repeat those kernels' bits, "
            "not the grid's committed ones (each run_config names the kernels it ran)")


def kernels_of(device: str) -> str | None:
    """The CPU kernels a provenance's device names (provenance writes them since ccf8d7e), else None."""
    named = re.fullmatch(r"CPU \(.*\b(\w+) kernels\b.*\)", device)
    return named[1] if named else None


def provenance(command: str, *, cuda: bool = False, cpu: str | None = None, exclude: Path | None = None) -> dict:
    """What a result names: the command that made it, the UTC date, the commit of the code
    (profiling/check_results.py compares it with the code's last change), the device (on CPU its
    architecture, model, the vector kernels ATen runs and `cpu`, e.g. its thread count) and the
    versions. A CPU result repeats to the bit with the same kernels, not across them: ATen picks
    AVX-512 ones where the CPU has them, AVX2 ones where not, and the two round otherwise; the
    variable ATEN_CPU_CAPABILITY=avx2 makes an AVX-512 machine run the AVX2 ones (docs/reproduce.md)."""
    import torch

    kernels = f"{cpu_kernels()} kernels"  # the form kernels_of reads
    on_cpu = ", ".join(filter(None, [platform.processor() or platform.machine(), cpu_model(), kernels, cpu]))
    return {"command": command, "date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
            "commit": commit(exclude),
            "device": torch.cuda.get_device_name() if cuda else f"CPU ({on_cpu})",
            "versions": {"torch": str(torch.__version__), "python": platform.python_version()}}
