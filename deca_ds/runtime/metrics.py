"""Per-client metrics (JSONL, optional TensorBoard), the run summary and the loss-curve plot."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np


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
        self.path.write_text("".join(line + "\n" for line in kept))
        self.file = self.path.open("a")
        self.tb = None
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self.tb = SummaryWriter(str(root / "tensorboard" / f"client_{client:03d}"))

    def write(self, record: dict) -> None:
        self.file.write(json.dumps(record) + "\n")
        self.file.flush()
        if self.tb is not None:
            for key, value in record.items():
                if key != "step" and isinstance(value, (int, float)):
                    self.tb.add_scalar(key, value, record["step"])

    def close(self) -> None:
        self.file.close()
        if self.tb is not None:
            self.tb.close()


def read_metrics(root: Path, n_clients: int) -> list[list[dict]]:
    return [[json.loads(line) for line in metrics_path(root, c).read_text().splitlines() if line]
            for c in range(n_clients)]


def _mean(records: list[dict], key: str) -> float:
    values = [r[key] for r in records if key in r]
    return float(np.mean(values)) if values else float("nan")


def summarize(records: list[list[dict]], window: int = 10) -> dict:
    """Start/end loss (mean of the first/last `window` steps), bytes and step-time split per client."""
    clients = []
    for c, recs in enumerate(records):
        dist = [r["consensus_distance"] for r in recs if "consensus_distance" in r]
        clients.append({
            "client": c,
            "loss_start": _mean(recs[:window], "loss"),
            "loss_end": _mean(recs[-window:], "loss"),
            "bytes_sent": int(sum(r.get("bytes_sent", 0) for r in recs)),
            "forward_ms": 1e3 * _mean(recs, "t_forward"),
            "backward_ms": 1e3 * _mean(recs, "t_backward"),
            "mix_update_ms": 1e3 * _mean(recs, "t_mix_update"),
            "last_consensus_distance": dist[-1] if dist else float("nan"),
        })
    return {"steps": len(records[0]) if records else 0, "clients": clients}


def summary_table(summary: dict) -> str:
    head = ("| client | loss start | loss end | sent (MB) | fwd (ms) | bwd (ms) | mix+update (ms) |\n"
            "| ---: | ---: | ---: | ---: | ---: | ---: | ---: |\n")
    rows = "".join(
        f"| {c['client']} | {c['loss_start']:.4f} | {c['loss_end']:.4f} | {c['bytes_sent'] / 1e6:.2f} | "
        f"{c['forward_ms']:.1f} | {c['backward_ms']:.1f} | {c['mix_update_ms']:.2f} |\n"
        for c in summary["clients"])
    return head + rows


def plot_losses(records: list[list[dict]], path: Path, window: int = 10, title: str = "deca") -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5))
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
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
