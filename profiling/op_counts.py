"""The PyTorch operations a simulated grid cell issues per step, by method and phase, against the
seconds per step its cells took on a GPU.

A cell of the GPU accuracy grid (reproduce/gpu_ag_news.yaml: a 768-wide Llama, 8 × 128 tokens,
8 clients one after the other in one process) leaves the device mostly idle: each operation is a
small kernel, and the step lasts as long as the host takes to issue them (Python, the dispatcher,
the launch). What a step costs there is then roughly its number of operations, which this counts
on any machine: every ATen operation the dispatcher runs (TorchDispatchMode, below autograd, so
the backward's too) in each client's forward (causal_lm_loss), backward (with the loop's own few),
local step (optimizer.local_step) and combination (optimizer.combine), summed over the clients of
one step of the simulator (deca_ds.simulate, as the grid's simulate backend runs it). `kernels`
leaves out the operations that only make a view or allocate (no kernel on a GPU).

The model is the grid's, drawn from its config (what a step runs does not depend on the weights),
with the grid's clients, graph, blocks, LoRA and adapter settings and dtypes. A batch is
`--micro-batch` × `--seq-len` random tokens, its last row padded at the end, one labelled token per
row (a classification answer); the counts hardly depend on the batch's size (`--check-shape`
counts DECA's steps at the grid's 8 × 128 as well). DECA's steps are counted over one pass over
its blocks, two steps each (the block's first step activates it), and weighted as the grid's R
steps a block; a baseline's steps are all alike. Where the grid has run a method's cells on a GPU
(`--cells`, their metrics.jsonl), the table sets their seconds per step beside its count: divided
by the count of the code those cells ran, the host's time per operation. torch.compile'd code
(compile_layers, fused_update) launches its own kernels, which this cannot count. A foreach call
(the moments' fold, the copy into the working weights) counts once in both columns, as the host
issues it once; a GPU runs it as one kernel per hundred or so tensors, or where its lists mix
dtypes (a bf16 gradient folded into fp32 moments) as one per tensor, launched from C++. Writes
<out>/op_counts.{md,csv,json}.

    python profiling/op_counts.py      # about 3 minutes on 2 cores
"""

from __future__ import annotations

import argparse
import importlib
import json
import statistics
import tempfile
from collections import Counter
from pathlib import Path
from unittest import mock

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import LlamaConfig

from deca_ds.optimizer import model_partition
from deca_ds.reproduce.grid import load_grid
from deca_ds.runtime.options import RunOptions
from deca_ds.runtime.plan import build_model
from deca_ds.topology import make_topology
from report import provenance, write_results

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
simulate_module = importlib.import_module("deca_ds.simulate")  # the module: the package exports the function
PHASES = ("forward", "backward", "local_step", "combine")
NO_KERNEL = {"empty", "empty_like", "empty_strided", "new_empty", "_unsafe_view", "lift_fresh"}


class OpCounter(TorchDispatchMode):
    """Counts every ATen operation dispatched while it is active, under the phase set last."""

    def __init__(self) -> None:
        super().__init__()
        self.phase = "backward"  # what runs outside the wrapped calls: loss.backward() and the loop's own
        self.ops: Counter = Counter()  # (phase, op name, whether it launches no kernel) -> count

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[self.phase, func.overloadpacket.__name__, not makes_kernel(func)] += 1
        return func(*args, **(kwargs or {}))

    def during(self, phase: str, fn):
        def call(*args, **kwargs):
            before, self.phase = self.phase, phase
            try:
                return fn(*args, **kwargs)
            finally:
                self.phase = before
        return call

    def totals(self) -> dict[str, dict[str, int]]:
        out = {phase: {"ops": 0, "kernels": 0} for phase in PHASES}
        for (phase, _, no_kernel), n in self.ops.items():
            out[phase]["ops"] += n
            out[phase]["kernels"] += 0 if no_kernel else n
        return out


def makes_kernel(func) -> bool:
    """False for an operation that only views its input (its result aliases it) or allocates."""
    if func.overloadpacket.__name__ in NO_KERNEL:
        return False
    return not any(r.alias_info is not None and not r.alias_info.is_write for r in func._schema.returns)


class Counted:
    """A method whose optimizers count their local steps and combinations under their own phase."""

    def __init__(self, method, counter: OpCounter) -> None:
        self.method, self.counter = method, counter

    def prepare(self, model):
        return self.method.prepare(model)

    def optimizer(self, model, mixer=None):
        opt = self.method.optimizer(model, mixer)
        opt.local_step = self.counter.during("local_step", opt.local_step)
        opt.combine = self.counter.during("combine", opt.combine)
        return opt


