"""Checks the GPU numbers the docs quote (profiling/README.md, docs/memory.md, docs/transport.md)
against the result files, and lists result files whose code has changed since they were made
(issue 17, target 5). A claim is found in its document with the line breaks and runs of spaces read
as one space, so re-wrapping a paragraph does not break it.

A result's commit is its JSON's "commit" (report.provenance writes it) or, for files older than
that key, the one its folder's README.md names ("Code: commit `…`"). The code it ran is the tool
its command names and every file of this repository that the tool can import, or start in another
process (launch/train.py for the tools that train through profiling/runs.py), followed through
deca_ds. It is stale when one of those files runs differently at HEAD: compared as Python syntax trees
without docstrings and without the top-level definitions that none of that code uses, so a comment,
a docstring, a re-wrapped line or a helper added for another command leaves it fresh, and a commit
that touches only other files (tests, docs, the reproduction grid) does too. Stale files are
listed, not deleted.

    python profiling/check_results.py        # exit 1 when a quoted number differs from its file
"""

from __future__ import annotations

import ast
import functools
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
    ("gpu_h200/profile_memory.json", {"offload": "none"}, "peak_gib", "**{:.2f} GiB"),
    ("gpu_h200/profile_memory.json", {"offload": "none"}, "peak_gb", "{:.2f} GB**"),
    ("gpu_h200/profile_memory.json", {"offload": "frozen"}, "peak_gib", "**{:.2f} GiB"),
    ("gpu_h200/profile_memory.json", {"offload": "frozen"}, "peak_gb", "{:.2f} GB**"),
    ("gpu_h200/profile_memory.json", {"offload": "none"}, "estimate_gib", "predicted {:.2f} and"),
    ("gpu_h200/profile_memory.json", {"offload": "frozen"}, "estimate_gib", "and {:.2f} GiB (measured/estimated"),
    ("gpu_h200/profile_memory.json", {"offload": "none"}, "measured_over_estimate", "{:.3f} and"),
    ("gpu_h200/profile_memory.json", {"offload": "frozen"}, "measured_over_estimate", "and {:.3f}; target"),
    ("gpu_h200/profile_memory.json", {"offload": "none"}, "setup_peak_gib", "{:.2f} GiB resident and"),
    ("gpu_h200/profile_memory.json", {"offload": "frozen"}, "setup_peak_gib", "{:.2f} GiB offloaded, are below"),
    ("gpu_h200/profile_memory.json", {"offload": "frozen"}, "step_ms", "): {:.0f} ms against"),
    ("gpu_h200/profile_memory.json", {"offload": "none"}, "step_ms", "against {:.0f} ms, "),
    ("gpu_h200/profile_memory.json", {"offload": "frozen"}, "step_over_resident", "ms, {:.2f}×, streaming"),
    ("gpu_h200/profile_memory.json", {"offload": "frozen"}, "streamed_gb", "streaming {:.2f} GB per step"),
    ("gpu_h100/profile_memory.json", {"offload": "none"}, "setup_peak_gib", "setup peaks of {:.1f} GiB"),
    ("gpu_h100/profile_memory.json", {"offload": "frozen"}, "setup_peak_gib", "and {:.1f} GiB, before"),
    ("gpu_h100/profile_memory.json", {"offload": "frozen"}, "step_ms", "{:.0f} ms against"),
    ("gpu_h100/profile_memory.json", {"offload": "none"}, "step_ms", "against {:.0f} ms resident"),
    ("gpu_h100/profile_memory.json", {"offload": "frozen"}, "step_over_resident", "{:.2f}× (target"),
    ("gpu_h100/profile_memory_mb8.json", {"offload": "none"}, "step_ms", "{:.0f} ms"),
    ("gpu_h100/profile_memory_mb8.json", {"offload": "frozen"}, "step_ms", "{:.0f} ms"),
    ("gpu_h100/profile_memory_mb8.json", {"offload": "none"}, "peak_gib", "{:.2f} GiB"),
    ("gpu_h100/profile_memory_mb8.json", {"offload": "frozen"}, "peak_gib", "{:.2f} GiB"),
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
    ("gpu_h200/profile_resources_llama-3.1-8b.json", None, "ratios.deca_agg_up_share_of_step",
     lambda v: f"{100 * v:.1f} % eagerly"),
    ("gpu_h200/profile_resources_llama-3.1-8b.json", None, "ratios.deca_fused_agg_up_share_of_step",
     lambda v: f"{100 * v:.1f} % with the fused update"),
    ("gpu_h200/profile_resources_llama-3.1-8b.json", {"update": "fused"}, "step_ms", "{:.1f} ms; target ≤ 3 %"),
    ("gpu_h200/profile_resources_llama-3.1-8b_uncompiled.json", {"update": "fused"}, "step_ms",
     "fused step from {:.1f} ms"),
    ("gpu_h200/profile_resources_llama-3.1-8b_compiled.json", {"update": "fused"}, "step_ms", "ms to {:.1f} ms in one"),
    ("gpu_h200/profile_resources_llama-3.1-8b_compiled.json", {"update": "fused"}, "bkwd_ms", "to {:.1f} ms; the same"),
    ("gpu_h200/profile_resources_llama-3.1-8b_compiled.json", None, "ratios.deca_fused_agg_up_share_of_step",
     lambda v: f"is then {100 * v:.1f} % of the step"),
    ("op_counts.json", {"method": "decaf"}, "combine_ops", "model issues {:,} operations"),
    ("op_counts_a98c8e8.json", {"method": "decaf"}, "combine_ops", "where it issued {:,} (Dec-LoRA's"),
    ("op_counts.json", {"method": "dec_lora"}, "combine_ops", "re-factorization: {:,} and"),
    ("op_counts_a98c8e8.json", {"method": "dec_lora"}, "combine_ops", "and {:,}; `results/op_counts.md`"),
    ("gpu_h200/decaf_refactor.json", {"path": "batched"}, "ms", "takes {:.1f} ms against"),
    ("gpu_h200/decaf_refactor.json", {"path": "pair_by_pair"}, "ms", "against {:.1f} ms pair by pair"),
    ("gpu_h200/profile_resources_llama-3.1-8b_sync.json", {"update": "fused"}, "step_ms", "step took {:.1f} ms with"),
    ("gpu_h200/profile_resources_llama-3.1-8b_sync.json", {"update": "fused"}, "bkwd_ms", "with a {:.1f} ms backward"),
    ("gpu_h200/profile_resources_llama-3.1-8b_sync.json", {"update": "fused"}, "agg_up_ms", "Agg & Up {:.2f} ms, 4.4"),
    ("gpu_h200/profile_resources_llama-3.1-8b_sync.json", None, "ratios.deca_fused_agg_up_share_of_step",
     lambda v: f"ms, {100 * v:.1f} % of it"),
    ("gpu_h200/profile_resources_llama-3.1-8b_events.json", None, "ratios.deca_fused_agg_up_share_of_step",
     lambda v: f"slower run, {100 * v:.1f} % (`_events.md`)"),
    ("gpu_h200/profile_resources_4clients_qwen2-1.5b_fused.json", {"update": "eager"}, "update_ms",
     "goes from {:.1f} to"),
    ("gpu_h200/profile_resources_4clients_qwen2-1.5b_fused.json", {"update": "fused"}, "update_ms",
     "to {:.1f} ms a step, 2.2 %"),
    ("gpu_h200/profile_resources_4clients_qwen2-1.5b_fused.json", None,
     "ratios.deca_fused_update_and_combination_share_of_step", lambda v: f"a step, {100 * v:.1f} % of"),
    ("gpu_h200/matmul_efficiency_32gb.json", {"micro_batch": 2}, "step_of_peak",
     lambda v: f"{100 * v:.0f}–43 % of the GEMM peak at micro-batch 2"),
    ("gpu_h200/matmul_efficiency.json", {"micro_batch": 2}, "step_of_peak",
     lambda v: f"39–{100 * v:.0f} % of the GEMM peak at micro-batch 2"),
    ("gpu_h200/matmul_efficiency_32gb.json", {"micro_batch": 4}, "step_of_peak", lambda v: f"{100 * v:.0f}–59 % at 4"),
    ("gpu_h200/matmul_efficiency.json", {"micro_batch": 4}, "step_of_peak", lambda v: f"56–{100 * v:.0f} % at 4"),
]
MEMORY = [
    ("gpu_h200/profile_memory.json", {"offload": "none"}, "peak_gib", "**{:.2f} GiB"),
    ("gpu_h200/profile_memory.json", {"offload": "none"}, "peak_gb", "{:.2f} GB**"),
    ("gpu_h200/profile_memory.json", {"offload": "none"}, "estimate_gib", "{:.2f} GiB (×"),
    ("gpu_h200/profile_memory.json", {"offload": "none"}, "measured_over_estimate", "(×{:.3f})"),
    ("gpu_h200/profile_memory.json", {"offload": "none"}, "setup_peak_gib", "| {:.2f} GiB | 16.88"),
    ("gpu_h200/profile_memory.json", {"offload": "none"}, "end_peak_gib", "| {:.2f} GiB | 110 ms"),
    ("gpu_h200/profile_memory.json", {"offload": "none"}, "step_ms", "| {:.0f} ms |"),
    ("gpu_h200/profile_memory.json", {"offload": "frozen"}, "peak_gib", "**{:.2f} GiB"),
    ("gpu_h200/profile_memory.json", {"offload": "frozen"}, "peak_gb", "{:.2f} GB**"),
    ("gpu_h200/profile_memory.json", {"offload": "frozen"}, "estimate_gib", "{:.2f} GiB (×"),
    ("gpu_h200/profile_memory.json", {"offload": "frozen"}, "measured_over_estimate", "(×{:.3f})"),
    ("gpu_h200/profile_memory.json", {"offload": "frozen"}, "setup_peak_gib", "| {:.2f} GiB | 5.10"),
    ("gpu_h200/profile_memory.json", {"offload": "frozen"}, "end_peak_gib", "| {:.2f} GiB | 294 ms"),
    ("gpu_h200/profile_memory.json", {"offload": "frozen"}, "step_ms", "| {:.0f} ms (2."),
    ("gpu_h200/profile_memory.json", {"offload": "frozen"}, "step_over_resident", "| 294 ms ({:.2f}×) |"),
    ("gpu_h200/profile_memory.json", {"offload": "frozen"}, "streamed_gb", "streams {:.2f} GB"),
    ("gpu_h100/profile_memory.json", {"offload": "none"}, "peak_gib", "| H100 | {:.2f} GiB |"),
    ("gpu_h100/profile_memory.json", {"offload": "none"}, "setup_peak_gib", "| {:.1f} GiB | — | 139 ms |"),
    ("gpu_h100/profile_memory.json", {"offload": "none"}, "step_ms", "| {:.0f} ms |"),
    ("gpu_h100/profile_memory.json", {"offload": "frozen"}, "setup_peak_gib", "| {:.1f} GiB | — | 404 ms"),
    ("gpu_h100/profile_memory.json", {"offload": "frozen"}, "step_ms", "| {:.0f} ms ("),
    ("gpu_h100/profile_memory.json", {"offload": "frozen"}, "step_over_resident", "({:.2f}× resident)"),
    ("gpu_h200/profile_resources_llama-3.1-8b.json", None, "ratios.deca_fused_agg_up_share_of_step",
     lambda v: f"is {100 * v:.1f} % of the step with the fused update"),
    ("gpu_h200/profile_resources_llama-3.1-8b.json", None, "ratios.deca_agg_up_share_of_step",
     lambda v: f"and {100 * v:.1f} % eagerly: not met"),
    ("gpu_h200/profile_resources_llama-3.1-8b.json", {"update": "fused"}, "update_ms", "correction {:.1f} ms of"),
    ("gpu_h200/profile_resources_llama-3.1-8b.json", {"update": "fused"}, "step_ms", "ms of {:.1f}, the rest"),
    ("gpu_h200/profile_resources_llama-3.1-8b_preset.json", None, "ratios.deca_fused_agg_up_share_of_step",
     lambda v: f"layers per block, {100 * v:.1f} % fused"),
    ("gpu_h200/profile_resources_llama-3.1-8b_preset.json", None, "ratios.deca_agg_up_share_of_step",
     lambda v: f"fused and {100 * v:.1f} % eagerly (`profile_resources_llama-3.1-8b_preset"),
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
    """The files a result's code is made of (code_closure of the tool its command ran)."""
    command = recorded(path).get("command", "")
    tool = re.search(r"profiling/(\w+\.py)", command)
    return code_closure("profiling/" + tool.group(1)) if tool else sorted(_package_files())


# Code a file starts in another process, which no import of it shows.
STARTS = {"profiling/runs.py": ["launch/train.py"]}


def _package_files() -> set[str]:
    return {str(f.relative_to(ROOT)) for f in (ROOT / "deca_ds").rglob("*.py")}


def _module_file(dotted: str, beside: str) -> list[str]:
    """The repository files `import dotted` runs, from a file in folder `beside`: each package's
    __init__.py on the way and the module itself; [] for anything outside the repository."""
    parts = dotted.split(".")
    if parts[0] != "deca_ds":  # a sibling of the importing file (profiling/ puts itself on sys.path)
        sibling = f"{beside}/{parts[0]}.py"
        return [sibling] if len(parts) == 1 and (ROOT / sibling).is_file() else []
    found = []
    for i in range(1, len(parts) + 1):
        base = "/".join(parts[:i])
        init, module = f"{base}/__init__.py", f"{base}.py"
        found += [f for f in (init, module) if (ROOT / f).is_file()]
    return found


def _imports(file: str) -> set[str]:
    """Repository files `file` imports anywhere in it (functions' deferred imports included), names
    as a dotted string constant (import_module(".blocks"), `-m deca_ds.x`), or starts (STARTS)."""
    tree = ast.parse((ROOT / file).read_text())
    folder = str(Path(file).parent)
    package = folder.replace("/", ".") if file.startswith("deca_ds") else ""
    found = set(STARTS.get(file, []))
    for node in ast.walk(tree):
        names = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*up, *([base] if base else [])])
            names = [base, *(f"{base}.{a.name}" for a in node.names)]
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            if re.fullmatch(r"\.\w+(\.\w+)*", node.value) and package:
                names = [package + node.value]
            elif re.fullmatch(r"deca_ds(\.\w+)+", node.value):
                names = [node.value]
        for name in names:
            found.update(_module_file(name, folder))
    return found


