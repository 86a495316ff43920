"""The training job behind deca-train (deca_ds/train.py): one DeepSpeed engine per rank, N clients, one method
(DECA's Algorithm 1 or a baseline) on the same data, graph, mixing, metrics and checkpoints.

Everything that can be wrong with the input is checked first (plan.py), before the process group
exists and before anything is written, so a bad run fails on every rank with the same message and
leaves earlier outputs as they were; rank 0 writes the summary at the end (report.py).
"""

from __future__ import annotations

import math
import os
import socket
import time
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import torch
import torch.distributed as dist

from ..data import ClientStream
from ..decentralized import DecentralizedOptimizer
from ..finite import MAX_CONSECUTIVE_SKIPS, finite, nonfinite_problem
from ..methods import Method
from ..models import causal_lm_loss, compile_layers, enable_activation_checkpointing
from ..offload import FrozenLayerOffload
from ..optimizer import block_schedule
from ..prefix import FrozenPrefix
from ..rng import client_seed, random_state, restore_random_state
from . import checkpoint as ckpt
from . import cleanup, lr_schedule, outputs
from .allocated import DeviceMemory, TensorBytes, counting, cpu_counter
from .consensus import consensus_distance, consensus_weights, export_consensus
from .dist import ClientGroups, ClientLayout, DistributedMixer, Heartbeat, PeerError, answered_within, host_staging
from .ds_engine import ClientMPU, initialize
from .metrics import MetricsWriter
from .nonfinite import (
    NonFiniteError,
    describe_nonfinite,
    nonfinite_ranks,
    skipped_update,
    stop_if_nonfinite,
    update_finite,
)
from .options import RunOptions
from .plan import Plan, plan_run, write_run_config
from .progress import Progress
from .rank import init_process_group, launch_local_rank, launch_rank, local_device, to_device
from .report import answer_questions, final_report, gather_metrics
from .same_start import check_same_start
from .task import Task, share_counts
from .timing import DeviceTime, Timer
from .trace import StepTrace


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


def _resume_step(root: Path, layout: ClientLayout, resume: bool, auto: bool) -> int | None:
    """The newest step every client's checkpoint verifies for, each skipped newer step named with
    why; None to start the run (--auto-resume where no node holds it, or it wrote no checkpoint yet).
    `resume`: whether this node holds the run to resume."""
    mine, problems = ckpt.scan_steps(root, layout.client, layout.ranks_per_client) if resume else ([], {})
    everyone = [None] * layout.world_size
    dist.all_gather_object(everyone, (resume, socket.gethostname(), mine, problems))
    holds, hosts, steps, why = (list(column) for column in zip(*everyone))
    choose = partial(ckpt.choose_auto_start, holds, hosts, root=root) if auto else ckpt.choose_resume_step
    start, lines = choose(steps, why, layout.ranks_per_client)
    if layout.rank == 0:
        for line in lines:
            print(f"--{'auto-' if auto else ''}resume: {line}", flush=True)
    return start


@contextmanager
def frozen(model):
    """The model with no trainable parameter while it is scored before the optimizer exists: the
    optimizer has not chosen what trains yet, so offloading streams every layer as a frozen one.
    The flags come back as they were."""
    trainable = [p for p in model.parameters() if p.requires_grad]
    for p in trainable:
        p.requires_grad_(False)
    try:
        yield model
    finally:
        for p in trainable:
            p.requires_grad_(True)


def at_step(step: int, where: dict) -> str:
    """Where a message happened: "step 7 (round 0, block 2, r 1)"."""
    return f"step {step} (round {where['round']}, block {where['block']}, r {where['r']})"


def train(opts: RunOptions, ds_config: dict) -> dict | None:
    """The whole run on this rank: the plan (nothing talks or writes before it is checked), the job
    set up, its steps, then the consensus and the summary (or, at --time-limit, a checkpoint). Rank
    0 holds the output directory throughout (outputs.hold). A CPU rank counts its tensor memory from
    the start when asked (DECA_COUNT_CPU_MEMORY=1, runtime.allocated)."""
    started = time.monotonic()  # --time-limit counts the set-up too, as a scheduler's limit does
    counter = cpu_counter(local_device(opts.device_map))
    held = outputs.hold(Path(opts.output_dir)) if launch_rank() == 0 else nullcontext()
    with counting(counter), held:
        job = start_job(opts, ds_config, plan_run(opts, ds_config), counter)
        job.deadline = started + 60 * opts.time_limit if opts.time_limit else None
        while not job.optimizer.done and not job.stopped:
            job.step()
        return job.finish() if job.optimizer.done else job.stop()


