"""runtime/progress.py: deca-train's progress as lines in a file (after the first step, each block,
the last step, and at most every `every_s` seconds between), a bar on a terminal, nothing off rank 0."""

import io
import itertools

from deca_ds.runtime.progress import Progress


def deca_schedule(rounds: int, blocks: int, steps: int) -> list[dict]:
    """DECA's where() at each step: round, block, r."""
    return [{"round": t, "block": b, "r": r}
            for t, b, r in itertools.product(range(rounds), range(blocks), range(steps))]


def run(progress: Progress, schedule: list[dict], first: int = 0) -> None:
    for i in range(first, len(schedule)):
        progress.update(schedule[i], loss=1.0 / (i + 1), upcoming=schedule[i + 1] if i + 1 < len(schedule) else None)


def test_in_a_file_a_line_after_the_first_step_each_block_and_the_last():
    out, now = io.StringIO(), iter(range(100))  # a clock of 1 s a step
    schedule = deca_schedule(2, 2, 3)  # 12 steps: blocks end at 3, 6, 9, 12
    progress = Progress(12, 0, "deca", show=True, terminal=False, out=out, clock=lambda: float(next(now)))
    run(progress, schedule)
    progress.close()
    assert out.getvalue().splitlines() == [
        "deca: step 1/12 (8%), round 0, block 0, loss 1.0000, 1 steps/s, 00:11 left",
        "deca: step 3/12 (25%), round 0, block 0, loss 0.3333, 1 steps/s, 00:09 left",
        "deca: step 6/12 (50%), round 0, block 1, loss 0.1667, 1 steps/s, 00:06 left",
        "deca: step 9/12 (75%), round 1, block 0, loss 0.1111, 1 steps/s, 00:03 left",
        "deca: step 12/12 (100%), round 1, block 1, loss 0.0833, 1 steps/s, 00:00 left",
    ]


def test_one_block_a_line_each_round_and_a_resumed_run_counts_from_its_step():
    """B = 1: the block index stays 0, the round moves on. Resumed at step 4: its rate counts the
    steps this process took, and its first line is its first step."""
    out, now = io.StringIO(), iter(range(0, 100, 2))  # 2 s a step
    schedule = deca_schedule(3, 1, 4)
    progress = Progress(12, 4, "deca", show=True, terminal=False, out=out, clock=lambda: float(next(now)))
    run(progress, schedule, first=4)
    assert [line.split(", loss")[0] for line in out.getvalue().splitlines()] == [
        "deca: step 5/12 (41%), round 1, block 0", "deca: step 8/12 (66%), round 1, block 0",
        "deca: step 12/12 (100%), round 2, block 0"]
    assert out.getvalue().splitlines()[1].endswith("0.5 steps/s, 00:08 left")


def test_a_baseline_without_blocks_gets_a_line_every_every_s_seconds():
    out, now = io.StringIO(), iter(range(0, 1000, 25))  # 25 s a step
    schedule = [{"round": 0, "block": None, "r": t} for t in range(10)]
    progress = Progress(10, 0, "dadam", show=True, terminal=False, out=out, every_s=60.0,
                        clock=lambda: float(next(now)))
    run(progress, schedule)
    # the clock reads 25 s at step 1, then 50, 75, ...: lines 60 s apart or more, then the last
    assert [line.split(",")[0] for line in out.getvalue().splitlines()] == [
        "dadam: step 1/10 (10%)", "dadam: step 4/10 (40%)", "dadam: step 7/10 (70%)", "dadam: step 10/10 (100%)"]


def test_on_a_terminal_a_bar_and_off_rank_0_nothing(capsys):
    schedule = deca_schedule(1, 2, 2)
    out = io.StringIO()
    bar = Progress(4, 0, "deca", show=True, terminal=True, out=out)
    run(bar, schedule)
    bar.close()
    assert out.getvalue() == "" and "4/4" in capsys.readouterr().err  # tqdm draws on stderr
    quiet = Progress(4, 0, "deca", show=False, terminal=False, out=out)
    run(quiet, schedule)
    quiet.close()
    assert out.getvalue() == "" and capsys.readouterr() == ("", "")
