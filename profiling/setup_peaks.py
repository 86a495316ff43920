"""The setup phase's memory, measured against the estimator's setup terms (deca_ds.memory,
setup_phases): one process runs the runtime's setup steps in its order, each a phase of
peaks.PhasePeaks, and the increment each one adds is compared with the term that models it.

    init       the model drawn in the working dtype (models.draw_from_config) weights + init_transient
               or loaded from a bf16 safetensors checkpoint and moved to the
               device, as the trainer does (models.load_model, then .to)
    evaluate   one no-grad scoring forward (models.labelled_logits)          eval_forward
    optimizer  DecaOptimizer activates the first block: its master, m, v      optimizer_state

DeepSpeed's engine setup is not run here: at stage 0 it wraps the module without copying it
(the estimator counts nothing for it; a GPU run through launch/train.py measures it). A phase's
number is the tensor memory allocated: on a GPU (`--device cuda`) torch.cuda's allocated peak, on
CPU its counterpart, a deca_ds.runtime.allocated.TensorBytes counter of what operators allocate (exact: memory from
before a phase that is freed inside it is not netted out, as in a resident set). Each row also says
what the phase still holds at its end (`held_bytes`), and on CPU the resident set's high-water
mark above its start (`rss_peak_bytes`, VmHWM, every tensor in pages of its own by
peaks.map_each_allocation): the whole process, a mapped file's pages included.

`--load config checkpoint` (the default) measures both ways of starting, one after the other in the
same process: the checkpoint is the same random initialisation, saved by save_pretrained before
its measurement starts. On CPU a loaded model's weights stay mapped from the file (safetensors):
no operator allocates them, and they become resident when first read, in the evaluation's phase
rather than init's; the resident setup peak (`setup_peak_rss`) compares the two starts.

    python profiling/setup_peaks.py --out profiling/results/cpu/setup_peaks.json
"""

from __future__ import annotations

import argparse
import gc
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "profiling"))

from deca_ds.config import DTYPES  # noqa: E402
from deca_ds.runtime.allocated import DeviceMemory, TensorBytes, counting  # noqa: E402
from peaks import PhasePeaks, map_each_allocation, rss  # noqa: E402
from report import emit, provenance  # noqa: E402

LOADS = ("config", "checkpoint")


def tiny_config(hidden: int, layers: int, vocab: int):
    from transformers import LlamaConfig

    return LlamaConfig(hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                       num_attention_heads=8, num_key_value_heads=4, vocab_size=vocab, tie_word_embeddings=False)


def draw(config, *, dtype: str, device: torch.device):
    """The random initialisation of `config` (seed 0) in `dtype`, drawn on `device` as the trainer
    draws a --from-config model."""
    from deca_ds.models import draw_from_config

    with device:
        return draw_from_config(config, dtype=DTYPES[dtype], seed=0, device=device)


def start_model(config, *, dtype: str, load: str, device: torch.device, checkpoint: Path):
    """The model as the trainer starts it (plan.build_model, then .to(device)): drawn on the
    device from `config`, or `load="checkpoint"`: loaded from the safetensors checkpoint that
    `save_checkpoint` wrote to `checkpoint`."""
    from deca_ds.models import load_model

    if load == "checkpoint":
        return load_model(str(checkpoint), dtype=DTYPES[dtype]).to(device).eval()
    return draw(config, dtype=dtype, device=device).eval()


def save_checkpoint(config, *, dtype: str, device: torch.device, checkpoint: Path) -> None:
    """draw()'s model as a safetensors checkpoint, drawn on `device` (fast on a GPU) and freed
    before any measurement."""
    draw(config, dtype=dtype, device=device).save_pretrained(checkpoint)
    gc.collect()