def start_job(opts: RunOptions, ds_config: dict, plan: Plan, counter: TensorBytes | None = None) -> Job:
    """This rank's part of the run set up: process group, mixer, the resumed state, the model on
    its device (offloaded layers in host memory), the optimizer and DeepSpeed's engine, the run's
    files claimed and written. `counter`: this CPU rank's count of tensor memory, if it keeps one."""
    model, partition, out, laps = plan.model, plan.partition, plan.out, plan.laps
    laps("checks")
    rank, world_size, device, store = init_process_group(opts.timeout, plan.placement["transport"], opts.device_map)
    layout = ClientLayout(rank, world_size, opts.ranks_per_client)
    check_same_start(plan.fingerprint, layout)
    task = share_counts(plan.task, layout)
    heartbeat = Heartbeat(store, layout)
    groups = ClientGroups(layout, plan.topology.W, opts.timeout,
                          client_backend="nccl" if device.type == "cuda" and layout.ranks_per_client > 1 else None)
    torch.manual_seed(client_seed(opts.seed, rank))  # what the simulator's ClientGenerators seed
    mixer = DistributedMixer(plan.topology.W, layout, groups, timeout_s=opts.timeout,
                             transfer_dtype=opts.transfer_dtype(),
                             staging=host_staging(device))
    placement = {**plan.placement, "host_staging": mixer.staging is not None}
    laps("process group")
    start, state = 0, None
    resume = plan.resume_changes is not None
    if resume or opts.auto_resume:  # every rank, so that they agree
        start = _resume_step(out, layout, resume, opts.auto_resume)
        resume = start is not None
    if resume:  # the weights go into the model where it is now (host memory unless drawn on the device)
        state = ckpt.load_client(out, start, layout.client, layout.local_rank, model, device)
        laps("checkpoint")
    start = start or 0
    # Offloaded layers go to pinned host memory before the model moves, so the device never holds
    # them all; the first block the optimizer activates is made resident first.
    offload = FrozenLayerOffload(model, partition, device, mode=opts.offload, keep=opts.offload_keep,
                                 simulate_on_cpu=os.environ.get("DECA_OFFLOAD_ON_CPU") == "1")
    first_block = block_schedule(opts.deca_config(), partition.num_blocks, 0)[0]
    if offload.enabled:
        offload.activate(first_block)
        laps("offload to host memory")
    # On the device before the optimizer exists: the active block's master and moments are
    # created beside its parameters (DeepSpeed would move the module only afterwards).
    model.to(device)
    laps("to the device")
    # x̄ before training, scored before the first block's master, m and v exist, so the evaluation's
    # forward and that state are never on the device together (the setup peak stays below training's).
    # Client 0's first record keeps it, so a resumed run's summary has it too.
    before = None
    if rank == 0 and not resume:
        with frozen(model):
            before = task.evaluate(model, opts.eval_limit or None)
        if before:
            print(f"accuracy before training: {before['accuracy']:.3f} (chance {before['chance']:.3f})")
        laps("evaluation")
    # Its first activation puts back the layers rank 0's evaluation streamed last, so every rank's
    # module looks alike to DeepSpeed's broadcast.
    optimizer = plan.method.optimizer(model, mixer, before_activate=offload.activate if offload.enabled else None)
    # stopped by the launcher (another rank failed): name who went silent before exiting
    cleanup.set_board((lambda: heartbeat.silent_ranks(optimizer.global_step, 1.0)) if world_size > 1 else None,
                      heartbeat.wait_for_readers)
    prefix = FrozenPrefix(model, partition, offload) if offload.enabled else None
    if "activation_checkpointing" in ds_config:
        enable_activation_checkpointing(model)
    if opts.compile_layers:
        compile_layers(model)
    engine = initialize(model, optimizer, ds_config, ClientMPU(groups.client, layout.client_ranks, groups.single),
                        device)
    laps("optimizer and DeepSpeed")
    stream = task.stream(opts, layout.client)

    if resume:
        if engine.lr_scheduler is not None:  # where the preset's schedule was, or it would start over
            lr_schedule.go_to(engine.lr_scheduler, start)
        optimizer.load_state_dict(state["optimizer"])
        stream.load_state_dict(state["rank"]["stream"])
        restore_random_state(state["rank"])
        if rank == 0:
            print(f"resumed from step {start} of {optimizer.total_steps}")
    if node_lead():
        # Every node's first rank, as nodes need not share a file system: the run_config.json
        # there is what --resume looks for on that node (same content everywhere, written atomically).
        outputs.claim(out, resume=resume)
        if resume:
            outputs.record_resume(out, plan.resume_changes)
        else:
            write_run_config(out, opts, ds_config, plan.topology, partition, layout, task, plan.trainable, placement,
                             model.config._attn_implementation)
    if rank == 0:  # stopped by SIGTERM (a time limit, a scheduler): where a new run would go on from
        cleanup.set_resume(partial(ckpt.resume_note, out, layout.client, layout.ranks_per_client,
                                   opts.checkpoint_interval, auto=opts.auto_resume))
    dist.barrier()
    metrics = (MetricsWriter(out, layout.client, resume_step=start, tensorboard=opts.tensorboard)
               if layout.local_rank == 0 else None)

    # The setup's peak (the first evaluation's batch, say) is logged apart (first record), not as
    # the training step's.
    memory = DeviceMemory(device, counter)
    setup = memory.now()
    memory.reset_peak()
    laps("outputs")
    if rank == 0:
        print(laps, flush=True)
    timer = Timer(memory, opts.phase_timing)
    optimizer.clock = mixer.clock = timer.now
    progress = Progress(optimizer.total_steps, optimizer.global_step, opts.method, show=rank == 0)
    return Job(opts, layout, device, groups, heartbeat, mixer, offload, prefix, optimizer, engine, stream, task,
               plan.method, out, placement, metrics, timer, progress, start=start, before=before,
               setup_peak=setup.get("mem_peak", setup.get("mem_rss")),
               trace=StepTrace(out, rank, opts.trace_start, opts.trace_steps, device.type == "cuda"),
               skipped=state["rank"].get("nonfinite_skipped", 0) if state else 0)


