"""Matmul efficiency of a model's forward and backward (issue 17, target 4): achieved TFLOP/s per
micro-batch (b × seq) against the device's own dense matmul peak, measured with a large GEMM in
the same run; optionally under an allocator cap that emulates a smaller card.

FLOPs are counted analytically (model_flops), 2 per multiply-add of every matmul, per sequence:

    layers · s · 2 · (h·q + 2·h·kv + q·h + 3·h·i)      projections q, k, v, o and the MLP's gate, up, down
  + layers · 2 · 2 · s² · q                            attention scores QKᵀ and P·V, the full s × s (as
                                                       torch.utils.flop_counter counts SDPA; a causal
                                                       kernel that skips the upper half does less)
  + positions · 2 · h · V                              the LM head at the labelled positions

with h hidden, q = heads·head_dim, kv = kv_heads·head_dim, i intermediate, V vocabulary. Backward
with every weight trainable is twice the forward (a gradient for the input and one for the weight
of each matmul). Elementwise work (norms, SiLU, softmax, RoPE) is not counted.

    python profiling/matmul_efficiency.py --config profiling/configs/llama-3.1-8b-instruct.json \\
        --layers 4 --out profiling/results/gpu_h100/matmul_efficiency.json
    python profiling/matmul_efficiency.py ... --card-gb 32    # RTX 5090's memory, by allocator cap
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "profiling"))

from deca_ds.config import DTYPES  # noqa: E402
from report import emit, provenance  # noqa: E402


def model_flops(config, batch: int, seq_len: int, positions: int = 1) -> int:
    """Forward FLOPs of a Llama-style decoder (module docstring), `positions` labelled per sequence."""
    h, i, V = config.hidden_size, config.intermediate_size, config.vocab_size
    d = getattr(config, "head_dim", None) or h // config.num_attention_heads
    q, kv = config.num_attention_heads * d, config.num_key_value_heads * d
    per_layer = seq_len * 2 * (h * q + 2 * h * kv + q * h + 3 * h * i) + 2 * 2 * seq_len * seq_len * q
    return batch * (config.num_hidden_layers * per_layer + positions * 2 * h * V)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _median_s(fn, device: torch.device, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        _sync(device)
        t0 = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2]


def gemm_peak(n: int, dtype: torch.dtype, device: torch.device, repeats: int) -> float:
    """TFLOP/s of an n × n by n × n matmul (2n³ FLOPs), after one warm-up."""
    a, b = (torch.randn(n, n, dtype=dtype, device=device) for _ in range(2))
    a @ b
    return 2 * n**3 / _median_s(lambda: a @ b, device, repeats) / 1e12


def measure(model, config, batch: int, seq_len: int, device: torch.device, repeats: int) -> dict:
    """Forward and backward time (medians) of one micro-batch, the LM head at the last position."""
    ids = torch.randint(0, config.vocab_size, (batch, seq_len), device=device)

    def forward():
        return model(input_ids=ids, logits_to_keep=1, use_cache=False).logits.float().sum()

    def step():
        model.zero_grad(set_to_none=True)
        forward().backward()

    step()  # warm-up
    fwd = _median_s(forward, device, repeats)
    both = _median_s(step, device, repeats)
    flops = model_flops(config, batch, seq_len)
    return {"micro_batch": batch, "seq_len": seq_len, "forward_flops": flops, "backward_flops": 2 * flops,
            "forward_ms": 1e3 * fwd, "backward_ms": 1e3 * (both - fwd),
            "forward_tflops": flops / fwd / 1e12, "backward_tflops": 2 * flops / max(both - fwd, 1e-9) / 1e12,
            "step_tflops": 3 * flops / both / 1e12}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default=str(ROOT / "profiling" / "configs" / "llama-3.1-8b-instruct.json"))
    p.add_argument("--layers", type=int, help="keep this many decoder layers (the FLOP rate is per layer)")
    p.add_argument("--micro-batches", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--dtype", choices=("bf16", "fp32"), default="bf16")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--gemm-size", type=int, default=8192)
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--card-gb", type=float, help="cap the CUDA allocator at this many GB (emulate a smaller card)")
    p.add_argument("--out", help="JSON file to write")
    return p.parse_args(argv)


def main(argv=None) -> dict:
    args = parse_args(argv)
    from transformers import AutoConfig, AutoModelForCausalLM

    device, dtype = torch.device(args.device), DTYPES[args.dtype]
    if device.type == "cuda" and device.index is None:  # the allocator's cap takes an indexed device only
        device = torch.device("cuda", torch.cuda.current_device())
    config = AutoConfig.from_pretrained(args.config)
    if args.layers:
        config.num_hidden_layers = args.layers
    cap = None
    if args.card_gb:
        if device.type != "cuda":
            raise SystemExit("--card-gb caps the CUDA allocator: it needs --device cuda")
        cap = min(1.0, args.card_gb * 1e9 / torch.cuda.get_device_properties(device).total_memory)
        torch.cuda.set_per_process_memory_fraction(cap, device)
    peak = gemm_peak(args.gemm_size, dtype, device, args.repeats)
    torch.manual_seed(0)
    with device:
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="sdpa")
    rows = []
    for b in args.micro_batches:
        try:
            row = measure(model, config, b, args.seq_len, device, args.repeats)
        except torch.OutOfMemoryError:
            row = {"micro_batch": b, "seq_len": args.seq_len, "oom": True}
            model.zero_grad(set_to_none=True)
            torch.cuda.empty_cache()
        else:
            row.update(oom=False, forward_of_peak=row["forward_tflops"] / peak,
                       backward_of_peak=row["backward_tflops"] / peak, step_of_peak=row["step_tflops"] / peak)
            if device.type == "cuda":
                row["max_allocated_gib"] = torch.cuda.max_memory_allocated(device) / 2**30
                torch.cuda.reset_peak_memory_stats(device)
        rows.append(row)
    result = {**provenance("matmul_efficiency.py", argv, cuda=device.type == "cuda"), "dtype": args.dtype,
              "config": args.config, "layers": config.num_hidden_layers, "gemm_size": args.gemm_size,
              "gemm_peak_tflops": peak, "card_gb": args.card_gb, "memory_fraction": cap, "results": rows}
    emit(result, args.out)
    return result


if __name__ == "__main__":
    main()
