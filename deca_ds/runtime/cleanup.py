"""How a rank exits, normally, on an error or when the launcher stops it.

When one rank fails, the deepspeed launcher SIGTERMs the others. A Python handler would run only
when the main thread returns from the collective it is blocked in, so SIGTERM is blocked in every
thread and taken by a thread of ours, which prints who went silent (the heartbeat board) and where
the main thread was before the process exits: the dead client is named even when the launcher
stops the survivors first, and a rank stopped for taking too long says what it was doing.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
import traceback
from typing import Callable

# what the SIGTERM line says, and how rank 0 waits for the others to read the heartbeat board
# before its exit takes the store down: set once the board exists; and where a new run would go on
_SIGTERM: dict = {"describe": None, "linger": None, "resume": None}


def exit_now(code: int) -> None:
    """Leave at once, output flushed: a failed rank must not wait in a process group's destructor
    for a peer that is stopped (the launcher would wait with it)."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def install(describe: Callable[[], str] | None = None) -> None:
    """On SIGTERM print `describe()` (who went silent) and exit 143. Called once by a rank's entry
    point (launch/train.py), from the main thread before any other thread starts, so that every
    thread inherits the blocked SIGTERM."""
    _SIGTERM["installed"] = True
    if threading.current_thread() is not threading.main_thread():
        return
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
    _SIGTERM["describe"] = describe

    def on_sigterm() -> None:
        signal.sigwait({signal.SIGTERM})
        # a rank started without a launcher is its job's only rank (deca_ds.runtime.rank)
        launched = "RANK" in os.environ
        rank = os.environ.get("RANK", "0")
        try:
            said = _SIGTERM["describe"]() if _SIGTERM["describe"] else ""
        except Exception as e:  # the store may be gone with rank 0
            said = f"(the heartbeat board could not be read: {type(e).__name__})"
        resume = resume_note()
        why = " (the launcher stops every rank once one fails; so does a time limit)" if launched else ""
        print(f"\n[rank {rank}] stopped by SIGTERM{why}{': ' if said else ''}{said}\n[rank {rank}] it was at:\n"
              f"{main_thread_at()}" + (f"[rank {rank}] {resume}\n" if resume else ""), file=sys.stderr, flush=True)
        os._exit(143)

    threading.Thread(target=on_sigterm, name="deca-sigterm", daemon=True).start()


def main_thread_at(calls: int = 8) -> str:
    """The main thread's innermost calls: where a stopped rank was (a hang's place, a slow set-up's phase)."""
    frame = sys._current_frames().get(threading.main_thread().ident)
    return "".join(traceback.format_stack(frame)[-calls:]) if frame is not None else "(no main thread)\n"


def installed() -> bool:
    """Whether this process is a rank started as a command (deca-train, launch/train.py), not a test calling main()."""
    return _SIGTERM.get("installed", False)


def set_board(describe: Callable[[], str] | None, linger: Callable[[float], object]) -> None:
    """Once the heartbeat board can be read: what the SIGTERM line says (its silent ranks; None
    for a job of one rank), and how rank 0 waits, a given time at most, for the other ranks to
    read it."""
    _SIGTERM["describe"], _SIGTERM["linger"] = describe, linger


def set_resume(note: Callable[[], str]) -> None:
    """What the SIGTERM lines end with: where the run would go on from (`note()`, read then)."""
    _SIGTERM["resume"] = note


def resume_note() -> str:
    """Where a new run would go on from (set_resume's note, read now; "" before the run knows)."""
    try:
        return _SIGTERM["resume"]() if _SIGTERM["resume"] else ""
    except Exception as e:  # a file system that does not answer
        return f"(its checkpoints could not be read: {type(e).__name__})"


def linger(timeout_s: float) -> None:
    """Rank 0, failing because of a peer: keep the store up until the others have read the board
    (all of `timeout_s` when there is no board yet)."""
    if _SIGTERM["linger"] is None:
        time.sleep(timeout_s)
    else:
        _SIGTERM["linger"](timeout_s)
