"""8-bit moments of the active block (DecaConfig(state_bits=8)) against fp32: memory and drift.

On a tiny Llama (hidden 32, 64 tokens, the tests' shape), for each learning rate and variant:
  memory        DecaOptimizer.state_bytes() of the largest active block (master + m + v), fp32 vs
                8-bit moments, measured; and the same arithmetic for one Llama-3.1-8B decoder layer
                from its config (computed)
  drift         the simulator run twice on the same data and graph, fp32 and 8-bit moments: distance
                of the client-average models ‖x̄8 − x̄32‖ relative to the fp32 run's own change
                ‖x̄32 − x0‖ and to ‖x̄32‖, their held-out losses, and the largest per-step gap of the
                clients' mean training loss
  update error  one client; each step the 8-bit optimizer gets the fp32 run's master, gradient and
                x⁺: ‖Δ8 − Δ32‖ / ‖Δ32‖ of the step's update, the quantization error itself before
                the training dynamics amplify it (steps r >= 1 of a block; r = 0 starts from m = v = 0)
Writes <out>/state_8bit.{md,csv,json}.
"""

from __future__ import annotations

import argparse
import copy
import json
from pathlib import Path

import torch

from deca_ds import DecaConfig, DecaOptimizer, make_topology, simulate
from deca_ds.data import token_range_batches
from deca_ds.memory import ModelSpec
from deca_ds.models import tiny_llama
from deca_ds.quantized import num_absmax
from report import provenance, write_results

HERE = Path(__file__).resolve().parent
VARIANTS = ("deca", "trivial_bma", "no_bma")
VOCAB = 64


def tiny(layers: int) -> torch.nn.Module:
    """The tiny Llama of tests/helpers.py (Llama's own init range, not the demo's): the same weights."""
    return tiny_llama(VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
                      max_position_embeddings=64, initializer_range=0.02)


def client_batches(n_clients: int, steps: int, batch: int = 2, seq: int = 8, seed: int = 1) -> list[list[dict]]:
    """deca_ds.data.token_range_batches over the tiny Llama's vocabulary."""
    return token_range_batches(n_clients, steps, VOCAB, batch=batch, seq=seq, seed=seed)


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python profiling/state_8bit.py", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--lr", type=float, nargs="+", default=[1e-3, 3e-3], help="learning rates γ to compare at")
    p.add_argument("--variants", nargs="+", choices=VARIANTS, default=list(VARIANTS), help="BMA variants")
    p.add_argument("--layers", type=int, default=3, help="decoder layers of the tiny model (one per block)")
    p.add_argument("--clients", type=int, default=4, help="N, for the drift runs")
    p.add_argument("--topology", default="ring", help="graph of the drift runs (deca_ds.make_topology)")
    p.add_argument("--steps-per-block", type=int, default=8, help="R")
    p.add_argument("--rounds", type=int, default=2, help="T")
    p.add_argument("--big-config", default=str(HERE / "configs" / "llama-3.1-8b-instruct.json"),
                   help="model whose one-layer block's state bytes are computed alongside")
    p.add_argument("--out", default=str(HERE / "results"), help="output directory")
    return p.parse_args(argv)


def flat(params: dict) -> torch.Tensor:
    return torch.cat([t.flatten() for t in params.values()])


def held_out_loss(args, params: dict, batches) -> float:
    model = tiny(args.layers)
    model.load_state_dict(params)
    with torch.no_grad():
        return sum(model(**b).loss.item() for b in batches) / len(batches)


def drift(args, cfg: dict) -> dict:
    model = tiny(args.layers)
    steps = args.rounds * args.layers * args.steps_per_block
    batches = client_batches(args.clients, steps)
    held = [b for client in client_batches(args.clients, 4, batch=8, seed=99) for b in client]
    W = make_topology(args.topology, args.clients).W
    mean, losses = {}, {}
    for bits in (32, 8):
        curve = losses[bits] = []
        finals = simulate(model, batches, W, DecaConfig(**cfg, state_bits=bits),
                          on_step=lambda info: curve.append(sum(info.losses) / len(info.losses)))
        mean[bits] = {n: sum(f[n] for f in finals) / len(finals) for n in finals[0]}
    x0, x32, x8 = flat(dict(model.named_parameters())), flat(mean[32]), flat(mean[8])
    return {
        "rel_dist_to_update": ((x8 - x32).norm() / (x32 - x0).norm()).item(),
        "rel_dist_to_params": ((x8 - x32).norm() / x32.norm()).item(),
        "heldout_loss_initial": held_out_loss(args, dict(model.named_parameters()), held),
        "heldout_loss_fp32": held_out_loss(args, mean[32], held),
        "heldout_loss_8bit": held_out_loss(args, mean[8], held),
        "max_step_train_loss_gap": max(abs(a - b) for a, b in zip(losses[32], losses[8])),
    }


def update_error(args, cfg: dict) -> dict:
    """Single client, the fp32 run leading; both optimizers take its x⁺, so the 8-bit one sees the
    same x and g every step and differs by its moments only."""
    a = tiny(args.layers)
    b = copy.deepcopy(a)
    opt32, opt8 = DecaOptimizer(a, DecaConfig(**cfg)), DecaOptimizer(b, DecaConfig(**cfg, state_bits=8))
    errors, state = [], {32: 0, 8: 0}
    for batch in client_batches(1, opt32.total_steps)[0]:
        state = {32: max(state[32], opt32.state_bytes()), 8: max(state[8], opt8.state_bytes())}
        r = opt32.step_in_block
        a(**batch).loss.backward()
        for p, q in zip(a.parameters(), b.parameters()):
            q.grad = None if p.grad is None else p.grad.clone()
        x = opt32.active.master.clone()
        half32, half8 = opt32.adam_half_step(), opt8.adam_half_step()
        if r:
            errors.append(((half8 - half32).norm() / (half32 - x).norm()).item())
        # bma_correct keeps x⁺ as its master (no copy): each optimizer gets a tensor of its own
        opt8.bma_correct(half32.clone())
        opt32.bma_correct(half32)
    return {"state_bytes_fp32": state[32], "state_bytes_8bit": state[8],
            "update_err_mean": sum(errors) / len(errors), "update_err_max": max(errors)}


