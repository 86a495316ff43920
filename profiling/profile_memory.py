"""Peak and average memory per granularity (the paper's Fig. 12), from real training runs.

For each --layers-per-block value this runs launch/train.py with --ranks ranks (started like
torchrun starts them), reads every client's metrics, and reports the peak and the average over
steps of device memory (torch.cuda max_memory_allocated / memory_allocated on a GPU) or of the
process's resident set (psutil RSS, on CPU ranks). Writes <out>/profile_memory.{md,csv,json,png}.

    python profiling/profile_memory.py --ds-config ds_configs/cpu_demo.json --ranks 4
    python profiling/profile_memory.py --ds-config ds_configs/rtxpro6000_llama-3.1-8b.json --ranks 8 \\
        --train-args --from-config --model profiling/configs/llama-3.1-8b-instruct.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from datetime import datetime, timezone
from pathlib import Path

import runs
from report import pyplot, write_results
from runs import ROOT


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ds-config", default=str(ROOT / "ds_configs" / "cpu_demo.json"))
    p.add_argument("--ranks", type=int, default=4, help="ranks on this machine (one client each)")
    p.add_argument("--layers-per-block", type=int, nargs="+", default=[1, 2, 4])
    p.add_argument("--steps-per-block", type=int, default=4)
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--work-dir", default="/tmp/deca_profile_memory", help="where the runs' outputs go")
    p.add_argument("--out", default=str(ROOT / "profiling" / "results"))
    p.add_argument("--timeout", type=float, default=3600)
    p.add_argument("--train-args", nargs=argparse.REMAINDER, default=[],
                   help="everything after this goes to launch/train.py unchanged")
    return p.parse_args(argv)


def run(args, lpb: int) -> Path:
    train_args = ["--ds_config", args.ds_config, "--layers-per-block", str(lpb),
                  "--steps-per-block", str(args.steps_per_block), "--rounds", str(args.rounds),
                  "--eval-limit", "16", *args.train_args]
    return runs.train(train_args, args.ranks, Path(args.work_dir) / f"lpb{lpb}", args.timeout,
                      f"layers_per_block={lpb}")


def measure(out: Path) -> dict:
    rows = [r for client in runs.metrics(out) for r in client]
    key_now, key_peak = ("mem_allocated", "mem_peak") if "mem_peak" in rows[0] else ("mem_rss", "mem_rss")
    run_config = json.loads((out / "run_config.json").read_text())
    return {
        "kind": "device memory (torch.cuda)" if key_now == "mem_allocated" else "process RSS (CPU)",
        "blocks": len(run_config["blocks"]),
        "peak_gib": max(r[key_peak] for r in rows) / 2**30,
        "mean_gib": statistics.fmean(r[key_now] for r in rows) / 2**30,
        "steps": len(rows) // run_config["n_clients"],
    }


def main(argv=None) -> dict:
    args = parse_args(argv)
    results = []
    for lpb in args.layers_per_block:
        results.append({"layers_per_block": lpb, **measure(run(args, lpb))})
    summary = {
        "command": "python profiling/profile_memory.py " + " ".join(sys.argv[1:] if argv is None else argv),
        "date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"), "ranks": args.ranks,
        "ds_config": args.ds_config, "train_args": args.train_args, "results": results,
    }
    write(summary, Path(args.out))
    return summary


def write(summary: dict, out: Path) -> None:
    rows = summary["results"]
    md = [f"**Memory per granularity, measured** ({rows[0]['kind']}, per client, {summary['ranks']} ranks); "
          f"command: `{summary['command']}`; {summary['date']}.", "",
          "| layers per block | blocks | steps | peak (GiB) | mean over steps (GiB) |", "| ---: | ---: | ---: | ---: | ---: |"]
    md += [f"| {r['layers_per_block']} | {r['blocks']} | {r['steps']} | {r['peak_gib']:.3f} | {r['mean_gib']:.3f} |"
           for r in rows]
    md += ["", "On a GPU the peak is torch.cuda.max_memory_allocated (the true peak, every allocation counted) "
           "and the mean is memory_allocated at the end of each step; on CPU ranks both come from the "
           "process's RSS sampled at the end of each step, which includes the Python, torch and DeepSpeed "
           "runtime (about 0.4 GiB) and is not a measure of a tiny model's optimizer state."]
    write_results(out, "profile_memory", markdown="\n".join(md) + "\n", rows=rows, payload=summary)

    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6, 4))
    x = range(len(rows))
    ax.bar([i - 0.2 for i in x], [r["peak_gib"] for r in rows], width=0.4, label="peak")
    ax.bar([i + 0.2 for i in x], [r["mean_gib"] for r in rows], width=0.4, label="mean over steps")
    ax.set_xticks(list(x), [str(r["layers_per_block"]) for r in rows])
    ax.set_xlabel("layers per block")
    ax.set_ylabel(f"GiB ({rows[0]['kind']})")
    ax.set_title("DECA memory per client by granularity")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "profile_memory.png", dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    print(json.dumps(main()["results"], indent=2))
