"""profiling/check_results.py: the GPU numbers the docs quote equal their result files; stale results are found."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "profiling"))

import check_results  # noqa: E402


@pytest.mark.parametrize("doc,claim", check_results.claims(),
                         ids=lambda v: v if isinstance(v, str) else f"{v[0]}:{v[1]}:{v[2]}")
def test_the_docs_quote_the_result_files(doc, claim):
    value, ok = check_results.quoted((ROOT / doc).read_text(), claim)
    assert ok, f"{doc} does not quote {value} ({claim})"


def test_a_changed_number_is_caught_and_a_rewrapped_one_is_not():
    text = (ROOT / "docs" / "memory.md").read_text()
    ratio = check_results.MEMORY[-2]  # a percentage, written by a function
    assert check_results.quoted(text, ratio) == ("is 5.7 % /", True)
    assert not check_results.quoted(text.replace("5.7 %", "5.8 %"), ratio)[1]
    assert check_results.quoted(text.replace("is 5.7 % /", "is\n  5.7  %\n/"), ratio)[1]
    readme = (ROOT / "profiling" / "README.md").read_text()
    assert not check_results.quoted(readme.replace("18.27 GiB", "18.30 GiB"), check_results.PROFILING[0])[1]


def test_results_older_than_their_code_are_stale():
    if subprocess.run(["git", "cat-file", "-e", "17f96e9^{commit}"], cwd=ROOT, check=False).returncode:
        pytest.skip("this checkout's history lacks commit 17f96e9 (shallow clone)")
    s, = check_results.stale("gpu_h100/profile_memory.json")
    assert s["commit"] == "17f96e9" and s["stale"] and "deca_ds/runtime/trainer.py" in s["changed"]
    # the tool, what it imports, and the trainer its ranks run (launch/train.py, started by runs.py)
    assert {"profiling/profile_memory.py", "profiling/runs.py", "launch/train.py", "deca_ds/train.py",
            "deca_ds/runtime/trainer.py", "deca_ds/optimizer.py", "deca_ds/updates.py"} <= set(s["code"])
    assert "deca_ds/reproduce/cli.py" not in s["code"]  # nothing a profiling run can reach
    # HEAD itself is fresh for any code
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                          check=True).stdout.strip()
    assert check_results.changed_code(head, s["code"]) == []
    assert check_results.changed_code("0" * 40, s["code"]) is None  # a commit git does not know


def test_only_a_change_to_what_the_code_runs_makes_it_stale():
    digest = check_results.code_digest
    source = '''"""Module."""\n\n\ndef f(x):\n    """Twice x."""\n    return 2 * x  # double\n'''
    reworded = '''"""Another module docstring."""\n\ndef f(x):\n    """Doubles x,\n    in other words."""\n''' \
        '''    return 2 * x  # twice\n'''
    assert digest(reworded) == digest(source)
    assert digest(source.replace("2 * x", "3 * x")) != digest(source)
    assert digest(source.replace('    """Twice x."""\n', "")) == digest(source)
    # a function that is only a docstring still differs from one that does something
    assert digest('def f():\n    """Nothing."""\n') == digest("def f():\n    pass\n") != digest(source)
    # given the names the result's code uses: a helper it never calls, and the import only that helper
    # needs, change nothing; a change to what it calls does
    used = check_results.used_names([ast.parse("from m import f\nprint(f(2))\n")])
    helper = "import sys\n" + source + "\n\ndef g():\n    return sys.argv\n"
    assert digest(helper, used) == digest(source, used) != digest(helper)
    assert digest(source.replace("2 * x", "3 * x"), used) != digest(source, used)
    assert digest(helper, used, package=True) != digest(source, used, package=True)  # an __init__ re-exports


def test_a_result_s_own_commit_wins_over_its_folder_s_readme(tmp_path):
    """setup_peaks.py nests its provenance; a README naming an older commit must not stand in for it."""
    (tmp_path / "README.md").write_text("Code: commit `1111111` of this repository.")
    nested = tmp_path / "nested.json"
    nested.write_text('{"loads": {}, "provenance": {"commit": "2222222+dirty", '
                      '"command": "python profiling/setup_peaks.py --out x"}}')
    top = tmp_path / "top.json"
    top.write_text('{"commit": "3333333", "command": "python profiling/update_cost.py", "rows": []}')
    bare = tmp_path / "bare.json"
    bare.write_text('{"results": []}')
    assert check_results.recorded_commit(nested) == "2222222"
    assert "profiling/setup_peaks.py" in check_results.described_code(nested)
    assert check_results.recorded_commit(top) == "3333333"
    assert check_results.described_code(top) == check_results.code_closure("profiling/update_cost.py")
    assert check_results.recorded_commit(bare) == "1111111"


def test_provenance_names_the_checkout_s_head(tmp_path):
    """A result's commit is HEAD's short hash, "+dirty" with uncommitted changes to tracked files
    outside the result's own directory (`exclude`), which the result itself may be."""
    import torch

    from deca_ds import reporting

    head = subprocess.run(["git", "rev-parse", "--short=7", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                          check=True).stdout.strip()
    dirty = bool(subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT,
                                capture_output=True, text=True, check=True).stdout.strip())
    made = reporting.provenance("python profiling/x.py --out y", cpu="2 threads")
    assert made["commit"] == head + ("+dirty" if dirty else "")
    assert made["command"] == "python profiling/x.py --out y" and made["device"].endswith(", 2 threads)")
    model = [line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("model name")] \
        if Path("/proc/cpuinfo").is_file() else []
    kernels = f"{torch.backends.cpu.get_cpu_capability()} kernels"  # which decide a CPU result's bits
    assert f", {kernels}, 2 threads)" in made["device"]
    if model:  # which CPU
        assert f", {model[0].split(':', 1)[1].strip()}, {kernels}, 2 threads)" in made["device"]
    # the kernels a process runs, as ATEN_CPU_CAPABILITY sets them (docs/reproduce.md), not the CPU's best
    pinned = subprocess.run([sys.executable, "-c", "from deca_ds.reporting import provenance; "
                             "print(provenance('x')['device'])"], env={**os.environ, "ATEN_CPU_CAPABILITY": "default"},
                            capture_output=True, text=True, check=True, timeout=120).stdout
    assert "DEFAULT kernels)" in pinned
    assert reporting.commit(exclude=ROOT) == head  # every change is inside `exclude`
    # results written outside the checkout (a grid's --results-dir in /tmp) exclude nothing of it
    assert reporting.commit(exclude=tmp_path) == made["commit"]
