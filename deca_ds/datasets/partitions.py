"""The clients' shares of a task: IID, or Dirichlet-skewed over the labels or the instructions'
categories; how skewed a split is, and its report (partition.json, label histogram table and heatmap)."""

from __future__ import annotations

import json
import os
import re
from collections import Counter
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from ..data import dirichlet_partition, iid_partition, label_histogram
from ..files import write_text
from .tasks import Record


def instruction_category(instruction: str | None) -> str:
    """The first word of the instruction, lower-cased, without surrounding punctuation ("" if none)."""
    words = (instruction or "").split()
    return re.sub(r"^\W+|\W+$", "", words[0]).lower() if words else ""


def partition_keys(records: Sequence[Record], key: str = "label", *, top_k: int = 8,
                   label_names: Sequence[str] | None = None) -> tuple[list[int], tuple[str, ...]]:
    """What a partition is skewed over: (per-record key index, key names).

    key="label": the records' labels (names from `label_names`, else "0", "1", …).
    key="category": the first word of each record's instruction, lower-cased; the `top_k` most
    frequent words (ties broken alphabetically) are categories 0..K-1 and every other word
    (and an empty instruction) is "other" (index K, present only when used).
    """
    if key == "label":
        if any(r.label is None for r in records):
            raise ValueError("key='label': some records have no label (a generation task); use key='category' or iid")
        labels = [int(r.label) for r in records]
        n = max(labels, default=-1) + 1
        names = tuple(label_names) if label_names is not None else tuple(str(k) for k in range(n))
        return labels, names
    if key == "category":
        if top_k < 1:
            raise ValueError(f"top_k must be >= 1, got {top_k}")
        words = [instruction_category(r.instruction) for r in records]
        counts = Counter(w for w in words if w)
        if not counts:  # one key for all: the split would not be skewed at all
            raise ValueError("partition key 'category' skews the split by each instruction's first word, and no "
                             "record has an instruction (a classification task's records have none): split by the "
                             "label")
        top = [w for w, _ in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))[:top_k]]
        index = {w: k for k, w in enumerate(top)}
        keys = [index.get(w, len(top)) for w in words]
        return keys, tuple(top) + (("other",) if len(top) in keys else ())
    raise ValueError(f"key must be 'label' or 'category', got {key!r}")


def partition_records(
    records: Sequence[Record],
    n_clients: int,
    *,
    alpha: float = 0.25,
    seed: int = 0,
    min_size: int = 2,
    iid: bool = False,
    key: str = "label",
    top_k: int = 8,
) -> list[list[int]]:
    """Each client's record indices (disjoint, together all records).

    iid=True: a random split of near-equal sizes. key="label": Dirichlet(alpha) over the labels
    (`deca_ds.data.dirichlet_partition`); records without labels (generation) are split IID.
    key="category": Dirichlet(alpha) over `partition_keys(records, "category", top_k=top_k)`.
    """
    if iid or (key == "label" and any(r.label is None for r in records)):
        return iid_partition(len(records), n_clients, seed=seed)
    keys, _ = partition_keys(records, key, top_k=top_k)
    return dirichlet_partition(keys, n_clients, alpha, seed=seed, min_size=min_size)


def label_skew(labels: Sequence[int], partition: Sequence[Sequence[int]], num_labels: int | None = None) -> float:
    """Mean over clients of the total variation distance between the client's label
    distribution and the global one (0 = IID; 1 = disjoint supports)."""
    return histogram_skew(label_histogram(labels, partition, num_labels or max(labels) + 1))


def histogram_skew(histogram) -> float:
    """`label_skew` from the clients × labels counts alone (all that per-client data files share)."""
    hist = np.asarray(histogram, dtype=float)
    glob = hist.sum(0) / hist.sum()
    local = hist / np.maximum(hist.sum(1, keepdims=True), 1)
    return float(0.5 * np.abs(local - glob).sum(1).mean())


def write_partition_report(out_dir: str | os.PathLike, histogram, label_names: Sequence[str],
                           partition: Sequence[Sequence[int]] | None = None) -> dict[str, Path]:
    """partition.json (sizes, clients × labels histogram, mean TV distance and, where one process
    split the data, each client's indices), label_histogram.csv and .md (the counts) and
    label_histogram.png (a heatmap). The same inputs give byte-identical files."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    names = [str(n) for n in label_names]
    hist = np.asarray(histogram, dtype=np.int64)
    paths = {k: out / f for k, f in (("json", "partition.json"), ("csv", "label_histogram.csv"),
                                      ("md", "label_histogram.md"), ("png", "label_histogram.png"))}
    write_text(paths["json"], json.dumps({
        "n_clients": len(hist), "label_names": names, "sizes": hist.sum(1).tolist(),
        "label_histogram": hist.tolist(), "mean_tv_distance": round(histogram_skew(hist), 6),
        **({"partition": [[int(i) for i in p] for p in partition]} if partition is not None else {}),
    }, indent=1, allow_nan=False) + "\n")

    def cell(s: str) -> str:
        return s.replace(",", " ").replace("|", "/")

    rows = [["client", *map(cell, names), "total"]]
    rows += [[str(c), *map(str, h.tolist()), str(int(h.sum()))] for c, h in enumerate(hist)]
    write_text(paths["csv"], "".join(",".join(r) + "\n" for r in rows))
    md = ["| " + " | ".join(rows[0]) + " |", "|" + " ---: |" * len(rows[0])]
    md += ["| " + " | ".join(r) + " |" for r in rows[1:]]
    write_text(paths["md"], "\n".join(md) + "\n")

    fig = Figure(figsize=(1.2 + 0.6 * len(names), 1.0 + 0.35 * len(hist)), dpi=100)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    image = ax.imshow(hist, aspect="auto", cmap="viridis")
    ax.set_xticks(range(len(names)), names, rotation=45, ha="right", fontsize=7)
    ax.set_yticks(range(len(hist)), [str(c) for c in range(len(hist))], fontsize=7)
    ax.set_xlabel("label")
    ax.set_ylabel("client")
    if hist.size <= 400:
        top = hist.max() or 1
        for (c, k), v in np.ndenumerate(hist):
            ax.text(k, c, str(v), ha="center", va="center", fontsize=6, color="black" if v > top / 2 else "white")
    fig.colorbar(image, ax=ax)
    fig.tight_layout()
    fig.savefig(paths["png"], format="png", metadata={"Software": None})
    return paths
