"""The simulate backend's child process: one cell's N clients in this process through
deca_ds.simulate, then the consensus model x̄ evaluated, into the cell directory cells.py prepared.

    python -m deca_ds.reproduce.simulated CELL_DIR    # what cells.run_grid starts for each simulated cell

With `checkpoint_interval` it writes checkpoint.pt (every client's model and optimizer, the data
streams' positions and each client's random state) and then checkpoint.json; a cell started again
goes on from there to the same bits.
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from dataclasses import asdict
from pathlib import Path

import torch

from ..evaluation import answer_sets
from ..files import atomic_write, write_json, write_text
from ..mixing import ClientView
from ..models import compile_layers
from ..optimizer import model_partition
from ..reporting import commit, cpu_kernels
from ..rng import ClientGenerators
from ..runtime import lr_schedule
from ..runtime.options import RunOptions
from ..runtime.plan import build_model
from ..runtime.progress import Progress
from ..runtime.rank import local_device, to_device
from ..runtime.task import build_task
from ..simulate import simulate
from ..topology import make_topology
from .cell_dir import (
    CELL,
    CHECKPOINT,
    CHECKPOINT_META,
    METRICS,
    RNG,
    RUN_CONFIG,
    finish,
    read_json,
    simulated_checkpoint,
)
from .generation import ANSWERS


class Recording:
    """A method that remembers the client models and optimizers simulate() builds from it, compiles
    each client's decoder layers where the cell asks (`compile_layers`, as deca-train does), gives
    each optimizer the preset's LR schedule as DeepSpeed's engine does a rank's (`schedule`; step()
    steps them once a step) and, resuming, each client its checkpointed weights, optimizer state
    and schedule's place."""

    def __init__(self, method, saved: dict | None = None, *, compiled: bool = False,
                 schedule: dict | None = None) -> None:
        self.method, self.models, self.optimizers, self.saved = method, [], [], saved
        self.compiled, self.schedule, self.schedules = compiled, schedule, []

    def prepare(self, model):
        model = self.method.prepare(model)
        if self.compiled:
            compile_layers(model)
        self.models.append(model)
        return model

    def optimizer(self, model, mixer=None):
        i, saved = len(self.optimizers), self.saved
        if saved:
            model.load_state_dict(saved["models"][i])
        opt = self.method.optimizer(model, mixer)
        self.optimizers.append(opt)
        if self.schedule:
            self.schedules.append(lr_schedule.build(opt, self.schedule))
            if saved:  # before the optimizer's state: a torch schedule steps from its first lr
                lr_schedule.go_to(self.schedules[-1], saved["step"])
        if saved:
            opt.load_state_dict(saved["optimizers"][i])
            if i == len(saved["models"]) - 1:  # simulate() builds the last client just before its first step
                self.saved = None  # the clients hold their own copies now
        return opt

    def step(self) -> None:
        """After every client's step: each schedule's step (DeepSpeed's engine steps a rank's then)."""
        lr_schedule.step(self.schedules)


def save_checkpoint(d: Path, step: int, recording: Recording, streams: list, generators, wall_s: float,
                    skipped: int) -> None:
    """The cell after `step` steps (and `skipped` non-finite ones), replacing the previous checkpoint; a
    stop while it is written leaves no checkpoint.json, so no half-written state is ever resumed (the
    cell starts afresh)."""
    state = {"step": step, "wall_s": wall_s, "nonfinite_skipped": skipped,
             "models": [m.state_dict() for m in recording.models],
             "optimizers": [o.state_dict() for o in recording.optimizers],
             "streams": [s.state_dict() for s in streams], "generators": generators.states}
    (d / CHECKPOINT_META).unlink(missing_ok=True)
    atomic_write(d / CHECKPOINT, lambda tmp: torch.save(state, tmp))
    write_json(d / CHECKPOINT_META, {"step": step, "bytes": (d / CHECKPOINT).stat().st_size, "rng": RNG})


