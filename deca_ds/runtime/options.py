"""Run options of deca-train (launch/train.py): one dataclass, RunOptions, with every option's type,
default, choices and help, and the checks a set of options must pass before anything is loaded.
parsing.py builds the command line from it and merges the options' four sources.

This module imports no torch (nor the modules that do) at import time: `--help` and
`--print-config` stay fast. The choice lists below are the names the algorithm modules define;
tests/test_config.py checks they agree.
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
import string
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ..blocks import Partition
    from ..config import DecaConfig
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
# And for the graph: only the random one draws its edges (`--er-p 0.3 --topology ring` was a ring)
RANDOM_GRAPH = ("er_p", "topology_seed")


def unread_by(method: str, dataset: str | None = None, iid: bool = False,
              topology: str = "erdos_renyi") -> dict[str, dict[str, str]]:
    """The options a run of `method` on `dataset` (split IID or not) over `topology` does not read,
    by what leaves them unread ('--method dadam', '--dataset synthetic', '--iid', '--topology
    ring'), each with who does read it."""
    groups = {f"--method {method}": {name: f"read by {'/'.join(methods)} only"
                                      for name, methods in READ_BY.items() if method not in methods}}
    if dataset == "synthetic":
        groups["--dataset synthetic"] = dict.fromkeys(TASK_DATA, "read by --dataset files and the hub tasks")
    if iid:
        groups["--iid"] = dict.fromkeys(DIRICHLET, "the Dirichlet split's, which --iid replaces")
    if topology != "erdos_renyi":
        groups[f"--topology {topology}"] = dict.fromkeys(RANDOM_GRAPH, "read by --topology erdos_renyi only")
    return groups


def unread_in(options: dict) -> set[str]:
    """The options of `unread_by` for a run of these options (a run_config.json's, a grid cell's,
    asdict(RunOptions); one left out takes its default): they change none of its results (a run
    saved before they were refused may hold another value)."""
    defaults = option_defaults()
    groups = unread_by(*(options.get(k, defaults[k]) for k in ("method", "dataset", "iid", "topology")))
    return {name for names in groups.values() for name in names}


# Options that act only with another (given alone, they did nothing, silently), and why
NEEDS = {"trace_start": ("trace_steps", "it is the first of the steps that one traces"),
         "eval_clients": ("eval_interval", "it scores each client at the steps that one scores x̄ at"),
         "max_new_tokens": ("questions", "it bounds the answers to that one's question sets"),
         "weight_decay_on": ("weight_decay", "it chooses the tensors that one decays"),
         "keep_checkpoints": ("checkpoint_interval", "it prunes the checkpoints that one writes"),
         "auto_resume": ("checkpoint_interval", "it resumes from the checkpoints that one writes")}


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
    er_p: float = _opt(0.5, "Erdős–Rényi edge probability (--topology erdos_renyi only)")
    topology_seed: int = _opt(0, "seed of the Erdős–Rényi graph (--topology erdos_renyi only)")
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
    keep_checkpoints: int = _opt(2, "complete checkpoints kept (with --checkpoint-interval)")
    time_limit: float = _opt(0.0, "minutes: stop, with a checkpoint, at the last step that ends before this long "
                             "after the start (0 = none; docs/outputs.md)")
    resume: bool = _opt(False, "continue from the latest complete checkpoint in --output-dir")
    auto_resume: bool = _opt(False, "continue the run in --output-dir if it holds one, else start it: one command "
                             "for a job's first start and every requeue (docs/outputs.md)")
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
                     "topology_seed", "time_limit"):
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
        ignored, given = {}, 0
        for who, names in unread_by(self.method, self.dataset, self.iid, self.topology).items():
            flags = [f"--{name.replace('_', '-')} ({reader})" for name, reader in names.items()
                     if getattr(self, name) != defaults[name]]
            if flags:
                ignored[who] = f"{who} does not read {', '.join(flags)}"
                given += len(flags)
        if ignored:
            leave = "it at its default" if given == 1 else "them at their defaults"
            graph_only = all(who.startswith("--topology") for who in ignored)
            where = ("in a grid, they go to its erdos_renyi cells only" if graph_only
                     else "in a grid, under method_options or the task's options")
            raise ValueError(f"{'; '.join(ignored.values())}: leave {leave} ({where})")
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
        if self.auto_resume and (self.resume or self.overwrite):
            raise ValueError(f"--auto-resume chooses between continuing the run and starting it: leave out "
                             f"--{'resume' if self.resume else 'overwrite'} (or give --no-auto-resume where a run "
                             "file sets it)")
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


# Options that do not change what a run computes (its weights, data order and split): --resume
# accepts a change to these and records it; a change to any other option is refused. Where the
# frozen layers live and where the token cache is are memory and disk placement: an offloaded run
# equals the resident one bit for bit (tests/test_runtime.py), so a resume may move to another card.
NOT_RESULT = frozenset({"output_dir", "overwrite", "resume", "auto_resume", "timeout", "consensus_interval",
                        "eval_interval", "eval_clients", "eval_limit", "checkpoint_interval", "keep_checkpoints",
                        "time_limit", "export", "save_clients", "tensorboard", "trace_steps", "trace_start",
                        "phase_timing", "offload", "offload_keep", "offload_budget", "token_cache", "device_map",
                        "gpu_memory_gb"})
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
