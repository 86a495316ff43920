"""The training job behind launch/train.py: one DeepSpeed engine per rank, N clients, one method
(DECA's Algorithm 1 or a baseline) on the same data, graph, mixing, metrics and checkpoints.

Everything that can be wrong with the input is checked before the process group exists and
before anything is written, so a bad run fails on every rank with the same message and leaves
earlier outputs as they were.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import sys
import time
from contextlib import contextmanager
from dataclasses import asdict
from pathlib import Path

import psutil
import torch
import torch.distributed as dist
from tqdm import tqdm

from .. import __version__
from ..blocks import Partition, find_decoder_layers
from ..data import ClientStream
from ..datasets import write_partition_report
from ..decentralized import DecentralizedOptimizer
from ..methods import Method
from ..mixing import ClientView
from ..models import causal_lm_loss, check_plain_logits, enable_activation_checkpointing, load_model
from ..offload import FrozenLayerOffload, check_keep
from ..optimizer import block_schedule, model_partition
from ..prefix import FrozenPrefix
from ..topology import Topology, make_topology
from . import checkpoint as ckpt
from .dist import (ClientGroups, ClientLayout, DistributedMixer, Heartbeat, PeerError, all_mean_, check_layout,
                   init_process_group, local_device)
from .ds_engine import ClientMPU, initialize
from .metrics import MetricsWriter, plot_losses, read_metrics, summarize, summary_table
from .options import RunOptions, offload_keep_for_budget, parse_args
from .task import Task, build_task

_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp64": torch.float64}


def build_model(opts: RunOptions, vocab_size: int):
    # A random initialisation is drawn on the rank's device (on the CPU an 8B model takes minutes),
    # except with offloading, whose point is that the device never holds every layer.
    model = load_model(opts.model, dtype=_DTYPES[opts.working_dtype], trust_remote_code=opts.trust_remote_code,
                       from_config=opts.from_config, vocab_size=vocab_size, seed=opts.seed,
                       init_device=local_device() if opts.offload == "none" else "cpu")
    if opts.loss_chunk:
        check_plain_logits(model.config)
    return model


def next_shard(stream: ClientStream, layout: ClientLayout) -> dict:
    """Rank l of a client takes micro-batches l, l+G, l+2G, … of the client's stream, so the G
    ranks of a client see disjoint data and their averaged gradient is that of G micro-batches."""
    stream.position += layout.local_rank
    batch = next(stream)
    stream.position += layout.ranks_per_client - layout.local_rank - 1
    return batch


def upcoming_shards(stream: ClientStream, layout: ClientLayout, n: int) -> list[dict]:
    """The next `n` micro-batches next_shard will give, the stream left where it is."""
    state = stream.state_dict()
    shards = [next_shard(stream, layout) for _ in range(n)]
    stream.load_state_dict(state)
    return shards


def check_output_dir(opts: RunOptions) -> Path:
    out = Path(opts.output_dir)
    if (out / "run_config.json").exists() and not (opts.resume or opts.overwrite):
        raise ValueError(f"output directory {out} already holds a run; pass --resume to continue it "
                         "or --overwrite to replace it")
    if opts.resume and not (out / "run_config.json").exists():
        raise ValueError(f"--resume: {out} holds no run to continue")
    return out


def memory_now(device: torch.device) -> dict:
    """Device memory in use now and its peak so far (CUDA), or the process's resident set (CPU)."""
    if device.type == "cuda":
        return {"mem_allocated": torch.cuda.memory_allocated(device),
                "mem_peak": torch.cuda.max_memory_allocated(device)}
    return {"mem_rss": psutil.Process().memory_info().rss}


