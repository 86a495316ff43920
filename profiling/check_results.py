"""Checks the GPU numbers the docs quote (profiling/README.md, docs/memory.md, docs/transport.md)
against the result files, and lists result files whose recorded commit is older than the code they
describe (issue 17, target 5). A claim is found in its document with the line breaks and runs of
spaces read as one space, so re-wrapping a paragraph does not break it.

A result's commit is its JSON's "commit" (report.provenance writes it) or, for files older than
that key, the one its folder's README.md names ("Code: commit `…`"). The code it describes is
deca_ds/ and the tool its command ran; it is stale when git has a commit after the recorded one
that touches either. Stale files are listed, not deleted.

    python profiling/check_results.py        # exit 1 when a quoted number differs from its file
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "profiling" / "results"

# (result file, the row's fields, the value's key, how the document writes it). Without fields the key is
# a path of top-level keys ("ratios.deca_step_over_D-Adam"); a format is a str.format pattern or a function.
PROFILING = [
    ("gpu_h100/profile_memory.json", {"offload": "none"}, "peak_gib", "{:.2f} GiB"),
    ("gpu_h100/profile_memory.json", {"offload": "frozen"}, "peak_gib", "{:.2f} GiB"),
    ("gpu_h100/profile_memory.json", {"offload": "none"}, "estimate_gib", "{:.2f}"),
    ("gpu_h100/profile_memory.json", {"offload": "frozen"}, "estimate_gib", "{:.2f} GiB"),
    ("gpu_h100/profile_memory.json", {"offload": "none"}, "setup_peak_gib", "{:.1f} GiB"),
    ("gpu_h100/profile_memory.json", {"offload": "frozen"}, "setup_peak_gib", "{:.1f} GiB"),
    ("gpu_h100/profile_memory.json", {"offload": "none"}, "step_ms", "{:.0f} ms"),
    ("gpu_h100/profile_memory.json", {"offload": "frozen"}, "step_ms", "{:.0f} ms"),
    ("gpu_h100/profile_memory.json", {"offload": "frozen"}, "step_over_resident", "{:.2f}×"),
    ("gpu_h100/profile_memory_mb8.json", {"offload": "none"}, "step_ms", "{:.0f} ms"),
    ("gpu_h100/profile_memory_mb8.json", {"offload": "frozen"}, "step_ms", "{:.0f} ms"),
    ("gpu_h100/profile_memory_mb8.json", {"offload": "none"}, "peak_gib", "{:.2f} GiB"),
    ("gpu_h100/profile_memory_mb8.json", {"offload": "frozen"}, "peak_gib", "{:.2f} GiB"),
    ("gpu_h100/profile_memory_offload_setup.json", {"offload": "frozen"}, "setup_peak_gib", "{:.2f} GiB"),
    ("gpu_h100/profile_memory_offload_setup.json", {"offload": "frozen"}, "peak_gib", "{:.2f} GiB"),
    ("gpu_h200/profile_memory_2clients_llama-3.1-8b.json", {"offload": "none"}, "peak_gib", "{:.2f} GiB"),
    ("gpu_h200/profile_memory_2clients_llama-3.1-8b.json", {"offload": "none"}, "peak_gb", "{:.2f} GB"),
    ("gpu_h200/profile_memory_2clients_llama-3.1-8b.json", {"offload": "none"}, "estimate_gib", "{:.2f} GiB"),
    ("gpu_h200/profile_memory_2clients_llama-3.1-8b.json", {"offload": "none"}, "measured_over_estimate",
     "({:.3f};"),
    ("gpu_h200/profile_memory_2clients_llama-3.1-8b.json", {"offload": "none"}, "setup_peak_gib", "{:.2f} GiB"),
    ("gpu_h100/profile_resources_4clients_qwen2-1.5b.json", {"method": "DECA"}, "comm_mb", "{:.3f} MB"),
    ("gpu_h100/profile_resources_4clients_qwen2-1.5b.json", {"method": "DECA"}, "exchange_ms", "{:.0f} of"),
    ("gpu_h100/profile_resources_4clients_qwen2-1.5b.json", {"method": "DECA"}, "step_ms", "of {:.0f} ms"),
    ("gpu_h200/update_cost.json", {"variant": "deca", "update": "eager"}, "update_ms", "{:.2f} ms eagerly"),
    ("gpu_h200/update_cost.json", {"variant": "deca", "update": "fused"}, "update_ms", "{:.2f} ms with"),
    ("gpu_h200/update_cost.json", {"variant": "deca", "update": "fused_alone"}, "update_ms", "{:.2f} ms in place"),
    ("gpu_h200/update_cost.json", {"variant": "deca", "update": "fused"}, "update_in_copies", "{:.1f} and"),
    ("gpu_h200/update_cost.json", {"variant": "deca", "update": "fused_alone"}, "update_in_copies", "and {:.1f}"),
]
MEMORY = [
    ("gpu_h100/profile_memory.json", {"offload": "none"}, "peak_gib", "**{:.2f} GiB"),
    ("gpu_h100/profile_memory.json", {"offload": "none"}, "peak_gb", "{:.2f} GB**"),
    ("gpu_h100/profile_memory.json", {"offload": "none"}, "estimate_gib", "{:.2f} GiB (×"),
    ("gpu_h100/profile_memory.json", {"offload": "none"}, "measured_over_estimate", "(×{:.3f})"),
    ("gpu_h100/profile_memory.json", {"offload": "none"}, "step_ms", "| {:.0f} ms |"),
    ("gpu_h100/profile_memory.json", {"offload": "frozen"}, "peak_gib", "**{:.2f} GiB"),
    ("gpu_h100/profile_memory.json", {"offload": "frozen"}, "peak_gb", "{:.2f} GB**"),
    ("gpu_h100/profile_memory.json", {"offload": "frozen"}, "estimate_gib", "{:.2f} GiB (×"),
    ("gpu_h100/profile_memory.json", {"offload": "frozen"}, "measured_over_estimate", "(×{:.3f})"),
    ("gpu_h100/profile_memory.json", {"offload": "frozen"}, "step_ms", "| {:.0f} ms ("),
    ("gpu_h100/profile_memory.json", {"offload": "frozen"}, "step_over_resident", "({:.2f}× resident)"),
    ("gpu_h100/profile_memory_mb8.json", {"offload": "none"}, "peak_gib", "{:.2f} GiB resident"),
    ("gpu_h100/profile_memory_mb8.json", {"offload": "frozen"}, "peak_gib", "{:.2f} GiB offloaded"),
    ("gpu_h100/profile_memory_mb8.json", {"offload": "frozen"}, "step_over_resident", "step {:.2f}× resident"),
    ("gpu_h100/profile_resources_qwen2-1.5b.json", None, "ratios.deca_step_over_D-Adam", "{:.2f}× the time"),
    ("gpu_h100/profile_resources_qwen2-1.5b.json", None, "ratios.deca_step_over_Dec-LoRA", "{:.2f}× /"),
    ("gpu_h100/profile_resources_llama-3.1-8b.json", None, "ratios.deca_step_over_Dec-LoRA", "/ {:.2f}× that"),
    ("gpu_h100/profile_resources_qwen2-1.5b.json", None, "ratios.deca_agg_up_share_of_step",
     lambda v: f"is {100 * v:.1f} % /"),
    ("gpu_h100/profile_resources_llama-3.1-8b.json", None, "ratios.deca_agg_up_share_of_step",
     lambda v: f"/ {100 * v:.1f} % of"),
]
TRANSPORT = [
    ("gpu_h100/shared_device_exact.json", None, "max_abs_diff", "largest difference was {:.1f},"),
    ("gpu_h100/profile_resources_4clients_qwen2-1.5b.json", {"method": "DECA"}, "comm_mb", "DECA {:.3f} MB"),
    ("gpu_h100/profile_resources_4clients_qwen2-1.5b.json", {"method": "Dec-LoRA"}, "comm_mb",
     "Dec-LoRA and DeCAF {:.3f} MB"),
    ("gpu_h100/profile_resources_4clients_qwen2-1.5b.json", {"method": "DeCAF"}, "comm_mb",
     "Dec-LoRA and DeCAF {:.3f} MB"),
    ("gpu_h100/profile_resources_4clients_qwen2-1.5b.json", {"method": "Dec-Adapter"}, "comm_mb",
     "Dec-Adapter {:.3f} MB"),
    ("gpu_h200/profile_resources_4clients_qwen2-1.5b.json", {"method": "D-Adam"}, "comm_mb", "D-Adam {:,.3f} MB"),
    ("gpu_h100/profile_resources_4clients_qwen2-1.5b.json", {"method": "DECA"}, "exchange_ms", "({:.0f} of"),
    ("gpu_h100/profile_resources_4clients_qwen2-1.5b.json", {"method": "DECA"}, "step_ms", "of {:.0f} ms on the H100"),
    ("gpu_h200/profile_resources_4clients_qwen2-1.5b.json", None, "ratios.deca_step_over_D-Adam",
     "{:.2f}× D-Adam's"),
    ("gpu_h200/profile_memory_2clients_llama-3.1-8b.json", {"offload": "none"}, "peak_gib",
     "{:.2f} GiB peak per client"),
    ("gpu_h200/profile_memory_2clients_llama-3.1-8b.json", {"offload": "none"}, "estimate_gib",
     "{:.2f} GiB estimated ("),
    ("gpu_h200/profile_memory_2clients_llama-3.1-8b.json", {"offload": "none"}, "measured_over_estimate",
     "({:.3f};"),
]
# {document: its claims}
CLAIMS = {"profiling/README.md": PROFILING, "docs/memory.md": MEMORY, "docs/transport.md": TRANSPORT}


def claims() -> list[tuple[str, tuple]]:
    """(document, claim) for every claim of every document."""
    return [(doc, claim) for doc, listed in CLAIMS.items() for claim in listed]


def quoted(text: str, claim: tuple) -> tuple[str, bool]:
    """The claim's value as the document writes it, and whether `text` has it (whitespace folded)."""
    name, where, key, fmt = claim
    data = json.loads((RESULTS / name).read_text())
    if where is None:
        value = data
        for part in key.split("."):
            value = value[part]
    else:
        rows = data["results"] if "results" in data else data["rows"]
        value = next(r for r in rows if all(r.get(k) == v for k, v in where.items()))[key]
    written = fmt(value) if callable(fmt) else fmt.format(value)
    return written, written in " ".join(text.split())