def load_checkpoint(d: Path, device) -> dict | None:
    """The cell's checkpoint (on `device`), None without one; the metrics of the steps after it are
    dropped, as the resumed cell logs them again."""
    step = simulated_checkpoint(d)
    if step is None:
        return None
    saved = torch.load(d / CHECKPOINT, map_location=device, weights_only=True)
    if saved["step"] != step:
        raise ValueError(f"{d / CHECKPOINT} holds step {saved['step']}, {d / CHECKPOINT_META} says {step}")
    lines = [line for line in (d / METRICS).read_text().splitlines() if line and json.loads(line)["step"] < step]
    if len(lines) != step:
        raise ValueError(f"{d / METRICS} logs {len(lines)} of the {step} steps before the checkpoint")
    write_text(d / METRICS, "".join(line + "\n" for line in lines))
    return saved


def _distances(vectors) -> list[float]:
    """‖x_i − x̄‖ of each client's vector."""
    xs = [x.detach().double() for x in vectors]
    mean = torch.stack(xs).mean(0)
    return torch.stack([torch.linalg.vector_norm(x - mean) for x in xs]).tolist()  # one wait for a GPU, not N


def _final_vectors(recording: Recording) -> list:
    """What x̄ is the mean of once training is over: every parameter of a linear method's model (DECA
    holds no active block then), the trainable vector of a non-linear one (DeCAF)."""
    if recording.optimizers[0].linear:
        return [torch.cat([p.detach().reshape(-1).double() for p in m.parameters()]) for m in recording.models]
    return [o.consensus_vector() for o in recording.optimizers]


def consensus_model(recording: Recording):
    """x̄ in client 0's model: the mean of every parameter, or for a method whose combination is not
    linear (DeCAF) its own combination of every client's vector with uniform weights."""
    models, optimizers = recording.models, recording.optimizers
    n = len(models)
    with torch.no_grad():
        if optimizers[0].linear:
            for params in zip(*(m.parameters() for m in models)):
                params[0].copy_(torch.stack([p.detach().float() for p in params]).mean(0))
        else:
            own = optimizers[0].consensus_vector()
            optimizers[0].combine_now(ClientView([(1 / n, o.consensus_vector()) for o in optimizers], own))
    return models[0]


