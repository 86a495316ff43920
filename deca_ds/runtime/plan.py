"""What a run will do, built from its options before any rank talks or writes (plan_run): the
clients' layout and placement, graph, data, model, blocks and method, the output directory and,
resuming, what changed since the saved run; everything that can be wrong with the input is
refused here, on every rank with the same message. write_run_config records the plan."""

from __future__ import annotations

import json
import os
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from .. import __version__
from ..blocks import Partition, find_decoder_layers
from ..config import parse_dtype
from ..datasets import write_partition_report
from ..files import write_json, write_text
from ..memory import ModelSpec
from ..methods import Method
from ..models import check_plain_logits, check_positions, load_model
from ..offload import check_keep
from ..optimizer import model_partition
from ..reporting import commit, cpu_kernels
from ..topology import Topology, make_topology
from . import outputs
from .dist import ClientLayout, check_layout
from .footprint import model_config, offload_keep_for_budget
from .options import RunOptions
from .parsing import dump_config
from .rank import cap_gpu_memory, launch_rank, local_device
from .same_start import start_fingerprint
from .task import Task, build_task, check_questions, own_clients
from .trace import check_window
from .transport import check_placement, env_placement, resolve_transport, spans_nodes


def build_model(opts: RunOptions, vocab_size: int):
    # A random initialisation is drawn on the rank's device (on the CPU an 8B model takes minutes);
    # offloaded, the model stays in host memory (the device never holds every layer), each module
    # drawn on the device in turn: the same weights as a resident run's.
    model = load_model(opts.model, dtype=parse_dtype(opts.working_dtype), trust_remote_code=opts.trust_remote_code,
                       from_config=opts.from_config, vocab_size=vocab_size, seed=opts.seed,
                       init_device=local_device(opts.device_map), host_memory=opts.offload != "none")
    if opts.loss_chunk:
        check_plain_logits(model.config)
    return model


def check_output_dir(opts: RunOptions, ds_config: dict, task: Task) -> tuple[Path, dict[str, list] | None]:
    """The output directory, refused if the run may not write there, and whether this node resumes
    the run in it: None to start, else the options changed since the saved run (refused if they change
    the result, as is other training data). --auto-resume resumes where the directory holds a run."""
    out = Path(opts.output_dir)
    resume = opts.resume or (opts.auto_resume and (out / "run_config.json").is_file())
    # --auto-resume finding a run with no run_config.json: one killed in its set-up, before any step
    outputs.check_output_dir(out, resume=resume, overwrite=opts.overwrite or (opts.auto_resume and outputs.is_run(out)))
    if not resume:
        return out, None
    try:
        saved = json.loads((out / "run_config.json").read_text())
    except ValueError as e:
        raise ValueError(f"--resume: {out / 'run_config.json'} is not valid JSON: {e}") from None
    defaults = asdict(RunOptions())
    changes = outputs.resume_changes(saved, asdict(opts), ds_config, int(os.environ.get("WORLD_SIZE", "1")),
                                     defaults)
    outputs.check_same_data(saved, task.data_fingerprints)
    return out, changes


