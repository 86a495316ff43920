"""A cell's directory: what a cell writes there, and what the grid reads of it.

A cell directory holds cell.json (its settings, written first), run_config.json (what the run
resolved: topology, client sizes, trainable parameters, budget), metrics.jsonl (one record per
model update step: the clients' mean training loss, the consensus distance every
`consensus_interval` steps and, in simulated cells, the seconds since the cell started) and, once
it has finished, final.json (accuracy and macro-F1 of the consensus model x̄, losses, wall time).
A simulated cell with `checkpoint_interval` also holds checkpoint.pt (every client's model and
optimizer, the data streams' positions and each client's random state) and checkpoint.json (its
step and size, written after it) while it runs: a stopped cell goes on from there, to the same bits.
A cell with final.json and the same settings is skipped; one with other settings stops the grid
before anything runs. Where the grid makes its base model (`pretrain`), the settings include the
sha256 of its weights: cells fine-tuned from other weights (pretrained again elsewhere, on another
device) never share a table. A deepspeed cell's deca-train writes into train/, whose outputs
become the same files (collect_deepspeed).
"""

from __future__ import annotations

import functools
import json
import shutil
from pathlib import Path

from ..files import sha256, write_json, write_text
from ..runtime.metrics import loss_ends
from .generation import ANSWERS
from .grid import Cell, Grid
from .pretrain import WEIGHTS

CELL, RUN_CONFIG, METRICS, FINAL, LOG = "cell.json", "run_config.json", "metrics.jsonl", "final.json", "log.txt"
CHECKPOINT, CHECKPOINT_META = "checkpoint.pt", "checkpoint.json"  # a simulated cell's
# how the checkpoint's clients drew their dropout masks: from generators of their own (rng.ClientGenerators);
# an older checkpoint, whose clients drew from one, is not gone on from (the cell starts afresh)
RNG = "per client"
BASE = "base_sha256"  # settings' key: the weights of the model the grid's `pretrain` made
ANSWERED = "answered"  # settings' key: the question sets a generation cell's model answers


def read_json(path: Path):
    return json.loads(path.read_text())


def is_finished(cell_dir: Path) -> bool:
    return (cell_dir / FINAL).is_file()


def saved_settings(cell_dir: Path) -> dict | None:
    return read_json(cell_dir / CELL)["settings"] if (cell_dir / CELL).is_file() else None


def settings_changed(saved: dict | None, now: dict) -> list[str]:
    """The options in which a finished cell's saved settings and the grid's differ in what they
    compute. Options that change no result (runtime.options.NOT_RESULT, and those the cell's method
    does not read) are not compared, and an option the cell's code did not have yet counts as its
    default: a new option's default keeps the old behaviour. The base model's weights are compared
    where both settings know them, and the preset's keys that change a step (presets.STEP_KEYS)."""
    from ..runtime.options import NOT_RESULT, option_defaults, unread_in

    if saved is None or saved.get("key") != now["key"]:
        return ["no settings saved" if saved is None else "key"]
    defaults = json.loads(json.dumps(option_defaults(), allow_nan=False))
    old, new = saved["options"], now["options"]
    changed = sorted(k for k in (set(old) | set(new)) - NOT_RESULT - unread_in(new)
                     if old.get(k, defaults.get(k)) != new.get(k, defaults.get(k)))
    old_ds, new_ds = saved.get("deepspeed", {}), now.get("deepspeed", {})
    changed += [f"the preset's {k}" for k in sorted(set(old_ds) | set(new_ds)) if old_ds.get(k) != new_ds.get(k)]
    if None not in (saved.get(BASE), now.get(BASE)) and saved[BASE] != now[BASE]:
        changed.append("the base model's weights")
    if saved.get(ANSWERED) != now.get(ANSWERED):
        changed.append("the questions answered")
    return changed


def cell_settings(grid: Grid, cell: Cell, base: str | None) -> dict:
    """What decides the cell's result: its options, where the grid makes its base model the sha256
    `base` of that model's weights (None while it is not made), and for a generation cell the
    questions its model answers (Generation.settings)."""
    answered = {ANSWERED: grid.generation.settings} if grid.generates(cell) else {}
    return cell.settings() | ({BASE: base} if base else {}) | answered


def base_weights(grid: Grid) -> str | None:
    """sha256 of the weights the grid's `pretrain` made; None without the section or the model."""
    path = Path(grid.pretrain.output_dir) / WEIGHTS if grid.pretrain else None
    if path is None or not path.is_file():
        return None
    stat = path.stat()
    return _sha256(str(path.resolve()), stat.st_mtime_ns, stat.st_size)


@functools.lru_cache(maxsize=8)
def _sha256(path: str, mtime_ns: int, size: int) -> str:
    """Once per version of the file (the grid checks its cells several times a run)."""
    return sha256(Path(path))


def finished_changes(grid: Grid, cell: Cell, base: str | None) -> list[str] | None:
    """None while the cell is unfinished; once finished, the settings in which its results differ
    from the grid's ([] when they are the grid's); `base` as cell_settings."""
    d = grid.cell_dir(cell)
    if not is_finished(d):
        return None
    return settings_changed(saved_settings(d), cell_settings(grid, cell, base))


