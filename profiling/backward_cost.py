"""Backward time per active block vs full-parameter backward (the paper's Appendix B.3).

DECA's backward stops at the active block (nothing below it builds a graph) and frozen layers
above it compute input gradients only. The paper counts R·Σ_k k = ½RB(B+1) "atomic backward
operations" per round against RB² for methods that train every layer, a ratio of (B+1)/(2B),
and notes that skipping the frozen layers' weight gradients roughly halves their cost on top.

This measures, on one process, forward+backward time with block k active for every k (one layer
per block) and with every decoder layer trainable, side by side in one run, and writes
<out>/backward_cost.{md,csv,json,png}. Times are medians over --reps after a warm-up.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, LlamaConfig

from deca_ds import DecaConfig, DecaOptimizer
from report import provenance, pyplot, save_figure, write_results


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--micro-batch", type=int, default=4)
    p.add_argument("--reps", type=int, default=7)
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads (1 = least noisy)")
    p.add_argument("--out", default="profiling/results")
    return p.parse_args(argv)


def timed_step(model, batch, reps: int) -> tuple[float, float]:
    """Median forward and backward seconds of one micro-batch (one warm-up first)."""
    fwd, bwd = [], []
    for i in range(reps + 1):
        model.zero_grad(set_to_none=True)
        t0 = time.perf_counter()
        loss = model(**batch).loss
        t1 = time.perf_counter()
        loss.backward()
        t2 = time.perf_counter()
        if i:
            fwd.append(t1 - t0)
            bwd.append(t2 - t1)
    return statistics.median(fwd), statistics.median(bwd)


def main(argv=None) -> dict:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=args.hidden, intermediate_size=4 * args.hidden, num_hidden_layers=args.layers,
                         num_attention_heads=max(1, args.hidden // 64), vocab_size=1024,
                         max_position_embeddings=args.seq_len, tie_word_embeddings=False)
    model = AutoModelForCausalLM.from_config(config).train()
    ids = torch.randint(0, config.vocab_size, (args.micro_batch, args.seq_len))
    batch = {"input_ids": ids, "labels": ids}

    rows = []
    for k in range(args.layers):
        DecaOptimizer(model, DecaConfig(custom_blocks=[f"model.layers.{k}"]))  # block k trainable, rest frozen
        fwd, bwd = timed_step(model, batch, args.reps)
        rows.append({"block": k, "layers_traversed": args.layers - k,
                     "forward_ms": 1e3 * fwd, "backward_ms": 1e3 * bwd})
    for name, p in model.named_parameters():
        p.requires_grad_(".layers." in name)  # full-parameter fine-tuning of the decoder layers
    full_fwd, full_bwd = timed_step(model, batch, args.reps)

    B = args.layers
    deca_total = sum(r["backward_ms"] for r in rows)
    summary = {
        **provenance("backward_cost.py", argv, threads=args.threads), "args": vars(args),
        "full_forward_ms": 1e3 * full_fwd, "full_backward_ms": 1e3 * full_bwd,
        "lowest_block_backward_ms": rows[0]["backward_ms"], "highest_block_backward_ms": rows[-1]["backward_ms"],
        "deca_round_backward_ms": deca_total, "full_round_backward_ms": B * 1e3 * full_bwd,
        "measured_ratio": deca_total / (B * 1e3 * full_bwd),
        "paper_ratio_block_count": (B + 1) / (2 * B),
        "rows": rows,
    }
    write(summary, Path(args.out))
    return summary


def write(summary: dict, out: Path) -> None:
    rows = summary["rows"]
    md = [f"**Backward cost per active block** — measured on {summary['device']}; command: "
          f"`{summary['command']}`; {summary['date']}; torch {summary['versions']['torch']}.", "",
          "| active block | layers traversed | forward (ms) | backward (ms) |", "| ---: | ---: | ---: | ---: |"]
    md += [f"| {r['block']} | {r['layers_traversed']} | {r['forward_ms']:.1f} | {r['backward_ms']:.1f} |" for r in rows]
    md += [f"| all layers trainable | {len(rows)} | {summary['full_forward_ms']:.1f} | "
           f"{summary['full_backward_ms']:.1f} |",
           "",
           "One round with R steps per block: DECA's backward "
           f"Σ_k bwd(k) = {summary['deca_round_backward_ms']:.1f}·R ms "
           f"vs full-parameter B·bwd = {summary['full_round_backward_ms']:.1f}·R ms: measured ratio "
           f"**{summary['measured_ratio']:.3f}**; the paper's block count ½RB(B+1)/RB² = (B+1)/(2B) = "
           f"{summary['paper_ratio_block_count']:.3f} (its further saving from frozen layers computing input "
           "gradients only is included in the measurement, not in that count)."]
    write_results(out, "backward_cost", markdown="\n".join(md) + "\n", rows=rows, payload=summary)

    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.bar([r["block"] for r in rows], [r["backward_ms"] for r in rows], label="DECA, block k active")
    ax.axhline(summary["full_backward_ms"], color="C3", ls="--", label="all decoder layers trainable")
    ax.set_xlabel("active block k (0 = next to the embeddings)")
    ax.set_ylabel("backward (ms, median)")
    ax.set_title(f"Backward stops at the active block (ratio per round {summary['measured_ratio']:.2f})")
    ax.legend()
    save_figure(fig, out / "backward_cost.png")


if __name__ == "__main__":
    print(json.dumps({k: v for k, v in main().items() if k != "rows"}, indent=2, allow_nan=False))
