"""What the loss costs in memory, whole and in chunks (--loss-chunk), measured on CPU.

Each setting runs in a fresh process: a Llama with Llama-3's 128,256-token vocabulary and small
layers (so the logits dominate), one decoder layer trainable as in DECA, one forward and backward
of models.causal_lm_loss on a micro-batch with every position labelled. The process's peak
resident memory (ru_maxrss) above its resident memory before the forward is the step's
activation peak; beside it, deca_ds.memory's estimate of the loss's part (act_logits) and the
step's time. Writes <out>/<name>.{md,csv,json}.

    python profiling/loss_memory.py                          # micro-batch 8 × 512, chunks 0 16 64 256
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time
from pathlib import Path

import torch

from report import provenance, write_results

HERE = Path(__file__).resolve().parent
SHAPE = dict(hidden_size=256, intermediate_size=688, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, vocab_size=128256, max_position_embeddings=1024, tie_word_embeddings=False)


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python profiling/loss_memory.py", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--chunks", type=int, nargs="+", default=[0, 16, 64, 256], help="loss_chunk values (0 = whole)")
    p.add_argument("--micro-batch", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--vocab", type=int, default=SHAPE["vocab_size"])
    p.add_argument("--out", default=str(HERE / "results"))
    p.add_argument("--name", default="loss_memory")
    p.add_argument("--child", type=int, default=None, help=argparse.SUPPRESS)
    return p.parse_args(argv)


def child(args) -> dict:
    """One forward and backward in this process; prints its measurements as JSON."""
    import psutil
    from transformers import LlamaConfig, LlamaForCausalLM

    from deca_ds.models import causal_lm_loss

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**{**SHAPE, "vocab_size": args.vocab})).train()
    model.requires_grad_(False)
    model.model.layers[0].requires_grad_(True)  # DECA's active block; embeddings and head frozen
    ids = torch.randint(0, args.vocab, (args.micro_batch, args.seq_len))
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids}
    before = psutil.Process().memory_info().rss
    t0 = time.perf_counter()
    causal_lm_loss(model, batch, loss_chunk=args.child).backward()
    seconds = time.perf_counter() - t0
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux
    return {"peak_above_start": peak - before, "step_s": seconds}


def main(argv=None) -> dict:
    args = parse_args(argv)
    if args.child is not None:
        print(json.dumps(child(args), allow_nan=False))
        return {}
    from transformers import LlamaConfig

    from deca_ds.memory import GiB, ModelSpec, Workload, estimate_memory

    spec = ModelSpec.from_config(LlamaConfig(**{**SHAPE, "vocab_size": args.vocab}), name="llama-2x256-v128k")
    rows = []
    for chunk in args.chunks:
        done = subprocess.run([sys.executable, __file__, "--child", str(chunk), "--micro-batch", str(args.micro_batch),
                               "--seq-len", str(args.seq_len), "--vocab", str(args.vocab)],
                              capture_output=True, text=True, check=True, timeout=1800)
        measured = json.loads(done.stdout.strip().splitlines()[-1])
        workload = Workload(working_dtype="fp32", micro_batch=args.micro_batch, seq_len=args.seq_len,
                            loss_positions=args.seq_len - 1, loss_chunk=chunk)  # the last position predicts nothing
        est = estimate_memory(spec, 1, workload)
        rows.append({"loss_chunk": chunk, "measured_peak_gib": measured["peak_above_start"] / GiB,
                     "estimated_logits_gib": est.act_logits / GiB, "step_s": measured["step_s"]})
    whole = rows[0]["measured_peak_gib"] if args.chunks[0] == 0 else None
    summary = {**provenance("loss_memory.py", argv, threads=torch.get_num_threads()),
               "model": spec.name, "micro_batch": args.micro_batch, "seq_len": args.seq_len, "rows": rows}
    md = [f"**Memory of the loss, measured** on {summary['device']}; command: `{summary['command']}`; "
          f"{summary['date']}; "
          f"torch {torch.__version__}. {spec.name}: 2 layers of hidden 256, vocabulary {args.vocab:,}, fp32; "
          f"micro-batch {args.micro_batch} × {args.seq_len}, every position labelled.", "",
          "| loss chunk | peak above start, measured (GiB) | loss's logits, estimated (GiB) | forward + backward (s) |"
          + (" of the whole loss's peak |" if whole else ""),
          "| ---: | ---: | ---: | ---: |" + (" ---: |" if whole else "")]
    md += [f"| {r['loss_chunk'] or 'whole'} | {r['measured_peak_gib']:.2f} | {r['estimated_logits_gib']:.2f} | "
           f"{r['step_s']:.1f} |" + (f" {r['measured_peak_gib'] / whole:.2f} |" if whole else "") for r in rows]
    md += ["", "Peak above start: the process's peak resident memory (ru_maxrss) minus its resident memory "
           "before the forward, so every activation of the step, the layers' included; the estimate is the "
           "loss's part alone (deca_ds.memory act_logits). One process per row."]
    write_results(Path(args.out), args.name, markdown="\n".join(md) + "\n", rows=rows, payload=summary)
    print("\n".join(md))
    return summary


if __name__ == "__main__":
    main()
