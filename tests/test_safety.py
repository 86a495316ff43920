"""Nothing is lost: the output directory holds only what a run owns, divergence stops every rank,
--resume refuses a different run, checkpoints verify, and errors name the problem (issue 20)."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
import torch

from deca_ds.finite import MAX_CONSECUTIVE_SKIPS, finite, nonfinite_problem
from deca_ds.reporting import commit
from deca_ds.runtime import checkpoint, nonfinite, outputs, plan
from deca_ds.train import main as train_main
from ranks import wait_all
from test_runtime import PRESET, start_ranks

TINY = ["--ds_config", PRESET, "--topology", "ring", "--layers-per-block", "2", "--steps-per-block", "3",
        "--rounds", "1", "--micro-batch", "4", "--max-seq-len", "32", "--eval-limit", "16", "--timeout", "60"]


def snapshot(out: Path) -> dict:
    return {p: p.read_bytes() for p in sorted(out.rglob("*")) if p.is_file()}


def refused(argv: list[str], capsys) -> str:
    with pytest.raises(SystemExit) as exit_info:
        train_main(argv)
    assert exit_info.value.code == 1
    return capsys.readouterr().err


# ---- 1. the output directory -------------------------------------------------------------------

@pytest.fixture
def user_dir(tmp_path, monkeypatch):
    """A directory of the user's own files, some under names a run also uses."""
    monkeypatch.setenv("WORLD_SIZE", "2")
    out = tmp_path / "mine"
    (out / "metrics").mkdir(parents=True)
    (out / "metrics" / "experiment_2024.csv").write_text("a,b\n1,2\n")
    (out / "notes.txt").write_text("keep me")
    return out


def test_a_directory_without_a_run_is_refused_and_left_alone(user_dir, capsys):
    before = snapshot(user_dir)
    err = refused([*TINY, "--output-dir", str(user_dir)], capsys)
    assert "is not empty and holds no deca-ds run" in err and "--overwrite" in err, err
    # --overwrite does not make its metrics/ the run's: it is named and kept
    err = refused([*TINY, "--output-dir", str(user_dir), "--overwrite"], capsys)
    assert "holds no deca-ds run but has metrics" in err, err
    # a requeueable job's first start, too
    err = refused([*TINY, "--output-dir", str(user_dir), "--auto-resume", "--checkpoint-interval", "4"], capsys)
    assert "is not empty and holds no deca-ds run" in err, err
    assert snapshot(user_dir) == before


def test_a_run_file_of_the_users_is_never_replaced(tmp_path):
    """A run writes its options back as config.yaml: a user's own file of that name, say the run file
    the command reads, is named and kept, even with --overwrite."""
    out = tmp_path / "mine"
    out.mkdir()
    (out / "config.yaml").write_text("# my comments\nsteps: 3\n")
    with pytest.raises(ValueError, match="holds no deca-ds run but has config.yaml"):
        outputs.check_output_dir(out, resume=False, overwrite=True)


def test_claim_removes_only_what_a_run_writes(tmp_path):
    out = tmp_path / "run"
    for name in ("checkpoints/step_00000003/client_000", "metrics", "consensus", "clients/client_000", "partition"):
        (out / name).mkdir(parents=True)
    for name in ("run_config.json", "config.yaml", "summary.json", "summary.md", "loss_curve.png",
                 "metrics/client_000.jsonl", "notes.txt", "analysis/plot.py"):
        (out / name).parent.mkdir(parents=True, exist_ok=True)
        (out / name).write_text("x")
    outputs.check_output_dir(out, resume=False, overwrite=True)  # a run: --overwrite may replace it
    outputs.claim(out, resume=False)
    assert sorted(p.name for p in out.iterdir()) == ["analysis", "notes.txt", "run_owner.json"]
    owner = json.loads((out / "run_owner.json").read_text())
    assert owner["tool"] == "deca-ds" and set(owner["outputs"]) == set(outputs.RUN_OUTPUTS)
    # resuming drops only the finished run's results
    (out / "summary.json").write_text("{}")
    (out / "checkpoints").mkdir()
    outputs.claim(out, resume=True)
    assert sorted(p.name for p in out.iterdir()) == ["analysis", "checkpoints", "notes.txt", "run_owner.json"]


def test_claim_removes_what_a_cut_off_write_of_the_run_left(tmp_path, monkeypatch):
    """A rank killed while it wrote x̄ (SIGKILL, or its exit on a time limit's SIGTERM, where no
    cleanup runs) leaves a hidden temporary as large as the model: the next run removes it, resuming
    or starting over, and nothing else hidden."""
    from deca_ds.files import atomic_directory, atomic_write

    class Killed(BaseException):
        pass

    def half(tmp):
        Path(tmp).write_text("half")
        raise Killed

    out = tmp_path / "run"
    for resume in (False, True):
        (out / "clients" / "client_001").mkdir(parents=True, exist_ok=True)
        with monkeypatch.context() as mp:  # killed before the cleanup of each of the three writes
            mp.setattr(shutil, "rmtree", lambda *a, **k: None)
            mp.setattr(Path, "unlink", lambda *a, **k: None)
            with pytest.raises(Killed):
                atomic_write(out / "summary.json", half)  # leaves .summary.json.<random>.tmp
            with pytest.raises(Killed), atomic_directory(out / "consensus") as partial:  # .consensus.<random>.partial
                half(partial / "model.safetensors")
            with atomic_directory(out / "clients" / "client_001", replace=True):  # .client_001.<random>.old
                pass
        # not the run's: kept (clients/ is the run's, all removed when it starts over)
        mine = [out / ".notes.abcdefgh.tmp", out / ".cache", *[out / "clients" / ".mine.abcdefgh.partial"] * resume]
        for path in mine:
            path.write_text("keep me")
        assert len([p for p in out.rglob(".*") if p.parent in (out, out / "clients")]) == 3 + len(mine)
        outputs.claim(out, resume=resume)
        hidden = sorted(p for p in out.rglob(".*") if p.parent in (out, out / "clients"))
        assert hidden == sorted(mine), hidden


