"""Peak and average memory per granularity and offload mode (the paper's Fig. 12), from real training
runs, next to the estimator's figure for the same run.

For each --layers-per-block × --offload this runs launch/train.py with --ranks ranks (started like
torchrun starts them), reads every client's metrics, and reports the training peak and the average
over steps of device memory (torch.cuda max_memory_allocated / memory_allocated on a GPU; on CPU
ranks started with DECA_COUNT_CPU_MEMORY=1 their count of tensor memory) or of the process's
resident set (psutil RSS, on other CPU ranks), the setup's own peak (the whole model is on the
device once before offloading frees the frozen layers), the median step time, and - for a model
given by its config - deca_ds.memory's estimate of the peak for exactly that run (same dtypes,
graph degree, micro-batch, sequence length, checkpointing, offload). With --card
the runs are capped at that card's memory less deca_ds.memory's reserve for the CUDA context
(launch/train.py --gpu-memory-gb): a preset that runs to the end fits its card. Writes
<out>/profile_memory.{md,csv,json,png} after every run, so a run that fails or is stopped keeps
those before it.

    python profiling/profile_memory.py --ranks 4
    python profiling/profile_memory.py --ds-config ds_configs/rtx5090_qwen2-1.5b.json --card "RTX 5090" \\
        --ranks 1 --layers-per-block 2 --train-args --from-config --model profiling/configs/qwen2-1.5b.json \\
        --dataset synthetic --synthetic-words 600
    python profiling/profile_memory.py --ds-config ds_configs/profile_bf16.json --ranks 1 \\
        --layers-per-block 1 --offload none frozen \\
        --train-args --from-config --model profiling/configs/llama-3.1-8b-instruct.json
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import numpy as np
import torch

import runs
from deca_ds.memory import DEFAULT_RESERVE, GPUS, GiB
from deca_ds.offload import OFFLOAD_MODES
from report import provenance, pyplot, save_figure, setting, write_results
from runs import ROOT


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers-per-block", type=int, nargs="+", default=[1, 2, 4])
    p.add_argument("--offload", nargs="+", choices=OFFLOAD_MODES, default=["none"])
    p.add_argument("--offload-keep", type=int, nargs="+", default=[0], metavar="N",
                   help="with offload frozen: top decoder layers kept resident (launch/train.py --offload-keep); "
                        "a run for each")
    p.add_argument("--steps-per-block", type=int, default=4)
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--out", default=str(ROOT / "profiling" / "results"))
    p.add_argument("--name", default="profile_memory", help="base name of the result files")
    p.add_argument("--card", choices=GPUS, help="run as on this card: every rank's CUDA allocator capped at its "
                   "memory less the reserve for the CUDA context (needs a GPU at least that large)")
    runs.add_run_args(p, work_dir="/tmp/deca_profile_memory")
    args = p.parse_args(argv)
    if args.card and not torch.cuda.is_available():
        p.error(f"--card {args.card!r} caps the CUDA allocator: this machine has no GPU")
    return args


def card_cap_gb(card: str | None) -> float | None:
    """The allocator cap (GB) that stands in for `card`: its memory less DEFAULT_RESERVE."""
    return None if card is None else (GPUS[card] - DEFAULT_RESERVE) / 1e9


def run(args, lpb: int, offload: str, keep: int) -> Path:
    train_args = ["--ds_config", args.ds_config, "--layers-per-block", str(lpb), "--offload", offload,
                  *(["--offload-keep", str(keep)] if keep else []),
                  "--steps-per-block", str(args.steps_per_block), "--rounds", str(args.rounds),
                  "--eval-limit", "16",
                  *(["--gpu-memory-gb", f"{card_cap_gb(args.card):.3f}"] if args.card else []), *args.train_args]
    return runs.train(train_args, args.ranks, Path(args.work_dir) / f"lpb{lpb}_{offload}{keep or ''}", args.timeout,
                      f"layers_per_block={lpb}, offload={offload}, keep={keep}")


SECTIONS = ("prefix", "forward", "backward", "step", "other")  # the trainer's mem_peak_<section>
PHASES = ("prefix", "backward", "update", "mixing")  # the estimator's, beside them


def measure(out: Path, warmup: int) -> dict:
    clients = runs.metrics(out)
    rows = [r for client in clients for r in client]
    key_now, key_peak = ("mem_allocated", "mem_peak") if "mem_peak" in rows[0] else ("mem_rss", "mem_rss")
    run_config = json.loads((out / "run_config.json").read_text())
    steps = [r for client in clients for r in client[warmup:]]
    if not steps:
        raise SystemExit(f"{out}: no steps left after --warmup {warmup}")
    peak = max(r[key_peak] for r in rows) / GiB
    model = runs.estimate(run_config) if key_now == "mem_allocated" else None  # RSS is not device memory
    est = None if model is None else model.peak / GiB
    # on a GPU, the peak of each section of a step (the largest over the steps), beside the estimator's phases
    sections = {name: max(r.get(f"mem_peak_{name}", 0) for r in rows) / GiB for name in SECTIONS}
    # after the last step: the finite check, x̄ (export) and rank 0's evaluation of it (the trainer's summary)
    ends = json.loads((out / "summary.json").read_text()).get("mem_end_peak") or []
    end = max((peak for peak in ends if peak is not None), default=None)
    return {
        "kind": "process RSS (CPU)" if key_now == "mem_rss" else "device memory (torch.cuda)"
                if torch.cuda.is_available() else "tensor memory (counted on CPU, DECA_COUNT_CPU_MEMORY)",
        "micro_batch": run_config["options"]["micro_batch"],
        "seq_len": run_config["options"]["max_seq_len"],
        "blocks": len(run_config["blocks"]),
        "steps": len(rows) // run_config["n_clients"],
        "peak_gib": peak,
        "peak_gb": peak * GiB / 1e9,
        "mean_gib": statistics.fmean(r[key_now] for r in rows) / GiB,
        "setup_peak_gib": max(r["mem_setup_peak"] for r in rows if "mem_setup_peak" in r) / GiB,
        "end_peak_gib": None if end is None else end / GiB,
        # offloaded: the layers below each block run once for all its steps, at its first step (t_prefix);
        # their time is spread over the steps
        "prefix_ms": 1e3 * statistics.fmean(r.get("t_prefix", 0.0) for r in steps),
        "step_ms": 1e3 * (statistics.median(r["t_forward"] + r["t_backward"] + r["t_mix_update"] for r in steps)
                          + statistics.fmean(r.get("t_prefix", 0.0) for r in steps)),
        "streamed_gb": statistics.fmean(r.get("bytes_streamed", 0) for r in steps) / 1e9,
        "update_ms": 1e3 * statistics.median(r["t_mix_update"] for r in steps),
        # client 0's first loss: an offloaded run's equals the resident one's (the same draw, bit for bit)
        "first_loss": clients[0][0]["loss"],
        "estimate_gib": est,
        "measured_over_estimate": None if est is None else peak / est,
        **{f"peak_{name}_gib": value or None for name, value in sections.items()},
        **{f"estimate_{phase}_gib": None if model is None else model.phases[phase] / GiB for phase in PHASES},
    }


def main(argv=None) -> dict:
    args = parse_args(argv)
    results, summary = [], None
    for lpb in args.layers_per_block:
        for offload in args.offload:
            for keep in args.offload_keep if offload == "frozen" else [0]:
                results.append({"layers_per_block": lpb, "offload": offload, "offload_keep": keep,
                                **measure(run(args, lpb, offload, keep), args.warmup)})
                # written after every run: a later run that fails or is stopped keeps the ones before it
                summary = report(args, argv, results)
    return summary


def report(args, argv, results: list[dict]) -> dict:
    """The summary of the runs so far, written to <out>/<name>.*."""
    by = {(r["layers_per_block"], r["offload"]): r for r in results}
    for r in results:
        resident = by.get((r["layers_per_block"], "none"))
        r["step_over_resident"] = resident and r["step_ms"] / resident["step_ms"]
    summary = {
        **provenance("profile_memory.py", argv, cuda=torch.cuda.is_available()),
        "ranks": args.ranks, "ds_config": args.ds_config, "train_args": args.train_args, "results": results,
        "card": args.card, "gpu_memory_gb": card_cap_gb(args.card),
    }
    write(summary, Path(args.out), args.name)
    return summary


def _f(value, fmt: str) -> str:
    return "—" if value is None else format(value, fmt)


def write(summary: dict, out: Path, name: str) -> None:
    rows = summary["results"]
    md = [f"**Memory per granularity, measured** ({rows[0]['kind']}, per client) on {summary['device']}, "
          f"{summary['ranks']} ranks; command: `{summary['command']}`; {summary['date']}; "
          f"torch {summary['versions']['torch']}."
          + (f" Run as on an {summary['card']}: every rank's allocator capped at {summary['gpu_memory_gb']:.2f} GB "
             f"(the card's memory less {DEFAULT_RESERVE / GiB:g} GiB for the CUDA context); every run below "
             "finished under it."
             if summary.get("card") else ""), "",
          "| layers per block | offload | micro-batch × max tokens | blocks | steps | peak (GiB) | peak (GB) "
          "| estimate (GiB) | measured / estimate | mean over steps (GiB) | setup peak (GiB) | step (ms) "
          "| of which layers below, once per block (ms) | mixing + update (ms) | streamed (GB per step) "
          "| step / resident | first loss |",
          "| ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: "
          "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    md += [f"| {r['layers_per_block']} | {setting(r)} | {r['micro_batch']} × {r['seq_len']} | {r['blocks']} | "
           f"{r['steps']} | {r['peak_gib']:.2f} | "
           f"{r['peak_gb']:.2f} | {_f(r['estimate_gib'], '.2f')} | {_f(r['measured_over_estimate'], '.3f')} | "
           f"{r['mean_gib']:.2f} | {r['setup_peak_gib']:.2f} | {r['step_ms']:.1f} | {r['prefix_ms']:.1f} | "
           f"{r['update_ms']:.1f} | {r['streamed_gb']:.3f} | {_f(r['step_over_resident'], '.2f')} | "
           f"{r['first_loss']:.6f} |" for r in rows]
    md += ["", "On a GPU the peak is torch.cuda.max_memory_allocated over the training steps (every allocation "
           "counted; reset after setup), the mean is memory_allocated at the end of each step, and the setup "
           "peak is the maximum before the first step (loading, the first evaluation). The step is the median of "
           "forward + backward + mixing + update over the steps after the warm-up, plus the mean per step of the "
           "time FrozenPrefix takes at each block's first step to run the layers below the block for all its "
           "steps (offload frozen only; the fewer steps per block, the larger that share). The estimate is "
           "deca_ds.memory's peak for the same run; it leaves out the CUDA context and allocator slack, as "
           "max_memory_allocated does. On CPU ranks all three come from the process's RSS, which includes the "
           "Python, torch and DeepSpeed runtime (about 0.4 GiB), so there is no estimate to compare with, and "
           "--offload frozen is a no-op there."]
    if any(r["peak_forward_gib"] for r in rows):
        md += ["", "Where the peak is set: each section's allocation peak on the GPU (the largest over the steps; "
               "the step is the update and the mixing; other, the work between them, such as the checks after the "
               "update; after training: the check that the weights are finite, forming x̄ and rank 0's evaluation "
               "of it), beside the estimator's phases (GiB).", "",
               "| layers per block | offload | prefix | forward | backward | step | other | after training "
               "| estimated: prefix | backward | update | mixing |",
               "| ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
        md += [f"| {r['layers_per_block']} | {setting(r)} | "
               + " | ".join(_f(r[f"peak_{k}_gib"], ".2f") for k in SECTIONS)
               + f" | {_f(r.get('end_peak_gib'), '.2f')} | "
               + " | ".join(_f(r[f"estimate_{k}_gib"], ".2f") for k in PHASES) + " |" for r in rows]
    write_results(out, name, markdown="\n".join(md) + "\n", rows=rows, payload=summary)

    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 4))
    x = np.arange(len(rows))
    ax.bar(x - 0.2, [r["peak_gib"] for r in rows], width=0.4, label="peak (measured)")
    ax.bar(x + 0.2, [r["mean_gib"] for r in rows], width=0.4, label="mean over steps")
    if any(r["estimate_gib"] is not None for r in rows):
        ax.scatter(x - 0.2, [r["estimate_gib"] or np.nan for r in rows], color="k", marker="_", s=400,
                   label="estimate", zorder=3)
    ax.set_xticks(x, [f"{r['layers_per_block']}\n{setting(r)}" for r in rows])
    ax.set_xlabel("layers per block / offload")
    ax.set_ylabel(f"GiB ({rows[0]['kind']})")
    ax.set_title(f"DECA memory per client ({summary['device']})")
    ax.legend()
    save_figure(fig, out / f"{name}.png")


if __name__ == "__main__":
    print(json.dumps(main()["results"], indent=2, allow_nan=False))
