"""The offloaded step against the resident one (issue 17, target 2): trains with every layer
resident and with `--offload frozen` (FrozenPrefix runs the layers below the block once per
block) at each `--offload-keep`, at the preset's R, and writes one JSON with each setting's step
time, peaks and its step time over the resident step's.

Each setting is one profile_memory.py run (launch/train.py, one round over all blocks). On the
Llama-3.1-8B config at R = 48 a setting is 1536 steps, several minutes on an H100: run a few
settings per call and `--merge` them into the same file; the ratios are recomputed from the
measured step times of the rows present whenever a resident row is there.

    python profiling/offload_sweep.py --keep 0 5 --out profiling/results/gpu_h100/offload_sweep.json \\
        --train-args --from-config --model profiling/configs/llama-3.1-8b-instruct.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "profiling"))

import profile_memory  # noqa: E402
import runs  # noqa: E402
from report import provenance  # noqa: E402

TARGET_RATIO = 1.5
TARGET_PEAK_GB = 10.0


def preset_steps_per_block(path: str) -> int:
    deca = json.loads(Path(path).read_text()).get("deca", {})
    if "steps_per_block" not in deca:
        raise SystemExit(f"{path}: no deca.steps_per_block; give --steps-per-block")
    return int(deca["steps_per_block"])


def with_ratios(rows: list[dict]) -> list[dict]:
    """Each row's step time over the resident row's (None without one) and whether it meets the targets."""
    resident = next((r for r in rows if r["offload"] == "none"), None)
    for r in rows:
        r["step_over_resident"] = resident and r["step_ms"] / resident["step_ms"]
        r["meets_targets"] = (r["offload"] == "frozen" and resident is not None
                              and r["step_over_resident"] <= TARGET_RATIO and r["peak_gb"] <= TARGET_PEAK_GB)
    return rows


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default=str(ROOT / "ds_configs" / "rtxpro6000_llama-3.1-8b.json"),
                   help="the preset whose deca.steps_per_block is R")
    p.add_argument("--steps-per-block", type=int, help="R (default: the preset's)")
    p.add_argument("--resident", action=argparse.BooleanOptionalAction, default=True,
                   help="also run the resident step")
    p.add_argument("--keep", type=int, nargs="*", default=[0, 4, 5, 6], help="--offload-keep values")
    p.add_argument("--out", default=str(ROOT / "profiling" / "results" / "offload_sweep.json"))
    p.add_argument("--merge", action="store_true", help="keep the rows of other settings already in --out")
    runs.add_run_args(p, work_dir="/tmp/deca_offload_sweep", ds_config="profile_bf16.json", ranks=1)
    args = p.parse_args(argv)
    R = args.steps_per_block or preset_steps_per_block(args.preset)
    rows = []
    settings = ([("none", [0])] if args.resident else []) + ([("frozen", args.keep)] if args.keep else [])
    for offload, keeps in settings:
        summary = profile_memory.main([
            "--ds-config", args.ds_config, "--ranks", str(args.ranks), "--layers-per-block", "1",
            "--offload", offload, "--offload-keep", *map(str, keeps), "--steps-per-block", str(R),
            "--warmup", str(args.warmup), "--work-dir", args.work_dir, "--timeout", str(args.timeout),
            "--out", str(Path(args.work_dir) / "tables"), "--name", f"offload_{offload}",
            "--train-args", *args.train_args])
        rows += [{"offload": r["offload"], "offload_keep": r["offload_keep"], "steps_per_block": R,
                  **{k: r[k] for k in ("step_ms", "prefix_ms", "streamed_gb", "peak_gib", "peak_gb",
                                       "setup_peak_gib", "estimate_gib", "steps", "kind")}}
                 for r in summary["results"]]
    out = Path(args.out)
    if args.merge and out.exists():
        done = {(r["offload"], r["offload_keep"]) for r in rows}
        rows = [r for r in json.loads(out.read_text())["results"]
                if (r["offload"], r["offload_keep"]) not in done] + rows
    rows.sort(key=lambda r: (r["offload"] != "none", r["offload_keep"]))
    fits = [r for r in with_ratios(rows) if r["meets_targets"]]
    result = {**provenance("offload_sweep.py", argv, cuda=torch.cuda.is_available()),
              "steps_per_block": R, "train_args": args.train_args,
              "targets": {"step_over_resident": TARGET_RATIO, "peak_gb": TARGET_PEAK_GB},
              "best_keep": min(fits, key=lambda r: r["step_ms"])["offload_keep"] if fits else None,
              "results": rows}
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2, allow_nan=False) + "\n")
    return result


if __name__ == "__main__":
    main()