def test_a_file_as_output_dir_is_refused(tmp_path):
    (tmp_path / "f").write_text("x")
    with pytest.raises(ValueError, match="is not a directory"):
        outputs.check_output_dir(tmp_path / "f", resume=False, overwrite=True)


def test_a_held_directory_is_refused_and_left_as_it_was(user_dir, tmp_path):
    """A second hold on a directory (what a second run's rank 0 takes first) is refused, naming the
    first holder; each hold leaves the directory as it found it: the user's files, and a directory
    it had to make removed again where the run wrote nothing into it."""
    import os
    import socket

    before = snapshot(user_dir)
    with outputs.hold(user_dir):
        assert user_dir / outputs.LOCK in user_dir.iterdir()
        with pytest.raises(ValueError, match=r"holds no deca-ds run \(metrics, notes.txt\)"):  # nor is the lock
            outputs.check_output_dir(user_dir, resume=False, overwrite=False)
        with pytest.raises(ValueError, match=rf"--output-dir {user_dir} is in use by deca-train \(pid {os.getpid()} "
                                             rf"on {re.escape(socket.gethostname())}, since .*choose another"):
            with outputs.hold(user_dir):
                pass
    assert snapshot(user_dir) == before
    new = tmp_path / "runs" / "first"
    with outputs.hold(new):
        assert new.is_dir()
    assert not (tmp_path / "runs").exists()
    with outputs.hold(new):
        (new / "metrics").mkdir()
    assert sorted(p.name for p in new.iterdir()) == ["metrics"]


def test_a_file_system_without_locks_runs_unheld_and_says_so(tmp_path, monkeypatch, capsys):
    import errno
    import fcntl

    def no_locks(*args):
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(fcntl, "flock", no_locks)
    with outputs.hold(tmp_path / "run"):
        pass
    assert "its file system takes no locks (No locks available)" in capsys.readouterr().err


# ---- 2 and 3: divergence stops every rank; --overwrite then a crash leaves no stale results -----

@pytest.fixture(scope="module")
def diverged(tmp_path_factory):
    """An earlier run's directory (with a file of the user's) overwritten by a run with lr 1e30."""
    tmp = tmp_path_factory.mktemp("diverged")
    out = tmp / "run"
    (out / "metrics").mkdir(parents=True)
    for name, text in (("run_config.json", '{"old": 1}'), ("summary.json", '{"old": 1}'), ("summary.md", "old"),
                       ("loss_curve.png", "old"), ("notes.txt", "keep me"), ("metrics/client_000.jsonl", "{}\n")):
        (out / name).write_text(text)
    procs = start_ranks([*TINY, "--output-dir", str(out), "--overwrite", "--lr", "1e30"], 2, tmp / "logs")
    codes = wait_all(procs, timeout=300)
    return out, codes, [(tmp / "logs" / f"rank{r}.err").read_text() for r in range(2)]


def test_divergence_stops_every_rank_naming_client_step_and_block(diverged):
    out, codes, errs = diverged
    assert codes == [1, 1], errs
    for err in errs:
        m = re.search(r"non-finite (loss|update) on client (\d) \(rank \d\) at step (\d+) \(round 0, block (\d)", err)
        assert m, err[-3000:]
    steps = {re.search(r"at step (\d+)", err).group(1) for err in errs}
    assert len(steps) == 1, "every rank must stop at the same step"
    assert not (out / "consensus").exists() and not (out / "summary.json").exists()
    for c in range(2):  # what was logged is valid JSON and finite
        for line in (out / "metrics" / f"client_{c:03d}.jsonl").read_text().splitlines():
            json.loads(line, parse_constant=lambda c: pytest.fail(f"non-JSON constant {c}"))


def test_overwrite_then_crash_leaves_no_stale_results(diverged):
    out, _, _ = diverged
    assert (out / "notes.txt").read_text() == "keep me"
    assert (out / "run_owner.json").is_file() and "options" in json.loads((out / "run_config.json").read_text())
    for stale in outputs.RESULT_FILES:
        assert not (out / stale).exists(), stale


def test_summary_of_no_records_is_valid_json():
    from deca_ds.runtime.metrics import summarize, summary_table

    summary = summarize([[{"step": 0, "loss": 1.0, "t_forward": 0.1}]])
    json.dumps(summary, allow_nan=False)
    assert summary["clients"][0]["last_consensus_distance"] is None and "| - |" in summary_table(summary)


def test_every_json_the_project_writes_refuses_nan():
    """json.dumps / json.dump without allow_nan=False would write bare NaN, which is not JSON."""
    import ast

    root = Path(__file__).resolve().parents[1]
    missing = []
    for path in [*(root / "deca_ds").rglob("*.py"), *(root / "profiling").rglob("*.py")]:
        for node in ast.walk(ast.parse(path.read_text())):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                    and node.func.attr in ("dump", "dumps")
                    and isinstance(node.func.value, ast.Name) and node.func.value.id == "json"
                    and not any(k.arg == "allow_nan" and isinstance(k.value, ast.Constant) and k.value.value is False
                                for k in node.keywords)):
                missing.append(f"{path.relative_to(root)}:{node.lineno}")
    assert not missing, missing


def test_atomic_writes_get_the_umask_mode(tmp_path):
    import os

    from deca_ds import files

    old = os.umask(0o022)
    try:
        files.write_json(tmp_path / "a.json", {"x": 1})
        (tmp_path / "b.txt").write_text("plain")
    finally:
        os.umask(old)
    assert (tmp_path / "a.json").stat().st_mode & 0o777 == 0o644 == (tmp_path / "b.txt").stat().st_mode & 0o777
    with pytest.raises(ValueError):
        files.write_json(tmp_path / "nan.json", {"x": float("nan")})
    assert not (tmp_path / "nan.json").exists() and not list(tmp_path.glob(".nan.json.*"))


