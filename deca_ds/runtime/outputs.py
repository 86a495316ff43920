"""What a run writes into --output-dir, listed once, and the rules that keep everything else safe.

A run owns exactly the entries of RUN_OUTPUTS. It writes the marker `run_owner.json` before
anything else, so a directory is recognised as a run (older runs: by their run_config.json).
A directory that holds anything else and no run is refused unless --overwrite; --overwrite then
writes beside the foreign files but never removes them, and removes only RUN_OUTPUTS entries of
an earlier run, after every check of the new run has passed. While a run lives its rank 0 holds the
directory (`hold`), so a second run started on it is refused.
"""

from __future__ import annotations

import errno
import json
import os
import re
import socket
import sys
import time
from contextlib import contextmanager
from pathlib import Path

from .. import __version__
from ..files import leftovers, remove, write_json
from ..reporting import commit, cpu_kernels

MARKER = "run_owner.json"
# The results of a finished run: removed before training starts, so that a run that crashes
# after --overwrite or --resume never leaves them beside a newer run_config.json.
RESULT_FILES = ("summary.json", "summary.md", "loss_curve.png")
RUN_OUTPUTS = (MARKER, "run_config.json", "config.yaml", *RESULT_FILES, "partition", "checkpoints", "metrics",
               "tensorboard", "trace", "consensus", "adapter", "clients", "answers")
CLIENT_DIR = re.compile(r"client_\d{3,}")  # clients/client_NNN/ (--save-clients)
# flock'ed by a live run's rank 0 (`hold`). Not among RUN_OUTPUTS, which a run starting over removes:
# removed, it would no longer keep out a run that opens the path anew.
LOCK = ".deca-train.lock"


def is_run(out: Path) -> bool:
    return (out / MARKER).is_file() or (out / "run_config.json").is_file()


def check_output_dir(out: Path, *, resume: bool, overwrite: bool) -> None:
    """Refuse an output directory the run may not write to (called on every rank, before anything
    is written)."""
    _check_not_a_file(out)
    if resume:
        if not (out / "run_config.json").is_file():
            raise ValueError(f"--resume: {out} holds no run to continue")
        return
    if is_run(out):
        if not overwrite:
            raise ValueError(f"output directory {out} already holds a run; pass --resume to continue it "
                             "or --overwrite to replace it")
        return
    foreign = sorted(p.name for p in out.iterdir() if p.name != LOCK) if out.is_dir() else []
    if foreign and not overwrite:
        raise ValueError(f"output directory {out} is not empty and holds no deca-ds run ({', '.join(foreign[:5])}"
                         f"{', …' if len(foreign) > 5 else ''}); choose an empty directory, or pass --overwrite "
                         "to write beside these files (nothing of them is removed)")
    clashes = [name for name in foreign if name in RUN_OUTPUTS]
    if clashes:
        raise ValueError(f"output directory {out} holds no deca-ds run but has {', '.join(clashes)}, which a run "
                         "writes; these are not removed even with --overwrite: move them or choose another directory")


def _check_not_a_file(out: Path) -> None:
    if out.exists() and not out.is_dir():
        raise ValueError(f"--output-dir {out} exists and is not a directory")


@contextmanager
def hold(out: Path):
    """Rank 0 holds the output directory for the whole run, from before its first check: a second
    run started on it meanwhile (from another terminal, a job requeued while the first still runs) is
    refused before it reads or writes anything, naming the run that holds it, instead of deleting or
    interleaving that run's files. The lock goes with its process (flock), so a killed run leaves none;
    the lock file goes at the run's end, and so do the directories the run made if it wrote nothing
    into them (a run refused by a later check leaves nothing behind)."""
    _check_not_a_file(out)
    made = [d for d in (out, *out.parents) if not d.exists()]
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ValueError(f"--output-dir {out} cannot be created: {e.strerror}") from None
    lock = None
    try:
        lock = _lock(out)
        yield
    finally:
        if lock is not None:
            (out / LOCK).unlink(missing_ok=True)
            lock.close()
        for d in made:  # the deepest first; rmdir removes only an empty one
            try:
                d.rmdir()
            except OSError:
                break


