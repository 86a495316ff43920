"""Run options of deca-train (launch/train.py): one dataclass, four sources.

Precedence, lowest first: the defaults below < the DeepSpeed preset's "deca" section < a run file
(--config, YAML or JSON) < the command line. The command line is generated from the dataclass,
so every option has one name everywhere (`--steps-per-block` on the command line,
`steps_per_block` in files). Every value from a file is converted to the field's declared type
here, at the edge, with errors that name the file and the key.

The same conversion and flags serve the commands that take some of these options or options of
their own (deca-eval, deca-split, deca-pretrain, grid files): `convert_options`, `add_option`.

This module imports no torch (nor the modules that do) at import time: `--help` and
`--print-config` stay fast. The choice lists below are the names the algorithm modules define;
tests/test_config.py checks they agree.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import functools
import json
import math
import os
import re
import string
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import yaml

from ..mapping_files import load_json, load_yaml
from .presets import HONORED, load_ds_config, preset_names, split_ds_config

if TYPE_CHECKING:
    from ..blocks import Partition
    from ..config import DecaConfig
    from ..memory import MemoryEstimate
    from ..methods import Method

VARIANTS = ("deca", "trivial_bma", "no_bma")  # deca_ds.config.VARIANTS
WEIGHT_DECAY_ON = ("all", "matrices")  # deca_ds.config.WEIGHT_DECAY_ON
TASK_NAMES = ("nwgi", "agnews", "tfns", "mnli", "alpaca")  # deca_ds.datasets.TASKS
METHOD_NAMES = ("deca", "dadam", "dec_lora", "dec_adapter", "decaf")  # deca_ds.methods.METHODS
OFFLOAD_MODES = ("none", "frozen")  # deca_ds.offload.OFFLOAD_MODES
TOPOLOGIES = ("ring", "erdos_renyi", "complete_bipartite", "complete", "torus", "exponential")  # deca_ds.topology
WEIGHT_SCHEMES = ("metropolis_hastings", "uniform", "laplacian")  # deca_ds.topology
BLOCK_ORDERS = ("ascending", "descending", "random")  # deca_ds.blocks.BLOCK_ORDERS
# DECA's options the baselines ignore, and the baselines' DECA ignores: set away from their default
# for a method that ignores them they would change nothing (--state-bits 8 would not shrink D-Adam's
# moments, --steps would not shorten DECA's T·B·R), so such a run is refused rather than run as if
# they held. The baselines do read T, B (from layers per block) and R: their default budget is T·B·R.
# LoRA's and the adapters' options say whose they are in their names; one command line may carry
# them for every method.
BASELINES = tuple(m for m in METHOD_NAMES if m != "deca")
# What trains beside the decoder layers where asked: DECA's blocks and D-Adam's full parameter set
# (deca_ds.blocks.partition_model's flags); the adapters' methods train only their adapters.
TRAINS = ("train_embeddings", "train_final_norm", "train_lm_head")  # deca_ds.blocks.EXTRA_PARTS
READ_BY = {"variant": ("deca",), "bma_betas": ("deca",), "block_order": ("deca",), "state_bits": ("deca",),
           "steps": BASELINES, "mix_every": BASELINES,
           **dict.fromkeys(TRAINS, ("deca", "dadam"))}
# The same for the data: what names a user's data (files, columns, labels, the chat template its
# prompts are rendered with) the built-in synthetic task does not read, so `--data-files train=mine.jsonl`
# without `--dataset files` would train on the synthetic task; --iid replaces the Dirichlet split.
TASK_DATA = ("data_files", "text_column", "text_pair_column", "label_column", "label_names", "response_column",
             "chat_template")
DIRICHLET = ("dirichlet_alpha", "partition_key")


def unread_by(method: str, dataset: str | None = None, iid: bool = False) -> dict[str, dict[str, str]]:
    """The options a run of `method` on `dataset` (split IID or not) does not read, by what leaves
    them unread ('--method dadam', '--dataset synthetic', '--iid'), each with who does read it."""
    groups = {f"--method {method}": {name: f"read by {'/'.join(methods)} only"
                                      for name, methods in READ_BY.items() if method not in methods}}
    if dataset == "synthetic":
        groups["--dataset synthetic"] = dict.fromkeys(TASK_DATA, "read by --dataset files and the hub tasks")
    if iid:
        groups["--iid"] = dict.fromkeys(DIRICHLET, "the Dirichlet split's, which --iid replaces")
    return groups


def unread_in(options: dict) -> set[str]:
    """The options of `unread_by` for a run of these options (a run_config.json's, a grid cell's,
    asdict(RunOptions); one left out takes its default): they change none of its results (a run
    saved before they were refused may hold another value)."""
    defaults = option_defaults()
    groups = unread_by(*(options.get(k, defaults[k]) for k in ("method", "dataset", "iid")))
    return {name for names in groups.values() for name in names}


# Options that act only with another (given alone, they did nothing, silently), and why
NEEDS = {"trace_start": ("trace_steps", "it is the first of the steps that one traces"),
         "eval_clients": ("eval_interval", "it scores each client at the steps that one scores x̄ at"),
         "max_new_tokens": ("questions", "it bounds the answers to that one's question sets"),
         "weight_decay_on": ("weight_decay", "it chooses the tensors that one decays")}


def read_options(saved: dict) -> dict:
    """A run's recorded options (run_config.json's) less those it did not read, which a run saved
    before they were refused may hold at any value: what RunOptions takes for that run."""
    defaults = option_defaults()
    gone = unread_in(saved) | {name for name, (needed, _) in NEEDS.items() if not saved.get(needed, defaults[needed])}
    return {k: v for k, v in saved.items() if k not in gone}


TRANSPORTS = ("auto", "nccl", "gloo")  # how ranks talk (deca_ds.runtime.transport)
PHASE_TIMINGS = ("sync", "events")  # deca_ds.runtime.timing


def per_client(path: str) -> bool:
    """Whether a data file path names each client's own file: it holds the `{client}` field
    (`{client:03d}` too). Any other field, or an unmatched brace, is refused (a literal brace is
    written `{{`)."""
    rule = "the only field a path may hold is {client} (each client's own file); a literal brace is written '{{'"
    try:
        fields = {name for _, name, _, _ in string.Formatter().parse(path) if name is not None}
    except ValueError as e:
        raise ValueError(f"data file path {path!r}: {e}; {rule}") from None
    if fields - {"client"}:
        raise ValueError(f"data file path {path!r} holds {', '.join(f'{{{f}}}' for f in sorted(fields))}: {rule}")
    try:
        path.format(client=0)
    except (ValueError, TypeError) as e:
        raise ValueError(f"data file path {path!r}: {e}; {rule}") from None
    return bool(fields)


def client_path(path: str, client: int) -> str:
    """`client`'s own file of a per-client path (`per_client`)."""
    return path.format(client=client)


