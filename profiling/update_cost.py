"""What DECA's update of one active block costs, against the memory traffic it cannot avoid.

One client, one block of a model built from its config: each step gets a fresh random gradient in
the working dtype, then adam_half_step() and bma_correct() run and are timed (the device
synchronized around each), with PyTorch's eager ops (`eager`) and with the fused kernels of
`fused_update` (torch.compile; compiled in the warm-up steps) in its two data flows: `fused`, the
path of a client with neighbors (here handed its own x½ back as x⁺ by a mixer that says it is not
alone, so no network), and `fused_alone`, a client without neighbors, which updates in place. In
the same run a copy of an fp32 vector of the block's size is timed: one read and one write of 4
bytes per element, the yardstick. The update is a memory-bound stream over the block, so its time
in copies says how many block-sized passes it makes, wherever it runs. On a GPU each call is also
timed until it returns, before the device is waited for: the host's time to issue the update
(Python, Dynamo's guards, the launches), which is the step's time where the device waits for the
host (profiling/results/gpu_h200/README.md, `da61034`); on CPU the two are one. The floor is what the
fused kernels must move (floor_bytes):
- fused: read g, x, m, v, write m, v, x½ (half step); read x, x⁺ (twice: ‖x − x⁺‖ first), m, v,
  write m, v, the weights (correction; x⁺ becomes x without a copy). no_bma: the correction only
  reads x⁺ and writes the weights.
- fused_alone: read g, x, m, v (‖x − x½‖, x½ in registers); read g, x, m, v again, write x, m, v,
  the weights. no_bma: the second pass only.
Writes <out>/<name>.{md,csv,json}.

On CPU glibc hands a freed buffer as large as x½ back to the OS, and the next step's x½ pays a
page fault per 4 KiB (about 60 ms of a ~90 ms half step for Qwen2-1.5B's block); a GPU's caching
allocator reuses the buffer. By default the tool therefore asks glibc to keep freed memory
(mallopt: no mmap'd chunks, no trimming), so both devices time the same passes over the block;
--system-allocator times the process as training runs it on CPU.

    python profiling/update_cost.py                       # Qwen2-1.5B's block (46.8 M parameters)
    python profiling/update_cost.py --config profiling/configs/llama-3.1-8b-instruct.json   # on a GPU
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

from deca_ds import DecaConfig, DecaOptimizer
from deca_ds.config import parse_dtype
from deca_ds.memory import load_config, meta_model
from peaks import M_MMAP_MAX, M_TRIM_THRESHOLD, mallopt
from report import provenance, write_results

HERE = Path(__file__).resolve().parent


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python profiling/update_cost.py", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--config", default=str(HERE / "configs" / "qwen2-1.5b.json"), help="HF config (file or dir)")
    p.add_argument("--working-dtype", choices=["fp32", "bf16"], default=None,
                   help="default: bf16 on a GPU, fp32 on CPU (where bf16-to-fp32 arithmetic is not vectorized "
                        "and would dominate)")
    p.add_argument("--variants", nargs="+", default=["deca", "no_bma"], choices=["deca", "trivial_bma", "no_bma"])
    p.add_argument("--updates", nargs="+", default=["eager", "fused", "fused_alone"],
                   choices=["eager", "fused", "fused_alone"],
                   help="eager PyTorch ops, or DecaConfig(fused_update=True) with neighbors or without")
    p.add_argument("--steps", type=int, default=10, help="timed steps per variant, after --warmup")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--system-allocator", action="store_true",
                   help="CPU: leave glibc's malloc as it is (freed block-sized buffers go back to the OS)")
    p.add_argument("--out", default=str(HERE / "results"))
    p.add_argument("--name", default="update_cost")
    return p.parse_args(argv)


def floor_bytes(working_bytes: int, master_bytes: int = 4, *, variant: str = "deca", alone: bool = False) -> int:
    """Bytes per block parameter the fused update must move (module docstring)."""
    g_x_m_v = working_bytes + 3 * master_bytes
    if alone:  # ‖x − x½‖, then x, m, v and the weights written in place
        update = g_x_m_v + 3 * master_bytes + working_bytes
        return update if variant == "no_bma" else g_x_m_v + update
    half_step = g_x_m_v + 3 * master_bytes
    if variant == "no_bma":
        return half_step + master_bytes + working_bytes
    return half_step + 4 * master_bytes + 2 * master_bytes + 2 * master_bytes + working_bytes


class NotAlone:
    """A mixer that hands x½ back as x⁺ but has neighbors as far as the optimizer knows: the fused
    path of a client in a graph, timed without a network."""

    alone = False

    def mix(self, x_half: torch.Tensor) -> torch.Tensor:
        return x_half


def timed(fn, device: torch.device) -> tuple[float, float, object]:
    """fn's time with the device waited for, its host time (until it returns), and its result."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    sync()
    t0 = time.perf_counter()
    out = fn()
    t_host = time.perf_counter() - t0
    sync()
    return time.perf_counter() - t0, t_host, out


