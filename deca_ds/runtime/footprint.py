"""deca-train --estimate: one client's GPU memory for the run the options describe, estimated
(deca_ds.memory) before anything is loaded onto a device.

It reads what the run's memory depends on as the run reads it: the model's config (no weights),
the task (its tokenizer and data, so the LM head's positions are the answer's tokens, as in
training, and whether rank 0 scores x̄ before training; the tokenized set is cached for the run),
the graph (its largest neighbourhood), and --offload-budget's choice of --offload-keep. Nothing is
trained and nothing is written but the token cache. `estimate_run` (the estimate for a set of
options) and `offload_keep_for_budget` serve the trainer and the profiling tools too.
"""

from __future__ import annotations

import os
from collections import Counter
from dataclasses import asdict
from pathlib import Path

from ..evaluation.classification import SCORE_BATCH
from ..memory import DEFAULT_RESERVE, GPUS, GiB, MemoryEstimate, ModelSpec, Workload, estimate_memory
from ..topology import make_topology
from .dist import check_layout
from .options import TRAINS, RunOptions
from .rank import launch_rank
from .transport import parse_device_map


def model_config(opts: RunOptions, vocab_size: int):
    """The config of the model the run trains: the built-in tiny Llama's for this vocabulary, else
    the checkpoint's or config file's own (a local path), or a hub id's (from the cache or the hub)."""
    from transformers import AutoConfig

    from ..memory import load_config
    from ..models import tiny_config

    if opts.model == "tiny":
        return tiny_config(vocab_size)
    if Path(opts.model).exists():  # RunOptions expanded its ~
        return load_config(opts.model, trust_remote_code=opts.trust_remote_code)
    return AutoConfig.from_pretrained(opts.model, trust_remote_code=opts.trust_remote_code)


def estimate_run(options: dict, model_config, ds_config: dict, *, n_neighbors: int, loss_positions: int,
                 offload_keep: int | None = None, eval_batch: int = 0, eval_positions: int = 2) -> MemoryEstimate:
    """deca_ds.memory's estimate of a round's peak for a run with `options` (RunOptions as a dict,
    micro-batch resolved) on the model of `model_config` (a config, its path, or a ModelSpec);
    `eval_batch` > 0: rank 0's evaluation before training, that many sequences per forward with
    the LM head at `eval_positions` of each. A baseline's (`options["method"]`) is
    deca_ds.baseline_memory's for the method the run builds."""
    workload = Workload(working_dtype=options["working_dtype"], transfer_dtype=options["mix_dtype"],
                        n_neighbors=n_neighbors, micro_batch=options["micro_batch"], seq_len=options["max_seq_len"],
                        checkpointing="activation_checkpointing" in ds_config,
                        deepspeed_allreduce=options["ranks_per_client"] > 1, loss_positions=loss_positions,
                        loss_chunk=options["loss_chunk"], eval_batch=eval_batch, eval_positions=eval_positions)
    spec = ModelSpec.from_config(model_config, trust_remote_code=options["trust_remote_code"])
    if options["method"] != "deca":
        from ..baseline_memory import estimate_method

        # its default step budget (DECA's T·B·R on this model) does not change its memory
        run = RunOptions(**options)
        method = run.build_method(spec.partition(options["layers_per_block"], **run.trains()))
        return estimate_method(spec, method, workload)
    return estimate_memory(
        spec, options["layers_per_block"], workload, master_dtype=options["master_dtype"],
        offload=options["offload"], offload_keep=options["offload_keep"] if offload_keep is None else offload_keep,
        variant=options["variant"], state_bits=options["state_bits"], fused_update=options["fused_update"],
        steps_per_block=options["steps_per_block"], grad_accum=options["grad_accum"],
        **{name: options.get(name, False) for name in TRAINS})  # a run recorded before they existed: off


def offload_keep_for_budget(options: dict, model_config, ds_config: dict, *, n_neighbors: int,
                            loss_positions: int) -> int:
    """The most top decoder layers --offload frozen can keep resident within --offload-budget GB of
    estimated peak: a binary search, as every layer kept adds to the peak."""
    spec = ModelSpec.from_config(model_config, trust_remote_code=options["trust_remote_code"])
    budget = options["offload_budget"] * 1e9
    peak = lambda keep: estimate_run(options, spec, ds_config, n_neighbors=n_neighbors,  # noqa: E731
                                     loss_positions=loss_positions, offload_keep=keep).peak
    if peak(0) > budget:
        raise ValueError(f"--offload-budget {options['offload_budget']:g} GB: even with every frozen decoder layer "
                         f"offloaded the estimated peak is {peak(0) / 1e9:.2f} GB")
    fits, over = 0, spec.num_layers + 1  # peak(fits) <= budget; every keep >= over is past it
    while over - fits > 1:
        keep = (fits + over) // 2
        fits, over = (keep, over) if peak(keep) <= budget else (fits, keep)
    return fits