def recorded(path: Path) -> dict:
    """The result's provenance: its top level, or its "provenance" (setup_peaks.py nests it there)."""
    data = json.loads(path.read_text())
    if not isinstance(data, dict):
        return {}
    return data.get("provenance", data)


def recorded_commit(path: Path) -> str | None:
    commit = recorded(path).get("commit")
    if commit not in (None, "unknown"):
        return commit.split("+")[0]
    folder_readme = path.parent / "README.md"
    if path.parent != RESULTS and folder_readme.exists():
        found = re.search(r"Code: commit `([0-9a-f]{7,40})`", folder_readme.read_text())
        return found and found.group(1)
    return None


def described_code(path: Path) -> list[str]:
    command = recorded(path).get("command", "")
    tool = re.search(r"profiling/(\w+\.py)", command)
    return ["deca_ds", *(["profiling/" + tool.group(1)] if tool else [])]


def newer_commits(commit: str, paths: list[str]) -> list[str] | None:
    """Commits after `commit` touching `paths` (short hashes); None when git does not know it."""
    done = subprocess.run(["git", "log", "--format=%h", f"{commit}..HEAD", "--", *paths], cwd=ROOT,
                          capture_output=True, text=True, timeout=60, check=False)
    return done.stdout.split() if done.returncode == 0 else None