@functools.cache
def code_closure(tool: str) -> list[str]:
    """`tool` and every repository file it can run (_imports, followed to the end)."""
    seen, todo = set(), [tool]
    while todo:
        file = todo.pop()
        if file not in seen and (ROOT / file).is_file():
            seen.add(file)
            todo += sorted(_imports(file))
    return sorted(seen)


def _defines(node: ast.stmt) -> set[str]:
    """The names a top-level statement defines (a function, a class, an assignment's targets, an
    import's names)."""
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
        return {node.name}
    if isinstance(node, (ast.Import, ast.ImportFrom)) and getattr(node, "module", None) != "__future__":
        return {a.asname or a.name.split(".")[0] for a in node.names}
    targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(node, ast.AnnAssign) else []
    return {t.id for t in targets if isinstance(t, ast.Name)}


def used_names(trees: list[ast.AST]) -> frozenset[str]:
    """Every name the syntax trees use: variables, attributes, imported names, and identifiers
    written as strings (getattr, a lazy import's table)."""
    names = set()
    for tree in trees:
        for node in ast.walk(tree):
            if isinstance(node, ast.Name):
                names.add(node.id)
            elif isinstance(node, ast.Attribute):
                names.add(node.attr)
            elif isinstance(node, ast.alias):
                names.add(node.asname or node.name.split(".")[-1])
            elif isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value.isidentifier():
                names.add(node.value)
    return frozenset(names)


