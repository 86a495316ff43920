"""Per-step computation and communication of DECA and every baseline (the paper's Table 9), measured.

Runs launch/train.py once per method, one after the other on the same ranks, model, data and
graph, drops each client's first --warmup steps, and reports medians over the remaining
(client, step) samples: Fwd, Bkwd, Agg & Up (local update + exchange + combination; the
optimizer step DeepSpeed calls), the combination alone (Agg: DeCAF's SVD shows here), Comm (MB
sent per step per client), and the ratios the issue's targets are stated in. Writes
<out>/profile_resources.{md,csv,json,png} after every run (a run that fails or is stopped keeps
those before it). A run traced by --train-args --trace-steps N leaves each rank's trace (the
trainer's --trace-steps) in <out>/<name>_trace/<method>/. With --merge, methods measured by
earlier calls with the same ranks, preset, warm-up and train args stay in the table (one method
per call fits a time limit), and the ratios are taken over all of them. With --repeats N every
setting (method and update) runs N times, the settings in turn and in reversed order every other
time (A B, B A, A B, ...), and each row gives the medians of its runs: where the host sets the step
(a GPU at a small micro-batch), one step's runs in one call can differ by more than two settings
do, and the later of two runs has been the slower (profiling/results/gpu_h200/README.md, `da61034`).

    python profiling/profile_resources.py --ds-config ds_configs/cpu_demo.json --ranks 4
    python profiling/profile_resources.py --ds-config ds_configs/rtxpro6000_llama-3.1-8b.json --ranks 8 \\
        --train-args --from-config --model profiling/configs/llama-3.1-8b-instruct.json
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
from pathlib import Path

import torch

import runs
from report import provenance, pyplot, save_figure, write_results
from runs import ROOT

METHODS = ("deca", "dadam", "dec_lora", "dec_adapter", "decaf")
# the optimizers' update, and the decoder layers compiled with it or not: (suffix of run directories and
# ratio keys, suffix of method labels, launch/train.py's options)
UPDATES = {"eager": ("", "", []), "fused": ("_fused", " (fused)", ["--fused-update"]),
           "compiled": ("_compiled", " (fused, compiled layers)", ["--fused-update", "--compile-layers"])}
LABELS = {"deca": "DECA", "dadam": "D-Adam", "dec_lora": "Dec-LoRA", "dec_adapter": "Dec-Adapter", "decaf": "DeCAF"}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--methods", nargs="+", default=list(METHODS), choices=METHODS)
    p.add_argument("--updates", nargs="+", default=["eager"], choices=list(UPDATES),
                   help="the optimizers' update: PyTorch's eager ops, or --fused-update (torch.compile'd kernels; "
                        "compiled in the warm-up steps), or compiled: --fused-update with the decoder layers "
                        "compiled too (--compile-layers); every method runs once per choice")
    p.add_argument("--steps-per-block", type=int, default=8, help="DECA's R; the baselines take as many steps")
    p.add_argument("--out", default=str(ROOT / "profiling" / "results"))
    p.add_argument("--name", default="profile_resources", help="base name of the result files")
    p.add_argument("--repeats", type=int, default=1,
                   help="runs of every setting, in alternating order; each row gives the medians of its runs")
    p.add_argument("--merge", action="store_true",
                   help="keep the methods already in <out>/<name>.json (measured with the same settings)")
    runs.add_run_args(p, work_dir="/tmp/deca_profile_resources", warmup=3)
    args = p.parse_args(argv)
    if args.repeats < 1:
        p.error(f"--repeats must be at least 1, not {args.repeats}")
    return args


def median_ms(rows: list[dict], *keys: str) -> float:
    return 1e3 * statistics.median(sum(r[k] for k in keys) for r in rows)


def measure(out: Path, warmup: int) -> dict:
    rows = [r for client in runs.metrics(out) for r in client[warmup:]]
    if not rows:
        raise SystemExit(f"{out}: no steps left after --warmup {warmup}")
    run_config = json.loads((out / "run_config.json").read_text())
    return {
        "trainable_params": run_config["trainable_params"],
        "samples": len(rows),
        "fwd_ms": median_ms(rows, "t_forward"),
        "bkwd_ms": median_ms(rows, "t_backward"),
        "agg_up_ms": median_ms(rows, "t_mix_update"),
        "agg_ms": median_ms(rows, "t_aggregate"),
        "exchange_ms": median_ms(rows, "t_exchange"),
        "update_ms": median_ms(rows, "t_local_update", "t_aggregate"),
        "step_ms": median_ms(rows, "t_forward", "t_backward", "t_mix_update"),
        "wall_ms": median_ms(rows, "t_step"),
        "comm_mb": statistics.fmean(r["bytes_sent"] for r in rows) / 1e6,
        # {gpu: clients} where they time-share it (launch/train.py records it), empty on CPU ranks
        "clients_per_gpu": run_config.get("clients_per_gpu", {}),
        **runs.device_peak(out),
    }


def sharing(rows: list[dict]) -> str:
    """What the times mean where clients share a GPU (several clients on one GPU take turns on it)."""
    shared = sorted({(gpu, k) for r in rows for gpu, k in r.get("clients_per_gpu", {}).items() if k > 1})
    if not shared:
        return ""
    where = ", ".join(f"{k} on GPU {gpu}" for gpu, k in shared)
    return (f" The clients time-share their GPU ({where}) and exchange through host memory: the step "
            "times are not one-GPU-per-client figures; compare the methods with each other.")


# what a merged table's rows must share
SETTINGS = ("ranks", "ds_config", "train_args", "warmup")


def earlier_rows(args) -> list[dict]:
    """The rows of <out>/<name>.json to keep (--merge), refused before any run if measured otherwise."""
    path = Path(args.out) / f"{args.name}.json"
    if not args.merge or not path.exists():
        return []
    earlier = json.loads(path.read_text())
    now = {key: getattr(args, key) for key in SETTINGS}
    differ = [f"{key}: {earlier.get(key)!r} there, {now[key]!r} here"
              for key in SETTINGS if earlier.get(key) != now[key]]
    if differ:
        raise SystemExit(f"--merge: {path} was measured with other settings ({'; '.join(differ)}); "
                         "give another --name or --out")
    return earlier["results"]


def ratios_of(results: list[dict]) -> dict:
    """DECA's shares of its step and its step over each baseline's, per update (eager, fused)."""
    by = {r["method"]: r for r in results}
    ratios = {}
    for tag, label, _ in UPDATES.values():
        deca = by.get("DECA" + label)
        if deca is None:
            continue
        ratios[f"deca{tag}_agg_up_share_of_step"] = deca["agg_up_ms"] / deca["step_ms"]
        ratios[f"deca{tag}_update_and_combination_share_of_step"] = deca["update_ms"] / deca["step_ms"]
        for name in ("D-Adam", "Dec-LoRA", "Dec-Adapter", "DeCAF"):
            if name + label in by:
                ratios[f"deca{tag}_step_over_{name}{tag}"] = deca["step_ms"] / by[name + label]["step_ms"]
    if {"DECA", "DECA (fused)"} <= by.keys():
        ratios["deca_fused_agg_up_over_eager"] = by["DECA (fused)"]["agg_up_ms"] / by["DECA"]["agg_up_ms"]
    compiled = "DECA" + UPDATES["compiled"][1]
    if {compiled, "DECA (fused)"} <= by.keys():
        ratios["deca_compiled_step_over_fused"] = by[compiled]["step_ms"] / by["DECA (fused)"]["step_ms"]
    return ratios


def main(argv=None) -> dict:
    args = parse_args(argv)
    kept = earlier_rows(args)
    made = provenance("profile_resources.py", argv, cuda=torch.cuda.is_available())
    settings = [(update, method) for update in args.updates for method in args.methods]
    measured: dict[tuple[str, str], list[dict]] = {}
    for k in range(args.repeats):
        for update, method in settings if k % 2 == 0 else settings[::-1]:
            run = method + UPDATES[update][0] + (f"_{k + 1}" if args.repeats > 1 else "")
            train_args = ["--ds_config", args.ds_config, "--method", method, "--rounds", "1",
                          "--steps-per-block", str(args.steps_per_block), "--eval-limit", "16",
                          "--consensus-interval", "0", *UPDATES[update][2], *args.train_args]
            out = runs.train(train_args, args.ranks, Path(args.work_dir) / run, args.timeout, run)
            if (out / "trace").is_dir():  # --train-args --trace-steps N: each rank's trace beside the tables
                shutil.copytree(out / "trace", Path(args.out) / f"{args.name}_trace" / run, dirs_exist_ok=True)
            measured.setdefault((update, method), []).append(measure(out, args.warmup))
            # written after every run: a later run that fails or is stopped keeps the ones before it
            results = [{"method": LABELS[method] + UPDATES[update][1], "update": update,
                        **of_runs(measured[update, method]), "command": made["command"]}
                       for update, method in settings if (update, method) in measured]
            summary = report(args, made, kept, results)
    return summary


def of_runs(measured: list[dict]) -> dict:
    """One setting's row from its runs: the median of each time and of Comm, the samples of all,
    the largest peak, and each run's step and wall time in the order they ran."""
    first = measured[0]
    row = {key: value for key, value in first.items() if not key.endswith(("_ms", "_mb", "_gib"))}
    row["samples"] = sum(m["samples"] for m in measured)
    for key in first:
        values = [m[key] for m in measured]
        if key.endswith(("_ms", "_mb")):
            row[key] = statistics.median(values)
        elif key.endswith("_gib"):
            row[key] = None if None in values else max(values)
    return {**row, "runs": len(measured), "step_ms_runs": [m["step_ms"] for m in measured],
            "wall_ms_runs": [m["wall_ms"] for m in measured]}