class Laps:
    """Seconds of each phase of the set-up, for the line rank 0 prints: where a slow start goes (an
    8B model drawn on the CPU, layers pinned in host memory)."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self._last = time.perf_counter()

    def __call__(self, phase: str) -> None:
        """`phase` ended now; it began where the previous one ended."""
        now = time.perf_counter()
        self.seconds[phase], self._last = now - self._last, now

    def __str__(self) -> str:
        return (f"set up in {sum(self.seconds.values()):.1f} s: "
                + ", ".join(f"{phase} {s:.1f} s" for phase, s in self.seconds.items()))


def loss_positions_max(opts: RunOptions, task: Task) -> int:
    """The most positions the LM head runs at per micro-batch (models.causal_lm_loss: the union of the
    rows' labelled positions)."""
    return min(opts.max_seq_len, opts.micro_batch * task.answer_tokens)


def write_run_config(out: Path, opts: RunOptions, ds_config: dict, topology: Topology, partition: Partition,
                     layout: ClientLayout, task: Task, trainable: int, placement: dict, attention: str) -> None:
    resolved = {
        "options": asdict(opts), "ds_config": ds_config, "topology": topology.to_dict(),
        "method": opts.method, "trainable_params": trainable,
        # the most positions the LM head runs at per micro-batch (models.causal_lm_loss)
        "loss_positions_max": loss_positions_max(opts, task),
        "blocks": [asdict(b) for b in partition.blocks], "frozen": list(partition.frozen),
        "world_size": layout.world_size, "n_clients": layout.n_clients, **placement,
        "client_sizes": task.client_sizes,
        "split_keys": list(task.key_names), "split_histogram": task.key_histogram,
        "data_fingerprints": task.data_fingerprints,
        "versions": {"deca_ds": __version__, "torch": torch.__version__, "python": sys.version.split()[0]},
        "commit": commit(),  # the checkout's ("+dirty": changed files), "unknown" outside one
        "cpu_kernels": cpu_kernels(),  # ATen's on CPU (AVX2, AVX512, …): a CPU run's bits depend on them
        # the model's attention: an export's config.json does not say, and its loader takes transformers'
        # default (sdpa), while the tiny Llama computes eager; deca-eval --run loads the export with it
        "attn_implementation": attention,
    }
    write_json(out / "run_config.json", resolved)
    # the same run as a run file: deca-train --config <out>/config.yaml (with --resume or --overwrite)
    write_text(out / "config.yaml", dump_config(opts, ds_config))
    write_partition_report(out / "partition", task.key_histogram, task.key_names,
                           None if opts.client_data else task.client_indices)
    if layout.rank:
        return
    print(json.dumps({"options": asdict(opts), "ds_config": ds_config}, indent=2, allow_nan=False))
    print(topology.describe())
    print(partition.describe() if opts.method == "deca"
          else f"method {opts.method}: {trainable:,} trainable parameters")
    print("examples per client:", task.client_sizes)


@dataclass
class Plan:
    """What a run will do, built from its options with everything that can fail on bad input checked,
    before any rank talks or writes (plan_run)."""

    n_clients: int
    placement: dict  # transport, clients_per_gpu; host_staging once the mixer exists
    topology: Topology
    task: Task
    model: torch.nn.Module
    fingerprint: dict  # compared across ranks once connected (same_start)
    partition: Partition
    method: Method
    trainable: int
    out: Path
    resume_changes: dict[str, list] | None  # None: this node holds no run to resume (check_output_dir)
    laps: Laps  # the set-up's phases so far


def plan_run(opts: RunOptions, ds_config: dict) -> Plan:
    laps = Laps()
    n_clients = check_layout(int(os.environ.get("WORLD_SIZE", "1")), opts.ranks_per_client, opts.clients)
    transport = resolve_transport(opts.transport, torch.cuda.is_available())
    places = env_placement(opts.device_map)
    # {gpu: clients sharing it}: recorded with the run, since step times of time-shared GPUs differ
    placement = {"transport": transport,
                 "clients_per_gpu": check_placement(places, opts.ranks_per_client, transport)}
    cap_gpu_memory(opts.gpu_memory_gb, local_device(opts.device_map), placement["clients_per_gpu"])  # before the model
    topology = make_topology(opts.topology, n_clients, weights=opts.weights, p=opts.er_p,
                             seed=opts.topology_seed, matrix_file=opts.matrix_file)
    check_questions(opts)
    # per-client files: a process reads its own client's only
    task = build_task(opts, n_clients, own_clients(opts))
    laps("data")
    # from the config, before the weights load (an 8B model drawn on the CPU takes minutes): the
    # context, and the blocks asked of the model (a tied LM head has no tensor of its own to train)
    config = model_config(opts, len(task.tokenizer))
    check_positions(config, opts.max_seq_len)
    spec = ModelSpec.from_config(config, trust_remote_code=opts.trust_remote_code)
    spec.partition(opts.layers_per_block, **opts.trains())
    model = build_model(opts, len(task.tokenizer))
    laps("model")
    # compared across sites once connected; the weights only where nodes load them from their own disks
    fingerprint = start_fingerprint(model, task.tokenizer, opts, ds_config, weights=spans_nodes())
    partition = model_partition(model, opts.deca_config())
    if opts.offload_budget:
        opts.offload_keep = offload_keep_for_budget(
            asdict(opts), spec, ds_config, loss_positions=loss_positions_max(opts, task),
            n_neighbors=max(len(topology.neighbors(i)) for i in range(n_clients)))
        if launch_rank() == 0:
            print(f"--offload-budget {opts.offload_budget:g} GB: keeping the top {opts.offload_keep} decoder layers "
                  "on the device")
    check_keep(len(find_decoder_layers(model)[1]), opts.offload_keep)
    check_window(opts.trace_start, opts.trace_steps, opts.total_steps(partition))
    method = opts.build_method(partition)
    model = method.prepare(model)
    trainable = method.num_trainable(model)
    out, resume_changes = check_output_dir(opts, ds_config, task)
    return Plan(n_clients, placement, topology, task, model, fingerprint, partition, method, trainable, out,
                resume_changes, laps)