def estimate(opts: RunOptions, ds_config: dict) -> tuple[MemoryEstimate, dict]:
    """(the estimate of a round's peak block, what it was computed for)."""
    from ..models import check_positions
    from .plan import loss_positions_max
    from .task import build_task, own_clients, task_kind

    if opts.clients is None and "WORLD_SIZE" not in os.environ:  # a launcher's ranks make the clients, as in the run
        raise ValueError("--estimate: give --clients N, the run's number of clients (its neighbourhoods and so its "
                         "exchange buffers depend on it)")
    n_clients = opts.clients or check_layout(int(os.environ["WORLD_SIZE"]), opts.ranks_per_client, None)
    topology = make_topology(opts.topology, n_clients, weights=opts.weights, p=opts.er_p, seed=opts.topology_seed,
                             matrix_file=opts.matrix_file)
    neighbors = max(len(topology.neighbors(i)) for i in range(n_clients))
    task = build_task(opts, n_clients, own_clients(opts))
    config = model_config(opts, len(task.tokenizer))
    check_positions(config, opts.max_seq_len)  # a run the trainer refuses has no footprint to give
    spec = ModelSpec.from_config(config, trust_remote_code=opts.trust_remote_code)
    options, positions = asdict(opts), loss_positions_max(opts, task)
    if opts.offload_budget:
        options["offload_keep"] = offload_keep_for_budget(options, spec, ds_config, n_neighbors=neighbors,
                                                          loss_positions=positions)
    gpus = parse_device_map(opts.device_map)  # explicit: each rank on a shared GPU is another client's
    # rank 0 scores x̄ before a new run trains: SCORE_BATCH (prompt, label) sequences per forward
    scored = task_kind(opts) == "classification" and not opts.resume
    evaluation = {"eval_batch": SCORE_BATCH if scored else 0, "eval_positions": task.answer_tokens}
    setting = {"clients": n_clients, "neighbors": neighbors, "loss_positions": positions, **evaluation,
               "offload_keep": options["offload_keep"], "clients_per_gpu": max(Counter(gpus).values()) if gpus else 1}
    est = estimate_run(options, spec, ds_config, n_neighbors=neighbors, loss_positions=positions, **evaluation)
    if opts.method == "deca":
        setting["block"] = spec.partition(opts.layers_per_block, **opts.trains()).blocks[est.block].name
    return est, setting


def card_fits(opts: RunOptions, est: MemoryEstimate, clients_per_gpu: int = 1) -> dict[str, tuple[int, bool]]:
    """{card: (its memory, whether it holds the process's peak plus the reserve for the CUDA context
    and NCCL, that many times)} for the cards deca_ds.memory knows and --gpu-memory-gb's cap."""
    cards = dict(GPUS)
    if opts.gpu_memory_gb:
        cards[f"--gpu-memory-gb {opts.gpu_memory_gb:g}"] = int(opts.gpu_memory_gb * 1e9)
    need = clients_per_gpu * (est.process_peak + DEFAULT_RESERVE)
    return {name: (capacity, need <= capacity) for name, capacity in cards.items()}


def report(opts: RunOptions, est: MemoryEstimate, setting: dict) -> str:
    """The estimate as deca-train --estimate prints it: the setting, the terms, the phases (the
    largest is the peak), and the cards the process fits."""
    terms = [("weights", est.weights), ("offload buffers", est.offload_buffers),
             ("master, m, v", est.optimizer_state), ("gradient", est.grad), ("x½", est.x_half),
             ("exchange buffers", est.send_copy + est.recv + est.x_plus + est.grad_kept),
             ("activations (approx.)", est.activations), ("prefix cache", est.prefix_cache)]
    # the phases this run has: FrozenPrefix runs only offloaded, DeepSpeed's all-reduce only with G > 1
    absent = {name for name, runs in (("prefix", est.offload == "frozen"), ("grad_allreduce", est.grad_allreduce))
              if not runs}
    phases = [*(("setup: " + k, v) for k, v in est.setup_phases.items()),
              *((k, v) for k, v in est.phases.items() if k not in absent), ("end: consensus", est.end)]
    k = setting["clients_per_gpu"]
    fits = "; ".join(f"{name} ({capacity / GiB:.1f} GiB): {'yes' if fit else 'no'}"
                     for name, (capacity, fit) in card_fits(opts, est, k).items())
    offload = f"offload {opts.offload}" + (f", top {setting['offload_keep']} layer(s) kept" if opts.offload == "frozen"
                                           else "")
    if est.method == "deca":
        extra = [what for what, on in (("embeddings", opts.train_embeddings), ("final norm", opts.train_final_norm),
                                       ("LM head", opts.train_lm_head)) if on]
        trains = (f"{est.num_layers} decoder layers in {est.num_blocks - len(extra)} blocks"
                  + (f" and {len(extra)} more ({', '.join(extra)})" if extra else ""))
        where = f"; the peak block: {est.block} ({setting['block']})"
    else:
        trains, where = f"{est.method} training {est.block_params:,} parameters at every step", ""
    return "\n".join([
        f"one client's GPU memory, estimated (deca_ds.memory): {est.model}, {trains}, {est.working_dtype} weights, "
        f"{est.master_dtype} master, {offload}",
        f"{setting['clients']} client(s), at most {setting['neighbors']} neighbour(s) each; micro-batch "
        f"{opts.micro_batch} × {opts.max_seq_len} tokens, the LM head at {setting['loss_positions']} position(s)"
        + where,
        *(f"  {name:<24} {value / GiB:9.3f} GiB" for name, value in terms if value),
        *(f"  phase {name:<18} {value / GiB:9.3f} GiB" for name, value in phases),
        f"  {'peak of the process':<24} {est.process_peak / GiB:9.3f} GiB",
        (f"{k} clients on one GPU (--device-map), each with its own peak and " if k > 1 else "fits with ")
        + f"{DEFAULT_RESERVE / GiB:g} GiB more for the CUDA context and NCCL: {fits}",
    ])


def main(opts: RunOptions, ds_config: dict) -> None:
    est, setting = estimate(opts, ds_config)
    if launch_rank() == 0:  # under a launcher: one report, not one per rank
        print(report(opts, est, setting))