def report(args, made: dict, kept: list[dict], results: list[dict]) -> dict:
    """The summary of the rows kept (--merge) and the runs so far, written to <out>/<name>.*."""
    done = {r["method"] for r in results}
    order = [LABELS[m] + label for _, label, _ in UPDATES.values() for m in METHODS]
    rows = sorted([r for r in kept if r["method"] not in done] + results, key=lambda r: order.index(r["method"]))
    summary = {
        **made,
        "ranks": args.ranks, "ds_config": args.ds_config, "train_args": args.train_args,
        "warmup": args.warmup, "results": rows, "ratios": ratios_of(rows),
    }
    write(summary, Path(args.out), args.name)
    return summary


def _cell(value: float | None) -> str:
    """Two decimals, or a dash for what a row has not (a row merged from before the trainer recorded it)."""
    return "—" if value is None else f"{value:.2f}"


def _peaks(row: dict) -> str:
    """'measured / estimated' GiB, a dash for what a run has not (CPU ranks, the tiny model, older rows)."""
    return " / ".join(_cell(row.get(key)) for key in ("peak_gib", "estimate_gib"))


def write(summary: dict, out: Path, name: str) -> None:
    rows = summary["results"]
    md = [f"**Per-step cost per client, measured** on {summary['device']}, {summary['ranks']} ranks "
          f"(one client each); medians after {summary['warmup']} warm-up steps; "
          f"command: `{summary['command']}`; {summary['date']}; torch {summary['versions']['torch']}.", "",
          "| method | trainable params | Fwd (ms) | Bkwd (ms) | Agg & Up (ms) | of which exchange (ms) "
          "| of which Agg (ms) | update + Agg (ms) | step (ms) | wall (ms) | Comm (MB/step) "
          "| peak GiB (measured / estimated) |",
          "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    md += [f"| {r['method']} | {r['trainable_params']:,} | {r['fwd_ms']:.2f} | {r['bkwd_ms']:.2f} | "
           f"{r['agg_up_ms']:.2f} | {r['exchange_ms']:.2f} | {r['agg_ms']:.2f} | {r['update_ms']:.2f} | "
           f"{r['step_ms']:.2f} | {_cell(r.get('wall_ms'))} | {r['comm_mb']:.3f} | {_peaks(r)} |" for r in rows]
    repeated = [r for r in rows if r.get("runs", 1) > 1]
    if repeated:  # --repeats: the spread the medians hide
        md += ["", "Rows of several runs (--repeats, the settings in alternating order) give the medians of their "
               "runs; step (ms) of each run, in the order the setting ran: "
               + "; ".join(f"{r['method']} " + ", ".join(f"{s:.2f}" for s in r["step_ms_runs"]) for r in repeated)
               + "."]
    commands = list(dict.fromkeys(r["command"] for r in rows if "command" in r))
    if len(commands) > 1:  # --merge: each row's own call
        md += ["", "Merged from one call per group of rows: " + "; ".join(f"`{c}`" for c in commands) + "."]
    if summary["ratios"]:
        md += ["", "| ratio | value |", "| --- | ---: |"]
        md += [f"| {k.replace('_', ' ')} | {v:.3f} |" for k, v in summary["ratios"].items()]
    md += ["", "Agg & Up is the optimizer step DeepSpeed calls: the local Adam update, the exchange with the "
           "neighbors and the combination (DECA: weighted sum and BMA correction; DeCAF: the truncated SVD). "
           "'of which exchange' is the send and receive of x½, waiting for the neighbors included; 'of which "
           "Agg' is the combination after it; 'update + Agg' is Agg & Up without the exchange: the local "
           "update and the combination, the arithmetic a client does (medians of each, so the parts need not "
           "add up exactly). Step is the sum of the phases; wall is the whole step as the rank's loop took it "
           "(the checks and the record after the update included): what a run's throughput is. "
           "Comm is the bytes a client sends per step "
           "(a baseline mixing every K-th step sends nothing in between). Peak: a GPU run's training peak "
           "per client (torch.cuda) beside deca_ds.memory's estimate for it (deca_ds.baseline_memory for a "
           "baseline; none for the built-in tiny model); CPU ranks measure none. Times from CPU ranks share the "
           "machine's cores and are comparable with each other, not with a GPU." + sharing(rows)]
    write_results(out, name, markdown="\n".join(md) + "\n", rows=rows, payload=summary)

    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 4))
    bottom = [0.0] * len(rows)
    for key, label in (("fwd_ms", "forward"), ("bkwd_ms", "backward"), ("agg_up_ms", "aggregation & update")):
        values = [r[key] for r in rows]
        ax.bar([r["method"] for r in rows], values, bottom=bottom, label=label)
        bottom = [b + v for b, v in zip(bottom, values)]
    ax.set_ylabel("ms per step (median)")
    ax.set_title(f"Per-step cost per client ({summary['device']})")
    ax.legend()
    save_figure(fig, out / f"{name}.png")


if __name__ == "__main__":
    print(json.dumps(main()["results"], indent=2, allow_nan=False))