def stale(gpu_only: bool = True) -> list[dict]:
    """Every result JSON (GPU folders only by default) with its commit and what changed since."""
    found = []
    for path in sorted(RESULTS.glob("gpu_*/*.json" if gpu_only else "**/*.json")):
        commit = recorded_commit(path)
        newer = newer_commits(commit, described_code(path)) if commit else None
        found.append({"file": str(path.relative_to(RESULTS)), "commit": commit, "code": described_code(path),
                      "newer_commits": newer, "stale": commit is None or newer is None or bool(newer)})
    return found


def main() -> int:
    wrong = []
    for doc, claim in claims():
        value, ok = quoted((ROOT / doc).read_text(), claim)
        print(f"{'ok  ' if ok else 'MISS'} {doc}: {claim[0]} {claim[1]} {claim[2]}: {value}")
        wrong += [] if ok else [value]
    for s in stale():
        why = ("no commit recorded" if s["commit"] is None else "commit unknown to git" if s["newer_commits"] is None
               else f"{len(s['newer_commits'])} later commits touch {', '.join(s['code'])}")
        print(f"{'STALE' if s['stale'] else 'fresh'} {s['file']} (commit {s['commit']}): {why if s['stale'] else ''}")
    return 1 if wrong else 0


if __name__ == "__main__":
    sys.exit(main())
