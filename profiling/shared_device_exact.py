"""Distributed == simulator on one device: N clients of launch/train.py sharing this machine's GPU
(or its CPU) through the host-staged gloo transport, against deca_ds.simulate in one process on the
same device, from the same initialisation and batches. Reports each client's largest difference.

On a GPU the ranks and the simulator run the same kernels on the same card, so the only differences
are the order of floating-point sums inside kernels that do not fix it (atomics in the embedding's
backward, cuBLAS's split-K choices); in fp32 those stay at the weights' rounding, far below the
1e-6 bound. On CPU ranks both run at DECA_RANK_THREADS threads (default 1).

    python profiling/shared_device_exact.py --ranks 4 --out $OUT/shared_device_exact.json \\
        --train-args --from-config --model profiling/configs/cpu/llama-8x256
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import torch
from safetensors.torch import load_file

import deca_ds
import runs
from deca_ds.runtime import plan
from deca_ds.runtime.parsing import parse_args as parse_train_args
from deca_ds.runtime.rank import local_device, to_device
from deca_ds.topology import make_topology
from report import emit, provenance

RUN = ["--topology", "ring", "--layers-per-block", "2", "--steps-per-block", "3", "--rounds", "1",
       "--micro-batch", "4", "--max-seq-len", "32", "--eval-limit", "16", "--lr", "1e-3",
       "--save-clients", "--transport", "gloo", "--timeout", "120"]


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--bound", type=float, default=1e-6, help="largest |distributed - simulated| allowed (fp32)")
    p.add_argument("--out", help="JSON file for the result")
    runs.add_run_args(p, work_dir="/tmp/deca_shared_device_exact", warmup=0)
    return p.parse_args(argv)


def main(argv=None) -> dict:
    args = parse_args(argv)
    os.environ.setdefault("DECA_RANK_THREADS", "1")
    run = ["--ds_config", args.ds_config, *RUN, *args.train_args]
    out = runs.train(run, args.ranks, Path(args.work_dir), args.timeout, "distributed run")

    opts, _ = parse_train_args([*run, "--output-dir", "unused"])
    device = local_device(opts.device_map)
    torch.set_num_threads(int(os.environ["DECA_RANK_THREADS"]))
    task = plan.build_task(opts, args.ranks)
    model = plan.build_model(opts, len(task.tokenizer))  # drawn on the device, as the ranks draw it
    # each rank's own stream
    streams = [(to_device(b, device) for b in task.stream(opts, c)) for c in range(args.ranks)]
    simulated = deca_ds.simulate(model, streams, make_topology(opts.topology, args.ranks).W, opts.deca_config())
    init = {n: p.detach().cpu() for n, p in model.named_parameters()}
    clients = []
    for c in range(args.ranks):
        got = load_file(out / "clients" / f"client_{c:03d}" / "model.safetensors")
        want = {n: w.cpu() for n, w in simulated[c].items()}
        clients.append({
            "client": c,
            "max_abs_diff": max((got[n].float() - w.float()).abs().max().item() for n, w in want.items()),
            "max_change_from_init": max((w - init[n]).abs().max().item() for n, w in want.items()),
        })
    worst = max(c["max_abs_diff"] for c in clients)
    result = {
        **provenance("shared_device_exact.py", argv, cuda=device.type == "cuda",
                     threads=None if device.type == "cuda" else torch.get_num_threads()),
        "ranks": args.ranks, "device_type": device.type, "train_args": run, "bound": args.bound,
        "clients": clients, "max_abs_diff": worst, "within_bound": worst <= args.bound,
    }
    emit(result, args.out)
    if worst > args.bound:
        raise SystemExit(f"distributed and simulated clients differ by {worst:.3g} > {args.bound:g}")
    return result


if __name__ == "__main__":
    main()