# ---- 9. messages that say what to do -------------------------------------------------------------

def test_an_empty_training_file_is_named(tmp_path):
    from deca_ds.datasets import load_task

    (tmp_path / "train.jsonl").write_text("")
    with pytest.raises(ValueError, match=r"data file for split 'train' is empty: .*train\.jsonl"):
        load_task(data_files={"train": str(tmp_path / "train.jsonl")}, text_column="text", label_column="label")


def test_a_latin1_csv_is_named_with_its_encoding(tmp_path):
    from deca_ds.datasets import load_task

    path = tmp_path / "train.csv"
    path.write_bytes("text,label\ncafé au lait,a\nnaïve,b\n".encode("latin-1"))
    with pytest.raises(ValueError, match=r"not UTF-8 text \(encoding error at byte 14\).*train\.csv.*UTF-8"):
        load_task(data_files={"train": str(path)}, text_column="text", label_column="label")


def test_the_dirichlet_minimum_names_options_the_cli_has():
    from deca_ds.data import dirichlet_partition
    from deca_ds.runtime.parsing import parse_args

    with pytest.raises(ValueError) as info:
        dirichlet_partition([0, 0, 1, 1], 4, 0.01, min_size=2, max_tries=3)
    flags = re.findall(r"--[a-z-]+", str(info.value))
    assert flags and "min_size" not in str(info.value)
    for flag in flags:  # every option the message names is one the command line accepts
        parse_args(["--ds_config", PRESET, flag] + (["1"] if flag != "--iid" else []))


# ---- 5. a checkpoint is complete only when its manifest verifies ---------------------------------

def saved_steps(root: Path, steps=(3, 6), ranks_per_client: int = 2):
    model = torch.nn.Linear(4, 3)
    for step in steps:
        for local_rank in range(ranks_per_client):
            checkpoint.save_client(root, step, 0, local_rank, model=model if local_rank == 0 else None,
                                   optimizer_state={"m": torch.ones(3)} if local_rank == 0 else None,
                                   rank_state={"step": step})
    return checkpoint.client_dir


