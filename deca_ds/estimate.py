"""deca-estimate: estimated GPU memory and communication of one DECA client, per model × granularity
× offload, and of one client of each baseline (deca_ds.baseline_memory), per model.

    deca-estimate --config path/to/config.json --layers-per-block 2 --out /tmp/est
    python profiling/estimate.py                       # profiling/configs' four models into profiling/results

Writes <out>/<name>.md (also printed), .csv and .json with every term of deca_ds.memory.MemoryEstimate,
and .png (peak per model × layers per block × offload against the GPU capacities and the paper's
M + 10M/B). Everything is computed from config.json files on the meta device: no weights, no GPU.
"""

from __future__ import annotations

import argparse
import datetime as dt
import math
import os
import platform
import shlex
import sys
from pathlib import Path

from .reporting import pyplot, save_figure, setting, write_results

BASELINES = ("dadam", "dec_lora", "dec_adapter", "decaf")  # deca_ds.methods.METHODS but DECA
# deca_ds.blocks.EXTRA_PARTS (held equal by the tests): --help loads no torch
EXTRA_PARTS = ("embeddings", "final_norm", "lm_head")


def parse_args(argv=None, *, prog: str = "deca-estimate", configs: list[str] | None = None,
               out: str = "estimate") -> argparse.Namespace:
    """The command line; `configs` (default model configs; None: --config is required) and `out` are
    the defaults of the calling command."""
    p = argparse.ArgumentParser(
        prog=prog,
        description="Estimate (not measure) the per-client GPU memory and communication of DECA, and of "
                    "the baselines, from model configs. Memory in GiB (2^30 B), communication in MB (10^6 B).",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--config", nargs="+", default=configs, required=configs is None, metavar="PATH",
                   type=os.path.expanduser,
                   help="HF config.json files (or directories holding one)")
    p.add_argument("--layers-per-block", nargs="+", type=int, default=[1, 2, 4], metavar="N",
                   help="granularities to estimate (decoder layers per block)")
    p.add_argument("--offload", nargs="+", choices=["none", "frozen"], default=["none", "frozen"],
                   help="none: every weight on the GPU; frozen: frozen decoder layers on the host, streamed "
                        "through two layer buffers")
    p.add_argument("--checkpointing", action=argparse.BooleanOptionalAction, default=True,
                   help="activation checkpointing of the decoder layers")
    p.add_argument("--micro-batch", type=int, default=1)
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--grad-accum", type=int, default=1,
                   help="micro-batches per step (with offload frozen, FrozenPrefix holds R × this many hidden states)")
    p.add_argument("--loss-positions", type=int, default=None,
                   help="positions per micro-batch the LM head runs at (labelled tokens; default: the whole sequence)")
    p.add_argument("--loss-chunk", type=int, default=0,
                   help="deca-train --loss-chunk: the head and the loss over this many positions at a time")
    p.add_argument("--neighbors", type=int, default=2, help="neighbors per client, itself excluded (ring: 2)")
    p.add_argument("--working-dtype", choices=["bf16", "fp16", "fp32"], default="bf16")
    p.add_argument("--master-dtype", choices=["fp32", "fp64"], default="fp32")
    p.add_argument("--transfer-dtype", choices=["master", "working"], default="master",
                   help="dtype of the exchanged block (master = exact)")
    p.add_argument("--variant", choices=["deca", "trivial_bma", "no_bma"], default="deca")
    p.add_argument("--offload-keep", type=int, nargs="+", default=[0], metavar="N",
                   help="with offload frozen: top decoder layers kept resident (deca-train --offload-keep); "
                        "several values: a row each")
    p.add_argument("--state-bits", type=int, choices=[32, 8], default=32,
                   help="8: the active block's m, v as bitsandbytes block-wise codes (DecaConfig.state_bits)")
    p.add_argument("--fused-update", action="store_true",
                   help="DecaConfig.fused_update: the fused half step holds the gradient and x½ together "
                        "(with --neighbors 0: the update runs in place and holds no x½)")
    p.add_argument("--train", nargs="+", choices=EXTRA_PARTS, default=[], metavar="PART",
                   help=f"also train these ({', '.join(EXTRA_PARTS)}), as deca-train's --train-* flags: DECA, a block "
                        "each; D-Adam, with the rest")
    p.add_argument("--attn", choices=["sdpa", "eager"], default="sdpa", help="attention implementation")
    p.add_argument("--steps-per-block", type=int, default=48, help="R, for the communication per round")
    p.add_argument("--h2d-gbps", type=finite(least=0, strict=True), default=55.2,
                   help="host-to-device copy rate (GB/s) for the offloaded copy time per step; default: pinned "
                        "copies measured on the H100 machine of profiling/results/gpu_h100")
    p.add_argument("--deepspeed-allreduce", action="store_true",
                   help="count DeepSpeed's stage-0 gradient all-reduce buckets (runs with G > 1 ranks per client)")
    p.add_argument("--clients-per-gpu", type=int, default=1, metavar="K",
                   help="clients sharing one GPU (deca-train --transport gloo with more ranks than GPUs): "
                        "fits = K × (peak + reserve) <= capacity; the peak stays per client")
    p.add_argument("--baselines", nargs="*", choices=BASELINES, default=list(BASELINES), metavar="METHOD",
                   help=f"baselines to estimate beside DECA, with deca-train's defaults ({', '.join(BASELINES)}; "
                        "none: DECA only)")
    p.add_argument("--reserve-gib", type=finite(least=0), default=1.0,
                   help="memory a process needs besides the estimate (CUDA context, NCCL, allocator slack); "
                        "fits = peak + reserve <= capacity")
    p.add_argument("--out", default=out, metavar="DIR", type=os.path.expanduser, help="output directory")
    p.add_argument("--name", default="estimate", help="base name of the output files")
    return p.parse_args(argv)