@dataclass
class Job:
    """One rank's part of a run once set up (start_job): step() until the optimizer is done, then finish()."""

    opts: RunOptions
    layout: ClientLayout
    device: torch.device
    groups: ClientGroups
    heartbeat: Heartbeat
    mixer: DistributedMixer
    offload: FrozenLayerOffload
    prefix: FrozenPrefix | None
    optimizer: DecentralizedOptimizer
    engine: object  # DeepSpeed's engine around the model and the optimizer
    stream: ClientStream
    task: Task
    method: Method
    out: Path
    placement: dict
    metrics: MetricsWriter | None  # a client's first rank writes its records
    timer: Timer
    progress: Progress
    start: int  # the step the run started (or resumed) at
    before: dict | None  # x̄ scored before training (rank 0, a new run)
    setup_peak: int | None  # bytes the setup peaked at, logged with the first step
    trace: StepTrace  # --trace-steps (off: every call a no-op)
    skipped: int = 0  # --skip-nonfinite: steps skipped over the whole run
    consecutive: int = 0  # ... and in a row up to now
    last_step_s: float = 0.0
    deadline: float | None = None  # --time-limit, by rank 0's time.monotonic()
    stopped: bool = False  # ... reached: the run's checkpoint is written, its end is not
    saved_at: int | None = None  # the step of the newest checkpoint this run wrote

    def step(self) -> None:
        """One step of the schedule: every micro-batch's forward and backward, the optimizer's step
        (mixing included) on the last, then the step's record, and a checkpoint when one is due. A
        collective that fails (a rank lost) stops the rank naming the ranks that went silent."""
        step, where = self.optimizer.global_step, self.optimizer.where()
        self.trace.at_step(step)
        step_start = time.perf_counter()
        try:
            if self._step(step, where, step_start):
                self.last_step_s = time.perf_counter() - step_start
            if self.deadline is not None and not self.optimizer.done and self._time_is_up():
                self._save(self.optimizer.global_step)
                self.stopped = True
        except RuntimeError as err:  # PeerError from mixing, or a collective that lost a rank
            # Live ranks post a step (or their own failure) within a few step times.
            grace = min(self.opts.timeout, max(3.0, 3 * self.last_step_s))
            raise PeerError(f"rank {self.layout.rank} (client {self.layout.client}) failed at {at_step(step, where)}: "
                            f"{err}; {self.heartbeat.silent_ranks(step, grace)}") from err

    def _step(self, step: int, where: dict, start: float) -> bool:
        """step()'s work, begun at `start` (time.perf_counter()); False when --skip-nonfinite skipped it."""
        opts, optimizer, mixer, offload, layout = self.opts, self.optimizer, self.mixer, self.offload, self.layout
        record = {"step": step, **where, "lr": optimizer.lr}  # the lr this step uses, before a schedule's step
        sent, exchanged = mixer.total_bytes_sent, mixer.total_exchange_s
        streamed = offload.bytes_streamed if offload.enabled else 0
        self.heartbeat.beat(step)
        if opts.consensus_interval and step % opts.consensus_interval == 0:
            with answered_within(opts.timeout, "the consensus distance (an all-gather of every rank)"):
                record["consensus_distance"] = consensus_distance(optimizer.consensus_vector())
        t_prefix = self._fill_prefix(step)
        losses, bad, times = self._micro_batches()
        if bad:
            self._skip(step, where, bad)
            return False
        self.consecutive = 0
        if self.prefix is not None and not self.prefix.pending:
            self.prefix.clear()  # the block is done: its layers compute again
        with answered_within(opts.timeout, "the client's loss (an all-reduce of its ranks)"):
            loss = self._client_loss(losses)
        problem = 1 if not math.isfinite(loss) else 0 if update_finite(optimizer) else 2
        stop_if_nonfinite(problem, layout, self.device, f"at {at_step(step, where)}", opts.timeout)
        t_exchange = mixer.total_exchange_s - exchanged
        times.update(t_local_update=optimizer.last_times["local_update"], t_exchange=t_exchange,
                     t_aggregate=optimizer.last_times["combine"] - t_exchange)
        # the step's checks above waited for the device: --phase-timing events' times read at once
        record.update(loss=loss, **{key: float(t) for key, t in times.items()},
                      bytes_sent=mixer.total_bytes_sent - sent, **self.timer.memory())
        if offload.enabled:
            # the first step of a block also runs the layers below it for all the block's steps
            record.update(t_prefix=float(t_prefix), bytes_streamed=offload.bytes_streamed - streamed)
        if opts.eval_interval and (step + 1) % opts.eval_interval == 0:
            record.update(evaluate_during_training(self.engine.module, optimizer, self.task, opts, layout))
        if self.skipped:
            record["nonfinite_skipped"] = self.skipped
        if step == self.start:
            record["mem_setup_peak"] = self.setup_peak
        if step == 0 and self.before:
            record.update({f"eval_initial_{k}": v for k, v in self.before.items()})
        record["t_step"] = time.perf_counter() - start  # the step's wall time here: phases, checks, record
        if self.metrics:
            self.metrics.write(record)
        self.progress.update(where, loss, None if optimizer.done else optimizer.where())
        # the last step's too: a run whose end fails (x̄, its export, its evaluation) resumes straight to it
        if opts.checkpoint_interval and ((step + 1) % opts.checkpoint_interval == 0 or optimizer.done):
            self._save(step + 1)
        return True

    def _save(self, step: int) -> None:
        """The checkpoint of `step` (the steps before it done), unless this run has written it."""
        if step != self.saved_at:
            with self.offload.host_weights():
                save_checkpoint(self.out, step, self.layout, self.engine.module, self.optimizer, self.stream,
                                self.opts.keep_checkpoints, self.skipped)
            self.saved_at = step

    def _time_is_up(self) -> bool:
        """--time-limit: whether one more step, as long as the last, would end past it, by rank 0's
        clock, which every rank learns (one all-reduce a step), so that all stop at the same step."""
        up = torch.zeros(1, dtype=torch.float64, device=self.device)
        if self.layout.rank == 0:
            up[0] = time.monotonic() + self.last_step_s >= self.deadline
        with answered_within(self.opts.timeout, "the time limit's check (an all-reduce of every rank)"):
            dist.all_reduce(up)
        return bool(up.item())

    def stop(self) -> None:
        """--time-limit reached: the checkpoint is written (step()); the outputs closed, the process
        group left, the consensus, its export and the summary left to the run that goes on."""
        self.trace.close()
        self.progress.close()
        if self.metrics:
            self.metrics.close()
        step = self.optimizer.global_step
        if self.layout.rank == 0:
            print(f"--time-limit {self.opts.time_limit:g} min: stopped after step {step} of "
                  f"{self.optimizer.total_steps}, its checkpoint written ({ckpt.step_dir(self.out, step)}); the "
                  f"same command{'' if self.opts.auto_resume else ' with --resume'} goes on from it",
                  flush=True)
        dist.barrier()
        dist.destroy_process_group()

    def _fill_prefix(self, step: int) -> float | DeviceTime:
        """With offloaded layers, at a block's first step (or the first after resuming): the layers
        below the block, run once for the micro-batches of all its remaining steps. Its seconds."""
        prefix, optimizer = self.prefix, self.optimizer
        if prefix is None or not prefix.enabled or not (optimizer.step_in_block == 0 or step == self.start):
            return 0.0
        t0 = self.timer.mark()
        left = (optimizer.config.steps_per_block - optimizer.step_in_block) * self.opts.grad_accum
        shards = upcoming_shards(self.stream, self.layout, left)
        prefix.fill(self.engine.module, optimizer.active.index,
                    [to_device(shard, self.device) for shard in shards])
        return self.timer.mark("prefix") - t0

    def _micro_batches(self) -> tuple[list[float], dict[int, int], dict[str, float | DeviceTime]]:
        """Forward and backward of each micro-batch; DeepSpeed runs the optimizer's step (mixing
        included) on the last. The losses, the ranks with a non-finite loss or gradient
        (--skip-nonfinite: then no rank updates) and the phases' seconds."""
        engine, timer = self.engine, self.timer
        losses, bad, times = [], {}, dict.fromkeys(("t_forward", "t_backward", "t_mix_update"), 0.0)
        for micro in range(self.opts.grad_accum):
            batch = to_device(next_shard(self.stream, self.layout), self.device)
            if self.prefix is not None:
                self.prefix.next(batch)
            t0 = timer.mark()
            with self.trace.phase("forward"):
                loss = causal_lm_loss(engine, batch, loss_chunk=self.opts.loss_chunk)
            t1 = timer.mark("forward")
            with self.trace.phase("backward"):
                engine.backward(loss)
            t2 = timer.mark("backward")
            losses.append(loss.detach())  # read after the step: reading it now would wait for the backward
            if self.opts.skip_nonfinite and micro == self.opts.grad_accum - 1:  # all ranks skip together, or none
                problem = nonfinite_problem([x.item() for x in losses], engine.module)
                bad = nonfinite_ranks(problem, self.layout, self.device, self.opts.timeout)
            with skipped_update(self.optimizer, bool(bad)), self.trace.phase("step"):
                engine.step()  # DECA's step (mixing included) runs on the accumulation boundary only
            t3 = timer.mark("step")
            for key, t in zip(times, (t1 - t0, t2 - t1, t3 - t2)):
                times[key] += t
        return [x.item() for x in losses], bad, times

    def _skip(self, step: int, where: dict, bad: dict[int, int]) -> None:
        self.skipped, self.consecutive = self.skipped + 1, self.consecutive + 1
        if self.layout.rank == 0:
            print(f"--skip-nonfinite: skipped step {step} (round {where['round']}, block {where['block']}): "
                  f"{describe_nonfinite(bad, self.layout)}; {self.skipped} skipped so far", flush=True)
        if self.consecutive > MAX_CONSECUTIVE_SKIPS:
            raise NonFiniteError(f"{self.consecutive} consecutive steps non-finite up to step {step}: the run "
                                 "has diverged; every rank stops and nothing is exported (a smaller --lr)")

    def _client_loss(self, losses: list[float]) -> float:
        """The client's loss of this step: the mean over its micro-batches and its G ranks."""
        # on the device: NCCL reduces GPU tensors only
        loss = torch.tensor(sum(losses) / len(losses), dtype=torch.float64, device=self.device)
        if self.layout.ranks_per_client > 1:
            dist.all_reduce(loss, group=self.groups.client)
            loss /= self.layout.ranks_per_client
        return loss.item()

    def finish(self) -> dict | None:
        """After the last step: refuse non-finite weights, export the consensus model, and on rank 0
        the summary of every client's metrics (returned; None on other ranks)."""
        layout, offload, engine, memory = self.layout, self.offload, self.engine, self.timer.device_memory
        self.trace.close()  # a trace to the last step ends here
        self.progress.close()
        if self.metrics:
            self.metrics.close()
        memory.reset_peak()  # the whole process's peak is the setup's, the steps' or this phase's
        with offload.host_weights():
            weights_finite = all(finite(p) for p in engine.module.parameters())
        stop_if_nonfinite(0 if weights_finite else 3, layout, self.device, "after the last step", self.opts.timeout)
        with offload.host_weights():  # offloaded layers are averaged and exported from host memory
            distance, final_model = export_consensus(engine.module, self.optimizer, self.method, self.out,
                                                     self.task.tokenizer, layout, self.opts, self.device)
        ends = [None] * layout.world_size  # each rank's distance and, where counted, this phase's peak
        dist.all_gather_object(ends, (distance, memory.peak() if memory.counted else None))
        records = gather_metrics(self.out, layout)
        result = None
        if layout.rank == 0:
            clients = ends[::layout.ranks_per_client]
            result = final_report(self.out, final_model, self.task, self.opts, records, [d for d, _ in clients],
                                  self.placement, [peak for _, peak in clients], memory)
        dist.barrier()
        dist.destroy_process_group()
        if result is not None and self.opts.questions:  # minutes of generation: no other rank waits for it
            answer_questions(self.out, final_model, self.task, self.opts, result)
        return result