def measure(config, *, dtype: str, eval_batch: int, seq_len: int, device: str = "cpu", load: str = "config") -> dict:
    """Run the setup steps once in this process; each phase's allocated peak above the count at its
    start, and what it still holds at its end (on CPU, a TensorBytes counter; also the resident set)."""
    from deca_ds import DecaConfig, DecaOptimizer
    from deca_ds.memory import Workload, estimate_block
    from deca_ds.models import labelled_logits

    dev = torch.device(device)
    cuda = dev.type == "cuda"
    memory = DeviceMemory(dev, None if cuda else TensorBytes(dev))

    def mark(phase: str) -> None:
        before[phase], rss_before[phase] = memory.allocated(), rss()
        peaks.mark(phase)

    # one-time costs (transformers' lazy imports and loading code, kernels' first-call buffers) are
    # not setup's: pay them on a one-layer copy first. A loaded model's files may go once it is
    # loaded (on CPU its tensors map them, and a mapping outlives the file's name).
    warm = config.__class__(**{**config.to_dict(), "num_hidden_layers": 1, "vocab_size": 16})
    # the evaluation's batch, made before the count starts (in a run the data loader makes it)
    ids = torch.randint(0, config.vocab_size, (eval_batch, seq_len), device=dev)
    labels = torch.full_like(ids, -100)
    labels[:, -1] = ids[:, -1]
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": labels}
    with tempfile.TemporaryDirectory(prefix="setup_peaks_") as tmp, counting(memory.counter):
        if load == "checkpoint":
            save_checkpoint(warm, dtype=dtype, device=dev, checkpoint=Path(tmp, "warm"))
            save_checkpoint(config, dtype=dtype, device=dev, checkpoint=Path(tmp, "model"))
        small = start_model(warm, dtype=dtype, load=load, device=dev, checkpoint=Path(tmp, "warm"))
        with torch.no_grad():
            labelled_logits(small, {"input_ids": torch.zeros(1, 8, dtype=torch.long, device=dev),
                                    "attention_mask": torch.ones(1, 8, dtype=torch.long, device=dev),
                                    "labels": torch.zeros(1, 8, dtype=torch.long, device=dev)})
        del small
        peaks = PhasePeaks(memory)
        gc.collect()
        before, rss_before = {}, {}
        mark("init")
        model = start_model(config, dtype=dtype, load=load, device=dev, checkpoint=Path(tmp, "model"))
        gc.collect()
        mark("evaluate")
        with torch.no_grad():
            labelled_logits(model, batch)
        gc.collect()
        mark("optimizer")
        # held, as in a run
        optimizer = DecaOptimizer(model, DecaConfig(layers_per_block=1, master_dtype=torch.float32))
        peaks.mark("end")
    del optimizer
    phases = {r["phase"]: r for r in peaks.rows if r["phase"] in before}
    measured = {p: r[f"{dev.type}_allocated_peak"] - before[p] for p, r in phases.items()}
    held = {p: r[f"{dev.type}_allocated_end"] - before[p] for p, r in phases.items()}

    workload = Workload(working_dtype=dtype, micro_batch=1, seq_len=seq_len, eval_batch=eval_batch, eval_positions=1,
                        n_neighbors=0)
    est = estimate_block(config, 1, 0, workload, master_dtype="fp32")
    terms = {"init": est.weights + est.init_transient, "evaluate": est.eval_forward,
             "optimizer": est.optimizer_state}
    rows = [{"phase": p, "measured_bytes": measured[p], "held_bytes": held[p], "estimated_bytes": terms[p],
             "measured_over_estimated": measured[p] / terms[p],
             # the whole process's resident set: libraries' pages, the interpreter's, a mapped file's
             **({} if cuda else {"rss_peak_bytes": phases[p]["rss_peak"] - rss_before[p]})}
            for p in terms]
    # the setup peak above the count before init, phase by phase cumulative
    result = {"rows": rows, "setup_peak_measured": max(before[p] - before["init"] + measured[p] for p in terms),
              "setup_peak_estimated": est.setup_peak, "setup_phases_estimated": est.setup_phases,
              "params": est.total_params, "block_params": est.block_params,
              "weight_bytes": sum(t.nbytes for t in (*model.parameters(), *model.buffers()))}
    if not cuda:
        result["setup_peak_rss"] = max(rss_before[p] - rss_before["init"] + r["rss_peak_bytes"]
                                       for p, r in zip(terms, rows))
    return result


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--dtype", choices=("bf16", "fp32"), default="bf16")
    p.add_argument("--eval-batch", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--device", default="cpu")
    p.add_argument("--load", nargs="+", choices=LOADS, default=list(LOADS),
                   help="how the model starts: drawn from its config, or loaded from a safetensors checkpoint")
    p.add_argument("--out", help="JSON file to write")
    return p.parse_args(argv)


def main(argv=None) -> dict:
    args = parse_args(argv)
    torch.set_num_threads(1)
    allocator = "the CUDA caching allocator" if args.device.startswith("cuda") else map_each_allocation()
    config = tiny_config(args.hidden, args.layers, args.vocab)
    result = {"loads": {load: measure(config, dtype=args.dtype, eval_batch=args.eval_batch, seq_len=args.seq_len,
                                      device=args.device, load=load) for load in args.load},
              "allocator": allocator}
    result["provenance"] = provenance("setup_peaks.py", argv, cuda=args.device.startswith("cuda"), threads=1)
    emit(result, args.out, indent=1)
    return result


if __name__ == "__main__":
    main()