def batches(vocab: int, micro_batch: int, seq_len: int, seed: int):
    """Endless random micro-batches: the last row padded in its second half, one label a row."""
    g = torch.Generator().manual_seed(seed)
    while True:
        ids = torch.randint(4, vocab, (micro_batch, seq_len), generator=g)
        mask = torch.ones_like(ids)
        mask[-1, seq_len // 2:] = 0
        labels = torch.full_like(ids, -100)
        last = mask.sum(1) - 1
        labels[torch.arange(micro_batch), last] = ids[torch.arange(micro_batch), last]
        yield {"input_ids": ids, "attention_mask": mask, "labels": labels}


def count_cell(options: dict, model_dir: Path, vocab: int, *, micro_batch: int, seq_len: int,
               steps_per_block: int = 2) -> dict:
    """Operations per simulator step (all clients) by phase, weighted as the grid's steps are."""
    grid_r = options["steps_per_block"]
    opts = RunOptions(**{**options, "model": str(model_dir), "from_config": True, "rounds": 1,
                         "steps_per_block": steps_per_block, "steps": None if options["method"] == "deca" else 3,
                         "device_map": "auto"})
    model = build_model(opts, vocab)
    partition = model_partition(model, opts.deca_config())
    counter = OpCounter()
    method = Counted(opts.build_method(partition), counter)
    W = make_topology(opts.topology, opts.clients, weights=opts.weights, p=opts.er_p, seed=opts.topology_seed).W
    streams = [batches(vocab, micro_batch, seq_len, seed=i) for i in range(opts.clients)]
    per_step, snapshots = [], []

    def on_step(info) -> None:
        snapshots.append((info, counter.totals()))

    forward = counter.during("forward", simulate_module.causal_lm_loss)
    with mock.patch.object(simulate_module, "causal_lm_loss", forward), counter:
        simulate_module.simulate(model, streams, W, method, on_step=on_step)
    previous = {phase: {"ops": 0, "kernels": 0} for phase in PHASES}
    for info, totals in snapshots:
        per_step.append((info.step_in_block,
                         {p: {k: totals[p][k] - previous[p][k] for k in ("ops", "kernels")} for p in PHASES}))
        previous = totals
    return {"steps": per_step, "clients": opts.clients, "method": options["method"], "grid_r": grid_r}


def mean_step(counted: dict) -> dict:
    """Operations per step of the grid's run by phase: a baseline's steps are alike (its last one);
    DECA's, each block's first step (which activates it) once and its second R − 1 times, over the
    blocks."""
    steps = counted["steps"]
    if counted["method"] != "deca":
        return steps[-1][1]
    firsts = [c for r, c in steps if r == 0]
    seconds = [c for r, c in steps if r == 1]
    R = counted["grid_r"]
    return {p: {k: (sum(c[p][k] for c in firsts) + (R - 1) * sum(c[p][k] for c in seconds)) / (R * len(firsts))
                for k in ("ops", "kernels")} for p in PHASES}


def cell_seconds(cells: Path, method: str) -> list[float]:
    """Seconds per step of the method's finished GPU cells: from the metrics' wall_s after the
    first 100 steps where they have it, else the cell's whole wall time (setup and evaluation in)."""
    out = []
    for final in sorted(cells.glob(f"*/*/{method}/seed*/final.json")):
        rows = [json.loads(line) for line in (final.parent / "metrics.jsonl").read_text().splitlines()]
        timed = [r for r in rows if "wall_s" in r and r["step"] >= 100]
        if len(timed) > 1:
            out.append((timed[-1]["wall_s"] - timed[0]["wall_s"]) / (timed[-1]["step"] - timed[0]["step"]))
        else:
            out.append(json.loads(final.read_text())["wall_s"] / (rows[-1]["step"] + 1))
    return out


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python profiling/op_counts.py", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--grid", default=str(ROOT / "reproduce" / "gpu_ag_news.yaml"))
    p.add_argument("--methods", nargs="+", default=None, help="default: the grid's")
    p.add_argument("--vocab", type=int, default=8004, help="the pretrained model's vocabulary (its tokenizer's)")
    p.add_argument("--micro-batch", type=int, default=1)
    p.add_argument("--seq-len", type=int, default=16)
    p.add_argument("--check-shape", action="store_true",
                   help="count two DECA clients' steps, one a block, at the grid's micro-batch and length and at "
                        "the counted ones, and compare")
    p.add_argument("--cells", default=str(ROOT / "reproduce" / "results" / "gpu_ag_news" / "cells"),
                   help="the grid's finished GPU cells")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", default=str(HERE / "results"))
    return p.parse_args(argv)


