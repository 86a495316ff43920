"""Run options of launch/train.py: one dataclass, four sources.

Precedence, lowest first: the defaults below < the preset's "deca" section < a run file
(--config, YAML or JSON) < the command line. The command line is generated from the dataclass,
so every option has one name everywhere (`--steps-per-block` on the command line,
`steps_per_block` in files).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import typing
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from ..blocks import Partition
from ..config import VARIANTS, DecaConfig, parse_dtype
from ..datasets import TASKS
from ..methods import METHODS, AdamConfig, DAdam, DeCAF, Deca, DecAdapter, DecLoRA, Method
from ..memory import OFFLOAD_MODES, MemoryEstimate, ModelSpec, estimate_memory
from ..methods.lora import DEFAULT_TARGETS
from ..topology import TOPOLOGIES, WEIGHT_SCHEMES
from .ds_engine import HONORED, load_ds_config


def _opt(default, help: str, **extra):
    return field(default=default, metadata={"help": help, **extra})


@dataclass
class RunOptions:
    # model and data
    model: str = _opt("tiny", "hub id or local path of a causal LM, or 'tiny' (built-in random Llama)")
    trust_remote_code: bool = _opt(False, "allow the model repo's own code (off unless you ask)")
    from_config: bool = _opt(False, "random-initialize the model from its config (no weights)")
    dataset: str = _opt("synthetic", "training data: 'synthetic' (built-in non-IID task), a paper task by name "
                        "(from the hub or its cache), or 'files' (--data-files)", choices=("synthetic", *TASKS, "files"))
    data_files: list[str] | None = _opt(None, "local data as split=path (train=…, test=…; .jsonl, .json, .csv, "
                                        ".parquet); with a task name, a local copy of that task")
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
    synthetic_words: int = _opt(12, "words per example of the synthetic task (long examples fill --max-seq-len "
                                "for memory and speed profiling)")
    eval_limit: int = _opt(512, "held-out examples scored per evaluation (0 = all)")
    # clients and graph
    clients: int | None = _opt(None, "number of clients N (default: world size / ranks per client)")
    ranks_per_client: int = _opt(1, "ranks per client G (data parallel inside a client)")
    topology: str = _opt("erdos_renyi", "communication graph", choices=(*TOPOLOGIES, "file"))
    er_p: float = _opt(0.5, "Erdős–Rényi edge probability")
    topology_seed: int = _opt(0, "seed of random graphs")
    weights: str = _opt("metropolis_hastings", "mixing weights", choices=WEIGHT_SCHEMES)
    matrix_file: str | None = _opt(None, "mixing matrix file (.json, .csv, .npy) for --topology file")
    # method
    method: str = _opt("deca", "what trains and how it is mixed: DECA or a baseline (decentralized full-parameter "
                       "Adam, Dec-LoRA, Dec-Adapter, DeCAF)", choices=tuple(METHODS))
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
    steps_per_block: int = _opt(48, "local steps per block R")
    rounds: int = _opt(4, "rounds T")
    lr: float = _opt(5e-5, "learning rate γ")
    adam_betas: tuple[float, float] = _opt((0.9, 0.999), "Adam α1 α2")
    eps: float = _opt(1e-8, "Adam ε")
    bma_betas: tuple[float, float] = _opt((0.9, 0.999), "BMA β1 β2")
    variant: str = _opt("deca", "moment correction", choices=VARIANTS)
    block_order: str = _opt("ascending", "block order per round", choices=("ascending", "descending", "random"))
    seed: int = _opt(0, "seed of model init, data split, data order and random block order")
    # precision
    working_dtype: str = _opt("fp32", "dtype of the model's weights", choices=("fp32", "bf16"))
    master_dtype: str = _opt("fp32", "dtype of the active block's master, m, v", choices=("fp32", "fp64"))
    offload: str = _opt("none", "DECA: 'frozen' keeps the frozen decoder layers in pinned host memory and streams "
                        "them to the GPU layer by layer (no-op on CPU ranks)", choices=OFFLOAD_MODES)
    offload_keep: int = _opt(0, "with --offload frozen: the top N decoder layers stay on the GPU, never streamed "
                             "(N layers' memory for less copying per step)")
    offload_budget: float = _opt(0.0, "with --offload frozen: keep as many top decoder layers on the GPU as fit "
                                 "this many GB (1e9 B) of estimated peak device memory (deca_ds.memory; the CUDA "
                                 "context comes on top); 0 = off, see --offload-keep")
    state_bits: int = _opt(32, "DECA: bits per value of the active block's m and v (8 = bitsandbytes block-wise, "
                           "extra [bnb])", choices=(32, 8))
    fused_update: bool = _opt(False, "run the optimizer update (DECA's and the baselines' Adam) as torch.compile'd "
                              "fused kernels: fewer passes over the block; compiles at the first step")
    loss_chunk: int = _opt(0, "run the LM head and the loss over this many positions at a time, recomputing "
                           "each chunk's logits in backward: the full logits (about 12 bytes per position and "
                           "vocabulary entry) never exist, for one more LM-head matmul (0 = off)")
    mix_dtype: str = _opt("master", "dtype exchanged between neighbors: 'master' (exact) or 'working'",
                          choices=("master", "working"))
    # batch (override the preset's DeepSpeed keys)
    micro_batch: int | None = _opt(None, "micro-batch per rank (train_micro_batch_size_per_gpu)")
    grad_accum: int | None = _opt(None, "micro-batches per step (gradient_accumulation_steps)")
    # outputs
    output_dir: str = _opt("outputs/deca", "where metrics, checkpoints and the exported model go")
    overwrite: bool = _opt(False, "allow writing into an output directory that already holds a run")
    consensus_interval: int = _opt(10, "steps between consensus-distance measurements (0 = off)")
    eval_interval: int = _opt(0, "steps between evaluations of the consensus model x̄ (0 = at the end only)")
    eval_clients: bool = _opt(False, "at those steps also evaluate each client's own model")
    checkpoint_interval: int = _opt(0, "steps between checkpoints (0 = none)")
    keep_checkpoints: int = _opt(2, "complete checkpoints kept")
    resume: bool = _opt(False, "continue from the latest complete checkpoint in --output-dir")
    export: bool = _opt(True, "write the consensus model at the end (--no-export: evaluate it in memory only, "
                        "as the profiling tools do)")
    save_clients: bool = _opt(False, "also export every client's model")
    tensorboard: bool = _opt(False, "write TensorBoard event files")
    timeout: float = _opt(300.0, "seconds any wait on another rank may take before the run fails")

    def __post_init__(self) -> None:
        for name in ("max_seq_len", "ranks_per_client", "keep_checkpoints", "mix_every", "lora_rank", "adapter_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        for name in ("eval_limit", "consensus_interval", "eval_interval", "checkpoint_interval", "offload_keep",
                     "offload_budget", "loss_chunk"):
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
        if (self.topology == "file") != (self.matrix_file is not None):
            raise ValueError("--topology file and --matrix-file go together")
        for f in dataclasses.fields(self):
            choices = f.metadata.get("choices")
            if choices and getattr(self, f.name) not in choices:
                raise ValueError(f"{f.name} must be one of {choices}, got {getattr(self, f.name)!r}")
        if self.offload == "frozen":
            # Evaluating x̄ mid-run swaps every weight in and out on the device, which offloading
            # exists to avoid; offloading streams the decoder layers DECA's blocks freeze.
            clashes = (["eval_interval"] if self.eval_interval else []) + (["method"] if self.method != "deca" else [])
            if clashes:
                raise ValueError(f"--offload frozen does not combine with {', '.join(clashes)} "
                                 "(evaluate at the end only; offload is DECA's)")
            if self.offload_budget and self.offload_keep:
                raise ValueError("--offload-budget chooses --offload-keep: give one of them")
        elif self.offload_keep or self.offload_budget:
            raise ValueError(f"--offload-{'keep' if self.offload_keep else 'budget'} needs --offload frozen")
        self.adam_betas, self.bma_betas = tuple(self.adam_betas), tuple(self.bma_betas)
        self.deca_config()  # validates Algorithm 1's numbers now, before anything starts

    def build_method(self, partition: Partition) -> Method:
        """The method to train with; `partition` is DECA's (its T·B·R is the baselines' default budget)."""
        config = self.deca_config()
        if self.method == "deca":
            return Deca(config, partition)
        adam = AdamConfig(steps=self.steps or config.rounds * partition.num_blocks * config.steps_per_block,
                          lr=self.lr, adam_betas=self.adam_betas, eps=self.eps, mix_every=self.mix_every,
                          master_dtype=config.master_dtype, fused_update=self.fused_update)
        if self.method == "dadam":
            return DAdam(adam)
        if self.method == "dec_adapter":
            return DecAdapter(adam, size=self.adapter_size, seed=self.seed)
        lora = DeCAF if self.method == "decaf" else DecLoRA
        return lora(adam, rank=self.lora_rank, alpha=self.lora_alpha, dropout=self.lora_dropout,
                    targets=self.lora_targets or DEFAULT_TARGETS, seed=self.seed)

    def deca_config(self) -> DecaConfig:
        return DecaConfig(
            lr=self.lr, adam_betas=self.adam_betas, bma_betas=self.bma_betas, eps=self.eps,
            steps_per_block=self.steps_per_block, rounds=self.rounds,
            layers_per_block=self.layers_per_block, variant=self.variant, block_order=self.block_order,
            seed=self.seed, master_dtype=parse_dtype(self.master_dtype), state_bits=self.state_bits,
            fused_update=self.fused_update,
        )


def _field_type(f: dataclasses.Field):
    hint = typing.get_type_hints(RunOptions)[f.name]
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    return hint if not args or typing.get_origin(hint) is tuple else args[0]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="launch/train.py",
        description="Decentralized full-parameter fine-tuning with DECA, one client per rank group.",
        epilog="DeepSpeed keys honored in --ds_config: " + "; ".join(f"{k}: {v}" for k, v in HONORED.items()),
    )
    p.add_argument("--ds_config", "--ds-config", dest="ds_config", required=True,
                   help="DeepSpeed JSON preset (see ds_configs/)")
    p.add_argument("--config", help="run file (YAML or JSON) of options; the command line wins")
    p.add_argument("--local_rank", "--local-rank", type=int, default=None, help=argparse.SUPPRESS)
    for f in dataclasses.fields(RunOptions):
        flag = "--" + f.name.replace("_", "-")
        kind = _field_type(f)
        kw = dict(default=argparse.SUPPRESS, help=f.metadata["help"], dest=f.name)
        if kind is bool:
            p.add_argument(flag, action=argparse.BooleanOptionalAction, **kw)
        elif typing.get_origin(kind) is list:
            p.add_argument(flag, type=str, nargs="+", **kw)
        elif typing.get_origin(kind) is tuple:
            p.add_argument(flag, type=float, nargs=2, metavar=("B1", "B2"), **kw)
        else:
            p.add_argument(flag, type=kind, choices=f.metadata.get("choices"), **kw)
    return p


def _read_run_file(path: str) -> dict:
    try:
        text = Path(path).read_text()
    except FileNotFoundError:
        raise ValueError(f"run file {path} does not exist") from None
    data = json.loads(text) if path.endswith(".json") else yaml.safe_load(text)
    if not isinstance(data, dict):
        raise ValueError(f"run file {path} must hold a mapping of options")
    return data


def _check_names(source: str, values: dict) -> None:
    known = {f.name for f in dataclasses.fields(RunOptions)}
    unknown = sorted(set(values) - known)
    if unknown:
        raise ValueError(f"{source}: unknown option(s) {unknown}")


def parse_args(argv: list[str] | None = None) -> tuple[RunOptions, dict]:
    """(options, DeepSpeed config) with every source merged and validated."""
    args = vars(build_parser().parse_args(argv))
    ds_config, preset = load_ds_config(args.pop("ds_config"))
    run_file = args.pop("config")
    args.pop("local_rank")
    _check_names("\"deca\" section of the DeepSpeed config", preset)
    merged = dict(preset)
    if run_file:
        values = _read_run_file(run_file)
        _check_names(f"run file {run_file}", values)
        merged.update(values)
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


def estimate_run(options: dict, model_config, ds_config: dict, *, n_neighbors: int, loss_positions: int,
                 offload_keep: int | None = None) -> MemoryEstimate:
    """deca_ds.memory's estimate of a round's peak for a DECA run with `options` (RunOptions as a dict,
    micro-batch resolved) on the model of `model_config` (a config, its path, or a ModelSpec)."""
    return estimate_memory(
        model_config, options["layers_per_block"], working_dtype=options["working_dtype"],
        master_dtype=options["master_dtype"],
        transfer_dtype="working" if options["mix_dtype"] == "working" else "master",
        n_neighbors=n_neighbors, micro_batch=options["micro_batch"], seq_len=options["max_seq_len"],
        checkpointing="activation_checkpointing" in ds_config, offload=options["offload"],
        offload_keep=options["offload_keep"] if offload_keep is None else offload_keep,
        variant=options["variant"], state_bits=options["state_bits"], fused_update=options["fused_update"],
        steps_per_block=options["steps_per_block"], grad_accum=options["grad_accum"],
        deepspeed_allreduce=options["ranks_per_client"] > 1, loss_positions=loss_positions,
        loss_chunk=options["loss_chunk"])


def offload_keep_for_budget(options: dict, model_config, ds_config: dict, *, n_neighbors: int,
                            loss_positions: int) -> int:
    """The most top decoder layers --offload frozen can keep resident within --offload-budget GB of
    estimated peak."""
    spec = ModelSpec.from_config(model_config)
    budget = options["offload_budget"] * 1e9
    peak = lambda keep: estimate_run(options, spec, ds_config, n_neighbors=n_neighbors,  # noqa: E731
                                     loss_positions=loss_positions, offload_keep=keep).peak
    fits = [keep for keep in range(spec.num_layers + 1) if peak(keep) <= budget]
    if not fits:
        raise ValueError(f"--offload-budget {options['offload_budget']:g} GB: even with every frozen decoder layer "
                         f"offloaded the estimated peak is {peak(0) / 1e9:.2f} GB")
    return max(fits)