@pytest.mark.parametrize("damage, reason", [
    ("truncate_model", r"model\.safetensors has \d+ bytes, its manifest says \d+"),
    ("flip_optimizer", r"optimizer\.pt does not match the sha256 in its manifest"),
    ("no_manifest", r"manifest_1\.json is missing or unreadable .*not finished"),
])
def test_a_damaged_checkpoint_is_skipped_with_its_reason(tmp_path, damage, reason):
    client_dir = saved_steps(tmp_path)
    d = client_dir(tmp_path, 6, 0)
    if damage == "truncate_model":
        data = (d / "model.safetensors").read_bytes()
        (d / "model.safetensors").write_bytes(data[: len(data) // 2])
    elif damage == "flip_optimizer":
        data = bytearray((d / "optimizer.pt").read_bytes())
        data[-30] ^= 0xFF
        (d / "optimizer.pt").write_bytes(bytes(data))
    else:
        (d / "manifest_1.json").unlink()
    complete, problems = checkpoint.scan_steps(tmp_path, 0, 2)
    assert complete == [3] and set(problems) == {6}
    assert re.search(reason, problems[6]), problems[6]
    start, lines = checkpoint.choose_resume_step([complete, complete], [problems, problems], 2)
    assert start == 3
    assert re.search(r"skipped checkpoint step 6 \(client 0: .*" + reason, lines[0]), lines
    assert "resuming from step 3" in lines[-1]


def test_resume_refuses_when_no_step_verifies_everywhere(tmp_path):
    start, lines = checkpoint.choose_resume_step([[3, 6], [3, 6]], [{}, {}], 1)
    assert (start, lines) == (6, [])
    start, lines = checkpoint.choose_resume_step([[3, 6], [3]], [{}, {6: "x is missing"}], 1)
    assert start == 3 and "client 1: x is missing" in lines[0]
    start, lines = checkpoint.choose_resume_step([[3, 6], [3, 6], [3], [3]], [{}, {}, {}, {}], 2)  # 2 ranks a client
    assert start == 3 and lines[0] == "skipped checkpoint step 6 (client 1: not written)", lines
    with pytest.raises(ValueError, match=r"no checkpoint is complete for every client \(client 1: step 3: bad\)"):
        checkpoint.choose_resume_step([[3], []], [{}, {3: "bad"}], 1)
    with pytest.raises(ValueError, match=r"the run wrote no checkpoint \(--checkpoint-interval N .*--overwrite"):
        checkpoint.choose_resume_step([[], []], [{}, {}], 1)



def test_auto_resume_starts_resumes_or_refuses_as_the_nodes_hold_the_run(tmp_path):
    def choose(holds, hosts, complete, problems, ranks_per_client=1):
        return checkpoint.choose_auto_start(holds, hosts, complete, problems, ranks_per_client, root=tmp_path)

    assert choose([False, False], ["a", "b"], [[], []], [{}, {}]) == (None, [])  # the first start
    # killed before its first checkpoint: nothing a step made is there to keep
    assert choose([True, True], ["a", "b"], [[], []], [{}, {}]) == (
        None, [f"the run in {tmp_path} wrote no checkpoint yet: starting it from step 0"])
    start, lines = choose([True] * 4, list("aabb"), [[3, 6], [3, 6], [3], [3]], [{}] * 4, 2)  # as --resume
    assert start == 3 and lines[0] == "skipped checkpoint step 6 (client 1: not written)", lines
    # requeued onto a node without its files: starting over would replace client 0's checkpoints
    with pytest.raises(ValueError, match=r"hold the run in .*, but not those of client 1 \(node7\): .*--overwrite"):
        choose([True, True, False, False], ["node3", "node3", "node7", "node7"], [[3], [3], [], []], [{}] * 4, 2)
    # a checkpoint some client did not finish is kept, as --resume keeps it
    with pytest.raises(ValueError, match=r"no checkpoint is complete for every client \(client 1: step 3: bad\)"):
        choose([True, True], ["a", "a"], [[3], []], [{}, {3: "bad"}])


def test_auto_resume_is_one_command_for_the_first_start_and_every_requeue(tmp_path):
    """The same command each time: it starts the run (in a directory a run killed in its set-up left),
    starts it again from step 0 when it was killed before its first checkpoint, and resumes it from
    its checkpoint after that; the run ends with the same x̄ and metrics every time."""
    from helpers import assert_only_run_outputs
    from ranks import start_rank
    from test_runtime import ROOT, unlaunched_env

    out = tmp_path / "run"
    outputs.claim(out, resume=False)  # what a run killed before its run_config.json leaves
    args = [*TINY, "--checkpoint-interval", "4", "--auto-resume", "--output-dir", str(out)]
    for name in ("first", "requeued", "requeued again"):
        rank = start_rank(args, unlaunched_env(), ROOT, tmp_path / f"{name}.out", tmp_path / f"{name}.err")
        assert wait_all([rank], timeout=300) == [0], (tmp_path / f"{name}.err").read_text()[-3000:]
        said = (tmp_path / f"{name}.out").read_text()
        metrics = (out / "metrics" / "client_000.jsonl").read_text()
        if name == "first":
            assert "resumed from" not in said and "--auto-resume:" not in said, said
            assert "accuracy before training" in said, said
            before = snapshot(out / "consensus"), metrics
            shutil.rmtree(out / "checkpoints")  # as if killed before its first checkpoint
            continue
        steps = len(before[1].splitlines())
        if name == "requeued":
            assert f"--auto-resume: the run in {out} wrote no checkpoint yet: starting it from step 0" in said, said
            assert "resumes" not in json.loads((out / "run_config.json").read_text())
        else:
            assert f"resumed from step {steps} of {steps}" in said, said
            assert len(json.loads((out / "run_config.json").read_text())["resumes"]) == 1
        assert snapshot(out / "consensus") == before[0]
        assert len(metrics.splitlines()) == steps
        assert_only_run_outputs(out)


def test_a_run_stopped_by_its_time_limit_resumes_to_the_uninterrupted_ones_end(tmp_path):
    """--time-limit stops every rank at the same step, each client's checkpoint written, nothing of
    the end (x̄, summary) written; resumed, the run ends with the x̄ of one that went through."""
    logs = tmp_path / "logs"
    runs = {name: tmp_path / name for name in ("through", "stopped")}
    for name, extra in (("through", []), ("stopped", ["--time-limit", "1e-6"]), ("resumed", ["--resume"])):
        out = runs.get(name, runs["stopped"])
        procs = start_ranks([*TINY, "--output-dir", str(out), *extra], 2, logs / name)
        assert wait_all(procs, timeout=300) == [0, 0], (logs / name / "rank0.err").read_text()[-3000:]
        said = (logs / name / "rank0.out").read_text()
        if name == "stopped":  # one step takes longer than the limit
            total = json.loads((runs["through"] / "summary.json").read_text())["steps"]
            assert (f"--time-limit 1e-06 min: stopped after step 1 of {total}, its checkpoint written "
                    f"({out / 'checkpoints' / 'step_00000001'}); the same command with --resume goes on") in said, said
            assert [checkpoint.complete_steps(out, c, 1) for c in range(2)] == [[1], [1]]
            logged = [(out / "metrics" / f"client_{c:03d}.jsonl").read_text().splitlines() for c in range(2)]
            assert [len(lines) for lines in logged] == [1, 1]
            assert not (out / "consensus").exists() and not (out / "summary.json").exists()
    assert "resumed from step 1" in said, said
    weights = [(runs[name] / "consensus" / "model.safetensors").read_bytes() for name in ("stopped", "through")]
    assert weights[0] == weights[1]

# ---- 4. --resume refuses a different run, accepts and records harmless changes -------------------

def test_resume_refuses_every_change_that_alters_the_result(diverged, monkeypatch):
    import dataclasses

    from deca_ds.runtime.parsing import parse_args
    from deca_ds.runtime.task import build_task

    out, _, _ = diverged
    monkeypatch.setenv("WORLD_SIZE", "2")
    same = [*TINY, "--output-dir", str(out), "--lr", "1e30", "--resume"]
    task = build_task(parse_args(same)[0], 2)
    opts, ds_config = parse_args([*same, "--micro-batch", "8", "--topology", "complete"])
    with pytest.raises(ValueError) as info:
        plan.check_output_dir(opts, ds_config, task)
    message = str(info.value)
    for difference in ("micro_batch: 4 in the saved run, 8 now", "topology: 'ring' in the saved run, 'complete' now",
                       "ds_config.train_micro_batch_size_per_gpu: 4 in the saved run, 8 now"):
        assert difference in message, message
    monkeypatch.setenv("WORLD_SIZE", "4")
    with pytest.raises(ValueError, match="world_size: 2 in the saved run, 4 now"):
        plan.check_output_dir(*parse_args(same), task)
    monkeypatch.setenv("WORLD_SIZE", "2")
    # timeouts, evaluation limits and intervals do not change the result: accepted, and named for the record
    _, changes = plan.check_output_dir(*parse_args([*same, "--timeout", "5", "--eval-limit", "8",
                                                       "--consensus-interval", "3"]), task)
    assert changes == {"timeout": [60.0, 5.0], "eval_limit": [16, 8], "consensus_interval": [5, 3]}
    # other training data with the same options (a data file edited in place): refused, naming the client
    saved = json.loads((out / "run_config.json").read_text())["data_fingerprints"]
    assert saved == task.data_fingerprints and len(set(saved)) == 2
    features = [dict(f) for f in task.features]
    last = features[task.client_indices[1][-1]]
    last["input_ids"] = [*last["input_ids"][:-2], last["input_ids"][-2] + 1, last["input_ids"][-1]]
    edited = dataclasses.replace(task, features=features, data_fingerprints=None)  # fingerprinted anew
    with pytest.raises(ValueError, match=r"--resume: the training data of client\(s\) \[1\] differ from the saved "
                                         r"run's \(its run_config.json's data_fingerprints"):
        plan.check_output_dir(*parse_args(same), edited)


def test_a_resume_cut_off_while_it_trims_the_metrics_keeps_them(tmp_path, monkeypatch):
    """Resuming rewrites each client's metrics without the steps it redoes: a failure in that write
    (the disk full, the job killed) leaves the file as it was, never cut short; done, the file holds
    the steps before the resumed one and then what the resumed run appends."""
    from deca_ds.runtime.metrics import MetricsWriter, metrics_path, read_client_metrics

    path = metrics_path(tmp_path, 0)
    path.parent.mkdir()
    path.write_text("".join(json.dumps({"step": s, "loss": 1.0 / s}) + "\n" for s in range(1, 7)))
    before = path.read_bytes()
    write_text = Path.write_text

    def disk_full(self, text, *args, **kwargs):  # what was opened is emptied, then the write fails
        write_text(self, "")
        raise OSError(28, "No space left on device")

    with monkeypatch.context() as mp:
        mp.setattr(Path, "write_text", disk_full)
        with pytest.raises(OSError, match="No space left"):
            MetricsWriter(tmp_path, 0, resume_step=4)
    assert path.read_bytes() == before and [p.name for p in path.parent.iterdir()] == [path.name]
    writer = MetricsWriter(tmp_path, 0, resume_step=4)
    writer.write({"step": 4, "loss": 0.5})
    writer.close()
    assert [r["step"] for r in read_client_metrics(tmp_path, 0)] == [1, 2, 3, 4]


def test_resume_ignores_an_option_the_method_does_not_read():
    """A D-Adam run saved with --state-bits 8 (ignored, before such options were refused) resumes
    without it: recorded, not refused; for a DECA run the moments' bits are a result's. So for a
    synthetic run's data files and an IID split's Dirichlet settings."""
    from deca_ds.runtime.outputs import resume_changes

    now = {"method": "dadam", "state_bits": 32, "lr": 1e-3}
    saved = {"options": {**now, "state_bits": 8}, "world_size": 2}
    assert resume_changes(saved, now, {}, 2, {}) == {"state_bits": [8, 32]}
    deca = {"options": {**saved["options"], "method": "deca"}, "world_size": 2}
    with pytest.raises(ValueError, match="state_bits: 8 in the saved run, 32 now"):
        resume_changes(deca, {**now, "method": "deca"}, {}, 2, {})
    # the same for the data: --data-files beside the synthetic task, --dirichlet-alpha beside --iid
    now = {"method": "deca", "dataset": "synthetic", "data_files": None, "iid": True, "dirichlet_alpha": 0.25}
    saved = {"options": {**now, "data_files": ["train=mine.jsonl"], "dirichlet_alpha": 0.1}, "world_size": 2}
    assert resume_changes(saved, now, {}, 2, {}) == {"data_files": [["train=mine.jsonl"], None],
                                                     "dirichlet_alpha": [0.1, 0.25]}
    with pytest.raises(ValueError, match=r"data_files: \['train=mine.jsonl'\] in the saved run, None now; "
                                         r"dirichlet_alpha: 0.1 in the saved run, 0.25 now"):
        files = {"dataset": "files", "iid": False}  # both read there
        resume_changes({**saved, "options": {**saved["options"], **files}}, {**now, **files}, {}, 2, {})


def test_record_resume_appends_to_run_config(tmp_path):
    (tmp_path / "run_config.json").write_text(json.dumps({"options": {"timeout": 60.0}}))
    outputs.record_resume(tmp_path, {"timeout": [60.0, 5.0]})
    saved = json.loads((tmp_path / "run_config.json").read_text())
    assert saved["options"] == {"timeout": 60.0} and saved["resumes"][0]["changed"] == {"timeout": [60.0, 5.0]}
    assert saved["resumes"][0]["commit"] == commit()  # the code it went on with (the checkout's here)
    assert saved["resumes"][0]["cpu_kernels"] == torch.backends.cpu.get_cpu_capability()  # and its kernels


def test_not_result_names_real_options():
    import dataclasses

    from deca_ds.runtime.options import NOT_RESULT, RunOptions

    assert NOT_RESULT <= {f.name for f in dataclasses.fields(RunOptions)}


# ---- 6. the judge's key goes only where the user said: tests/test_evaluation.py --------------------


# ---- 7 and 8: a dead rank under the deepspeed launcher is named, a stopped one says where it was -

def test_a_rank_stopped_by_sigterm_says_where_it_was():
    """A rank stopped by the launcher or by a measuring tool's time limit names the call its main
    thread was in (a hang, or a set-up phase that takes too long) before it exits."""
    import signal
    import subprocess
    import sys

    rank = ("import time\nfrom deca_ds.runtime import cleanup\ncleanup.install()\n"
            "def drawing_the_model():\n    print('ready', flush=True)\n    time.sleep(600)\ndrawing_the_model()\n")
    proc = subprocess.Popen([sys.executable, "-c", rank], cwd=Path(__file__).resolve().parents[1],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline() == "ready\n", proc.stderr.read()
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 143, err
    assert "stopped by SIGTERM" in err and re.search(r"it was at:\n(.|\n)*, in drawing_the_model\n", err), err

def test_a_stopped_run_says_where_it_goes_on_from(tmp_path, capsys):
    """A run of one rank (no launcher) stopped by Ctrl-C, then again by a time limit's SIGTERM once
    resumed: each time it exits at once (no traceback for Ctrl-C) naming its newest checkpoint, from
    which --resume goes on. While it runs, the same command started again is refused, naming it."""
    import signal
    import time

    from ranks import start_rank
    from test_runtime import ROOT, unlaunched_env

    out = tmp_path / "run"
    args = [*TINY, "--steps-per-block", "5000", "--checkpoint-interval", "20", "--output-dir", str(out)]

    def stop(sig, after: int, name: str) -> tuple[int, str, str]:
        """Start the run, signal it once a checkpoint after step `after` is complete: (exit, stdout, stderr)."""
        rank = start_rank(args, unlaunched_env(), ROOT, tmp_path / f"{name}.out", tmp_path / f"{name}.err")
        deadline = time.monotonic() + 300
        while not [m for m in out.glob("checkpoints/step_*/client_000/manifest_0.json")
                   if int(m.parts[-3].removeprefix("step_")) > after]:
            assert time.monotonic() < deadline and rank.poll() is None, (tmp_path / f"{name}.err").read_text()[-3000:]
            time.sleep(0.1)
        err = refused([*args, "--resume"], capsys)
        assert f"--output-dir {out} is in use by deca-train (pid {rank.pid} on" in err, err
        rank.send_signal(sig)
        code = wait_all([rank], timeout=120)[0]
        return code, (tmp_path / f"{name}.out").read_text(), (tmp_path / f"{name}.err").read_text()

    said = r"\[rank 0\] (?:interrupted \(Ctrl-C\): )?client 0's newest checkpoint is step (\d+) \(.*step_0*\1\): " \
           r"the same command with --resume goes on from the newest step every client completed"
    code, _, err = stop(signal.SIGINT, 0, "first")
    note = re.search(said, err)
    assert note, err[-3000:]
    first = int(note.group(1))
    assert code == 130 and "Traceback" not in err and first % 20 == 0, err[-3000:]
    args.append("--resume")
    code, stdout, err = stop(signal.SIGTERM, first, "resumed")
    assert f"resumed from step {first} of" in stdout, stdout[-3000:]
    assert code == 143 and re.search(r"\[rank 0\] stopped by SIGTERM\n\[rank 0\] it was at:\n", err), err[-3000:]
    # the main thread may complete a newer checkpoint while the note is written: at least the one awaited
    assert int(re.search(said, err).group(1)) > first, err[-3000:]


def test_a_run_whose_end_failed_resumes_straight_to_it(tmp_path):
    """The last step's checkpoint is written too, so a run whose end fails (forming x̄, its export or
    evaluation) loses no training: --resume trains no step and writes the same x̄ and summary. The x̄
    a resume finds (the end failed after the export) is replaced whole, never written into."""
    from helpers import assert_only_run_outputs
    from ranks import start_rank
    from test_runtime import ROOT, unlaunched_env

    out = tmp_path / "run"
    args = [*TINY, "--checkpoint-interval", "4", "--output-dir", str(out)]  # the last step is no multiple of it
    for name in ("first", "resumed", "resumed again"):
        rank = start_rank(args, unlaunched_env(), ROOT, tmp_path / f"{name}.out", tmp_path / f"{name}.err")
        assert wait_all([rank], timeout=300) == [0], (tmp_path / f"{name}.err").read_text()[-3000:]
        if name == "first":
            steps = sum(1 for _ in (out / "metrics" / "client_000.jsonl").open())
            assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step_00000004", f"step_{steps:08d}"]
            before = snapshot(out / "consensus"), json.loads((out / "summary.json").read_text())
            shutil.rmtree(out / "consensus")  # as if the export had failed
            (out / "summary.json").unlink()
            args.append("--resume")
            continue
        assert f"resumed from step {steps} of {steps}" in (tmp_path / f"{name}.out").read_text()
        assert sum(1 for _ in (out / "metrics" / "client_000.jsonl").open()) == steps
        assert snapshot(out / "consensus") == before[0]
        assert json.loads((out / "summary.json").read_text()) == before[1]
        assert_only_run_outputs(out)
        if name == "resumed":  # as if the evaluation after the export had failed, and consensus/ were damaged
            (out / "summary.json").unlink()
            (out / "consensus" / "model.safetensors").write_bytes(b"cut short")
            (out / "consensus" / "stale.json").write_text("{}")


def test_a_failed_replacement_keeps_the_directory_it_would_replace(tmp_path):
    """How a resumed run writes x̄ (and --save-clients' models) over those it wrote before: a failure
    keeps the old directory as it was (also when the new one cannot take its place once the old
    one is moved aside), a success leaves the new one alone, and nothing else stays."""
    import os

    from deca_ds.files import atomic_directory

    model = tmp_path / "consensus"
    model.mkdir()
    (model / "model.safetensors").write_text("whole")
    with pytest.raises(RuntimeError, match="out of memory"):
        with atomic_directory(model, replace=True) as partial:
            (partial / "model.safetensors").write_text("half")
            raise RuntimeError("out of memory")
    assert [p.name for p in tmp_path.iterdir()] == ["consensus"] and snapshot(model) == {
        model / "model.safetensors": b"whole"}
    replace = os.replace

    def swap_fails(src, dst):  # the old one moved aside, then the new one cannot take its place
        if str(src).endswith(".partial"):
            raise OSError(28, "No space left on device")
        replace(src, dst)

    with pytest.raises(OSError, match="No space left"), pytest.MonkeyPatch.context() as mp:
        mp.setattr(os, "replace", swap_fails)
        with atomic_directory(model, replace=True) as partial:
            (partial / "model.safetensors").write_text("new")
    assert [p.name for p in tmp_path.iterdir()] == ["consensus"] and snapshot(model) == {
        model / "model.safetensors": b"whole"}
    with atomic_directory(model, replace=True) as partial:
        (partial / "config.json").write_text("{}")
    assert [p.name for p in tmp_path.iterdir()] == ["consensus"] and snapshot(model) == {model / "config.json": b"{}"}


def test_a_dead_rank_under_the_launcher_is_named(tmp_path):
    """A rank SIGKILLed under the deepspeed launcher: the launcher SIGTERMs the survivor long before
    its --timeout, which names the dead client first. (A stopped rank: test_runtime's hung peer,
    whose neighbours fail within --timeout and exit; the launcher then SIGKILLs the stopped rank
    after its own 30 s.)"""
    import signal
    import subprocess
    import sys
    import time

    from deca_ds.runtime.rank import free_port
    from helpers import descendants
    from test_runtime import LAUNCH, ROOT

    timeout = 120
    out, port = tmp_path / "run", str(free_port())
    cmd = [sys.executable, "-m", "deepspeed.launcher.runner", "--num_gpus", "2", "--master_port", port, LAUNCH,
           *TINY, "--steps-per-block", "200", "--timeout", str(timeout), "--output-dir", str(out)]
    log = open(tmp_path / "launcher.log", "w")
    launcher = subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, text=True)
    victim = None
    try:
        deadline = time.monotonic() + 300
        metrics = out / "metrics" / "client_000.jsonl"
        while not (metrics.is_file() and len(metrics.read_text().splitlines()) >= 3):
            assert time.monotonic() < deadline and launcher.poll() is None, (tmp_path / "launcher.log").read_text()
            time.sleep(0.2)
        victim = descendants(launcher.pid, "--local_rank=1")[0]
        victim.send_signal(signal.SIGKILL)
        hit = time.monotonic()
        code = launcher.wait(timeout=timeout + 90)
        took = time.monotonic() - hit
    finally:
        for p in (launcher, victim):
            if p is not None and (p.poll() if isinstance(p, subprocess.Popen) else p.is_running()) in (None, True):
                p.kill()
    text = (tmp_path / "launcher.log").read_text()
    assert code != 0 and took < timeout, (code, took)
    named = [line for line in text.splitlines() if line.startswith("[rank 0]") and "client 1 (rank 1)" in line]
    assert named, text[-4000:]


# ---- 2b. --skip-nonfinite skips on every rank, counts, and gives up on a diverged run -------------

def steps_of_an_engine(rank: int, init: str, extensions: str) -> dict:
    """Three steps of a real DeepSpeed engine with a preset's LR schedule (a CPU rank in a gloo job
    of one), the second skipped: what each did to the weights and gradients, and where the schedule
    and the engine's count of skipped steps end."""
    import os

    import torch.distributed as dist

    from deca_ds.runtime.ds_engine import ClientMPU, initialize

    os.environ.update(TORCH_EXTENSIONS_DIR=extensions, LOCAL_RANK="0")
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=1)
    try:
        model = torch.nn.Linear(2, 1)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        group = dist.new_group([0])
        config = {"train_micro_batch_size_per_gpu": 1, "scheduler": {"type": "WarmupLR", "params": {
            "warmup_min_lr": 0.01, "warmup_max_lr": 0.1, "warmup_num_steps": 10, "warmup_type": "linear"}}}
        engine = initialize(model, optimizer, config, ClientMPU(group, [0], group), torch.device("cpu"))
        moved, cleared = [], []
        for skip in (False, True, False):
            engine.backward(engine(torch.ones(1, 2)).sum())
            before = model.weight.detach().clone()
            with nonfinite.skipped_update(optimizer, skip):
                engine.step()
            moved.append(not torch.equal(before, model.weight))
            cleared.append(model.weight.grad is None or not model.weight.grad.any().item())
        return {"moved": moved, "cleared": cleared, "schedule": engine.lr_scheduler.state_dict(),
                "skipped": engine.skipped_steps, "left": sorted({"step", "overflow"} & set(vars(optimizer)))}
    finally:
        dist.destroy_process_group()


def test_a_skipped_step_leaves_the_weights_and_the_lr_schedule_where_they_were(tmp_path):
    """DeepSpeed's engine.step() runs without the optimizer's step and, like a step it skips for an
    fp16 overflow, without stepping a preset's LR schedule: after 2 steps taken and 1 skipped the
    schedule stands where --resume puts it at step 2 (lr_schedule.go_to). Before, it advanced on skipped steps too, so
    each skip moved a warm-up a step ahead of the steps taken."""
    from ranks import run_on_ranks

    (tmp_path / "extensions").mkdir()
    [seen] = run_on_ranks(steps_of_an_engine, 1, f"file://{tmp_path / 'store'}", str(tmp_path / "extensions"))
    assert seen["moved"] == [True, False, True] and all(seen["cleared"])
    assert seen["schedule"] == {"last_batch_iteration": 1} and seen["skipped"] == 1  # -1 as built, +1 a step taken
    assert seen["left"] == []  # the class's step again, and no overflow flag


def test_a_skipped_step_gives_back_a_torch_schedules_wrapper_of_the_step():
    """torch's LR schedules wrap their optimizer's step on the instance (to count its calls); a
    skipped step puts that wrapper back, not the class's step."""
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.ones(1))], lr=1.0)
    torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=3)
    wrapped = vars(optimizer)["step"]
    optimizer.param_groups[0]["params"][0].grad = torch.ones(1)
    with nonfinite.skipped_update(optimizer, True):
        optimizer.step()
    assert vars(optimizer)["step"] is wrapped and "overflow" not in vars(optimizer)
    assert optimizer.param_groups[0]["params"][0].item() == 1.0