def steps_done(cell_dir: Path) -> int:
    """Model update steps a cell has logged: its metrics.jsonl (simulate), or deca-train's
    first client's metrics (deepspeed) while it runs."""
    from ..runtime.metrics import metrics_path

    for path in (cell_dir / METRICS, metrics_path(cell_dir / "train", 0)):
        if path.is_file():
            return sum(1 for line in path.read_text().splitlines() if line)
    return 0


def seconds_per_step(cell_dir: Path) -> float | None:
    """A simulated cell's mean seconds per step so far, from its metrics' `wall_s` (None without)."""
    path = cell_dir / METRICS
    lines = path.read_text().splitlines() if path.is_file() else []
    last = json.loads(lines[-1]) if lines else {}
    return last["wall_s"] / len(lines) if "wall_s" in last else None


def resume_step(grid: Grid, cell: Cell, d: Path, base: str | None) -> int | None:
    """The checkpoint step an unfinished cell goes on from, where it was started with the grid's
    settings: a simulated cell's checkpoint (simulated_checkpoint), or for the deepspeed backend the
    newest one complete for every client in its train/ (deca-train's --checkpoint-interval; files
    checked by size here, deca-train --resume checks their sha256 as well and goes back to an older
    step where one fails). None: the cell starts afresh."""
    from ..runtime.checkpoint import complete_steps

    train = d / "train"
    ran = (d if grid.backend == "simulate" else train) / RUN_CONFIG
    if not ran.is_file() or settings_changed(saved_settings(d), cell_settings(grid, cell, base)):
        return None
    if grid.backend == "simulate":
        return simulated_checkpoint(d)
    common = set.intersection(*(set(complete_steps(train, c, cell.ranks_per_client, hashes=False))
                                for c in range(cell.clients)))
    return max(common, default=None)


def simulated_checkpoint(d: Path) -> int | None:
    """The step of a simulated cell's checkpoint, None without a whole one of this code's (RNG):
    checkpoint.json, written after checkpoint.pt and removed before it is replaced, must give
    checkpoint.pt's size."""
    try:
        meta = read_json(d / CHECKPOINT_META)
        whole = (d / CHECKPOINT).stat().st_size == meta["bytes"] and meta.get("rng") == RNG
        return int(meta["step"]) if whole else None
    except (OSError, ValueError, KeyError, TypeError):
        return None


def collect_deepspeed(d: Path, *, wall_s: float) -> None:
    """deca-train's outputs (train/) as the cell's files: mean loss over clients per step, the step's
    lr and the mean consensus distance, the run config and the consensus model's metrics."""
    from ..runtime.metrics import read_client_metrics

    train = d / "train"
    config = read_json(train / RUN_CONFIG)
    records = [read_client_metrics(train, c) for c in range(config["n_clients"])]
    lines = []
    for step_records in zip(*records):
        first = step_records[0]
        rec = {k: first[k] for k in ("step", "round", "block", "r")}
        rec["loss"] = sum(r["loss"] for r in step_records) / len(step_records)
        if "lr" in first:  # the step's, every client's alike (deca-train logs it since b11fff9)
            rec["lr"] = first["lr"]
        if "consensus_distance" in first:
            rec["consensus_distance"] = sum(r["consensus_distance"] for r in step_records) / len(step_records)
        if "nonfinite_skipped" in first:  # skip_nonfinite: steps every client skipped so far
            rec["nonfinite_skipped"] = first["nonfinite_skipped"]
        lines.append(json.dumps(rec, allow_nan=False) + "\n")
    write_text(d / METRICS, "".join(lines))
    write_json(d / RUN_CONFIG, config)
    summary = read_json(train / "summary.json")
    evaluation = summary["consensus_eval"]
    if "consensus_answers" in summary:  # a generation cell: its answers beside a simulated cell's
        shutil.copytree(train / ANSWERS, d / ANSWERS, dirs_exist_ok=True)
        evaluation = {"answered": summary["consensus_answers"]}
    finish(d, evaluation, wall_s=wall_s,
           final_distance=sum(summary["final_consensus_distance"]) / len(summary["final_consensus_distance"]))


def finish(d: Path, evaluation: dict, *, wall_s: float, final_distance: float) -> dict:
    """final.json from the cell's metrics and the consensus model's evaluation. A resumed deepspeed
    cell's wall_s is that of its last attempt (a simulated one's, of every attempt's steps up to its
    checkpoint), and `resumed_from` names the checkpoint steps it went on from."""
    records = [json.loads(line) for line in (d / METRICS).read_text().splitlines() if line]
    loss_start, loss_end = loss_ends([r["loss"] for r in records])
    final = {**evaluation, "loss_start": loss_start, "loss_end": loss_end, "steps": len(records),
             "final_consensus_distance": final_distance, "wall_s": wall_s}
    skipped = records[-1].get("nonfinite_skipped") if records else None
    if skipped:  # skip_nonfinite: the steps taken again on other batches
        final["nonfinite_skipped"] = skipped
    resumed = read_json(d / CELL).get("resumed_from")
    if resumed:
        final["resumed_from"] = resumed
    write_json(d / FINAL, final)
    return final