def main(argv=None) -> dict:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    grid = load_grid(args.grid)
    cells = {}
    for c in grid.cells:  # each method's first cell: the main table's, at the first seed
        cells.setdefault(c.method, c)
    methods = args.methods or list(cells)
    rows, shape_check = [], None
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = Path(tmp)
        config = LlamaConfig(**grid.pretrain.model, vocab_size=args.vocab, pad_token_id=0, bos_token_id=None)
        config.save_pretrained(model_dir)
        for method in methods:
            counted = count_cell(cells[method].options, model_dir, args.vocab, micro_batch=args.micro_batch,
                                 seq_len=args.seq_len)
            ph, n = mean_step(counted), counted["clients"]
            total = {k: sum(ph[p][k] for p in PHASES) for k in ("ops", "kernels")}
            seconds = cell_seconds(Path(args.cells), method)
            row = {"method": method, **{f"{p}_ops": round(ph[p]["ops"] / n) for p in PHASES},
                   "client_step_ops": round(total["ops"] / n), "client_step_kernels": round(total["kernels"] / n),
                   "step_ops": round(total["ops"]), "step_kernels": round(total["kernels"]),
                   "gpu_s_per_step": round(statistics.mean(seconds), 4) if seconds else None,
                   "gpu_cells": len(seconds)}
            rows.append(row)
            print(row, flush=True)
        if args.check_shape:  # two DECA clients, one step a block: every step's counts at both shapes
            options = {**cells["deca"].options, "clients": 2, "topology": "ring"}
            big, small = (count_cell(options, model_dir, args.vocab, micro_batch=mb, seq_len=sl, steps_per_block=1)
                          for mb, sl in ((options["micro_batch"], options["max_seq_len"]),
                                         (args.micro_batch, args.seq_len)))
            diff = lambda k: max(abs(a[p][k] - b[p][k]) for (_, a), (_, b) in zip(big["steps"], small["steps"])  # noqa: E731
                                 for p in PHASES)
            shape_check = {"micro_batch": options["micro_batch"], "seq_len": options["max_seq_len"],
                           "max_difference": {"ops": diff("ops"), "kernels": diff("kernels")},
                           "at_grid_shape": big["steps"], "at_counted_shape": small["steps"]}
            print("shape check:", shape_check["max_difference"], flush=True)
    return write(Path(args.out), rows, shape_check, args)


def write(out: Path, rows: list[dict], shape_check: dict | None, args) -> dict:
    prov = provenance("op_counts.py", None, threads=args.threads)
    lines = [f"# ATen operations per step of a simulated cell of `{Path(args.grid).name}`", "",
             "Per client step, by phase (the backward's column includes the simulator loop's own few); per "
             "simulator step (all clients), all operations and those that launch a kernel; the seconds per "
             "step the grid's finished GPU cells took, with the code they ran (which may count otherwise).", "",
             "| method | forward | backward | local step | combine | client step | step: ops | step: kernels "
             "| GPU s/step (cells) |",
             "| :-- | --: | --: | --: | --: | --: | --: | --: | --: |"]
    for r in rows:
        gpu = "–" if r["gpu_s_per_step"] is None else f"{r['gpu_s_per_step']:.3f} ({r['gpu_cells']})"
        lines.append(f"| {r['method']} | {r['forward_ops']} | {r['backward_ops']} | {r['local_step_ops']} | "
                     f"{r['combine_ops']} | {r['client_step_ops']} | {r['step_ops']} | {r['step_kernels']} | {gpu} |")
    if shape_check is not None:
        d = shape_check["max_difference"]
        lines += ["", f"Counted at micro-batch {args.micro_batch} × {args.seq_len} tokens. Two DECA clients, one step "
                  f"a block, at the grid's {shape_check['micro_batch']} × {shape_check['seq_len']} as well: in any "
                  f"phase of any step the counts differ by at most {d['ops']} operations and {d['kernels']} kernels."]
    lines += ["", f"`{prov['command']}` at {prov.get('commit')} on {prov.get('device')}", ""]
    payload = {"rows": rows, "shape_check": shape_check, "provenance": prov}
    write_results(out, "op_counts", markdown="\n".join(lines), rows=rows, payload=payload)
    return payload


if __name__ == "__main__":
    main()