def measure(args, variant: str, update: str) -> dict:
    device = torch.device(args.device)
    dtype = parse_dtype(args.working_dtype)
    config = load_config(args.config)
    with torch.device(device):
        model = meta_model(config).to_empty(device=device).to(dtype)  # values do not matter, only sizes
    for p in model.parameters():
        torch.nn.init.normal_(p, std=0.02)
    opt = DecaOptimizer(model, DecaConfig(layers_per_block=1, steps_per_block=10**6, rounds=1, variant=variant,
                                          master_dtype=torch.float32, fused_update=update != "eager"),
                        mixer=NotAlone() if update == "fused" else None)
    params, n = opt.active.params, opt.active.master.numel()
    gen = torch.Generator(device).manual_seed(0)
    half, correct, host_half, host_correct, copy = [], [], [], [], []
    a, b = torch.randn(n, device=device, generator=gen), torch.empty(n, device=device)
    for step in range(args.warmup + args.steps):
        for p in params:
            p.grad = torch.randn(p.shape, device=device, dtype=dtype, generator=gen).mul_(1e-3)
        t_half, h_half, x_half = timed(opt.adam_half_step, device)
        t_correct, h_correct, _ = timed(lambda: opt.bma_correct(x_half), device)
        t_copy, _, _ = timed(lambda: b.copy_(a), device)
        if step >= args.warmup:
            half.append(t_half)
            correct.append(t_correct)
            host_half.append(h_half)
            host_correct.append(h_correct)
            copy.append(t_copy)
    floor = floor_bytes(torch.finfo(dtype).bits // 8, variant=variant, alone=update == "fused_alone")
    t_half, t_correct, h_half, h_correct, t_copy = (1e3 * statistics.median(x)
                                                    for x in (half, correct, host_half, host_correct, copy))
    return {"variant": variant, "update": update, "block_params": n, "working_dtype": args.working_dtype,
            "half_step_ms": t_half, "correct_ms": t_correct, "update_ms": t_half + t_correct,
            "host_ms": h_half + h_correct,
            "copy_ms": t_copy, "update_in_copies": (t_half + t_correct) / t_copy,
            "floor_in_copies": floor / 8, "over_floor": (t_half + t_correct) / t_copy / (floor / 8),
            "copy_gbps": 8 * n / (t_copy / 1e3) / 1e9}


def keep_freed_memory() -> str:
    """glibc: serve every allocation from the heap and never trim it, so a freed buffer is reused
    without page faults, as a caching allocator does."""
    mallopt({M_MMAP_MAX: 0, M_TRIM_THRESHOLD: 2**31 - 1}, "run with --system-allocator")
    return "glibc malloc keeping freed memory (mallopt M_MMAP_MAX=0, M_TRIM_THRESHOLD=2^31-1)"


def main(argv=None) -> dict:
    args = parse_args(argv)
    cuda = args.device.startswith("cuda")
    allocator = ("the CUDA caching allocator" if cuda else
                 "glibc malloc as is" if args.system_allocator else keep_freed_memory())
    args.working_dtype = args.working_dtype or ("bf16" if cuda else "fp32")
    rows = [measure(args, v, u) for v in args.variants for u in args.updates]
    summary = {
        **provenance("update_cost.py", argv, cuda=cuda, threads=torch.get_num_threads()),
        "allocator": allocator,
        "rows": rows,
    }
    md = [f"**DECA's update of one block, measured** on {summary['device']}, commit {summary['commit']}; "
          f"command: `{summary['command']}`; {summary['date']}; torch {summary['versions']['torch']}; {allocator}.", "",
          "| variant | update | block params | working | half step (ms) | correction (ms) | update (ms) "
          "| host (ms) | fp32 copy (ms) | update in copies | fused floor in copies | update / floor |",
          "| --- | --- | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    md += [f"| {r['variant']} | {r['update']} | {r['block_params']:,} | {r['working_dtype']} | "
           f"{r['half_step_ms']:.2f} | {r['correct_ms']:.2f} | {r['update_ms']:.2f} | {r['host_ms']:.3f} | "
           f"{r['copy_ms']:.3f} | {r['update_in_copies']:.1f} | "
           f"{r['floor_in_copies']:.1f} | {r['over_floor']:.2f} |" for r in rows]
    md += ["", "A copy reads and writes 4 bytes per element of the block (fp32); 'in copies' is a time divided "
           "by the copy's, so it counts block-sized passes whatever the device. The floor is what the fused "
           "kernels must read and write (module docstring), in copies. fused: a client with neighbors (its "
           "exchange not timed); fused_alone: one without, updating in place. Host: the update's two calls "
           "timed until they return, the device not waited for (on CPU, the update). Medians of the timed steps."]
    write_results(Path(args.out), args.name, markdown="\n".join(md) + "\n", rows=rows, payload=summary)
    print("\n".join(md))
    return summary


if __name__ == "__main__":
    main()
