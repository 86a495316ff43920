"""deca-train's progress on rank 0: a tqdm bar on a terminal; in a file (a scheduler's log, a grid
cell's log.txt) plain lines instead, since a bar redrawn with carriage returns after every step
makes one unreadable line of the file (the demo's 480 steps made 68 kB of it).

A line is printed after the first step, after each block (DECA's schedule), after the last step,
and whenever LINE_EVERY_S seconds have passed since the last line (baselines train every block at
once; a long block is not silent):

    deca: step 40/480 (8%), round 0, block 0, loss 1.2103, 35.5 steps/s, 00:13 left
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from typing import TextIO

from tqdm import tqdm

LINE_EVERY_S = 60.0  # a line at least this often in a file, whatever the schedule


class Progress:
    """Steps done out of `total` (from `initial`, a resumed run's step), shown when `show` (rank 0).

    terminal: draw a bar (default: whether stderr, tqdm's stream, is a terminal); else lines on `out`
    (default: stdout, with the trainer's other messages). `clock` times the rate and the lines."""

    def __init__(self, total: int, initial: int, desc: str, *, show: bool, terminal: bool | None = None,
                 out: TextIO | None = None, every_s: float = LINE_EVERY_S,
                 clock: Callable[[], float] = time.monotonic):
        terminal = sys.stderr.isatty() if terminal is None else terminal
        self.bar = tqdm(total=total, initial=initial, desc=desc, dynamic_ncols=True) if show and terminal else None
        self.lines = show and not terminal
        self.total, self.n, self.first, self.desc = total, initial, initial, desc
        self.out, self.every_s, self.clock = out, every_s, clock
        self.started = self.printed = clock()

    def update(self, where: dict, loss: float, upcoming: dict | None) -> None:
        """One step done at `where` (the optimizer's where() before it) with the client's `loss`;
        `upcoming`: where() after it (None: the run is done), in another round or block when the
        step was its block's last."""
        self.n += 1
        if self.bar is not None:
            self.bar.set_postfix(**where, loss=f"{loss:.4f}")
            self.bar.update(1)
            return
        now = self.clock()
        block_done = upcoming is None or (upcoming["round"], upcoming["block"]) != (where["round"], where["block"])
        due = self.n == self.first + 1 or block_done or now - self.printed >= self.every_s
        if self.lines and due:
            self.printed = now
            print(self.line(where, loss, now), file=self.out or sys.stdout, flush=True)

    def line(self, where: dict, loss: float, now: float) -> str:
        place = "" if where["block"] is None else f", round {where['round']}, block {where['block']}"
        rate = (self.n - self.first) / (now - self.started) if now > self.started else None
        speed = (f", {rate:.3g} steps/s, {tqdm.format_interval((self.total - self.n) / rate)} left"
                 if rate else "")
        return f"{self.desc}: step {self.n}/{self.total} ({100 * self.n // self.total}%){place}, loss {loss:.4f}{speed}"

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