def big_layer(path: str) -> dict:
    """One decoder layer of `path` as the active block: the same bytes state_bytes() would report."""
    spec = ModelSpec.from_config(path)
    sizes = spec.tensor_numels(spec.partition(1), 0)
    n = sum(sizes)
    return {"model": spec.name, "block_params": n, "state_bytes_fp32": 12 * n,
            "state_bytes_8bit": 4 * n + 2 * (n + 4 * num_absmax(sizes)),
            "step_transient_8bit": 3 * 4 * max(sizes)}  # the largest tensor's fp32 m, v and Adam temporary


def main(argv=None) -> dict:
    args = parse_args(argv)
    rows = []
    for lr in args.lr:
        for variant in args.variants:
            cfg = dict(lr=lr, variant=variant, steps_per_block=args.steps_per_block, rounds=args.rounds,
                       layers_per_block=1)
            row = {"lr": lr, "variant": variant, **update_error(args, cfg), **drift(args, cfg)}
            fp32_part = row["state_bytes_fp32"] / 3  # master, m and v are equal fp32 vectors
            row["state_ratio"] = row["state_bytes_8bit"] / row["state_bytes_fp32"]
            row["moments_ratio"] = (row["state_bytes_8bit"] - fp32_part) / (2 * fp32_part)
            rows.append(row)
            print(json.dumps(row, allow_nan=False))
    summary = {
        **provenance("state_8bit.py", argv, threads=torch.get_num_threads()),
        "bitsandbytes": __import__("bitsandbytes").__version__, "args": vars(args),
        "tiny_block_params": rows[0]["state_bytes_fp32"] // 12, "big_layer": big_layer(args.big_config), "rows": rows,
    }
    write(summary, Path(args.out))
    return summary


def write(s: dict, out: Path) -> None:
    rows, big, a = s["rows"], s["big_layer"], s["args"]
    r0, MB = rows[0], 1e6
    md = [f"**8-bit moments vs fp32 (DecaConfig(state_bits=8))** — measured on {s['device']}; command: "
          f"`{s['command']}`; {s['date']}; torch {s['versions']['torch']}, bitsandbytes {s['bitsandbytes']}.", "",
          "Optimizer state of the active block (master x + m + v); 8-bit m, v are uint8 codes plus one fp32 "
          "absmax per 256 elements of each tensor, the master stays fp32.", "",
          "| model, active block | params | fp32 state (bytes) | 8-bit state (bytes) | 8-bit / fp32 state | "
          "8-bit / fp32 moments |", "| --- | ---: | ---: | ---: | ---: | ---: |",
          f"| tiny Llama (h=32), 1 layer, measured state_bytes() | {s['tiny_block_params']:,} | "
          f"{r0['state_bytes_fp32']:,} | {r0['state_bytes_8bit']:,} | {r0['state_ratio']:.3f} | "
          f"{r0['moments_ratio']:.3f} |",
          f"| {big['model']}, 1 layer, computed | {big['block_params']:,} | {big['state_bytes_fp32']:,} | "
          f"{big['state_bytes_8bit']:,} | {big['state_bytes_8bit'] / big['state_bytes_fp32']:.3f} | "
          f"{(big['state_bytes_8bit'] - 4 * big['block_params']) / (8 * big['block_params']):.3f} |", "",
          f"Saved per active {big['model']} layer: {(big['state_bytes_fp32'] - big['state_bytes_8bit']) / MB:,.0f} MB; "
          f"while a step runs, the 8-bit path also holds one tensor's fp32 m, v and Adam temporary "
          f"({big['step_transient_8bit'] / MB:,.0f} MB for its largest tensor), freed before the next tensor.", "",
          f"Drift: {a['clients']} clients, {a['topology']}, {a['layers']} layers (one per block), "
          f"R = {a['steps_per_block']}, "
          f"T = {a['rounds']}; x̄ = client average, norms over every parameter (frozen ones included); "
          "update error from one client fed identical x, g, x⁺.", "",
          "| lr | variant | update error mean / max | ‖x̄8 − x̄32‖ / ‖x̄32 − x0‖ | ‖x̄8 − x̄32‖ / ‖x̄32‖ | "
          "held-out loss x0 → fp32 / 8-bit | max per-step train-loss gap |",
          "| ---: | --- | ---: | ---: | ---: | ---: | ---: |"]
    md += [f"| {r['lr']:g} | {r['variant']} | {r['update_err_mean']:.4f} / {r['update_err_max']:.4f} | "
           f"{r['rel_dist_to_update']:.4f} | {r['rel_dist_to_params']:.2e} | {r['heldout_loss_initial']:.4f} → "
           f"{r['heldout_loss_fp32']:.4f} / {r['heldout_loss_8bit']:.4f} | {r['max_step_train_loss_gap']:.2e} |"
           for r in rows]
    write_results(out, "state_8bit", markdown="\n".join(md) + "\n", rows=rows, payload=s)


if __name__ == "__main__":
    main()