class NanGradient(torch.autograd.Function):
    """The identity forward, NaN backward: a finite loss whose gradient is not."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad * float("nan")


@pytest.mark.parametrize("what", ["loss", "gradient"])
def test_simulate_skips_a_nonfinite_step_on_every_client_as_ranks_do(what):
    """simulate(skip_nonfinite=True): the step where client 1's loss (or gradient) is NaN is skipped
    by all three clients (no update, no mixing, nothing carried to the next step), so the run ends
    with the bits of one that never saw that step's batches; the same NaN at every step stops the
    run once MAX_CONSECUTIVE_SKIPS are skipped in a row."""
    from deca_ds import DecaConfig, make_topology, simulate
    from helpers import client_batches, tiny_llama

    W = make_topology("ring", 3).W
    cfg = DecaConfig(lr=1e-3, steps_per_block=2, rounds=1, layers_per_block=1)  # 2 blocks: 4 steps
    batches = client_batches(3, steps=5)
    poison = NanGradient.apply if what == "gradient" else lambda out: out * float("nan")
    calls, poisoned = [0], {5}  # the forwards run client by client (calls 1-3: step 0): client 1 at step 1

    def head(module, args, out):
        calls[0] += 1
        return poison(out) if calls[0] in poisoned else out

    model = tiny_llama(2)
    hook = model.lm_head.register_forward_hook(head)  # each client's deep copy calls it
    skips = []
    got = simulate(model, batches, W, cfg, skip_nonfinite=True, on_skip=lambda *seen: skips.append(seen))
    hook.remove()
    assert skips == [(1, f"non-finite {what} on client 1")]
    want = simulate(model, [b[:1] + b[2:] for b in batches], W, cfg)
    assert [sorted(g) for g in got] == [sorted(w) for w in want]
    assert all(torch.equal(g[name], w[name]) for g, w in zip(got, want) for name in w)

    hook = model.lm_head.register_forward_hook(head)
    calls[0], poisoned, skips = 0, set(range(1, 100, 3)), []  # client 0's every forward from step 0 on
    longer = client_batches(3, steps=2 * MAX_CONSECUTIVE_SKIPS)
    with pytest.raises(ValueError, match=f"{MAX_CONSECUTIVE_SKIPS + 1} consecutive steps non-finite up to step 0"):
        simulate(model, longer, W, cfg, skip_nonfinite=True, on_skip=lambda *seen: skips.append(seen))
    assert skips == [(0, f"non-finite {what} on client 0")] * MAX_CONSECUTIVE_SKIPS


def test_nonfinite_problem_sees_losses_and_gradients():
    import torch

    model = torch.nn.Linear(2, 1)
    model(torch.ones(1, 2)).sum().backward()
    assert nonfinite_problem([1.0, 2.0], model) == 0
    assert nonfinite_problem([1.0, float("nan")], model) == 1
    model.weight.grad[0, 0] = float("inf")
    assert nonfinite_problem([1.0], model) == 2


def test_finite_sees_every_nonfinite_value_without_a_tensor_sized_temporary():
    """The check after each update reads the active block's master; isfinite(t).all() made |t| and
    masks as large as the block (1.3 GB above a Llama-3.1-8B step's peak on a GPU)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    for dtype in (torch.float32, torch.bfloat16, torch.float16, torch.float64):
        x = torch.randn(1000, dtype=dtype)
        assert finite(x)
        for value in (float("nan"), float("inf"), -float("inf")):
            for at in (0, 517, 999):
                y = x.clone()
                y[at] = value
                assert not finite(y), (dtype, value, at)
    assert finite(torch.empty(0))  # an empty tensor has no value to be non-finite

    x = torch.randn(1_000_000)
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        assert finite(x)
    assert max(e.cpu_memory_usage for e in prof.events()) < 1024  # bytes: a scalar, not x's 4 MB


def test_skip_nonfinite_skips_on_every_rank_then_stops_a_diverged_run(tmp_path):
    out = tmp_path / "run"
    procs = start_ranks([*TINY, "--output-dir", str(out), "--lr", "1e30", "--skip-nonfinite"], 2, tmp_path / "logs")
    codes = wait_all(procs, timeout=300)
    outs = [(tmp_path / "logs" / f"rank{r}.out").read_text() for r in range(2)]
    errs = [(tmp_path / "logs" / f"rank{r}.err").read_text() for r in range(2)]
    assert codes == [1, 1], errs
    skips = re.findall(r"--skip-nonfinite: skipped step (\d+) .*; (\d+) skipped so far", outs[0])
    assert len(skips) == MAX_CONSECUTIVE_SKIPS + 1, outs[0][-3000:]
    assert [int(n) for _, n in skips] == list(range(1, len(skips) + 1))
    assert len({s for s, _ in skips}) == 1, "a skipped step does not advance the schedule"
    for err in errs:
        assert f"{MAX_CONSECUTIVE_SKIPS + 1} consecutive steps non-finite" in err, err[-2000:]
    assert not (out / "consensus").exists()


def test_a_clients_other_rank_prunes_its_files_and_the_folders_left_empty(tmp_path):
    """On a node apart from its client's first rank, rank 1 is alone with its step folders: keeping
    the newest, it removes its state file and its manifest of the older ones, then the empty folders."""
    from deca_ds.runtime import checkpoint as ckpt

    for step in (3, 6, 9):
        ckpt.save_client(tmp_path, step, 0, 1, model=None, optimizer_state=None, rank_state={"step": step})
    ckpt.prune_rank(tmp_path, 0, 1, keep=1)
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step_00000009"]
    assert sorted(p.name for p in ckpt.client_dir(tmp_path, 9, 0).iterdir()) == ["manifest_1.json", "rank_1.pt"]