def finite(*, least: float, strict: bool = False):
    """An argparse type: a finite float >= `least` (> with `strict`); inf and nan parse as floats."""
    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
        if not math.isfinite(value) or value < least or (strict and value == least):
            raise argparse.ArgumentTypeError(f"must be a finite number {'>' if strict else '>='} {least:g}, got {text}")
        return value
    return parse


def versions() -> dict:
    import accelerate
    import torch
    import transformers

    from . import __version__

    return {"deca_ds": __version__, "torch": torch.__version__, "transformers": transformers.__version__,
            "accelerate": accelerate.__version__, "python": platform.python_version()}


def gib(x: float) -> float:
    return x / 2**30


def run(args: argparse.Namespace) -> list[dict]:
    """DECA's rows (model × granularity × offload), then the baselines' (model × method)."""
    from .baseline_memory import estimate_method
    from .config import parse_dtype
    from .memory import ModelSpec, Workload, estimate_blocks
    from .methods import METHODS, AdamConfig

    specs = sorted((ModelSpec.from_config(c) for c in args.config), key=lambda s: s.total_params)
    trains = {f"train_{part}": True for part in args.train}
    workload = Workload(working_dtype=args.working_dtype, transfer_dtype=args.transfer_dtype,
                        n_neighbors=args.neighbors, micro_batch=args.micro_batch, seq_len=args.seq_len,
                        loss_positions=args.loss_positions, loss_chunk=args.loss_chunk,
                        checkpointing=args.checkpointing, attn_implementation=args.attn,
                        deepspeed_allreduce=args.deepspeed_allreduce)
    rows = []
    for spec in specs:
        for lpb in args.layers_per_block:
            if not 1 <= lpb <= spec.num_layers:
                raise ValueError(f"--layers-per-block {lpb}: {spec.name} has {spec.num_layers} decoder layers")
            for offload, keep in [(o, k) for o in args.offload for k in (args.offload_keep if o == "frozen" else [0])]:
                blocks = estimate_blocks(
                    spec, lpb, workload, master_dtype=args.master_dtype, grad_accum=args.grad_accum, offload=offload,
                    variant=args.variant, state_bits=args.state_bits, offload_keep=keep,
                    fused_update=args.fused_update, steps_per_block=args.steps_per_block, **trains)
                est = max(blocks, key=lambda e: (e.peak, -e.block))  # estimate_memory: the round's peak
                # what a step copies from host memory, on average over a round (every block R steps)
                streamed = sum(e.offload_stream_block for e in blocks) / (len(blocks) * args.steps_per_block)
                rows.append(_row(est, streamed, args))
    adam = AdamConfig(steps=1, master_dtype=parse_dtype(args.master_dtype), fused_update=args.fused_update)
    for spec in specs:
        for name in args.baselines:
            method = METHODS[name](adam, **trains) if name == "dadam" else METHODS[name](adam)
            rows.append(_row(estimate_method(spec, method, workload), 0, args))
    return rows