class Timer:
    """Wall-clock sections; on a GPU the device is synchronized so kernels are counted."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"

    def now(self) -> float:
        if self.cuda:
            torch.cuda.synchronize()
        return time.perf_counter()


def _resume_step(root: Path, layout: ClientLayout) -> int:
    mine = set(ckpt.complete_steps(root, layout.client, layout.ranks_per_client))
    everyone = [None] * layout.world_size
    dist.all_gather_object(everyone, sorted(mine))
    common = set.intersection(*(set(s) for s in everyone))
    if not common:
        raise ValueError(f"--resume: no checkpoint in {root / 'checkpoints'} is complete for every client")
    return max(common)


def _consensus_distance(x: torch.Tensor) -> float:
    mean = all_mean_(x.detach().clone())
    return torch.linalg.vector_norm(x - mean).item()


def to_consensus_(model, device: torch.device | None = None) -> float:
    """Replace this client's weights by x̄ = mean over clients (one all-reduce per tensor, in at
    least fp32 and on `device` - a weight in host memory goes there one tensor at a time - so no
    full-model buffer is ever allocated); return ‖x_i − x̄‖ of this client."""
    sq = 0.0
    with torch.no_grad():
        for p in model.parameters():
            x = p.detach().to(device=device or p.device, dtype=torch.promote_types(p.dtype, torch.float32),
                              copy=True)
            mean = all_mean_(x.clone())
            sq += x.sub_(mean).square_().sum().item()
            p.copy_(mean)
    return math.sqrt(sq)


@contextmanager
def consensus_weights(model):
    """Evaluate x̄ in the middle of training: the client's own weights wait in host memory and
    come back bit for bit (the optimizer's master copy is not touched)."""
    own = [p.detach().to("cpu", copy=True) for p in model.parameters()]
    to_consensus_(model)
    try:
        yield
    finally:
        with torch.no_grad():
            for p, saved in zip(model.parameters(), own):
                p.copy_(saved)


def factor_consensus_(optimizer) -> float:
    """x̄ of a method whose combination is not linear (DeCAF): its own combination of every
    client's vector with uniform weights (each client's G ranks hold the same vector; the frozen
    weights are the same everywhere). Returns ‖x_i − x̄‖ over the trainable vector."""
    x = optimizer.consensus_vector()
    gathered = [torch.empty_like(x) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, x)
    before = x.clone()
    optimizer.combine_now(ClientView([(1 / len(gathered), g) for g in gathered], x))
    return torch.linalg.vector_norm(before - x).item()


def export_consensus(model, optimizer, method: Method, out: Path, tokenizer, layout: ClientLayout,
                     opts: RunOptions, device: torch.device) -> tuple[float, object]:
    """Write the clients (optionally) and x̄ (rank 0, the method's format, unless --no-export);
    return ‖x_i − x̄‖ and the model to evaluate (x̄ itself)."""
    if opts.save_clients and layout.local_rank == 0:
        ckpt.save_hf_model(model, out / "clients" / f"client_{layout.client:03d}")
    distance = to_consensus_(model, device) if optimizer.linear else factor_consensus_(optimizer)
    if layout.rank == 0 and opts.export:
        model = method.save_consensus(model, out / "consensus", tokenizer)
    return distance, model


def loss_positions_max(opts: RunOptions, task: Task) -> int:
    """The most positions the LM head runs at per micro-batch (models.causal_lm_loss: the union of the
    rows' labelled positions)."""
    return min(opts.max_seq_len, opts.micro_batch * max(
        sum(label != -100 for label in f["labels"][1:]) for f in task.features))


def write_run_config(out: Path, opts: RunOptions, ds_config: dict, topology: Topology, partition: Partition,
                     layout: ClientLayout, task: Task, trainable: int) -> None:
    resolved = {
        "options": asdict(opts), "ds_config": ds_config, "topology": topology.to_dict(),
        "method": opts.method, "trainable_params": trainable,
        # the most positions the LM head runs at per micro-batch (models.causal_lm_loss)
        "loss_positions_max": loss_positions_max(opts, task),
        "blocks": [asdict(b) for b in partition.blocks], "frozen": list(partition.frozen),
        "world_size": layout.world_size, "n_clients": layout.n_clients,
        "client_sizes": [len(ix) for ix in task.client_indices],
        "split_keys": list(task.key_names), "split_histogram": task.key_histogram,
        "versions": {"deca_ds": __version__, "torch": torch.__version__, "python": sys.version.split()[0]},
    }
    ckpt.atomic_write(out / "run_config.json", lambda tmp: Path(tmp).write_text(json.dumps(resolved, indent=2)))
    write_partition_report(out / "partition", task.keys, task.client_indices, task.key_names)
    print(json.dumps({"options": asdict(opts), "ds_config": ds_config}, indent=2))
    print(topology.describe())
    print(partition.describe() if opts.method == "deca" else f"method {opts.method}: {trainable:,} trainable parameters")
    print("examples per client:", [len(ix) for ix in task.client_indices])


def train(opts: RunOptions, ds_config: dict) -> dict | None:
    # ---- everything that can fail on bad input, before any rank talks or writes --------------
    n_clients = check_layout(int(os.environ.get("WORLD_SIZE", "1")), opts.ranks_per_client, opts.clients)
    topology = make_topology(opts.topology, n_clients, weights=opts.weights, p=opts.er_p,
                             seed=opts.topology_seed, matrix_file=opts.matrix_file)
    task = build_task(opts, n_clients)
    model = build_model(opts, len(task.tokenizer))
    partition = model_partition(model, opts.deca_config())
    if opts.offload_budget:
        opts.offload_keep = offload_keep_for_budget(
            asdict(opts), model.config, ds_config, loss_positions=loss_positions_max(opts, task),
            n_neighbors=max(len(topology.neighbors(i)) for i in range(n_clients)))
        if int(os.environ.get("RANK", "0")) == 0:
            print(f"--offload-budget {opts.offload_budget:g} GB: keeping the top {opts.offload_keep} decoder layers "
                  "on the device")
    check_keep(len(find_decoder_layers(model)[1]), opts.offload_keep)
    method = opts.build_method(partition)
    model = method.prepare(model)
    trainable = method.num_trainable(model)
    out = check_output_dir(opts)

    # ---- the job ---------------------------------------------------------------------------
    rank, world_size, device, store = init_process_group(opts.timeout)
    layout = ClientLayout(rank, world_size, opts.ranks_per_client)
    heartbeat = Heartbeat(store, layout)
    groups = ClientGroups(layout, topology.W, opts.timeout)
    torch.manual_seed(opts.seed * 1_000_003 + rank)
    mixer = DistributedMixer(topology.W, layout, groups, timeout_s=opts.timeout,
                             transfer_dtype=_DTYPES[opts.working_dtype] if opts.mix_dtype == "working" else None)
    start, state = 0, None
    if opts.resume:  # the weights go into the model where it is now (host memory unless drawn on the device)
        start = _resume_step(out, layout)
        state = ckpt.load_client(out, start, layout.client, layout.local_rank, model, device)
    # Offloaded layers go to pinned host memory before the model moves, so the device never holds
    # them all; the first block the optimizer activates is made resident first.
    offload = FrozenLayerOffload(model, partition, device, mode=opts.offload, keep=opts.offload_keep,
                                 simulate_on_cpu=os.environ.get("DECA_OFFLOAD_ON_CPU") == "1")
    if offload.enabled:
        offload.activate(block_schedule(opts.deca_config(), partition.num_blocks, 0)[0])
    # On the device before the optimizer exists: the active block's master and moments are
    # created beside its parameters (DeepSpeed would move the module only afterwards).
    model.to(device)
    optimizer = method.optimizer(model, mixer)
    prefix = None
    if offload.enabled:
        optimizer.before_activate = offload.activate
        prefix = FrozenPrefix(model, partition, offload)
    if "activation_checkpointing" in ds_config:
        enable_activation_checkpointing(model)
    engine = initialize(model, optimizer, ds_config, ClientMPU(groups.client, layout.client_ranks, groups.single))
    stream = task.stream(opts, layout.client)
    lead = layout.local_rank == 0

    if opts.resume:
        optimizer.load_state_dict(state["optimizer"])
        stream.load_state_dict(state["rank"]["stream"])
        torch.set_rng_state(state["rank"]["torch_rng"])
        if "cuda_rng" in state["rank"]:  # dropout on a GPU draws from the device's generator
            torch.cuda.set_rng_state(state["rank"]["cuda_rng"].cpu())
        if rank == 0:
            print(f"resumed from step {start} of {optimizer.total_steps}")
    elif rank == 0:
        for stale in ("checkpoints", "metrics", "tensorboard", "consensus", "clients"):
            shutil.rmtree(out / stale, ignore_errors=True)  # --overwrite: nothing of the old run survives
        out.mkdir(parents=True, exist_ok=True)
        write_run_config(out, opts, ds_config, topology, partition, layout, task, trainable)
    dist.barrier()
    metrics = MetricsWriter(out, layout.client, resume_step=start, tensorboard=opts.tensorboard) if lead else None
    if rank == 0 and not opts.resume:
        before = task.evaluate(engine.module, opts.eval_limit or None)
        if before:
            print(f"accuracy before training: {before['accuracy']:.3f} (chance {before['chance']:.3f})")

    # The setup's peak (the first evaluation's batch, say) is logged apart (first record), not as
    # the training step's.
    setup = memory_now(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    timer = Timer(device)
    optimizer.clock = mixer.clock = timer.now
    bar = tqdm(total=optimizer.total_steps, initial=optimizer.global_step, disable=rank != 0,
               dynamic_ncols=True, desc=opts.method)
    last_step_s = 0.0
    while not optimizer.done:
        step, where = optimizer.global_step, optimizer.where()
        record = {"step": step, **where}
        step_start = time.perf_counter()
        sent, exchanged = mixer.total_bytes_sent, mixer.total_exchange_s
        streamed = offload.bytes_streamed if offload.enabled else 0
        try:
            heartbeat.beat(step)
            if opts.consensus_interval and step % opts.consensus_interval == 0:
                record["consensus_distance"] = _consensus_distance(optimizer.consensus_vector())
            t_fwd = t_bwd = t_step = t_prefix = 0.0
            if prefix is not None and prefix.enabled and (optimizer.step_in_block == 0 or step == start):
                # the layers below the block, once for the micro-batches of all its remaining steps
                t0 = timer.now()
                left = (optimizer.config.steps_per_block - optimizer.step_in_block) * opts.grad_accum
                prefix.fill(engine.module, optimizer.active.index,
                            [{k: v.to(device) for k, v in shard.items()} for shard in upcoming_shards(stream, layout, left)])
                t_prefix = timer.now() - t0
            losses = []
            for _ in range(opts.grad_accum):
                batch = {k: v.to(device) for k, v in next_shard(stream, layout).items()}
                if prefix is not None:
                    prefix.next(batch)
                t0 = timer.now()
                loss = causal_lm_loss(engine, batch, loss_chunk=opts.loss_chunk)
                t1 = timer.now()
                engine.backward(loss)
                t2 = timer.now()
                engine.step()  # DECA's step (mixing included) runs on the accumulation boundary only
                t3 = timer.now()
                t_fwd, t_bwd, t_step = t_fwd + t1 - t0, t_bwd + t2 - t1, t_step + t3 - t2
                losses.append(loss.item())
            if prefix is not None and not prefix.pending:
                prefix.clear()  # the block is done: its layers compute again
            # on the device: NCCL reduces GPU tensors only
            loss_t = torch.tensor(sum(losses) / len(losses), dtype=torch.float64, device=device)
            if layout.ranks_per_client > 1:
                dist.all_reduce(loss_t, group=groups.client)
                loss_t /= layout.ranks_per_client
            t_exchange = mixer.total_exchange_s - exchanged
            record.update(loss=loss_t.item(), t_forward=t_fwd, t_backward=t_bwd, t_mix_update=t_step,
                          t_local_update=optimizer.last_times["local_update"], t_exchange=t_exchange,
                          t_aggregate=optimizer.last_times["combine"] - t_exchange,
                          bytes_sent=mixer.total_bytes_sent - sent, **memory_now(device))
            if offload.enabled:
                # the first step of a block also runs the layers below it for all the block's steps
                record.update(t_prefix=t_prefix, bytes_streamed=offload.bytes_streamed - streamed)
            if opts.eval_interval and (step + 1) % opts.eval_interval == 0:
                record.update(evaluate_during_training(engine.module, task, opts, layout))
            if step == start:
                record["mem_setup_peak"] = setup.get("mem_peak", setup.get("mem_rss"))
            if metrics:
                metrics.write(record)
            bar.set_postfix(**where, loss=f"{record['loss']:.4f}")
            bar.update(1)
            if opts.checkpoint_interval and (step + 1) % opts.checkpoint_interval == 0 and not optimizer.done:
                with offload.host_weights():
                    save_checkpoint(out, step + 1, layout, engine.module, optimizer, stream, opts.keep_checkpoints)
            last_step_s = time.perf_counter() - step_start
        except RuntimeError as err:  # PeerError from mixing, or a collective that lost a rank
            # Live ranks post a step (or their own failure) within a few step times.
            grace = min(opts.timeout, max(3.0, 3 * last_step_s))
            raise PeerError(f"rank {rank} (client {layout.client}) failed at step {step} (round {where['round']}, "
                            f"block {where['block']}, r {where['r']}): {err}; "
                            f"{heartbeat.silent_ranks(step, grace)}") from err
    bar.close()

    if metrics:
        metrics.close()
    with offload.host_weights():  # offloaded layers are averaged and exported from host memory
        distance, final_model = export_consensus(engine.module, optimizer, method, out, task.tokenizer, layout,
                                                 opts, device)
    distances = [None] * world_size
    dist.all_gather_object(distances, distance)
    result = None
    if rank == 0:
        result = final_report(out, final_model, task, opts, layout, distances[::layout.ranks_per_client])
    dist.barrier()
    dist.destroy_process_group()
    return result


def evaluate_during_training(model, task: Task, opts: RunOptions, layout: ClientLayout) -> dict:
    """Metrics of x̄ (scored on rank 0, logged by every client) and, with --eval-clients, of each
    client's own model. Every rank takes part: forming x̄ is collective."""
    limit = opts.eval_limit or None
    result = [None]
    with consensus_weights(model):
        if layout.rank == 0:
            result[0] = task.evaluate(model, limit)
        dist.broadcast_object_list(result, src=0)
    record = {f"eval_consensus_{k}": v for k, v in result[0].items()}
    if opts.eval_clients and layout.local_rank == 0:
        record.update({f"eval_client_{k}": v for k, v in task.evaluate(model, limit).items()})
    return record


def save_checkpoint(out: Path, step: int, layout: ClientLayout, model, optimizer: DecentralizedOptimizer,
                    stream: ClientStream, keep: int) -> None:
    lead = layout.local_rank == 0
    ckpt.save_client(out, step, layout.client, layout.local_rank,
                     model=model if lead else None, optimizer_state=optimizer.state_dict() if lead else None,
                     rank_state={"step": step, "stream": stream.state_dict(), "torch_rng": torch.get_rng_state(),
                                 **({"cuda_rng": torch.cuda.get_rng_state()} if torch.cuda.is_available() else {})})
    dist.barrier()  # every client has `step` before anyone drops an older one
    if lead:
        done = ckpt.complete_steps(out, layout.client, layout.ranks_per_client)
        ckpt.prune(out, layout.client, done[-keep:])


def final_report(out: Path, model, task: Task, opts: RunOptions, layout: ClientLayout,
                 distances: list[float]) -> dict:
    records = read_metrics(out, layout.n_clients)
    summary = summarize(records)
    evaluation = task.evaluate(model, opts.eval_limit or None)
    summary.update(consensus_eval=evaluation, final_consensus_distance=distances,
                   bytes_sent_total=sum(c["bytes_sent"] for c in summary["clients"]))
    plot_losses(records, out / "loss_curve.png", title=opts.method)
    table = summary_table(summary)
    (out / "summary.md").write_text(table)
    ckpt.atomic_write(out / "summary.json", lambda tmp: Path(tmp).write_text(json.dumps(summary, indent=2)))
    c = summary["clients"]
    print("\n" + table)
    print(f"loss (mean over clients): start {sum(x['loss_start'] for x in c) / len(c):.4f} -> "
          f"end {sum(x['loss_end'] for x in c) / len(c):.4f}")
    if evaluation:
        print(f"consensus model: accuracy {evaluation['accuracy']:.3f} (chance {evaluation['chance']:.3f}), "
              f"macro-F1 {evaluation['macro_f1']:.3f} on {evaluation['n']} held-out examples")
    print("final consensus distance ||x_i - x̄|| per client: " + ", ".join(f"{d:.4g}" for d in distances))
    print(f"bytes sent (all clients): {summary['bytes_sent_total'] / 1e6:.2f} MB")
    print(f"step time split (mean over clients): forward {sum(x['forward_ms'] for x in c) / len(c):.1f} ms, "
          f"backward {sum(x['backward_ms'] for x in c) / len(c):.1f} ms, "
          f"mixing+update {sum(x['mix_update_ms'] for x in c) / len(c):.2f} ms")
    print(f"outputs: {out} (consensus/, metrics/, loss_curve.png, summary.json)")
    return summary


def main(argv: list[str] | None = None) -> None:
    rank = os.environ.get("RANK", "0")
    try:
        opts, ds_config = parse_args(argv)
        train(opts, ds_config)
    except (ValueError, PeerError) as err:
        print(f"[rank {rank}] error: {err}", file=sys.stderr, flush=True)
        sys.exit(1)