def run_simulated(d: Path) -> dict:
    """One cell in this process: N clients through deca_ds.simulate, then x̄ evaluated on the test split."""
    threads = os.environ.get("OMP_NUM_THREADS")
    if threads:
        torch.set_num_threads(int(threads))
    cell = read_json(d / CELL)
    opts = RunOptions(**cell["options"])
    steps = cell["settings"].get("deepspeed", {})  # the preset's keys that change a step, as on ranks
    n = opts.clients
    topology = make_topology(opts.topology, n, weights=opts.weights, p=opts.er_p, seed=opts.topology_seed,
                             matrix_file=opts.matrix_file)
    task = build_task(opts, n)
    # on the GPU where there is one (a checkpoint loads into host memory; a config is drawn there)
    device = local_device(opts.device_map)
    model = build_model(opts, len(task.tokenizer)).to(device)
    partition = model_partition(model, opts.deca_config())
    method = opts.build_method(partition, grad_clip=steps.get("gradient_clipping"))
    saved = load_checkpoint(d, device)  # the parent kept it (cells._prepare): the cell goes on from there
    # wall_s counts the steps' time of every attempt up to its checkpoint
    start = time.perf_counter() - (saved["wall_s"] if saved else 0.0)
    recording = Recording(method, saved, compiled=opts.compile_layers, schedule=steps.get("scheduler"))
    # each client's dropout masks as its own deca-train rank draws them
    generators = ClientGenerators(saved["generators"]) if saved else ClientGenerators.seeded(opts.seed, n)
    client_streams = [task.stream(opts, i) for i in range(n)]
    for stream, state in zip(client_streams, saved["streams"] if saved else []):
        stream.load_state_dict(state)
    streams = [(to_device(batch, device) for batch in stream) for stream in client_streams]
    probe = method.prepare(build_model(opts, len(task.tokenizer)))
    write_json(d / RUN_CONFIG, {
        "options": asdict(opts), "topology": topology.to_dict(), "method": opts.method,
        "trainable_params": method.num_trainable(probe), "n_clients": n,
        "blocks": [asdict(b) for b in partition.blocks], "client_sizes": task.client_sizes,
        "split_keys": list(task.key_names), "split_histogram": task.key_histogram, "device": str(device),
        "versions": {"torch": torch.__version__, "python": sys.version.split()[0]},
        # of this attempt: a cell resumed later may finish at another commit, or with other CPU kernels
        "commit": commit(), "cpu_kernels": cpu_kernels()})
    del probe
    metrics = (d / METRICS).open("a" if saved else "w", buffering=1)  # line by line: progress is visible
    # and in log.txt as deca-train prints it, with the mean of the clients' losses
    progress = Progress(opts.total_steps(partition), saved["step"] if saved else 0, opts.method, show=True)

    begun = {}  # what a step's record takes as it begins: its lr, and its consensus distance when measured
    skipped = saved.get("nonfinite_skipped", 0) if saved else 0  # skip_nonfinite: steps skipped, as a rank counts

    def on_skip(step: int, what: str) -> None:
        nonlocal skipped
        skipped += 1
        print(f"skip_nonfinite: skipped step {step}: {what}; {skipped} skipped so far", flush=True)

    def before_step(step: int) -> None:  # where deca-train's ranks measure them: before the step's update
        begun.clear()
        begun["lr"] = recording.optimizers[0].lr
        if opts.consensus_interval and step % opts.consensus_interval == 0:
            begun["consensus_distance"] = sum(_distances([o.consensus_vector() for o in recording.optimizers])) / n

    def on_step(info) -> None:
        # wall_s: seconds since the cell started, at the end of the step (beside other cells on one
        # GPU, how fast a step went depends on how many ran with it)
        recording.step()
        rec = {"step": info.step, "round": info.round, "block": info.block, "r": info.step_in_block,
               "loss": sum(info.losses) / len(info.losses), "wall_s": round(time.perf_counter() - start, 3),
               **begun, **({"nonfinite_skipped": skipped} if skipped else {})}
        lead = recording.optimizers[0]
        metrics.write(json.dumps(rec, allow_nan=False) + "\n")
        progress.update({"round": info.round, "block": info.block, "r": info.step_in_block}, rec["loss"],
                        None if lead.done else lead.where())
        done = info.step + 1
        if opts.checkpoint_interval and done % opts.checkpoint_interval == 0 and not lead.done:
            save_checkpoint(d, done, recording, client_streams, generators, time.perf_counter() - start, skipped)

    simulate(model, streams, topology.W, recording, on_step=on_step, before_step=before_step, generators=generators,
             grad_accum=opts.grad_accum, loss_chunk=opts.loss_chunk, transfer_dtype=opts.transfer_dtype(),
             skip_nonfinite=opts.skip_nonfinite, on_skip=on_skip)
    metrics.close()
    progress.close()
    final_distance = sum(_distances(_final_vectors(recording))) / n
    consensus = consensus_model(recording)
    if opts.questions:  # a generation task: x̄ answers the grid's question sets (judged after the cells)
        evaluation = {"answered": answer_sets(consensus, task.tokenizer, opts.question_sets(), d / ANSWERS,
                                              max_new_tokens=opts.max_new_tokens)}
    else:
        evaluation = task.evaluate(consensus, opts.eval_limit or None)
        if not evaluation or not math.isfinite(evaluation.get("accuracy", math.nan)):
            raise ValueError(f"the consensus model of {d} has no classification metrics: {evaluation}")
    final = finish(d, evaluation, wall_s=time.perf_counter() - start, final_distance=final_distance)
    for name in (CHECKPOINT_META, CHECKPOINT):  # the cell is done: what it would go on from is not needed
        (d / name).unlink(missing_ok=True)
    return final


if __name__ == "__main__":
    try:
        print(json.dumps(run_simulated(Path(sys.argv[1])), allow_nan=False))
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        sys.exit(1)