def _opt(default, help: str, **extra):
    return field(default=default, metadata={"help": help, **extra})


PATH, KEY_PATH = "path", "KEY=PATH"  # an option's `path` metadata: a path, or a list of KEY=PATH items


def expand_paths(options) -> None:
    """The path options of a dataclass of options (its fields' `path` metadata), `~` expanded."""
    for f in dataclasses.fields(options):
        if "path" in f.metadata:
            setattr(options, f.name, expand_home(getattr(options, f.name), f.metadata["path"]))


def expand_home(value, kind: str):
    """A path option's `~` (at the start of a path, or of each KEY=PATH item's path) as the user's home:
    no shell expands it in a run file, a grid, or `--output-dir=~/runs`, and a run would otherwise make
    a directory named `~` (which `rm -rf ~` then removes with the home)."""
    if value is None:
        return None
    if kind == PATH:
        return os.path.expanduser(value)
    return [key + "=" + os.path.expanduser(path) if sep else key
            for key, sep, path in (item.partition("=") for item in value)]


@dataclass
class RunOptions:
    # model and data
    model: str = _opt("tiny", "hub id or local path of a causal LM, or 'tiny' (built-in random Llama)",
                       path=PATH)
    trust_remote_code: bool = _opt(False, "allow the model repo's own code (off unless you ask)")
    from_config: bool = _opt(False, "random-initialize the model from its config (no weights)")
    dataset: str = _opt("synthetic", "training data: 'synthetic' (built-in non-IID task), a paper task by name "
                        "(from the hub or its cache), or 'files' (--data-files)",
                        choices=("synthetic", *TASK_NAMES, "files"))
    data_files: list[str] | None = _opt(None, "local data as split=path (train=…, test=…; .jsonl, .json, .csv, "
                                        ".parquet), or a task's local copy; train=…{client}…: each client's own",
                                        path=KEY_PATH)
    text_column: str | None = _opt(None, "column of the input text")
    text_pair_column: str | None = _opt(None, "second text column of pair tasks (e.g. MNLI's hypothesis)")
    label_column: str | None = _opt(None, "column of the label (int index or label name)")
    label_names: list[str] | None = _opt(None, "verbalized labels, in label-index order")
    response_column: str | None = _opt(None, "column of the answer of generation tasks")
    chat_template: bool = _opt(False, "render prompts with the tokenizer's chat template")
    partition_key: str = _opt("label", "what the Dirichlet split skews: the label, or the instruction's "
                              "first word ('category', for instruction data)", choices=("label", "category"))
    iid: bool = _opt(False, "split the data IID instead of Dirichlet")
    dirichlet_alpha: float = _opt(0.25, "Dirichlet concentration μ of the label split across clients")
    max_seq_len: int = _opt(64, "tokens per example (prompt truncated from the left, never the answer)")
    token_cache: str | None = _opt(None, "folder of the tokenized-training-set cache (one rank per machine "
                                   "tokenizes, the others read it); default $DECA_CACHE or ~/.cache/deca_ds; "
                                   "'none' = off", path=PATH)
    synthetic_words: int = _opt(12, "words per example of the synthetic task (long examples fill --max-seq-len "
                                "for memory and speed profiling)")
    eval_limit: int = _opt(512, "held-out examples scored per evaluation (0 = all)")
    questions: list[str] | None = _opt(None, "question sets x̄ answers after a generation task, NAME=FILE (Vicuna / "
                                       "MT-Bench JSONL), into answers/NAME.jsonl (docs/evaluation.md)",
                                       path=KEY_PATH)
    max_new_tokens: int = _opt(512, "tokens per answered turn of --questions (greedy)")
    # clients and graph
    clients: int | None = _opt(None, "number of clients N (default: world size / ranks per client)")
    ranks_per_client: int = _opt(1, "ranks per client G (data parallel inside a client)")
    transport: str = _opt("auto", "how ranks talk: 'nccl', 'gloo' (plain TCP; GPU blocks staged through pinned host "
                          "memory) or 'auto' (nccl on GPUs, gloo on CPUs); see docs/transport.md",
                          choices=TRANSPORTS)
    device_map: str = _opt("auto", "GPU of each local rank: 'auto' (local rank modulo the visible GPUs) or "
                           "indices by local rank, e.g. 0,0,1,1")
    gpu_memory_gb: float = _opt(0.0, "cap this rank's CUDA allocator at this many GB: run as on a smaller card, "
                                "e.g. 33 for an RTX 5090 (see docs/memory.md; 0 = off)")
    topology: str = _opt("erdos_renyi", "communication graph", choices=(*TOPOLOGIES, "file"))
    er_p: float = _opt(0.5, "Erdős–Rényi edge probability")
    topology_seed: int = _opt(0, "seed of random graphs")
    weights: str = _opt("metropolis_hastings", "mixing weights", choices=WEIGHT_SCHEMES)
    matrix_file: str | None = _opt(None, "mixing matrix file (.json, .csv, .npy) for --topology file",
                                     path=PATH)
    # method
    method: str = _opt("deca", "what trains and how it is mixed: DECA or a baseline (decentralized full-parameter "
                       "Adam, Dec-LoRA, Dec-Adapter, DeCAF)", choices=METHOD_NAMES)
    steps: int | None = _opt(None, "baselines: local steps (default: DECA's T·B·R for the same model, an equal "
                             "step budget)")
    mix_every: int = _opt(1, "baselines: mix after every K-th local step")
    lora_rank: int = _opt(8, "Dec-LoRA/DeCAF: LoRA rank r")
    lora_alpha: float = _opt(16.0, "Dec-LoRA/DeCAF: LoRA alpha (scale alpha/r)")
    lora_dropout: float = _opt(0.05, "Dec-LoRA/DeCAF: dropout on the LoRA input")
    lora_targets: list[str] | None = _opt(None, "Dec-LoRA/DeCAF: module names to adapt (default: every linear "
                                          "layer of attention and MLP)")
    adapter_size: int = _opt(64, "Dec-Adapter: bottleneck width")
    # Algorithm 1
    layers_per_block: int = _opt(2, "decoder layers per block (granularity)")
    train_embeddings: bool = _opt(False, "also train the input embeddings (frozen in the paper): DECA, as a block of "
                                  "their own before the layers'; D-Adam, with the rest")
    train_final_norm: bool = _opt(False, "also train the final norm: DECA, as a block of its own after the layers'; "
                                  "D-Adam, with the rest")
    train_lm_head: bool = _opt(False, "also train the LM head (an untied one: a tied head is the embeddings' matrix): "
                               "DECA, as the last block; D-Adam, with the rest")
    steps_per_block: int = _opt(48, "local steps per block R")
    rounds: int = _opt(4, "rounds T")
    lr: float = _opt(5e-5, "learning rate γ")
    adam_betas: tuple[float, float] = _opt((0.9, 0.999), "Adam α1 α2")
    eps: float = _opt(1e-8, "Adam ε")
    weight_decay: float = _opt(0.0, "decoupled weight decay λ (AdamW): each step scales the trained tensors "
                               "--weight-decay-on names by 1−γλ (0 = off, the paper's)")
    weight_decay_on: str = _opt("all", "what --weight-decay scales: 'all' trained tensors (torch's AdamW), or "
                                "'matrices', those of 2+ dimensions: not norm weights nor biases (HF Trainer's)",
                                choices=WEIGHT_DECAY_ON)
    bma_betas: tuple[float, float] = _opt((0.9, 0.999), "BMA β1 β2")
    variant: str = _opt("deca", "moment correction", choices=VARIANTS)
    block_order: str = _opt("ascending", "block order per round", choices=BLOCK_ORDERS)
    seed: int = _opt(0, "seed of model init, data split, data order and random block order")
    # precision
    working_dtype: str = _opt("fp32", "dtype of the model's weights", choices=("fp32", "bf16"))
    master_dtype: str = _opt("fp32", "dtype of the active block's master, m, v", choices=("fp32", "fp64"))
    offload: str = _opt("none", "DECA: 'frozen' keeps frozen decoder layers in host memory, streamed to the GPU",
                        choices=OFFLOAD_MODES)
    offload_keep: int = _opt(0, "with --offload frozen: the top N decoder layers stay on the GPU, never streamed")
    offload_budget: float = _opt(0.0, "with --offload frozen: choose --offload-keep to fit this many GB of "
                                 "estimated peak (0 = off)")
    state_bits: int = _opt(32, "DECA: bits per value of the active block's m and v (8 = bitsandbytes block-wise, "
                           "extra [bnb])", choices=(32, 8))
    fused_update: bool = _opt(False, "run the Adam update as torch.compile'd fused kernels (compiles at the "
                              "first step)")
    compile_layers: bool = _opt(False, "compile each decoder layer's training forward with torch.compile: fewer "
                                "kernel launches where the host sets the step (not with --offload frozen)")
    loss_chunk: int = _opt(0, "run the LM head and the loss over this many positions at a time, never holding "
                           "the full logits (0 = off)")
    mix_dtype: str = _opt("master", "dtype exchanged between neighbors: 'master' (exact) or 'working'",
                          choices=("master", "working"))
    # batch (override the preset's DeepSpeed keys)
    micro_batch: int | None = _opt(None, "micro-batch per rank (train_micro_batch_size_per_gpu)")
    grad_accum: int | None = _opt(None, "micro-batches per step (gradient_accumulation_steps)")
    # outputs
    output_dir: str = _opt("outputs/deca", "where metrics, checkpoints and the exported model go", path=PATH)
    overwrite: bool = _opt(False, "allow writing into an output directory that already holds a run")
    consensus_interval: int = _opt(10, "steps between consensus-distance measurements (0 = off)")
    eval_interval: int = _opt(0, "steps between evaluations of the consensus model x̄ (0 = at the end only)")
    eval_clients: bool = _opt(False, "at those steps also evaluate each client's own model")
    checkpoint_interval: int = _opt(0, "steps between checkpoints, and one at the last step (0 = none)")
    keep_checkpoints: int = _opt(2, "complete checkpoints kept")
    resume: bool = _opt(False, "continue from the latest complete checkpoint in --output-dir")
    export: bool = _opt(True, "write the consensus model at the end (--no-export: evaluate it in memory only, "
                        "as the profiling tools do)")
    save_clients: bool = _opt(False, "also export every client's model")
    tensorboard: bool = _opt(False, "write TensorBoard event files")
    trace_steps: int = _opt(0, "trace this many steps with torch.profiler on every rank, from --trace-start, into "
                            "trace/ (docs/outputs.md; 0 = off)")
    trace_start: int = _opt(3, "with --trace-steps: the first step traced (the steps before it warm up; "
                            "--fused-update compiles in them)")
    phase_timing: str = _opt("sync", "GPU: time the phases by waiting for the device at each ('sync'), or by CUDA "
                             "events read after the step ('events': the host runs ahead; docs/profiling.md)",
                             choices=PHASE_TIMINGS)
    timeout: float = _opt(300.0, "seconds any wait on another rank may take before the run fails")
    skip_nonfinite: bool = _opt(False, "skip (on every rank) a step whose loss or gradient is NaN or infinite on "
                                "any client, count it in the summary, and go on (default: every rank stops there)")

    def __post_init__(self) -> None:
        expand_paths(self)
        for f in dataclasses.fields(self):  # inf and nan parse as floats; no option means either
            value = getattr(self, f.name)
            values = value if isinstance(value, (list, tuple)) else (value,)
            if any(isinstance(v, float) and not math.isfinite(v) for v in values):
                raise ValueError(f"{f.name} must be a finite number, got {value}")
        for name in ("max_seq_len", "ranks_per_client", "keep_checkpoints", "mix_every", "lora_rank", "adapter_size",
                     "max_new_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        for name in ("eval_limit", "consensus_interval", "eval_interval", "checkpoint_interval", "offload_keep",
                     "offload_budget", "loss_chunk", "gpu_memory_gb", "trace_steps", "trace_start", "seed",
                     "topology_seed"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        for name in ("micro_batch", "grad_accum", "clients", "steps"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if not self.timeout > 0:
            raise ValueError(f"timeout must be > 0, got {self.timeout}")
        if not self.dirichlet_alpha > 0:
            raise ValueError(f"dirichlet_alpha must be > 0, got {self.dirichlet_alpha}")
        if self.dataset == "files" and not self.data_files:
            raise ValueError("--dataset files needs --data-files train=PATH [test=PATH]")
        for item in self.data_files or ():
            if "=" not in item or item.split("=", 1)[0] not in ("train", "test"):
                raise ValueError(f"--data-files takes train=PATH or test=PATH, got {item!r}")
        self._check_client_data()
        self.question_sets()
        if (self.topology == "file") != (self.matrix_file is not None):
            raise ValueError("--topology file and --matrix-file go together")
        for f in dataclasses.fields(self):
            choices = f.metadata.get("choices")
            if choices and getattr(self, f.name) not in choices:
                raise ValueError(f"{f.name} must be one of {choices}, got {getattr(self, f.name)!r}")
        self.adam_betas, self.bma_betas = tuple(self.adam_betas), tuple(self.bma_betas)
        defaults = option_defaults()
        ignored, given = [], 0
        for who, names in unread_by(self.method, self.dataset, self.iid).items():
            flags = [f"--{name.replace('_', '-')} ({reader})" for name, reader in names.items()
                     if getattr(self, name) != defaults[name]]
            if flags:
                ignored.append(f"{who} does not read {', '.join(flags)}")
                given += len(flags)
        if ignored:
            leave = "it at its default" if given == 1 else "them at their defaults"
            raise ValueError(f"{'; '.join(ignored)}: leave {leave} (in a grid, under method_options or the task's "
                             "options)")
        if self.offload == "frozen":
            # Evaluating x̄ mid-run swaps every weight in and out on the device, which offloading
            # exists to avoid; offloading streams the decoder layers DECA's blocks freeze.
            clashes = (["eval_interval"] if self.eval_interval else []) + (["method"] if self.method != "deca" else [])
            if self.compile_layers:  # its hooks move each layer's weights, which a compiled layer would trace
                raise ValueError("--offload frozen does not combine with --compile-layers (the offload's hooks "
                                 "move the weights inside each layer)")
            if clashes:
                raise ValueError(f"--offload frozen does not combine with {', '.join(clashes)} "
                                 "(evaluate at the end only; offload is DECA's)")
            if self.offload_budget and self.offload_keep:
                raise ValueError("--offload-budget chooses --offload-keep: give one of them")
        elif self.offload_keep or self.offload_budget:
            raise ValueError(f"--offload-{'keep' if self.offload_keep else 'budget'} needs --offload frozen")
        for name, (needed, why) in NEEDS.items():
            if getattr(self, name) != defaults[name] and not getattr(self, needed):
                raise ValueError(f"--{name.replace('_', '-')} needs --{needed.replace('_', '-')} ({why})")
        from .transport import parse_device_map

        parse_device_map(self.device_map)
        self.deca_config()  # validates Algorithm 1's numbers now, before anything starts

    def question_sets(self) -> dict[str, str]:
        """--questions as {name: file}, in order; a malformed item is refused, naming it."""
        sets: dict[str, str] = {}
        for item in self.questions or ():
            name, sep, path = item.partition("=")
            if not sep or not path or not re.fullmatch(SET_NAME, name) or name in sets:
                raise ValueError(f"--questions takes NAME=FILE, each NAME once, of letters, digits, '_', '-' or '.' "
                                 f"(it names answers/NAME.jsonl), got {item!r}")
            sets[name] = path
        return sets

    @property
    def client_data(self) -> bool:
        """Whether each client reads only its own training file (`--data-files train=…{client}…`)."""
        return any(per_client(path) for split, path in self.data_file_map().items() if split == "train")

    def data_file_map(self) -> dict[str, str]:
        """--data-files as {split: path}."""
        return dict(item.split("=", 1) for item in self.data_files or ())

    def _check_client_data(self) -> None:
        files = {split: per_client(path) for split, path in self.data_file_map().items()}
        if files.get("test"):
            raise ValueError("--data-files test=… is the test set every client is evaluated on: {client} belongs "
                             "in train=… only")
        if not files.get("train"):
            return
        # Each site reads only its own file, so nothing may be derived from all clients' data at once.
        clashes = [what for what, clash in (
            ("test=PATH, a test file every site has (the consensus is evaluated on it, and string labels are "
             "named from it)", "test" not in files),
            ("a tokenizer every site shares (a model path or hub id, not --model tiny or --from-config, whose "
             "word-level tokenizer is built from the data)", self.model == "tiny" or self.from_config),
            ("no --iid: the files are the split", self.iid),
            ("--partition-key label (the categories are counted over all the data)", self.partition_key != "label"),
        ) if clash]
        if clashes:
            raise ValueError("--data-files train=…{client}… (each client reads only its own file) needs "
                             + "; ".join(clashes))

    def build_method(self, partition: Partition, grad_clip: float | None = None) -> Method:
        """The method to train with; `partition` is DECA's (its T·B·R is the baselines' default budget).
        `grad_clip`: the gradient's global norm clipped to (a preset's gradient_clipping, where the
        optimizer applies it, not DeepSpeed's engine)."""
        from ..methods import AdamConfig, DAdam, Deca, DecAdapter, DeCAF, DecLoRA
        from ..methods.lora import DEFAULT_TARGETS

        config = self.deca_config(grad_clip)
        if self.method == "deca":
            return Deca(config, partition)
        # the same local Adam as DECA's: every AdamSettings field of its config
        adam = AdamConfig(steps=self.total_steps(partition), mix_every=self.mix_every, **config.adam_settings())
        if self.method == "dadam":
            return DAdam(adam, **self.trains())
        if self.method == "dec_adapter":
            return DecAdapter(adam, size=self.adapter_size, seed=self.seed)
        lora = DeCAF if self.method == "decaf" else DecLoRA
        return lora(adam, rank=self.lora_rank, alpha=self.lora_alpha, dropout=self.lora_dropout,
                    targets=self.lora_targets or DEFAULT_TARGETS, seed=self.seed)

    def total_steps(self, partition: Partition) -> int:
        """Local steps of the run: DECA's T·B·R, a baseline's --steps (T·B·R when not given)."""
        return (self.method != "deca" and self.steps) or self.rounds * partition.num_blocks * self.steps_per_block

    def transfer_dtype(self):
        """The dtype x½ travels to the neighbours in: the working dtype with --mix-dtype working,
        else None (the master's, exact)."""
        from ..config import parse_dtype

        return parse_dtype(self.working_dtype) if self.mix_dtype == "working" else None

    def deca_config(self, grad_clip: float | None = None) -> DecaConfig:
        from ..config import DecaConfig, parse_dtype

        return DecaConfig(
            lr=self.lr, adam_betas=self.adam_betas, bma_betas=self.bma_betas, eps=self.eps,
            weight_decay=self.weight_decay, weight_decay_on=self.weight_decay_on,
            steps_per_block=self.steps_per_block, rounds=self.rounds,
            layers_per_block=self.layers_per_block, variant=self.variant, block_order=self.block_order,
            seed=self.seed, master_dtype=parse_dtype(self.master_dtype), state_bits=self.state_bits,
            fused_update=self.fused_update, grad_clip=grad_clip, **self.trains(),
        )

    def trains(self) -> dict[str, bool]:
        """The train_* flags: which of the embeddings, final norm and LM head train beside the layers."""
        return {name: getattr(self, name) for name in TRAINS}


# Option groups of --help and docs/options.md: each starts at its first field and runs to the next one's,
# so a new option joins the group it is declared in.
GROUP_STARTS = {
    "model": "model and data",
    "clients": "clients and graph",
    "method": "method",
    "layers_per_block": "Algorithm 1",
    "working_dtype": "precision and memory",
    "micro_batch": "batch (overrides the preset's DeepSpeed keys)",
    "output_dir": "outputs",
}


# a question set's name (--questions NAME=FILE, a grid's `generation` section): it names answers/NAME.jsonl
SET_NAME = r"[A-Za-z0-9_.-]+"


def option_defaults() -> dict:
    """Every option's default (each field has one: `_opt` gives it)."""
    return {f.name: f.default for f in dataclasses.fields(RunOptions)}


def option_groups() -> list[tuple[str, list[dataclasses.Field]]]:
    """RunOptions' fields in declaration order, grouped under GROUP_STARTS' titles."""
    groups: list[tuple[str, list[dataclasses.Field]]] = []
    for f in dataclasses.fields(RunOptions):
        if f.name in GROUP_STARTS or not groups:
            groups.append((GROUP_STARTS.get(f.name, "options"), []))
        groups[-1][1].append(f)
    return groups


NO_PRESET = "none"  # --preset none: no DeepSpeed preset, DeepSpeed's keys at their defaults
_RUN_FILE_KEYS = ("deepspeed",)  # run-file keys besides the options


@functools.cache  # evaluating a class's annotations takes ~1.4 ms; add_option asks once per flag
def _hints(cls: type = RunOptions) -> dict:
    return typing.get_type_hints(cls)


def _optional(hint) -> tuple[object, bool]:
    """(the type inside Optional[...], whether None is allowed)."""
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        return args[0], len(args) < len(typing.get_args(hint))
    return hint, False


def _type_name(hint) -> str:
    kind, none = _optional(hint)
    origin = typing.get_origin(kind)
    name = ("a list of strings" if origin is list else f"a list of {len(typing.get_args(kind))} numbers"
            if origin is tuple else {bool: "a boolean", int: "an integer", float: "a float", str: "a string",
                                     dict: "a mapping"}[kind])
    return name + (" or null" if none else "")


def _convert(key: str, value, hint):
    """`value` as the declared type `hint`; ValueError(what was expected) if it is not one."""
    kind, none = _optional(hint)
    if value is None:
        if none:
            return None
        raise ValueError(f"expected {_type_name(kind)}, got null")
    origin = typing.get_origin(kind)
    if origin is list:
        items = [value] if isinstance(value, str) else value
        if not isinstance(items, (list, tuple)):
            raise ValueError(f"expected {_type_name(hint)}, got {value!r}")
        return [_convert(key, v, typing.get_args(kind)[0]) for v in items]
    if origin is tuple:
        inner = typing.get_args(kind)
        if not isinstance(value, (list, tuple)) or len(value) != len(inner):
            raise ValueError(f"expected {_type_name(hint)}, got {value!r}")
        return tuple(_convert(key, v, t) for v, t in zip(value, inner))
    if kind is dict:
        if isinstance(value, dict):
            return value
    elif kind is bool:
        if isinstance(value, bool):
            return value
        words = {"true": True, "yes": True, "on": True, "false": False, "no": False, "off": False}
        if isinstance(value, str) and value.lower() in words:
            return words[value.lower()]
    elif kind is str:
        if isinstance(value, str):
            return value
        raise ValueError(f"expected {_type_name(hint)}, got {value!r} (quote it)")
    elif not isinstance(value, bool) and isinstance(value, (int, float, str)):
        # YAML 1.1 reads 5e-5 (no dot) as a string; int accepts 1e3 and 100.0 but not 1.5
        try:
            number = float(value) if kind is float or not isinstance(value, int) else value
        except ValueError:
            pass
        else:
            if kind is float:
                return number
            if float(number).is_integer():
                return int(number)
    raise ValueError(f"expected {_type_name(hint)}, got {value!r}")


def convert_options(values: dict, source: str, *, cls: type = RunOptions, command: str = "deca-train",
                    also: tuple[str, ...] = _RUN_FILE_KEYS) -> dict:
    """Option values from `source` (a file, a preset, a grid's section), each converted to its type
    declared in `cls` (deca-train's RunOptions, or another command's options) and checked against
    its choices; unknown keys refused with the closest name (of the options, or the keys `also`
    allowed beside them)."""
    fields = {f.name: f for f in dataclasses.fields(cls)}
    hints = _hints(cls)
    out = {}
    for key, value in values.items():
        if key not in fields:
            close = difflib.get_close_matches(str(key).replace("-", "_"), [*fields, *also], n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else f" ({command} --help lists the options)"
            raise ValueError(f"{source}: unknown option {key!r}{hint}")
        try:
            out[key] = _convert(key, value, hints[key])
        except ValueError as err:
            raise ValueError(f"{source}: {key}: {err}") from None
        if "path" in fields[key].metadata:  # a grid keeps its cells' options as read
            out[key] = expand_home(out[key], fields[key].metadata["path"])
        choices = fields[key].metadata.get("choices")
        if choices and out[key] not in choices:
            raise ValueError(f"{source}: {key}: expected one of {', '.join(map(str, choices))}; got {value!r}")
    return out


def default_text(f: dataclasses.Field) -> str:
    """An option's default as the command line spells it."""
    return value_text(f.default)


def value_text(value) -> str:
    """An option's value as the command line spells it."""
    return ("none" if value is None else " ".join(map(str, value)) if isinstance(value, (tuple, list))
            else json.dumps(value, allow_nan=False) if isinstance(value, dict)
            else str(value).lower() if isinstance(value, bool) else str(value))


def type_text(name: str) -> str:
    """An option's declared type in words (what a run file's value must be)."""
    return _type_name(_hints()[name])


def _json_object(text: str) -> dict:
    try:
        value = load_json(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(f"not JSON ({err}): {text!r}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"expected a JSON object, got {text!r}")
    return value


def add_option(group, f: dataclasses.Field, *, cls: type = RunOptions, default=dataclasses.MISSING,
               help: str | None = None) -> None:
    """`f`'s flag on a parser (or group): `--name-with-dashes`, of its type declared in `cls` and its
    choices, absent from the parsed namespace unless given (required if `f` has no default).
    `default` and `help`: what another command (deca-eval) shows in their place."""
    kind, _ = _optional(_hints(cls)[f.name])
    if default is dataclasses.MISSING:
        default = f.default if f.default_factory is dataclasses.MISSING else f.default_factory()
    text = help or f.metadata["help"]
    if default is dataclasses.MISSING:
        kw = dict(required=True)
    else:
        kw, text = dict(default=argparse.SUPPRESS), f"{text} (default: {value_text(default)})"
    kw.update(dest=f.name, help=text.replace("%", "%%"))
    flag = "--" + f.name.replace("_", "-")
    if kind is dict:
        group.add_argument(flag, type=_json_object, metavar="JSON", **kw)
    elif kind is bool:
        group.add_argument(flag, action=argparse.BooleanOptionalAction, **kw)
    elif typing.get_origin(kind) is list:
        group.add_argument(flag, type=str, nargs="+", **kw)
    elif typing.get_origin(kind) is tuple:
        group.add_argument(flag, type=float, nargs=2, metavar=("B1", "B2"), **kw)
    else:
        group.add_argument(flag, type=kind, choices=f.metadata.get("choices"), **kw)


def build_parser(prog: str = "deca-train",
                 description: str = "Decentralized full-parameter fine-tuning with DECA, one client per rank group.",
                 *, estimate: bool = True) -> argparse.ArgumentParser:
    """The command line of deca-train (and of deca-split, whose run is not trained: estimate=False)."""
    p = argparse.ArgumentParser(
        prog=prog,
        usage=f"%(prog)s [--config RUN_FILE] [--preset NAME_OR_JSON] "
              f"[--print-config{' | --estimate | --fetch' * estimate}] [--OPTION VALUE ...]",
        description=f"{description} Options come from, lowest first: the defaults shown, the preset's \"deca\" "
                    "section, the run file (--config), the command line.",
        epilog="DeepSpeed keys honored in a preset or a run file's `deepspeed:`: "
               + "; ".join(f"{k}: {v}" for k, v in HONORED.items()),
    )
    p.add_argument("--config", metavar="RUN_FILE", type=os.path.expanduser,
                   help="run file (YAML or JSON) of options, with the DeepSpeed keys under `deepspeed:` (a mapping, "
                        "or a preset's name or path); the command line wins")
    p.add_argument("--preset", "--ds_config", "--ds-config", dest="ds_config", metavar="NAME_OR_JSON",
                   help=f"DeepSpeed preset: a shipped one by name ({', '.join(preset_names())}) or a JSON file; "
                        f"wins over the run file's `deepspeed:` (default: that, else '{NO_PRESET}': DeepSpeed's "
                        "defaults, micro-batch 1, no clipping)")
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--print-config", action="store_true",
                      help="print the resolved config as a run file (YAML) and exit without training")
    if estimate:
        mode.add_argument("--estimate", action="store_true",
                          help="print one client's estimated GPU memory for this run (deca_ds.memory, from the "
                               "model's config, the task and the graph; no weights loaded) and exit without training")
        mode.add_argument("--fetch", action="store_true",
                          help="download the hub model and task this run reads into the Hugging Face caches, for "
                               "machines without a network (then HF_HUB_OFFLINE=1), and exit without training")
    p.add_argument("--local_rank", "--local-rank", type=int, default=None, help=argparse.SUPPRESS)
    for title, fields in option_groups():
        group = p.add_argument_group(title)
        for f in fields:
            add_option(group, f)
    return p


def read_run_file(path: str) -> dict:
    """A run file's mapping, as read (YAML, or JSON by its .json suffix)."""
    try:
        text = Path(path).read_text()
    except FileNotFoundError:
        raise ValueError(f"run file {path} does not exist") from None
    try:
        data = load_json(text) if path.endswith(".json") else load_yaml(text)
    except (ValueError, yaml.YAMLError) as err:  # ValueError: not JSON, or a key given twice
        raise ValueError(f"run file {path} is not valid {'JSON' if path.endswith('.json') else 'YAML'}: {err}") \
            from None
    if not isinstance(data, dict):
        raise ValueError(f"run file {path} must hold a mapping of options")
    return data


def _preset(spec, source: str) -> tuple[dict, dict]:
    """(DeepSpeed config, its deca options) of a preset name/path, a mapping, or 'none'."""
    if isinstance(spec, dict):
        return split_ds_config(spec, source)
    if not isinstance(spec, str):
        raise ValueError(f"{source}: expected a mapping of DeepSpeed keys or a preset's name or path, got {spec!r}")
    return ({}, {}) if spec == NO_PRESET else load_ds_config(spec)


def resolve(args: argparse.Namespace) -> tuple[RunOptions, dict]:
    """(options, DeepSpeed config) of parsed command-line arguments, every source merged and validated."""
    args = dict(vars(args))
    cli_preset, run_file = args.pop("ds_config"), args.pop("config")
    for key in ("local_rank", "print_config", "estimate", "fetch"):
        args.pop(key, None)
    file_values = read_run_file(run_file) if run_file else {}
    file_preset = file_values.pop("deepspeed", NO_PRESET)
    spec, source = (cli_preset, "--preset") if cli_preset is not None else (file_preset, f"{run_file}: deepspeed")
    ds_config, preset = _preset(spec, source)
    merged = convert_options(preset, f"\"deca\" section of {spec if isinstance(spec, str) else source}")
    if run_file:
        merged.update(convert_options(file_values, run_file))
    merged.update(args)
    opts = RunOptions(**merged)
    if opts.micro_batch is not None:
        ds_config["train_micro_batch_size_per_gpu"] = opts.micro_batch
    if opts.grad_accum is not None:
        ds_config["gradient_accumulation_steps"] = opts.grad_accum
    # DeepSpeed 0.19 clips at global norm 1.0 unless told otherwise; DECA (and the paper) does not clip.
    ds_config.setdefault("gradient_clipping", 0.0)
    ds_config.setdefault("train_micro_batch_size_per_gpu", 1)
    ds_config.setdefault("gradient_accumulation_steps", 1)
    opts.micro_batch = ds_config["train_micro_batch_size_per_gpu"]
    opts.grad_accum = ds_config["gradient_accumulation_steps"]
    return opts, ds_config


def parse_args(argv: list[str] | None = None) -> tuple[RunOptions, dict]:
    """(options, DeepSpeed config) of a command line, every source merged and validated."""
    return resolve(build_parser().parse_args(argv))


def dump_config(opts: RunOptions, ds_config: dict) -> str:
    """The resolved config as a run file: `--config` of this text gives the same run."""
    values = {k: list(v) if isinstance(v, tuple) else v for k, v in dataclasses.asdict(opts).items()}
    return ("# deca-train run file (resolved config); run it with: deca-train --config FILE\n"
            + yaml.safe_dump({**values, "deepspeed": ds_config}, sort_keys=False, allow_unicode=True,
                             default_flow_style=None))


def estimate_run(options: dict, model_config, ds_config: dict, *, n_neighbors: int, loss_positions: int,
                 offload_keep: int | None = None, eval_batch: int = 0, eval_positions: int = 2) -> MemoryEstimate:
    """deca_ds.memory's estimate of a round's peak for a run with `options` (RunOptions as a dict,
    micro-batch resolved) on the model of `model_config` (a config, its path, or a ModelSpec);
    `eval_batch` > 0: rank 0's evaluation before training, that many sequences per forward with
    the LM head at `eval_positions` of each. A baseline's (`options["method"]`) is
    deca_ds.baseline_memory's for the method the run builds."""
    from ..memory import ModelSpec, Workload, estimate_memory

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
    from ..memory import ModelSpec

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


# Options that do not change what a run computes (its weights, data order and split): --resume
# accepts a change to these and records it; a change to any other option is refused. Where the
# frozen layers live and where the token cache is are memory and disk placement: an offloaded run
# equals the resident one bit for bit (tests/test_runtime.py), so a resume may move to another card.
NOT_RESULT = frozenset({"output_dir", "overwrite", "resume", "timeout", "consensus_interval", "eval_interval",
                        "eval_clients", "eval_limit", "checkpoint_interval", "keep_checkpoints", "export",
                        "save_clients", "tensorboard", "trace_steps", "trace_start", "phase_timing", "offload",
                        "offload_keep", "offload_budget", "token_cache", "device_map", "gpu_memory_gb"})
# DeepSpeed keys that only change logging
NOT_RESULT_DS = frozenset({"steps_per_print", "wall_clock_breakdown"})
# Options each site of a run may set for itself (deca_ds.runtime.same_start compares the rest
# across ranks): they change neither the result nor when the ranks talk. The model and the data
# files are paths on the site's own disk; what they hold is compared by content (the weights and
# tokenizer fingerprints, the label names).
PER_SITE = frozenset({"output_dir", "overwrite", "timeout", "phase_timing", "eval_clients", "eval_limit",
                      "keep_checkpoints", "export", "save_clients", "tensorboard", "offload", "offload_keep",
                      "offload_budget", "token_cache", "device_map", "gpu_memory_gb", "model", "data_files",
                      "trust_remote_code"})