def _row(est, streamed: float, args: argparse.Namespace) -> dict:
    """An estimate's row: its terms, what a step streams (bytes, and ms at --h2d-gbps), its fit on each card."""
    from .memory import GPUS

    reserve = int(args.reserve_gib * 2**30)
    row = est.to_dict()
    row["offload_stream_round"] = streamed
    row["offload_copy_ms"] = 1e3 * streamed / (args.h2d_gbps * 1e9)
    for gpu, capacity in GPUS.items():
        row[f"capacity {gpu}"] = capacity
        row[f"headroom {gpu}"] = est.headroom(gpu, reserve, args.clients_per_gpu)
        row[f"fits {gpu}"] = est.fits(gpu, reserve, args.clients_per_gpu)
    row["reserve"] = reserve
    row["clients_per_gpu"] = args.clients_per_gpu
    return row


def _fit(row: dict, gpu: str) -> str:
    room = gib(row[f"headroom {gpu}"])
    return f"yes (+{room:.1f})" if row[f"fits {gpu}"] else f"no ({room:.1f})"


def markdown(rows: list[dict], header: str, args: argparse.Namespace) -> str:
    from .memory import GPUS

    cols = ["model", "params", "layers/block", "B", "offload", "weights (+buffers) GiB", "optimizer state GiB",
            "grad GiB", "activations GiB (approx.)", "peak GiB (estimated)", "peak phase", "paper M+10M/B GiB",
            "D-Adam GiB (paper 9M / runtime)", "comm MB/step", "streamed GB/step (copy ms)"] + [
            f"fits {g} (headroom GiB)" for g in GPUS]
    lines = [header, "", "| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for r in (r for r in rows if r["method"] == "deca"):
        cells = [r["model"], f"{r['total_params'] / 1e9:.2f} B", str(r["layers_per_block"]), str(r["num_blocks"]),
                 setting(r),
                 f"{gib(r['weights'] + r['offload_buffers']):.2f}", f"{gib(r['optimizer_state']):.2f}",
                 f"{gib(r['grad']):.2f}", f"~{gib(r['activations']):.2f}", f"{gib(r['peak']):.2f}", r["peak_phase"],
                 f"{gib(r['paper_deca']):.2f}", f"{gib(r['paper_dadam_9m']):.1f} / {gib(r['dadam_runtime']):.1f}",
                 f"{r['comm_per_step'] / 1e6:.1f}",
                 (f"{r['offload_stream_round'] / 1e9:.2f} ({r['offload_copy_ms']:.0f})"
                  if r["offload"] == "frozen" else "—"),
                 ] + [_fit(r, g) for g in GPUS]
        lines.append("| " + " | ".join(cells) + " |")
    lines += _baseline_table([r for r in rows if r["method"] != "deca"])
    reserve = rows[0]["reserve"] / 2**30 if rows else args.reserve_gib
    lines += ["", "Notes", "",
              "- Every number is an estimate for ONE client, computed from the config on the meta device "
              "(`deca_ds.memory`). Memory in GiB (2^30 B), communication in MB (10^6 B). Measured against a "
              "real run on an H100 (Llama-3.1-8B, one layer per block, one client): measured / estimated peak "
              "1.003 resident, 1.010 offloaded (`gpu_h100/profile_memory.md`).",
              "- Peak = the largest of four phases of an inner step: backward (weights + optimizer state + grad "
              "+ activations), DeepSpeed's stage-0 gradient all-reduce (grad + flat copy + fp32 copy), the update "
              "(x½), and mixing (x½ + per neighbour one receive buffer of a mixing chunk, at most 2^25 elements, "
              "x⁺ summed into one of them and written over x½; in the master dtype). The block "
              "with the largest peak is shown ("
              + (f"of the decoder layers' blocks and, --train, one each for the {', '.join(args.train)}"
                 if args.train else "block 0: it is the largest and the deepest backward") + ").",
              "- weights (+buffers): all parameters in the working dtype (offload `none`), or embeddings + final norm "
              "+ LM head + the active block + two streaming buffers of the largest layer (offload `frozen`; "
              "the decoder layers then live in host memory, see `host_weights` in the CSV).",
              "- optimizer state = master + m + v of the active block (exact: DecaOptimizer.state_bytes()).",
              "- streamed (offload `frozen`): bytes of frozen layers a step copies from host memory, the mean over "
              f"a round of R = {args.steps_per_block} steps per block (FrozenPrefix runs the layers below the active "
              "block once per block; those above go up and down in every step; `offload_block_stream`, equal to "
              f"the bytes counted in CPU runs), and the time that takes at {args.h2d_gbps:g} GB/s host-to-device. "
              "With offloading a step takes about the longer of that and its compute (the copies run on a side "
              "stream), plus what the overlap misses.",
              "- activations are APPROXIMATE: tensors autograd saves in a Llama-style layer (counted from "
              "transformers' LlamaDecoderLayer and checked against saved tensors on CPU), checkpointed layer "
              "inputs, one layer's recomputation and backward temporaries, or the loss's fp32 logits peak at "
              f"{args.loss_positions or args.seq_len} positions"
              f"{f', {args.loss_chunk} at a time' if args.loss_chunk else ''} "
              f"(micro-batch {args.micro_batch}, sequence {args.seq_len}, {args.attn}, checkpointing "
              f"{'on' if args.checkpointing else 'off'}).",
              "- paper M+10M/B: Appendix B.2 with M = 2d bytes (d = all parameters); activations excluded. "
              "D-Adam: the paper's 9M, and full-parameter Adam as this runtime would hold it (all weights + "
              "master, m, v and grad of every decoder-layer parameter), activations and mixing buffers excluded.",
              f"- comm: bytes one client sends per inner step = neighbours ({args.neighbors}) × block × "
              f"{args.transfer_dtype}-dtype bytes; per round (× R = {args.steps_per_block}, over all blocks) "
              "in the CSV/JSON.",
              "- baselines (deca_ds.baseline_memory): one client training the method's tensors at every "
              "step, with deca-train's defaults (LoRA rank 8 on every linear layer of attention and MLP, "
              "dropout 0.05; adapters of width 64); the method applied to the meta model, so weights, "
              "trainable tensors and their dtypes are exact (peft keeps LoRA factors in fp32 under a bf16 "
              "base); x½ + exchange: x½ and the mixing buffers (DeCAF receives whole vectors); activations "
              "down to layer 0, where every baseline trains"
              + (f"; D-Adam also trains the {', '.join(args.train)} (--train)." if args.train else "."),
              f"- fits: {args.clients_per_gpu} × (peak + {reserve:g} GiB reserve (CUDA context, NCCL, allocator "
              f"slack)) ≤ the card's total as nvidia-smi reports it, for {args.clients_per_gpu} client(s) per GPU: "
              + ", ".join(f"{g} {c / 2**30:.2f} GiB" for g, c in GPUS.items())
              + "; headroom = total − clients × (reserve + peak). Allocator fragmentation is not modelled."]
    return "\n".join(lines) + "\n"


def _baseline_table(rows: list[dict]) -> list[str]:
    """The baselines' rows as a table of their own (no blocks, no offload)."""
    from .memory import GPUS

    if not rows:
        return []
    cols = ["model", "method", "trained params", "weights GiB", "optimizer state GiB", "grad GiB",
            "x½ + exchange GiB", "activations GiB (approx.)", "peak GiB (estimated)", "peak phase", "comm MB/step"] + [
            f"fits {g} (headroom GiB)" for g in GPUS]
    lines = ["", "Baselines, one client each (deca-train --method; deca_ds.baseline_memory):", "",
             "| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for r in rows:
        exchange = r["x_half"] + r["send_copy"] + r["recv"] + r["x_plus"]
        cells = [r["model"], r["method"], f"{r['block_params'] / 1e6:,.1f} M", f"{gib(r['weights']):.2f}",
                 f"{gib(r['optimizer_state']):.2f}", f"{gib(r['grad']):.2f}", f"{gib(exchange):.2f}",
                 f"~{gib(r['activations']):.2f}", f"{gib(r['peak']):.2f}", r["peak_phase"],
                 f"{r['comm_per_step'] / 1e6:.1f}"] + [_fit(r, g) for g in GPUS]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def _relative(path: str) -> str:
    try:
        return str(Path(path).resolve().relative_to(Path.cwd()))
    except ValueError:
        return path


def plot(rows: list[dict], path: Path, title: str) -> None:
    plt = pyplot()

    from .memory import GPUS

    groups = []
    for r in rows:
        key = (r["model"], r["layers_per_block"])
        if key not in groups:
            groups.append(key)
    offloads = list(dict.fromkeys(setting(r) for r in rows))
    width = 0.8 / len(offloads)
    fig, ax = plt.subplots(figsize=(max(8, 1.1 * len(groups) + 3), 6.5))
    for j, off in enumerate(offloads):
        xs, ys = [], []
        for x, key in enumerate(groups):
            for r in rows:
                if (r["model"], r["layers_per_block"]) == key and setting(r) == off:
                    xs.append(x - 0.4 + width * (j + 0.5))
                    ys.append(gib(r["peak"]))
        bars = ax.bar(xs, ys, width, label=f"estimated peak, offload {off}", color=f"C{j}")
        ax.bar_label(bars, fmt="%.1f", fontsize=7)
    paper = {}
    for r in rows:
        paper[(r["model"], r["layers_per_block"])] = gib(r["paper_deca"])
    ax.scatter(range(len(groups)), [paper[k] for k in groups], marker="_", s=600, color="black", zorder=3,
               linewidths=2, label="paper M + 10M/B (activations excluded)")
    for (gpu, capacity), style in zip(GPUS.items(), ["--", "-.", ":"]):
        ax.axhline(gib(capacity), color="gray", linestyle=style, linewidth=1)
        ax.text(len(groups) - 0.45, gib(capacity), f"{gpu} ({gib(capacity):.1f} GiB)", va="bottom", ha="right",
                fontsize=8, color="dimgray", bbox={"facecolor": "white", "edgecolor": "none", "pad": 1})
    ax.set_xticks(range(len(groups)), [f"{m}\n{n} layer{'s' if n > 1 else ''}/block" for m, n in groups],
                  rotation=45, ha="right", fontsize=8)
    ax.set_ylabel("GiB per client (estimated, not measured)")
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(0, 0.9))
    ax.set_ylim(0, max(max(gib(c) for c in GPUS.values()), max(gib(r["peak"]) for r in rows)) * 1.08)
    save_figure(fig, path)


def main(argv=None, *, prog: str = "deca-estimate", configs: list[str] | None = None, out: str = "estimate") -> int:
    """Run the command; `prog`, `configs` and `out` as in parse_args."""
    args = parse_args(argv, prog=prog, configs=configs, out=out)
    try:
        if Path(args.out).exists() and not Path(args.out).is_dir():
            raise ValueError(f"--out {args.out} is a file: give the directory the results go to")
        rows = run(args)
    except ValueError as err:  # a setting the estimator refuses, named: before anything is written
        print(f"{prog}: error: {err}", file=sys.stderr)
        return 2
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    command = prog + (" " + shlex.join(sys.argv[1:] if argv is None else argv)
                                                 if (sys.argv[1:] if argv is None else argv) else "")
    date = dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    vers = versions()
    header = (f"**DECA per-client memory (and the baselines'): estimated, not measured.** Command: `{command}`; "
              f"date: {date}; versions: "
              + ", ".join(f"{k} {v}" for k, v in vers.items()) + ".")
    text = markdown(rows, header, args)
    print(text)
    meta = {"command": command, "date": date, "versions": vers, "note": "estimated, not measured",
            "units": "bytes", "options": {k: v for k, v in vars(args).items() if k != "out"}}
    meta["options"]["config"] = [_relative(c) for c in args.config]
    write_results(out, args.name, markdown=text, rows=rows, payload={"meta": meta, "rows": rows})
    plot([r for r in rows if r["method"] == "deca"], out / f"{args.name}.png",
         f"DECA per-client peak memory (estimated)\n{args.working_dtype} weights, {args.master_dtype} master, "
         f"micro-batch {args.micro_batch} × {args.seq_len}, checkpointing {'on' if args.checkpointing else 'off'}, "
         f"{args.neighbors} neighbours")
    print(f"wrote {out / args.name}.md, .csv, .json, .png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
