"""README.md fits a screen first and its links, and those of docs/, lead somewhere; docs/api.md names the
whole public API."""

import json
import re
import statistics
from pathlib import Path

import pytest

import deca_ds
from deca_ds.reproduce.paired import paired_p

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
    for command in ("bash launch/demo.sh", ".venv/bin/python -m pytest -q -n 2 tests"):
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


def finished_cells(grid: str) -> list[dict]:
    cells = json.loads((ROOT / "reproduce" / "results" / grid / "results.json").read_text())["cells"]
    return [c for c in cells if c["finished"]]


def paired_accuracy(cells: list[dict], method: str, tables: set[str]) -> list[tuple[float, float]]:
    """(DECA's accuracy, `method`'s) of each DECA cell of these tables and the method's cell of its
    topology, clients, layers per block and seed, as tables.md pairs them; a cell in two tables (the
    main setting's) counts once."""
    def setting(c):
        return c["topology"], c["clients"], c["layers_per_block"], c["seed"]

    accuracy = {(c["method"], setting(c)): c["final"]["accuracy"] for c in cells if tables & set(c["tables"])}
    return [(accuracy[("deca", s)], accuracy[(m, s)]) for m, s in accuracy if m == method and ("deca", s) in accuracy]


def deca_against(cells: list[dict], method: str, tables: set[str]) -> tuple[int, int, int]:
    """(seeds DECA is ahead on, behind on, pairs) against `method` in the cells of these tables."""
    pairs = paired_accuracy(cells, method, tables)
    return sum(d > o for d, o in pairs), sum(d < o for d, o in pairs), len(pairs)


def deca_minus(cells: list[dict], method: str) -> list[float]:
    """DECA's accuracy less `method`'s in the main table, seed by seed (the paired t-test's input)."""
    return [d - o for d, o in paired_accuracy(cells, method, {"main"})]


def granularity_order(cells: list[dict]) -> list[int]:
    """DECA's layers per block, from the best mean accuracy over the seeds to the worst."""
    by_lpb = {}
    for c in cells:
        if c["method"] == "deca" and {"main", "granularity"} & set(c["tables"]):
            by_lpb.setdefault(c["layers_per_block"], []).append(c["final"]["accuracy"])
    return sorted(by_lpb, key=lambda lpb: -statistics.fmean(by_lpb[lpb]))


def test_readme_cpu_grid_orderings_are_the_committed_cells():
    """Each ordering the README's sentence on the scaled CPU grids states, counted seed by seed from
    reproduce/results/cpu_ag_news and cpu_synthetic's results.json."""
    text = " ".join((ROOT / "README.md").read_text().split())
    ag, synthetic = finished_cells("cpu_ag_news"), finished_cells("cpu_synthetic")
    main, sweeps, peft = {"main"}, {"topology", "clients"}, ("dec_lora", "dec_adapter", "decaf")
    for method in ("no_bma", "trivial_bma", *peft):
        assert deca_against(ag, method, main) == (5, 0, 5), method
    p = [paired_p(deca_minus(ag, method)) for method in ("no_bma", "trivial_bma", *peft)]
    assert "beats DECA without BMA, with trivial BMA and every decentralized PEFT baseline on each of the five seeds " \
           f"(paired t-test p {min(p):.2g} to {max(p):.2g})" in text
    ahead, _, pairs = map(sum, zip(*(deca_against(ag, method, sweeps) for method in peft)))
    assert ahead == pairs
    assert f"every PEFT baseline on each seed of every topology and number of clients ({ahead} of {pairs} paired " \
           "seeds)" in text
    order = granularity_order(ag)
    assert order == sorted(order)  # "falls as its blocks grow"
    assert f"falls as its blocks grow ({' > '.join(map(str, order))} layers per block)" in text

    for method in ("trivial_bma", "decaf", "dec_adapter"):
        assert deca_against(synthetic, method, main) == (5, 0, 5), method
    (_, no_bma, seeds), (_, lora, _) = (deca_against(synthetic, method, main) for method in ("no_bma", "dec_lora"))
    p_no_bma, p_lora = (paired_p(deca_minus(synthetic, method)) for method in ("no_bma", "dec_lora"))
    assert p_no_bma > 0.5 and p_lora > 0.5  # "no clear difference"
    assert f"it beats trivial BMA, DeCAF and Dec-Adapter on every seed, but is behind DECA without BMA on {no_bma} " \
           f"of {seeds} seeds and Dec-LoRA on {lora} (p {p_no_bma:.2g} and {p_lora:.2g}: no clear difference), and " \
           f"{granularity_order(synthetic)[0]} layers per block is best" in text
    # behind as many seeds on each task (ahead on AG News none, one seed a tie; on the synthetic task one)
    (behind, seeds), = {deca_against(cells, "dadam", main)[1:] for cells in (ag, synthetic)}
    assert f"D-Adam (not in the paper) beats DECA on {behind} of {seeds} seeds on each task" in text
