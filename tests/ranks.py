"""Rank processes for the tests, forked from a server that has imported the trainer once.

A rank started as `python launch/train.py` spends about 10 s of CPU importing torch, transformers
and DeepSpeed before it does anything, and a tiny run trains for under a second: on a 2-core machine
the imports were most of the suite's time. Here a multiprocessing forkserver imports the trainer
once; each rank is a fork of it that runs `deca_ds.train.main()` as the command does, with its own
environment, argv, working directory and output files, and SIGTERM handling installed by `main`.
Nothing but imports runs in the server (no thread pool, no process group), so each fork starts as a
fresh rank would after its imports. The launchers themselves (deepspeed, `--module`, the console
scripts) start real processes in the tests that are about them.
"""

from __future__ import annotations

import atexit
import contextlib
import multiprocessing
import os
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist

from helpers import exit_status

LAUNCH = str(Path(__file__).resolve().parents[1] / "launch" / "train.py")

_FORKS = multiprocessing.get_context("forkserver")
# what a rank imports on the way, the fused update's compiler and the rank-0 report's figures included
_FORKS.set_forkserver_preload(["deca_ds.train", "deca_ds.runtime.trainer", "deepspeed", "torch._inductor.compile_fx",
                               "matplotlib.pyplot"])


def _redirect(stdout: str, stderr: str) -> None:
    for fd, path in ((1, stdout), (2, stderr)):
        file = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(file, fd)
        os.close(file)


def _run(argv: list[str], env: dict[str, str], cwd: str, stdout: str, stderr: str) -> None:
    """The body of a rank: `launch/train.py argv` with this environment, exiting as that process would."""
    os.environ.clear()
    os.environ.update(env)
    os.chdir(cwd)
    _redirect(stdout, stderr)
    # Ctrl-C raises KeyboardInterrupt, as in a command started from a terminal. A fork takes the
    # forkserver's inherited disposition, which is "ignored" where the tests run as a background
    # job (`cmd &` in a script): a SIGINT then did nothing and the run went on to its end.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    sys.argv = [LAUNCH, *argv]
    from deca_ds.train import main

    code = 0
    try:
        main()
    except SystemExit as done:
        code = exit_status(done)
    except BaseException:
        traceback.print_exc()
        code = 1
    atexit._run_exitfuncs()  # what the interpreter's exit runs where main() returns (--estimate); a fork skips it
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


class Rank:
    """A started rank, with the part of subprocess.Popen's interface the tests use."""

    def __init__(self, process: multiprocessing.Process) -> None:
        self._process = process
        self.pid = process.pid

    def poll(self) -> int | None:
        return self._process.exitcode

    def wait(self, timeout: float | None = None) -> int:
        self._process.join(timeout)
        if self._process.exitcode is None:
            raise subprocess.TimeoutExpired(LAUNCH, timeout)
        return self._process.exitcode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:  # a reaped pid may belong to another process by now
            os.kill(self.pid, sig)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


def start_rank(argv: list[str], env: dict[str, str], cwd: Path, stdout: Path, stderr: Path) -> Rank:
    """`launch/train.py argv` as one rank with exactly `env`, its output in the two files."""
    process = _FORKS.Process(target=_run, args=(argv, env, str(cwd), str(stdout), str(stderr)), daemon=False)
    process.start()
    return Rank(process)


def wait_all(procs: list[Rank], timeout: float) -> list[int]:
    """Each rank's exit status, waiting at most `timeout` seconds for them all; past it every rank
    is killed and the test fails."""
    deadline = time.monotonic() + timeout
    codes = []
    for p in procs:
        try:
            codes.append(p.wait(timeout=max(1.0, deadline - time.monotonic())))
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise AssertionError(f"ranks still running after {timeout} s") from None
    return codes


def _call(fn: Callable, rank: int, args: tuple, path: str) -> None:
    _redirect(path + ".out", path + ".err")
    try:
        result = ("returned", fn(rank, *args))
    except BaseException:
        result = ("raised", traceback.format_exc())
    torch.save(result, path)


@contextlib.contextmanager
def gloo_group(rank: int, port: int, world: int):
    """The body as `rank` of a gloo process group of `world` forked ranks meeting at `port`."""
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        yield
    finally:
        dist.destroy_process_group()


def run_on_ranks(fn: Callable[..., Any], world: int, *args, timeout: float = 120.0) -> list:
    """fn(rank, *args) on `world` forked processes at once (a test's own gloo job), returning what
    each returned, in rank order; a rank's exception is raised here with its traceback. `fn` lives
    in a module (a test file) and returns tensors, numbers, strings and containers of them."""
    with tempfile.TemporaryDirectory() as tmp:
        paths = [os.path.join(tmp, f"rank{rank}.pt") for rank in range(world)]
        procs = [_FORKS.Process(target=_call, args=(fn, rank, args, path)) for rank, path in enumerate(paths)]
        for p in procs:
            p.start()
        codes = wait_all([Rank(p) for p in procs], timeout)
        results = []
        for rank, (code, path) in enumerate(zip(codes, paths)):
            if code != 0 or not os.path.exists(path):
                with open(path + ".err") as err:
                    raise AssertionError(f"rank {rank} exited {code} with no result:\n{err.read()[-3000:]}")
            kind, value = torch.load(path, weights_only=True)
            if kind == "raised":
                raise AssertionError(f"rank {rank} raised:\n{value}")
            results.append(value)
        return results
