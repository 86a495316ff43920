"""README.md fits a screen first and its links, and those of docs/, lead somewhere; docs/api.md names the
whole public API."""

import re
from pathlib import Path

import pytest

import deca_ds

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")


def prose(path: Path) -> str:
    """The Markdown without fenced code blocks or inline code, where brackets are not links."""
    text = re.sub(r"^```.*?^```", "", path.read_text(), flags=re.S | re.M)
    return re.sub(r"`[^`\n]*`", "", text)


def anchors(path: Path) -> set[str]:
    """GitHub's heading ids: lower case, punctuation but - and _ dropped, spaces to hyphens."""
    headings = re.findall(r"^#+ (.+)$", re.sub(r"^```.*?^```", "", path.read_text(), flags=re.S | re.M), re.M)
    return {re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-") for heading in headings}


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_resolves(page):
    links = [link for link in LINK.findall(prose(page)) if not re.match(r"[a-z]+:", link)]
    assert links or page.name != "README.md"
    for link in links:
        target, _, fragment = link.partition("#")
        file = (page.parent / target).resolve() if target else page
        assert file.is_file(), f"{page.relative_to(ROOT)} links {link}, and {target} is no file"
        if fragment and file.suffix == ".md":
            assert fragment in anchors(file), f"{page.relative_to(ROOT)} links {link}: no such heading"


def test_readme_first_screen_holds_the_two_commands_and_the_gpu_command():
    readme = (ROOT / "README.md").read_text()
    first_screen = readme.splitlines()[:40]
    for command in ("bash launch/demo.sh", ".venv/bin/python -m pytest -q tests"):
        assert command in first_screen, f"README's first 40 lines lack the line {command!r}"
    assert any(line.startswith("deepspeed --num_gpus") for line in first_screen)
    assert len(readme.encode()) < 6 * 1024, f"README.md is {len(readme.encode())} bytes"


def test_readme_picture_is_a_small_png():
    picture = ROOT / "docs" / "img" / "demo_loss_curve.png"
    data = picture.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) < 200 * 1024
    assert "docs/img/demo_loss_curve.png" in (ROOT / "README.md").read_text()


def test_api_doc_names_every_public_name():
    api = (ROOT / "docs" / "api.md").read_text()
    code = " ".join(re.findall(r"`([^`\n]+)`", api))
    missing = [name for name in deca_ds.__all__ if not re.search(rf"(?<![\w.]){re.escape(name)}\b", code)]
    assert not missing, f"docs/api.md does not name {missing}"


def test_readme_demo_numbers_are_the_committed_runs():
    """The README's demo accuracies are docs/demo/summary.json's, as the trainer wrote them."""
    import json

    summary = json.loads((ROOT / "docs" / "demo" / "summary.json").read_text())
    after, before = summary["consensus_eval"], summary["initial_eval"]
    text = " ".join((ROOT / "README.md").read_text().split())
    claim = (f"scores {after['accuracy']:.3f} accuracy on {after['n']} held-out examples "
             f"({before['accuracy']:.3f} before training, chance {after['chance']:.3f})")
    assert claim in text, claim
    assert before["n"] == after["n"]


@pytest.mark.parametrize("index", range(2))
def test_api_doc_examples_run(index, monkeypatch, capsys):
    """Each Python example of docs/api.md runs as written, from the repository root."""
    examples = re.findall(r"^```python\n(.*?)^```", (ROOT / "docs" / "api.md").read_text(), flags=re.S | re.M)
    assert len(examples) == 2
    monkeypatch.chdir(ROOT)
    exec(compile(examples[index], f"docs/api.md example {index + 1}", "exec"), {})
    assert capsys.readouterr().out


def test_readme_gpu_grid_numbers_are_the_committed_cells():
    """The README's sentence on the GPU accuracy grid: its count of finished cells and each method's
    mean accuracy over its finished seeds, from reproduce/results/gpu_ag_news/results.json."""
    import json
    import statistics

    cells = json.loads((ROOT / "reproduce" / "results" / "gpu_ag_news" / "results.json").read_text())["cells"]
    finished = [c for c in cells if c["finished"]]
    accuracy = {}
    for c in finished:
        accuracy.setdefault(c["method"], []).append(100 * c["final"]["accuracy"])
    mean = {method: f"{statistics.fmean(values):.1f}" for method, values in accuracy.items()}
    text = " ".join((ROOT / "README.md").read_text().split())
    claim = (f"has run {len(finished)} of its {len(cells)} cells so far (H200; two seeds): mean accuracy "
             f"DECA {mean['deca']} %, trivial BMA {mean['trivial_bma']}, no BMA {mean['no_bma']}, "
             f"D-Adam {mean['dadam']}; Dec-Adapter {mean['dec_adapter']} (one seed)")
    assert claim in text, claim
    seeds = {method: len(values) for method, values in accuracy.items()}
    assert seeds == {"deca": 2, "trivial_bma": 2, "no_bma": 2, "dadam": 2, "dec_adapter": 1}
