"""Estimated share of the fused update in a GPU step that was measured with the eager one.

An estimate, not a measurement, for when no GPU is at hand to time `--fused-update` itself. It
reads results measured on a GPU (profile_resources / profile_memory JSON; DECA's rows, resident),
takes out the measured eager update and puts in the fused update's memory traffic at an assumed
bandwidth:

    fused (ms) = block parameters × update_cost.floor_bytes(working, alone=True) / bandwidth + call overhead
    share      = fused / (step − measured update + fused)

The runs were measured on one GPU, so one client: no exchange, no weighted sum, and the fused
update is the in-place one of a client without neighbors (42 bytes per parameter with bf16
weights). The floor is exact for the fused kernels (their generated code moves those bytes and no
others); the bandwidth a GPU reaches on these streams and the cost of launching them are the
assumptions, and both are in the output.

    python profiling/update_share.py profiling/results/gpu_h100/profile_resources_*.json \\
        profiling/results/gpu_h100/profile_memory_mb8.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from deca_ds.config import parse_dtype
from deca_ds.memory import ModelSpec
from report import provenance, write_results
from update_cost import floor_bytes

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python profiling/update_share.py", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("results", nargs="+", help="profile_resources or profile_memory .json measured on a GPU")
    p.add_argument("--bandwidth", type=float, nargs="+", default=[3.0, 3.35], metavar="TB/s",
                   help="memory bandwidth the update's streams reach (H100 SXM: 3.35 nominal)")
    p.add_argument("--overhead-ms", type=float, default=0.2,
                   help="launching the compiled kernels (one per block tensor and pass)")
    p.add_argument("--target", type=float, default=0.03, help="the share the issue asks for at most")
    p.add_argument("--out", default=str(HERE / "results"))
    p.add_argument("--name", default="update_share")
    return p.parse_args(argv)


def _flag(args: list[str], name: str, default):
    return type(default)(args[args.index(name) + 1]) if name in args else default


def measured_rows(path: Path) -> list[dict]:
    """DECA's resident rows of one result file: model, layers per block and its largest block,
    micro-batch, step and update."""
    run = json.loads(path.read_text())
    train_args = run["train_args"]
    ds_config = json.loads((ROOT / run["ds_config"]).read_text())
    model = _flag(train_args, "--model", "")
    spec = ModelSpec.from_config(ROOT / model)  # one meta model per file, whatever its rows and bandwidths
    common = {"source": path.name, "device": run["device"], "model": model,
              "working_dtype": ds_config["deca"]["working_dtype"]}
    rows = []
    for r in run["results"]:
        if r.get("method", "DECA") != "DECA" or r.get("offload", "none") != "none":
            continue
        update_ms = r.get("agg_up_ms", r.get("update_ms"))
        if update_ms is None:
            raise SystemExit(f"{path}: its DECA row has no update time (written before profile_memory timed it)")
        layers_per_block = r.get("layers_per_block", _flag(train_args, "--layers-per-block", 1))
        rows.append({**common, "layers_per_block": layers_per_block,
                     "block_params": max(b.numel for b in spec.partition(layers_per_block).blocks),
                     "micro_batch": r.get("micro_batch", _flag(train_args, "--micro-batch", 1)),
                     "seq_len": r.get("seq_len", ds_config["deca"].get("max_seq_len")),
                     "step_ms": r["step_ms"], "eager_update_ms": update_ms})
    if not rows:
        raise SystemExit(f"{path}: no resident DECA row measured")
    return rows


def estimate(row: dict, bandwidth_tbs: float, overhead_ms: float) -> dict:
    per_param = floor_bytes(torch.finfo(parse_dtype(row["working_dtype"])).bits // 8, alone=True)
    fused_ms = row["block_params"] * per_param / (bandwidth_tbs * 1e12) * 1e3 + overhead_ms
    rest_ms = row["step_ms"] - row["eager_update_ms"]
    return {**row, "bytes_per_param": per_param, "bandwidth_tbs": bandwidth_tbs,
            "overhead_ms": overhead_ms, "fused_update_ms": fused_ms, "step_with_fused_ms": rest_ms + fused_ms,
            "eager_share": row["eager_update_ms"] / row["step_ms"], "fused_share": fused_ms / (rest_ms + fused_ms)}


def main(argv=None) -> dict:
    args = parse_args(argv)
    measured = [row for path in args.results for row in measured_rows(Path(path))]
    rows = [estimate(row, bw, args.overhead_ms) for row in measured for bw in args.bandwidth]
    made = provenance("update_share.py", argv)  # its device is not the one the steps were measured on
    command = made["command"]
    summary = {"command": command, "date": made["date"], "estimated": True, "target": args.target, "rows": rows}
    md = [f"**Fused update's share of the step, estimated** (not measured) from steps measured with the eager "
          f"update; command: `{command}`; {summary['date']}.", "",
          "| model | layers/block | tokens per step | measured on | step (ms) | eager update (ms) | block params "
          "| B/param | TB/s | fused update (ms) | share eager | share fused | ≤ target |",
          "| --- | ---: | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |"]
    md += [f"| {Path(r['model']).stem} | {r['layers_per_block']} | {r['micro_batch']} × {r['seq_len']} | {r['device']} "
           f"(`{r['source']}`) | {r['step_ms']:.1f} | {r['eager_update_ms']:.2f} | {r['block_params']:,} | "
           f"{r['bytes_per_param']} | {r['bandwidth_tbs']:g} | {r['fused_update_ms']:.2f} | {r['eager_share']:.1%} | "
           f"{r['fused_share']:.1%} | {'met' if r['fused_share'] <= args.target else 'not met'} |" for r in rows]
    md += ["", f"fused = block params × B/param ÷ bandwidth + {args.overhead_ms:g} ms for launching the kernels; "
           "share fused = fused ÷ (step − eager update + fused). B/param is the fused update's exact traffic "
           "(`update_cost.floor_bytes`, one client: the in-place update, no exchange, no weighted sum); the "
           f"bandwidth and the launch cost are assumptions. Target: ≤ {args.target:.0%} of the step."]
    write_results(Path(args.out), args.name, markdown="\n".join(md) + "\n", rows=rows, payload=summary)
    print("\n".join(md))
    return summary


if __name__ == "__main__":
    main()
