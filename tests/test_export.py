"""deca-export's refusals and its all-or-nothing directory. What it writes, x̄ of a checkpoint as the
run writes consensus/, is held per method to the run's own scores on ranks (test_runtime_methods)."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from deca_ds import export
from deca_ds.files import atomic_directory, current_umask
from deca_ds.runtime import checkpoint_consensus


@pytest.fixture
def run(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    (run / "run_config.json").write_text("{}")
    return run


def refused(argv: list[str], capsys) -> str:
    with pytest.raises(SystemExit) as stop:
        export.main(argv)
    assert stop.value.code == 1
    return capsys.readouterr().err


def test_an_out_that_holds_anything_is_refused_and_left_alone(run, tmp_path, capsys):
    out = tmp_path / "model"
    out.mkdir()
    (out / "notes.txt").write_text("keep me")
    err = refused(["--run", str(run), "--checkpoint", "3", "--out", str(out)], capsys)
    assert f"--out {out} holds files" in err, err
    assert [p.name for p in out.iterdir()] == ["notes.txt"] and (out / "notes.txt").read_text() == "keep me"
    (tmp_path / "file").write_text("x")
    assert "holds files (or is one)" in refused(["--run", str(run), "--checkpoint", "3",
                                                       "--out", str(tmp_path / "file")], capsys)
    assert "no run_config.json there" in refused(["--run", str(tmp_path), "--checkpoint", "3",
                                                  "--out", str(tmp_path / "new")], capsys)


def fake_consensus(save):
    method = SimpleNamespace(save_consensus=save)
    opts = SimpleNamespace(method="deca", working_dtype="bf16")
    return lambda *args: checkpoint_consensus.CheckpointModel(None, method, None, 3, opts, 2)


def test_an_export_is_whole_or_absent(run, tmp_path, monkeypatch):
    """A failure while writing leaves nothing of the export (an empty --out the user made stays);
    a finished one is renamed into place with where it came from, and what an export to the same
    --out killed before its end left beside it is removed."""
    out = tmp_path / "model"
    out.mkdir()

    def fails(model, directory, tokenizer):
        (directory / "model.safetensors").write_text("half")
        raise RuntimeError("disk full")

    monkeypatch.setattr(checkpoint_consensus, "checkpoint_model", fake_consensus(fails))
    with pytest.raises(RuntimeError, match="disk full"):
        export.main(["--run", str(run), "--checkpoint", "latest", "--out", str(out)])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model", "run"] and not any(out.iterdir())

    def writes(model, directory, tokenizer):
        (directory / "config.json").write_text("{}")

    monkeypatch.setattr(checkpoint_consensus, "checkpoint_model", fake_consensus(writes))
    cut_off = tmp_path / ".model.abcdefgh.partial"  # what an export killed before its end leaves
    (cut_off / "model.safetensors").parent.mkdir()
    (cut_off / "model.safetensors").write_text("half")
    (tmp_path / ".model.notes").write_text("not an export's")
    export.main(["--run", str(run), "--checkpoint", "latest", "--out", str(out)])
    assert sorted(p.name for p in tmp_path.iterdir()) == [".model.notes", "model", "run"]
    assert sorted(p.name for p in out.iterdir()) == ["config.json", export.MARKER]
    assert json.loads((out / export.MARKER).read_text()) == {
        "run": str(run.resolve()), "checkpoint": 3, "client": None, "method": "deca", "n_clients": 2,
        "working_dtype": "bf16"}


def test_a_directory_filled_meanwhile_is_left_as_it_is(tmp_path):
    """atomic_directory renames over an empty directory only; the new one gets the mode any other
    directory gets under the umask (mkdtemp's would be 0700)."""
    out = tmp_path / "model"
    with pytest.raises(OSError):
        with atomic_directory(out) as partial:
            (partial / "config.json").write_text("{}")
            out.mkdir()
            (out / "theirs.txt").write_text("keep me")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model"] and [p.name for p in out.iterdir()] == ["theirs.txt"]
    with atomic_directory(tmp_path / "new"):
        pass
    assert (tmp_path / "new").stat().st_mode & 0o777 == 0o777 & ~current_umask()
