"""DeCAF's re-factorization of one client's LoRA pairs: pair by pair, against all pairs at once.

The LoRA pairs DeCAF trains on a model built from its config (every linear layer of the decoder,
rank r; by default the GPU accuracy grid's 88M Llama, reproduce/gpu_ag_news.yaml), each combined
over `--terms` clients' random factors (the client and its neighbours): `pair_by_pair` takes
methods.lora.truncated_factors for each pair in turn, as DeCAF did until 2026-11-28 (on a GPU an
SVD and a wait for the device per pair); `batched` is methods.lora.refactor_pairs (one SVD per core
shape, on the host, and one copy back; since 2026-11-28 evening the QRs, products and copies of the
pairs of one shape in one batch, too). The device is synchronized around each timed call; medians
over --repeats after a warm-up call. Both must give the same B·A (to the bit on CPU; on a GPU the
SVDs run elsewhere: its largest relative difference is reported). Writes <out>/<name>.{md,csv,json}.

    python profiling/decaf_refactor.py                   # on CPU, or on a GPU where there is one
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch
import yaml

from deca_ds.memory import load_config, meta_model
from deca_ds.methods import AdamConfig, DeCAF, truncated_factors
from deca_ds.methods.lora import LoRAPair, refactor_pairs
from report import provenance, write_results

ROOT = Path(__file__).resolve().parents[1]


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python profiling/decaf_refactor.py", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--config", help="HF config (file or dir); default: the model reproduce/gpu_ag_news.yaml pretrains")
    p.add_argument("--rank", type=int, default=8, help="LoRA rank (DeCAF's default)")
    p.add_argument("--terms", type=int, default=5, help="factors combined per pair: the client and its neighbours")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--threads", type=int, default=None, help="torch threads on CPU (default: torch's)")
    p.add_argument("--out", default=str(ROOT / "profiling" / "results"))
    p.add_argument("--name", default="decaf_refactor")
    return p.parse_args(argv)


def grid_model() -> dict:
    grid = yaml.safe_load((ROOT / "reproduce" / "gpu_ag_news.yaml").read_text())
    return {"model_type": "llama", "vocab_size": 8004, **grid["pretrain"]["model"]}


def pair_shapes(args) -> list[tuple[int, int]]:
    """(fan_in, fan_out) of every LoRA pair DeCAF puts on the model, in its order."""
    from transformers import LlamaConfig

    config = load_config(args.config) if args.config else LlamaConfig(**grid_model())
    method = DeCAF(AdamConfig(steps=1), rank=args.rank)
    return [(A.shape[1], B.shape[0]) for A, B in method.lora_pairs(method.prepare(meta_model(config)))]


def timed(fn, device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return (time.perf_counter() - start) * 1e3


def main(argv=None) -> dict:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    shapes = pair_shapes(args)
    g = torch.Generator().manual_seed(0)
    factors = [[(1.0 / args.terms, torch.randn(args.rank, i, generator=g).to(device),
                 torch.randn(o, args.rank, generator=g).to(device)) for _ in range(args.terms)] for i, o in shapes]
    one = [(torch.empty(args.rank, i, device=device), torch.empty(o, args.rank, device=device)) for i, o in shapes]
    every = [LoRAPair(i, o, torch.empty_like(A), torch.empty_like(B), f)
             for (i, o), (A, B), f in zip(shapes, one, factors)]

    def pair_by_pair() -> None:
        for (A_out, B_out), f in zip(one, factors):
            B, A = truncated_factors(torch.cat([w * B_j for w, _, B_j in f], dim=1),
                                     torch.cat([A_j for _, A_j, _ in f], dim=0), args.rank)
            A_out.copy_(A)
            B_out.copy_(B)

    runs = {"pair_by_pair": pair_by_pair, "batched": lambda: refactor_pairs(every)}
    times = {name: [] for name in runs}
    for repeat in range(args.repeats + 1):  # the first, a warm-up, is not kept
        for name, fn in runs.items():
            ms = timed(fn, device)
            if repeat:
                times[name].append(ms)
    difference = max(float((B1 @ A1 - p.B_out @ p.A_out).norm() / (B1 @ A1).norm()) for (A1, B1), p in zip(one, every))
    rows = [{"path": name, "ms": statistics.median(ms), "ms_runs": ", ".join(f"{t:.2f}" for t in ms)}
            for name, ms in times.items()]
    speedup = rows[0]["ms"] / rows[1]["ms"]
    cpu_threads = torch.get_num_threads() if device.type == "cpu" else None
    payload = {"provenance": provenance("decaf_refactor.py", argv, cuda=device.type == "cuda", threads=cpu_threads),
               "pairs": len(shapes), "rank": args.rank, "terms": args.terms, "device": str(device), "rows": rows,
               "pair_by_pair_over_batched": speedup, "max_relative_difference_of_BA": difference}
    markdown = "\n".join([
        f"# DeCAF's re-factorization of {len(shapes)} LoRA pairs (rank {args.rank}, {args.terms} clients' factors "
        f"each) on {device}", "", "| path | ms (median) | runs |", "| :-- | --: | :-- |",
        *(f"| {r['path']} | {r['ms']:.2f} | {r['ms_runs']} |" for r in rows), "",
        f"pair by pair / batched: {speedup:.2f}; largest relative difference of B·A between them: {difference:.1e}.",
        "", f"`{payload['provenance']['command']}` at {payload['provenance']['commit']}", ""])
    write_results(Path(args.out), args.name, markdown=markdown, rows=rows, payload=payload)
    print(markdown)
    return payload


if __name__ == "__main__":
    main()