def evaluate_during_training(model, optimizer: DecentralizedOptimizer, task: Task, opts: RunOptions,
                             layout: ClientLayout) -> dict:
    """Metrics of x̄ (scored on rank 0, logged by every client) and, with --eval-clients, of each
    client's own model. Every rank takes part: forming x̄ is collective."""
    limit = opts.eval_limit or None
    result = [None]
    with consensus_weights(model, optimizer):
        if layout.rank == 0:
            result[0] = task.evaluate(model, limit)
        dist.broadcast_object_list(result, src=0)
    record = {f"eval_consensus_{k}": v for k, v in result[0].items()}
    if opts.eval_clients and layout.local_rank == 0:
        record.update({f"eval_client_{k}": v for k, v in task.evaluate(model, limit).items()})
    return record


def save_checkpoint(out: Path, step: int, layout: ClientLayout, model, optimizer: DecentralizedOptimizer,
                    stream: ClientStream, keep: int, nonfinite_skipped: int = 0) -> None:
    lead = layout.local_rank == 0
    ckpt.save_client(out, step, layout.client, layout.local_rank,
                     model=model if lead else None, optimizer_state=optimizer.state_dict() if lead else None,
                     rank_state={"step": step, "stream": stream.state_dict(), "nonfinite_skipped": nonfinite_skipped,
                                 **random_state()})
    dist.barrier()  # every client has `step` before anyone drops an older one
    if lead:
        done = ckpt.complete_steps(out, layout.client, layout.ranks_per_client, hashes=False)  # sizes only: cheap
        ckpt.prune(out, layout.client, done[-keep:])
    else:
        ckpt.prune_rank(out, layout.client, layout.local_rank, keep)


def node_lead() -> bool:
    """Whether this rank is its node's first (it writes the node's copy of the run's files)."""
    return launch_local_rank() == 0


