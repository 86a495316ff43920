"""Per-client metrics (JSONL, optional TensorBoard), the run summary and the loss-curve plot."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from ..files import write_text


def metrics_path(root: Path, client: int) -> Path:
    return root / "metrics" / f"client_{client:03d}.jsonl"


class MetricsWriter:
    """Appends one JSON object per step to the client's file; on resume, drops the records of
    steps the resumed run will redo, so the file reads as one uninterrupted run."""

    def __init__(self, root: Path, client: int, *, resume_step: int = 0, tensorboard: bool = False) -> None:
        self.path = metrics_path(root, client)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        kept = []
        if resume_step and self.path.exists():
            kept = [line for line in self.path.read_text().splitlines()
                    if line and json.loads(line).get("step", -1) < resume_step]
        # whole or not at all: a resume killed here keeps every record of the run so far
        write_text(self.path, "".join(line + "\n" for line in kept))
        self.file = self.path.open("a")
        self.tb = None
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self.tb = SummaryWriter(str(root / "tensorboard" / f"client_{client:03d}"))

    def write(self, record: dict) -> None:
        self.file.write(json.dumps(record, allow_nan=False) + "\n")
        self.file.flush()
        if self.tb is not None:
            for key, value in record.items():
                if key != "step" and isinstance(value, (int, float)):
                    self.tb.add_scalar(key, value, record["step"])

    def close(self) -> None:
        self.file.close()
        if self.tb is not None:
            self.tb.close()


def read_client_metrics(root: Path, client: int) -> list[dict]:
    return [json.loads(line) for line in metrics_path(root, client).read_text().splitlines() if line]


def _mean(records: list[dict], key: str, scale: float = 1.0) -> float | None:
    values = [r[key] for r in records if key in r]
    return scale * float(np.mean(values)) if values else None  # JSON has no NaN


def loss_ends(losses: list[float], most: int = 10) -> tuple[float | None, float | None]:
    """The start and end loss of a run: the mean of its first and last `most` steps, or of a tenth
    of a shorter run, so that the two never overlap (a 10-step run compares its first step with
    its last); None without steps."""
    if not losses:
        return None, None
    window = max(1, min(most, len(losses) // 10))
    return float(np.mean(losses[:window])), float(np.mean(losses[-window:]))


def summarize(records: list[list[dict]]) -> dict:
    """Start/end loss (loss_ends), bytes and step-time split per client; x̄'s evaluation before
    training (client 0's first record), None without one."""
    clients = []
    for c, recs in enumerate(records):
        dist = [r["consensus_distance"] for r in recs if "consensus_distance" in r]
        loss_start, loss_end = loss_ends([r["loss"] for r in recs if "loss" in r])
        clients.append({
            "client": c,
            "loss_start": loss_start,
            "loss_end": loss_end,
            "bytes_sent": int(sum(r.get("bytes_sent", 0) for r in recs)),
            "forward_ms": _mean(recs, "t_forward", 1e3),
            "backward_ms": _mean(recs, "t_backward", 1e3),
            "mix_update_ms": _mean(recs, "t_mix_update", 1e3),
            "last_consensus_distance": dist[-1] if dist else None,
        })
    first = records[0][0] if records and records[0] else {}
    initial = {k.removeprefix("eval_initial_"): v for k, v in first.items() if k.startswith("eval_initial_")}
    return {"steps": len(records[0]) if records else 0, "clients": clients, "initial_eval": initial or None}


def summary_table(summary: dict) -> str:
    head = ("| client | loss start | loss end | sent (MB) | fwd (ms) | bwd (ms) | mix+update (ms) |\n"
            "| ---: | ---: | ---: | ---: | ---: | ---: | ---: |\n")
    def cell(value: float | None, digits: int) -> str:
        return "-" if value is None else f"{value:.{digits}f}"

    rows = "".join(
        f"| {c['client']} | {cell(c['loss_start'], 4)} | {cell(c['loss_end'], 4)} | {c['bytes_sent'] / 1e6:.2f} | "
        f"{cell(c['forward_ms'], 1)} | {cell(c['backward_ms'], 1)} | {cell(c['mix_update_ms'], 2)} |\n"
        for c in summary["clients"])
    return head + rows


def plot_losses(records: list[list[dict]], path: Path, window: int = 10, title: str = "deca") -> None:
    from ..reporting import pyplot, save_figure

    fig, ax = pyplot().subplots(figsize=(8, 4.5))
    for c, recs in enumerate(records):
        steps = np.array([r["step"] for r in recs])
        loss = np.array([r["loss"] for r in recs])
        line, = ax.plot(steps, loss, alpha=0.25)
        if len(loss) >= window:
            smooth = np.convolve(loss, np.ones(window) / window, mode="valid")
            ax.plot(steps[window - 1:], smooth, color=line.get_color(), label=f"client {c}")
        else:
            line.set_label(f"client {c}")
    ax.set_xlabel("inner step")
    ax.set_ylabel("training loss")
    ax.set_title(f"{title} training loss ({len(records)} clients; bold: {window}-step mean)")
    ax.legend(fontsize="small")
    save_figure(fig, path)