def code_digest(source: str, used: frozenset[str] | None = None, *, package: bool = False) -> str:
    """What a Python file runs: its syntax tree without docstrings (comments are not in it) and,
    given the names the code uses, without the top-level definitions none of it uses (a helper
    added for another command changes nothing a result's code runs) and without the imports only
    those needed. A package's __init__ (`package`) keeps its imports: it re-exports them."""
    tree = ast.parse(source)
    if used is not None:
        imports = (ast.Import, ast.ImportFrom)
        kept = [n for n in tree.body if isinstance(n, imports) or not _defines(n) or _defines(n) & used]
        here = used_names([n for n in kept if not isinstance(n, imports)])
        tree.body = [n for n in kept if package or not isinstance(n, imports) or not _defines(n)
                     or _defines(n) & here]
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if (isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and body
                and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant)
                and isinstance(body[0].value.value, str)):
            node.body = body[1:] or [ast.Pass()]
    return ast.dump(tree, include_attributes=False)


@functools.cache
def _source_at(commit: str, file: str) -> str | None:
    """`file` at `commit`; None where it did not exist."""
    done = subprocess.run(["git", "show", f"{commit}:{file}"], cwd=ROOT, capture_output=True, text=True,
                          timeout=60, check=False)
    return done.stdout if done.returncode == 0 else None