def _lock(out: Path):
    """The open lock file, flock'ed for this process, its line saying whose it is; None where the file
    system takes no locks."""
    import fcntl

    path = out / LOCK
    for _ in range(100):
        f = path.open("a+")
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            f.seek(0)
            who = f.read().strip() or "another deca-train run"
            f.close()
            raise ValueError(f"--output-dir {out} is in use by {who}: a second run there would remove or mix "
                             "with that run's files. Wait for it to end or stop it, or choose another "
                             "--output-dir") from None
        except OSError as e:
            f.close()
            if e.errno not in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL):
                raise
            print(f"--output-dir {out}: its file system takes no locks ({e.strerror}), so a second run started "
                  "on this directory while this one runs would not be refused", file=sys.stderr, flush=True)
            return None
        try:  # the holder before us removed the file as it ended: our lock is on a name no longer there
            if os.fstat(f.fileno()).st_ino == path.stat().st_ino:
                break
        except FileNotFoundError:
            pass
        f.close()
    else:
        raise ValueError(f"--output-dir {out}: could not take its lock {path}, removed again each time")
    f.truncate(0)
    f.write(f"deca-train (pid {os.getpid()} on {socket.gethostname()}, since {time.strftime('%Y-%m-%d %H:%M:%S')})\n")
    f.flush()
    return f


def claim(out: Path, *, resume: bool) -> None:
    """Rank 0, once every check has passed: drop what an earlier run wrote (all of it when starting
    over, its result files when resuming, and either way what a write of it cut off left) and write
    the marker first."""
    out.mkdir(parents=True, exist_ok=True)
    stale = [out / name for name in (RUN_OUTPUTS if not resume else RESULT_FILES)]
    stale += leftovers(out, RUN_OUTPUTS) + leftovers(out / "clients", CLIENT_DIR)
    for path in stale:
        remove(path)
    owner = {"tool": "deca-ds", "version": __version__, "written": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
             "outputs": list(RUN_OUTPUTS)}
    write_json(out / MARKER, owner)


def resume_changes(saved: dict, options: dict, ds_config: dict, world_size: int,
                   defaults: dict) -> dict[str, list]:
    """Compare this run's resolved options and DeepSpeed config with the saved run_config.json:
    refuse (ValueError listing every difference) any change that alters the result; return the
    others as {name: [saved, now]} to record. An option the saved run predates counts as its default."""
    from .options import NOT_RESULT, NOT_RESULT_DS, unread_in

    before = {**defaults, **saved.get("options", {})}
    changed = {name: [before.get(name), value] for name, value in options.items()
               if _plain(before.get(name)) != _plain(value)}
    saved_ds, now_ds = saved.get("ds_config", {}), ds_config
    changed.update({f"ds_config.{k}": [saved_ds.get(k), now_ds.get(k)] for k in sorted(set(saved_ds) | set(now_ds))
                    if _plain(saved_ds.get(k)) != _plain(now_ds.get(k))})
    if saved.get("world_size", world_size) != world_size:
        changed["world_size"] = [saved["world_size"], world_size]
    same = NOT_RESULT | unread_in(options)
    refused = {k: v for k, v in changed.items() if k not in same and k.removeprefix("ds_config.") not in NOT_RESULT_DS}
    if refused:
        lines = "; ".join(f"{k}: {a!r} in the saved run, {b!r} now" for k, (a, b) in sorted(refused.items()))
        raise ValueError(f"--resume: this run differs from the one in run_config.json in what it computes: {lines}. "
                         "Pass the saved values, or start a new run in another --output-dir")
    return {k: v for k, v in changed.items() if k not in refused and k not in ("resume", "overwrite")}


def check_same_data(saved: dict, fingerprints: list[str | None]) -> None:
    """--resume: each client's encoded training data (the fingerprints this process knows) must be
    the saved run's, or the resumed stream would draw other examples at its saved position. A run
    saved before the fingerprints were recorded is not checked."""
    before = saved.get("data_fingerprints")
    if before is None:
        return
    changed = [c for c, (was, now) in enumerate(zip(before, fingerprints)) if now is not None and was != now]
    if changed:
        raise ValueError(f"--resume: the training data of client(s) {changed} differ from the saved run's (its "
                         "run_config.json's data_fingerprints: the examples as encoded, in order). Resume with the "
                         "data, tokenizer and --max-seq-len it started with, or start a new run in another "
                         "--output-dir")


def _plain(value):
    """JSON's view of a value (tuples are lists), so a saved option compares equal to its parsed one."""
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    return value


def record_resume(out: Path, changes: dict[str, list]) -> None:
    """Rank 0, resuming: append to run_config.json when, with which changed options, at which
    commit and with which CPU kernels (a resumed run may run other code, or on another machine, than
    its start) it resumed."""
    config = json.loads((out / "run_config.json").read_text())
    config.setdefault("resumes", []).append({"at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                                             "changed": changes, "commit": commit(), "cpu_kernels": cpu_kernels()})
    write_json(out / "run_config.json", config)