def changed_code(commit: str, files: list[str]) -> list[str] | None:
    """The files that run differently at HEAD than at `commit` (code_digest, with the names HEAD's
    `files` use); None when git does not know the commit."""
    def known(rev: str) -> str | None:
        done = subprocess.run(["git", "rev-parse", "--verify", "--quiet", f"{rev}^{{commit}}"], cwd=ROOT,
                              capture_output=True, text=True, timeout=60, check=False)
        return done.stdout.strip() if done.returncode == 0 else None

    then, head = known(commit), known("HEAD")
    if then is None or head is None:
        return None
    used = _used_at(head, tuple(files))
    return [f for f in files if _digest_at(then, f, used) != _digest_at(head, f, used)]


@functools.cache
def _used_at(commit: str, files: tuple[str, ...]) -> frozenset[str]:
    return used_names([ast.parse(s) for f in files if (s := _source_at(commit, f)) is not None])


@functools.cache
def _digest_at(commit: str, file: str, used: frozenset[str]) -> str | None:
    source = _source_at(commit, file)
    return None if source is None else code_digest(source, used, package=file.endswith("__init__.py"))


def stale(pattern: str = "gpu_*/*.json") -> list[dict]:
    """Each result JSON matching `pattern` (every GPU result by default) with its commit and the
    code that changed since."""
    found = []
    for path in sorted(RESULTS.glob(pattern)):
        commit, code = recorded_commit(path), described_code(path)
        changed = changed_code(commit, code) if commit else None
        found.append({"file": str(path.relative_to(RESULTS)), "commit": commit, "code": code,
                      "changed": changed, "stale": changed is None or bool(changed)})
    return found


def main() -> int:
    wrong = []
    for doc, claim in claims():
        value, ok = quoted((ROOT / doc).read_text(), claim)
        print(f"{'ok  ' if ok else 'MISS'} {doc}: {claim[0]} {claim[1]} {claim[2]}: {value}")
        wrong += [] if ok else [value]
    for s in stale():
        changed = s["changed"] or []
        why = ("no commit recorded" if s["commit"] is None else "commit unknown to git" if s["changed"] is None
               else f"{len(changed)} of the {len(s['code'])} files it ran changed since: {', '.join(changed[:4])}"
               + (f" and {len(changed) - 4} more" if len(changed) > 4 else ""))
        print(f"{'STALE' if s['stale'] else 'fresh'} {s['file']} (commit {s['commit']})" + (f": {why}" if s["stale"]
                                                                                             else ""))
    return 1 if wrong else 0


if __name__ == "__main__":
    sys.exit(main())
