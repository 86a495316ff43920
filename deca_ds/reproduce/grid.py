"""The reproduction grid: a YAML file of tasks x methods x (topology, clients, layers per block) x
seeds, expanded into cells and checked whole before any cell runs.

A grid file holds `options` (deca-train's RunOptions shared by every cell), `tasks` (name ->
options of that task), `methods`, `method_options` (method -> options of that method only), `seeds`
and `sweeps`: each sweep names the table it feeds (main, topology, clients, granularity, bma) and
the values of its axes (and optionally its own subset of `tasks` and its own `seeds`); an axis it
leaves out keeps the value of `options`. A `bma` sweep varies DECA's BMA betas (`bma_betas`: [β1,
β2] pairs); a cell at the betas it has anyway is the other tables' cell. Cells that two sweeps
share (the ER / 8-client cell of the main and topology tables) run once. Relative paths are read
from the directory the grid runs in.
An optional `pretrain` section (the scaled protocol) holds deca-pretrain's options for the
model `options.model` names: the grid pretrains it before its first cell unless that directory
already holds it, made with the same options.
An optional `paper` names the paper's model (qwen2.5-3b, llama-3.1-8b, qwen2-1.5b, llama-2-7b)
whose published numbers the report sets beside the grid's (deca_ds.reproduce.paper). A grid with
a generation task holds a `generation` section: the question sets its consensus models answer and
the judge that grades them (deca_ds.reproduce.generation).

Equal step budgets, as in the paper: every method of a comparison (the cells that differ only in
the method) takes the same number of model update steps - DECA's T·B·R, which the baselines get
by default - on the same number of examples per step. A method option that changes this is refused.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from ..mapping_files import load_yaml, repeated
from ..models import TINY_LLAMA
from ..reporting import CPU_KERNELS
from ..runtime.options import RANDOM_GRAPH, TRAINS, RunOptions, option_defaults
from ..runtime.parsing import convert_options
from ..runtime.presets import STEP_KEYS, load_ds_config, shipped_file, shipped_names
from ..runtime.task import DATASETS, task_kind
from . import paper
from .generation import Generation, GenerationError, parse_generation
from .pretrain import PretrainOptions

# The grid's methods: the three DECA variants of the ablation table and the baselines.
METHODS = ("deca", "trivial_bma", "no_bma", "dadam", "dec_lora", "dec_adapter", "decaf")
VARIANT_OF = {"deca": "deca", "trivial_bma": "trivial_bma", "no_bma": "no_bma"}
TABLES = ("main", "topology", "clients", "granularity", "bma")
AXES = ("topology", "clients", "layers_per_block")
BACKENDS = ("simulate", "deepspeed")
# Set per cell by the grid, never by `options`.
CELL_KEYS = ("method", "variant", "seed", "output_dir", *AXES)


# what --only takes: Cell fields, and `table`: the tables a cell feeds (its sweeps')
SELECTABLE = ("task", "method", "topology", "clients", "layers_per_block", "seed", "table")
# The checkout's reproduce/*.yaml, packaged as deca_ds/grids: an installed deca-reproduce runs them by name.
GRID_DIR = Path(__file__).resolve().parent.parent / "grids"


class GridError(ValueError):
    """A grid that cannot run as written: the message names the problem and where."""


@dataclass(frozen=True)
class Sweep:
    table: str
    tasks: tuple[str, ...]
    seeds: tuple[int, ...]
    methods: tuple[str, ...]
    topology: tuple[str, ...]
    clients: tuple[int, ...]
    layers_per_block: tuple[int, ...]
    bma_betas: tuple[tuple[float, float] | None, ...] = (None,)  # None: the options' own


@dataclass(frozen=True)
class Cell:
    """One run: a task, a method, one value per axis and a seed, with its resolved RunOptions."""

    task: str
    method: str
    topology: str
    clients: int
    layers_per_block: int
    seed: int
    options: dict = field(hash=False, compare=False)
    tables: tuple[str, ...] = field(default=(), hash=False, compare=False)
    bma_betas: tuple[float, float] | None = None  # a `bma` sweep's betas where they differ from the options'
    # the preset's keys that change a step (presets.STEP_KEYS) where it sets them
    deepspeed: dict = field(default_factory=dict, hash=False, compare=False)

    @property
    def key(self) -> str:
        bma = f"-bma{self.bma_betas[0]:g}-{self.bma_betas[1]:g}" if self.bma_betas else ""
        return (f"{self.task}/{self.topology}-n{self.clients}-lpb{self.layers_per_block}/{self.method}{bma}/"
                f"seed{self.seed}")

    @property
    def betas(self) -> str:
        """BMA's (β1, β2) the cell runs with, as the `bma` table names its rows: "0.3, 0.333"."""
        return ", ".join(f"{b:g}" for b in self.options["bma_betas"])

    @property
    def ranks_per_client(self) -> int:
        return self.options.get("ranks_per_client", 1)

    @property
    def group(self) -> tuple:
        """The comparison this cell belongs to: everything but the method."""
        return (self.task, self.topology, self.clients, self.layers_per_block, self.bma_betas, self.seed)

    def settings(self) -> dict:
        """What decides the cell's result: a finished cell with other settings is never overwritten."""
        opts = {k: v for k, v in self.options.items() if k != "output_dir"}
        # only where the preset sets them: the settings of cells from before they were saved still compare
        steps = {"deepspeed": self.deepspeed} if self.deepspeed else {}
        return json.loads(json.dumps({"key": self.key, "options": opts, **steps}, allow_nan=False))


@dataclass
class Grid:
    name: str
    backend: str
    runs_dir: Path
    results_dir: Path
    cells: list[Cell]
    budgets: dict[str, tuple[int, int]]  # cell key -> (model update steps, examples per client step)
    cell_timeout_s: float
    ds_config: str | None
    threads: int | None  # torch threads of each cell's process (None: torch's default)
    cpu_kernels: str | None  # ATen's CPU kernels of the grid's processes (ATEN_CPU_CAPABILITY; None: the CPU's best)
    jobs: int  # cells run at once (deepspeed backend: each on GPUs of its own, reproduce.placement)
    clients_per_gpu: int  # deepspeed backend: the ranks one GPU holds (above 1: they share it over gloo)
    deepspeed_args: list[str]  # the deepspeed launcher's, besides those placement adds for each cell
    pretrain: PretrainOptions | None = None  # how the cells' model is made, when the grid makes it
    paper: str | None = None  # the paper's model whose published numbers the report sets beside the cells'
    generation: Generation | None = None  # how the generation tasks' cells are answered and judged
    source: dict = field(repr=False, default_factory=dict)

    def cell_dir(self, cell: Cell) -> Path:
        return self.runs_dir / cell.key

    @staticmethod
    def generates(cell: Cell) -> bool:
        """Whether the cell's task is a generation task: its consensus model answers questions."""
        return bool(cell.options.get("questions"))

    def select(self, only: list[str]) -> Callable[[Cell], bool]:
        """`--only KEY=VALUE[,VALUE…] …`: whether a cell has one of the values for every KEY given
        (SELECTABLE: a Cell field, or `table`, which a cell has if it feeds that table); a key or
        value the grid does not have is refused, naming what it has."""
        def has(cell: Cell, key: str) -> set[str]:
            return set(cell.tables) if key == "table" else {str(getattr(cell, key))}

        wanted: dict[str, set[str]] = {}
        for item in only:
            key, sep, values = item.partition("=")
            if not sep or key not in SELECTABLE:
                raise GridError(f"--only {item!r}: give KEY=VALUE[,VALUE...] with KEY one of {', '.join(SELECTABLE)}")
            present = set().union(*(has(c, key) for c in self.cells))
            missing = [v for v in values.split(",") if v not in present]
            if missing:
                raise GridError(f"--only {item}: the grid has no {key} {', '.join(missing)} (it has "
                                f"{', '.join(sorted(present))})")
            wanted.setdefault(key, set()).update(values.split(","))
        return lambda cell: all(has(cell, key) & values for key, values in wanted.items())


_TOP = {"name", "backend", "runs_dir", "results_dir", "cell_timeout_s", "threads", "cpu_kernels", "jobs",
        "clients_per_gpu", "ds_config", "deepspeed_args", "pretrain", "paper", "generation", "options", "tasks",
        "methods", "method_options", "seeds", "sweeps"}
_SWEEP = {"table", "tasks", "seeds", "methods", "bma_betas", *AXES}
# Keys that decide where, how fast and under which limits cells run and how they are reported, not a result.
# (cpu_kernels does decide a CPU cell's bits, but each cell's run_config names the kernels it ran.)
NOT_RESULT = {"runs_dir", "results_dir", "cell_timeout_s", "jobs", "clients_per_gpu", "deepspeed_args", "paper",
              "cpu_kernels"}


def _count(value) -> bool:
    """Whether a grid value is an integer >= 1 (YAML's true is not one)."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def _as_list(value, what: str, *, once: bool = True) -> list:
    if isinstance(value, (list, tuple)):
        if not value:
            raise GridError(f"{what} is empty")
        return _once(list(value), what) if once else list(value)
    return [value]


def _once(values: list, what: str) -> list:
    """`values`, refused if one repeats: the cells are keyed by their values, so a repeat adds no cell
    (seeds [0, 0] run one seed), and is most likely a typo for another value."""
    again = repeated(values)
    if again:
        raise GridError(f"{what} lists {', '.join(map(repr, again))} more than once; give each value once")
    return values


def _check_keys(where: str, values: dict, known: set) -> None:
    if not isinstance(values, dict):
        raise GridError(f"{where} must be a mapping, got {type(values).__name__}")
    unknown = sorted(set(values) - known)
    if unknown:
        raise GridError(f"{where}: unknown key(s) {unknown}; known: {sorted(known)}")


def _check_methods(where: str, methods) -> tuple[str, ...]:
    methods = tuple(_as_list(methods, where))
    unknown = [m for m in methods if m not in METHODS]
    if unknown:
        raise GridError(f"{where}: unknown method(s) {unknown}; the grid knows {list(METHODS)}")
    return methods


def _options(where: str, values) -> dict:
    """A section of deca-train options, typed as a run file's are (YAML 1.1 reads 3e-3 as a string)."""
    if not isinstance(values, dict):
        raise GridError(f"{where} must be a mapping, got {type(values).__name__}")
    fixed = sorted(set(values) & set(CELL_KEYS) - set(AXES))
    if fixed:
        raise GridError(f"{where}: {fixed} are set per cell by the grid (methods, seeds, runs_dir), not as options")
    own = sorted(set(values) & {"resume", "overwrite", "auto_resume"})
    if own:
        raise GridError(f"{where}: {own} are the grid's: it resumes a cell's run, or starts it over, itself")
    if "time_limit" in values:
        raise GridError(f"{where}: time_limit stops a run before its end, and a grid's cells run to theirs "
                        "(cell_timeout_s bounds each)")
    answering = sorted(set(values) & {"questions", "max_new_tokens"})
    if answering:
        raise GridError(f"{where}: {answering} are the `generation` section's (questions, max_new_tokens), not options")
    try:
        return convert_options(values, where, also=())
    except ValueError as err:
        raise GridError(str(err)) from None


def num_layers(model: str) -> int | None:
    """Decoder layers of `model` ('tiny' or a local directory / config.json), None if unknown offline."""
    if model == "tiny":
        return TINY_LLAMA["num_hidden_layers"]
    path = Path(model)
    path = path / "config.json" if path.is_dir() else path
    if path.is_file():
        config = json.loads(path.read_text())
        return config.get("num_hidden_layers", config.get("n_layer"))
    return None


def _preset(ds_config: str | None) -> tuple[dict, dict]:
    """(the grid's DeepSpeed keys, the cell options its batch and `deca` section give), read once."""
    if not ds_config:
        return {}, {}
    try:
        data, deca = load_ds_config(ds_config)
    except ValueError as err:
        raise GridError(f"ds_config: {err}") from None
    return data, {"micro_batch": data.get("train_micro_batch_size_per_gpu"),
                  "grad_accum": data.get("gradient_accumulation_steps"), **deca}


def step_budget(options: dict, method: str, layers: int | None = None) -> tuple[int | str, int]:
    """(model update steps, examples per client step) of a cell: DECA's T·B·R, or a baseline's
    explicit `steps`. `layers`: the model's decoder layers where the grid makes the model (else read
    from its config). Steps are symbolic ('T·⌈L/layers per block⌉·R') when the depth is unknown offline."""
    examples = (options.get("micro_batch") or 1) * (options.get("grad_accum") or 1) * options.get("ranks_per_client", 1)
    tbr = (options["rounds"], options["layers_per_block"], options["steps_per_block"])
    extra = sum(bool(options.get(name)) for name in TRAINS)  # the embeddings', final norm's, LM head's blocks
    blocks = f"(⌈L/{tbr[1]}⌉ + {extra})" if extra else f"⌈L/{tbr[1]}⌉"
    layers = layers or num_layers(options["model"])
    deca_steps = (options["rounds"] * (math.ceil(layers / options["layers_per_block"]) + extra)
                  * options["steps_per_block"] if layers else f"{tbr[0]}·{blocks}·{tbr[2]}")
    if method in VARIANT_OF or not options.get("steps"):
        return deca_steps, examples
    if not layers:
        raise GridError(f"method {method} sets steps={options['steps']} but the depth of model {options['model']!r} "
                        "is unknown offline, so its budget cannot be checked against DECA's T·B·R; drop `steps` "
                        "(the baselines then take DECA's budget) or point `model` at a local config")
    return options["steps"], examples


def grid_names() -> list[str]:
    """Names of the shipped grids (`deca-reproduce NAME`)."""
    return shipped_names(GRID_DIR, ".yaml")


def grid_path(spec: str | Path) -> Path:
    """A grid file, or a shipped grid's name (deca_ds.runtime.presets.shipped_file)."""
    try:
        return shipped_file(spec, GRID_DIR, "reproduce/NAME.yaml", what="grid file", noun="grid")
    except ValueError as err:
        raise GridError(str(err)) from None


def load_grid(path: str | Path, *, runs_dir: str | Path | None = None, results_dir: str | Path | None = None,
              jobs: int | None = None, clients_per_gpu: int | None = None, deepspeed_args: list[str] | None = None,
              backend: str | None = None, ds_config: str | None = None, options: dict | None = None) -> Grid:
    """Read and check a grid file (a path, or a shipped grid's name); `runs_dir`, `results_dir`,
    `jobs`, `clients_per_gpu`, `deepspeed_args`, `backend` and `ds_config` override the file's, and
    `options` its options (every cell's)."""
    path = grid_path(path)
    try:
        data = load_yaml(path.read_text())
    except yaml.YAMLError as err:
        raise GridError(f"{path} is not valid YAML: {err}") from None
    if isinstance(data, dict):  # else build_grid says what the file holds
        given = {"backend": backend, "ds_config": ds_config}
        data = {**data, **{k: v for k, v in given.items() if v is not None}}
        if options:
            data["options"] = {**(data.get("options") or {}), **options}
    return build_grid(data, runs_dir=runs_dir, results_dir=results_dir, jobs=jobs, clients_per_gpu=clients_per_gpu,
                      deepspeed_args=deepspeed_args, where=str(path))


def parse_settings(pairs: list[str]) -> dict:
    """`KEY=VALUE` words (deca-reproduce --set) as options, each value read as YAML: 1e-4, true, [a, b]."""
    options = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise GridError(f"--set {pair!r}: expected KEY=VALUE, e.g. --set compile_layers=true")
        try:
            options[key] = load_yaml(value)
        except yaml.YAMLError as err:
            raise GridError(f"--set {pair!r}: the value is not valid YAML: {err}") from None
    return options


def _clients_per_gpu(k, backend: str, cells: list[Cell], where: str) -> int:
    """The grid's clients_per_gpu, checked against its backend and cells."""
    if not _count(k):
        raise GridError(f"{where}: clients_per_gpu must be an integer >= 1, got {k!r}")
    if k == 1:
        return k
    if backend != "deepspeed":
        raise GridError(f"{where}: clients_per_gpu {k}: the {backend} backend runs every client of a cell in one "
                        "process; it places ranks of the deepspeed backend")
    for c in cells:
        if c.ranks_per_client != 1:
            raise GridError(f"{where}: clients_per_gpu {k}: cell {c.key} has {c.ranks_per_client} ranks per client, "
                            "which need a GPU each; share GPUs only between clients of one rank")
        if c.options.get("transport", "auto") not in ("auto", "gloo"):
            raise GridError(f"{where}: clients_per_gpu {k}: cell {c.key} sets transport {c.options['transport']}, "
                            "and ranks that share a GPU talk over gloo (docs/transport.md)")
    return k


def _seeds(values, where: str) -> list[int]:
    seeds = _as_list(values, where)
    bad = [s for s in seeds if not isinstance(s, int) or isinstance(s, bool) or s < 0]
    if bad:
        raise GridError(f"{where} must be integers >= 0, got {bad}")
    return seeds


def build_grid(data: dict, *, runs_dir=None, results_dir=None, jobs=None, clients_per_gpu=None, deepspeed_args=None,
               where: str = "grid") -> Grid:
    """Check a grid file's contents whole and expand them into cells; the keyword arguments
    override the file's (load_grid)."""
    _check_keys(where, data, _TOP)
    grid_name, backend, ds_config = _header(data, where)
    base = _options(f"{where}: options", data.get("options") or {})
    methods = _check_methods(f"{where}: methods", data["methods"])
    method_options = data.get("method_options") or {}
    _check_keys(f"{where}: method_options", method_options, set(METHODS))
    method_options = {m: _options(f"{where}: method_options.{m}", opts) for m, opts in method_options.items()}
    tasks = _tasks(data["tasks"], where)
    seeds = _seeds(data["seeds"], f"{where}: seeds")
    ds_keys, preset = _preset(ds_config)  # whichever the backend: a grid run on the other one has the same cells
    on_steps = {k: ds_keys[k] for k in STEP_KEYS if ds_keys.get(k)}
    axis_defaults = {a: base.get(a, preset.get(a, option_defaults()[a])) for a in AXES}
    sweeps = [_sweep(raw, f"{where}: sweeps[{i}]", tasks, methods, seeds, axis_defaults)
              for i, raw in enumerate(data.get("sweeps") or [{"table": "main"}])]
    runs = Path(runs_dir or data.get("runs_dir") or f"runs/{grid_name}").expanduser()
    # a grid with erdos_renyi cells gives them its graph options (er_p, topology_seed); its other cells do not read them
    random_graph = any("erdos_renyi" in s.topology for s in sweeps)
    cells = _expand(sweeps, lambda task, method, topo, n, lpb, seed, betas: _cell(
        task, method, topo, n, lpb, seed, preset, on_steps, base, tasks[task], method_options.get(method) or {}, runs,
        where, betas, random_graph=random_graph))
    pretrain = _pretrain(data.get("pretrain"), cells, where)
    generation, generation_tasks = _generation(data.get("generation"), cells, where)
    # a generation cell's x̄ answers the question sets (deca-train --questions)
    cells = [dataclasses.replace(c, options={**c.options, **generation.options()}) if c.task in generation_tasks
             else c for c in cells]
    depth = pretrain.model["num_hidden_layers"] if pretrain else None
    budgets = {c.key: step_budget(c.options, c.method, depth) for c in cells}
    _check_budgets(cells, budgets, where)
    if backend == "simulate":
        for c in cells:
            if c.ranks_per_client != 1:
                raise GridError(f"{where}: cell {c.key}: the simulate backend runs each client as one rank "
                                f"(ranks_per_client 1, not {c.ranks_per_client}); use the deepspeed backend")
    running = _running(data, backend, cells, where, jobs=jobs, clients_per_gpu=clients_per_gpu,
                       deepspeed_args=deepspeed_args)
    paper_model = _paper_model(data.get("paper"), cells, where)
    results = Path(results_dir or data.get("results_dir") or runs / "results").expanduser()
    for name, directory, holds in (("runs_dir", runs, "cells run in"), ("results_dir", results,
                                                                       "tables and figures go to")):
        if directory.exists() and not directory.is_dir():
            raise GridError(f"{where}: {name} {directory} is a file: give the directory the grid's {holds}")
    return Grid(name=grid_name, backend=backend, runs_dir=runs, results_dir=results, cells=cells, budgets=budgets,
                ds_config=ds_config, **running, pretrain=pretrain, paper=paper_model, generation=generation,
                source=data)


def _header(data: dict, where: str) -> tuple[str, str, str | None]:
    """The grid's name, backend and ds_config, checked, and its required sections present."""
    text = [k for k in ("name", "backend", "runs_dir", "results_dir", "ds_config")
            if k in data and not isinstance(data[k], str)]
    if text:
        raise GridError(f"{where}: {', '.join(text)} must be text, got {[data[k] for k in text]}")
    for key in ("tasks", "methods", "seeds"):
        if key not in data:
            raise GridError(f"{where}: `{key}` is missing")
    grid_name = data.get("name", path_stem(where))
    if grid_name in ("", ".", "..") or "/" in grid_name or "\\" in grid_name:  # the default runs_dir is runs/NAME
        raise GridError(f"{where}: name must be a name, not a path, got {grid_name!r}")
    backend = data.get("backend", "simulate")
    if backend not in BACKENDS:
        raise GridError(f"{where}: backend must be one of {BACKENDS}, got {backend!r}")
    ds_config = data.get("ds_config")
    if backend == "deepspeed" and not ds_config:
        raise GridError(f"{where}: the deepspeed backend needs `ds_config` (a shipped preset's name, or a "
                        "DeepSpeed JSON file)")
    return grid_name, backend, ds_config


def _tasks(tasks, where: str) -> dict[str, dict]:
    """The `tasks` section: task name -> its options, each naming a dataset deca-train has."""
    if not isinstance(tasks, dict) or not tasks:
        raise GridError(f"{where}: tasks must be a non-empty mapping of task name -> options")
    tasks = {name: _options(f"{where}: tasks.{name}", opts or {}) for name, opts in tasks.items()}
    for name, opts in tasks.items():
        dataset = opts.get("dataset", name)
        if dataset not in DATASETS:
            raise GridError(f"{where}: unknown task {name!r} (dataset {dataset!r}); a task is one of {list(DATASETS)} "
                            "or names one with `dataset:`")
    return tasks


def _sweep(raw, at: str, tasks: dict, methods: tuple[str, ...], seeds: list[int], axis_defaults: dict) -> Sweep:
    """One entry of `sweeps`: its own subsets of the grid's tasks, seeds and methods, and its axes
    (an axis it leaves out takes `axis_defaults`: the options', else the preset's, else deca-train's)."""
    _check_keys(at, raw, _SWEEP)
    table = raw.get("table", "main")
    if table not in TABLES:
        raise GridError(f"{at}: table must be one of {TABLES}, got {table!r}")
    sweep_tasks = tuple(_as_list(raw.get("tasks", list(tasks)), f"{at}.tasks"))
    stray = sorted(set(sweep_tasks) - set(tasks))
    if stray:
        raise GridError(f"{at}: tasks {stray} are not in the grid's `tasks`")
    sweep_seeds = tuple(_seeds(raw.get("seeds", seeds), f"{at}.seeds"))
    sweep_methods = _check_methods(f"{at}.methods", raw.get("methods", methods))
    outside = sorted(set(sweep_methods) - set(methods))
    if outside:
        raise GridError(f"{at}: methods {outside} are not in the grid's `methods`")
    axes = {a: tuple(_as_list(raw.get(a, axis_defaults[a]), f"{at}.{a}")) for a in AXES}
    for axis in ("clients", "layers_per_block"):
        bad = [v for v in axes[axis] if not _count(v)]
        if bad:
            raise GridError(f"{at}: {axis} must be integers >= 1, got {bad}; set `{axis}` in options or the sweep")
    betas = _bma_betas(raw["bma_betas"], sweep_methods, at) if "bma_betas" in raw else (None,)
    return Sweep(table, sweep_tasks, sweep_seeds, sweep_methods, **axes, bma_betas=betas)


def _expand(sweeps: list[Sweep], make: Callable[..., Cell]) -> list[Cell]:
    """The cells of every sweep, made by `make(task, method, topology, clients, layers_per_block,
    seed, betas)`; a cell two sweeps share runs once and feeds both tables."""
    cells: dict[str, Cell] = {}
    # seed by seed: every cell of a sweep's first seed runs before any of its second, so a grid
    # stopped early (a time limit, a lent GPU's budget) has whole tables at one seed
    for sweep in sweeps:
        for seed, task, topo, n, lpb, method, betas in itertools.product(
                sweep.seeds, sweep.tasks, sweep.topology, sweep.clients, sweep.layers_per_block, sweep.methods,
                sweep.bma_betas):
            cell = make(task, method, topo, n, lpb, seed, betas)
            old = cells.get(cell.key)
            tables = (old.tables if old else ()) + (sweep.table,)
            cells[cell.key] = dataclasses.replace(cell, tables=tuple(dict.fromkeys(tables)))
    return list(cells.values())


def _running(data: dict, backend: str, cells: list[Cell], where: str, *, jobs, clients_per_gpu,
             deepspeed_args) -> dict:
    """How the cells run, as Grid's fields: threads, CPU kernels, cells at once, GPU sharing, the
    launcher's arguments and each cell's time limit (the keyword arguments override the file's)."""
    # One thread per cell by default: on a shared CPU, torch's threads spinning against other processes
    # cost several times the work (measured here: 21 s with one thread, minutes with two under load).
    threads = data.get("threads", 1 if backend == "simulate" else None)
    if threads is not None and (not isinstance(threads, int) or threads < 1):
        raise GridError(f"{where}: threads must be an integer >= 1 or null, got {threads!r}")
    cpu_kernels = data.get("cpu_kernels")
    if cpu_kernels is not None and cpu_kernels not in CPU_KERNELS:
        raise GridError(f"{where}: cpu_kernels must be one of {', '.join(CPU_KERNELS)} (ATEN_CPU_CAPABILITY's values) "
                        f"or null, got {cpu_kernels!r}")
    jobs = data.get("jobs", 1) if jobs is None else jobs
    if not _count(jobs):
        raise GridError(f"{where}: jobs must be an integer >= 1, got {jobs!r}")
    sharing = _clients_per_gpu(data.get("clients_per_gpu", 1) if clients_per_gpu is None else clients_per_gpu,
                               backend, cells, where)
    deepspeed_args = data.get("deepspeed_args") if deepspeed_args is None else deepspeed_args
    if deepspeed_args is not None and not isinstance(deepspeed_args, list):
        raise GridError(f"{where}: deepspeed_args must be a list of the launcher's arguments, e.g. [--hostfile, "
                        f"hosts], got {deepspeed_args!r}")
    if deepspeed_args and backend != "deepspeed":
        raise GridError(f"{where}: deepspeed_args {deepspeed_args}: the {backend} backend starts no deepspeed launcher")
    timeout = data.get("cell_timeout_s", 3600)
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not 0 < timeout < math.inf:
        raise GridError(f"{where}: cell_timeout_s must be a finite number > 0, got {timeout!r}")
    return {"threads": threads, "cpu_kernels": cpu_kernels, "jobs": jobs, "clients_per_gpu": sharing,
            "deepspeed_args": [str(a) for a in deepspeed_args or []], "cell_timeout_s": float(timeout)}


def _paper_model(paper_model, cells: list[Cell], where: str) -> str | None:
    """The grid's `paper`: one of the paper's models, with at least one of the grid's cells in its tables."""
    if paper_model is None:
        return None
    if paper_model not in paper.models():
        raise GridError(f"{where}: paper must name one of the paper's models, {paper.models()}, got {paper_model!r}")
    if not paper.published_cells(cells, paper_model):
        tasks = sorted({k[2] for table in paper.reference(paper_model).values() for k in table} - {paper.AVERAGE})
        raise GridError(f"{where}: paper {paper_model}: no cell of the grid is in the paper's tables, whose tasks "
                        f"are {', '.join(tasks)} (a task by its dataset)")
    return paper_model


def _generation(section, cells: list[Cell], where: str) -> tuple[Generation | None, frozenset[str]]:
    """The grid's `generation` section and its generation tasks: a grid has the one exactly when
    it has the other."""
    tasks = frozenset(c.task for c in cells if task_kind(RunOptions(**c.options)) == "generation")
    if tasks and section is None:
        raise GridError(f"{where}: {', '.join(sorted(tasks))} is a generation task: its consensus models answer "
                        "question sets that a judge model grades; name them in a `generation` section "
                        "(docs/reproduce.md)")
    if section is not None and not tasks:
        raise GridError(f"{where}: generation: the grid has no generation task (e.g. alpaca, or files with a "
                        "response_column) whose models would answer its questions")
    if section is None:
        return None, tasks
    try:
        return parse_generation(section, where), tasks
    except GenerationError as err:
        raise GridError(str(err)) from None


def _pretrain(section, cells: list[Cell], where: str) -> PretrainOptions | None:
    """The grid's `pretrain` section as deca-pretrain's options, writing the model every cell
    fine-tunes."""
    if section is None:
        return None
    known = {f.name for f in dataclasses.fields(PretrainOptions)} - {"output_dir"}
    _check_keys(f"{where}: pretrain", section, known)
    models = sorted({c.options["model"] for c in cells})
    if len(models) > 1 or models[0] == "tiny":
        raise GridError(f"{where}: pretrain makes the one model every cell fine-tunes, a directory `options.model` "
                        f"names; the cells fine-tune {models}")
    try:  # typed as deca-pretrain's options, as the cells' are deca-train's
        values = convert_options(section, f"{where}: pretrain", cls=PretrainOptions, command="deca-pretrain",
                                 also=())
    except ValueError as err:
        raise GridError(str(err)) from None
    try:
        made = PretrainOptions(output_dir=models[0], **values)
    except ValueError as err:
        raise GridError(f"{where}: pretrain: {err}") from None
    positions, default = made.model["max_position_embeddings"], option_defaults()["max_seq_len"]
    longer = {c.key: n for c in cells if (n := c.options.get("max_seq_len", default)) > positions}
    if longer:  # each would be refused at its start, after the pretraining
        shown = ", ".join(f"{key} (max_seq_len {n})" for key, n in sorted(longer.items())[:3])
        raise GridError(f"{where}: {len(longer)} cell(s) take examples longer than the context of the model pretrain "
                        f"makes (max_position_embeddings {positions}): {shown}{', …' if len(longer) > 3 else ''}; "
                        "lower their max_seq_len or raise pretrain.model.max_position_embeddings")
    return made


def path_stem(where: str) -> str:
    return Path(where).stem


def _bma_betas(values, methods: tuple[str, ...], where: str) -> tuple[tuple[float, float], ...]:
    """A `bma` sweep's (β1, β2) pairs, for DECA's variants only (the baselines have no BMA)."""
    others = [m for m in methods if m not in VARIANT_OF]
    if others:
        raise GridError(f"{where}.bma_betas: BMA's betas are DECA's; the sweep's methods {others} have none "
                        "(give the sweep `methods: [deca]`)")
    pairs = _as_list(values, f"{where}.bma_betas", once=False)  # each a pair first, then each pair once
    bad = [p for p in pairs if not isinstance(p, (list, tuple)) or len(p) != 2
           or not all(isinstance(b, (int, float)) and not isinstance(b, bool) for b in p)]
    if bad:
        raise GridError(f"{where}.bma_betas must be [β1, β2] pairs, e.g. [[0.3, 0.222], [0.3, 0.333]], got {bad}")
    return tuple(_once([(float(b1), float(b2)) for b1, b2 in pairs], f"{where}.bma_betas"))


def _cell(task, method, topology, clients, lpb, seed, preset, on_steps, base, task_opts, method_opts, runs, where,
          betas: tuple[float, float] | None = None, *, random_graph: bool = False) -> Cell:
    options = {**preset, **base, **task_opts, **method_opts}
    if random_graph and topology != "erdos_renyi":
        options = {k: v for k, v in options.items() if k not in RANDOM_GRAPH}
    options.setdefault("dataset", task)
    options.update(method="deca" if method in VARIANT_OF else method, variant=VARIANT_OF.get(method, "deca"),
                   topology=topology, clients=int(clients), layers_per_block=int(lpb), seed=seed)
    # a sweep's betas equal to those the cell has anyway make no other cell: it is the one the main table runs
    if betas is not None and betas != tuple(options.get("bma_betas", option_defaults()["bma_betas"])):
        options["bma_betas"] = list(betas)
    else:
        betas = None
    cell = Cell(task, method, topology, int(clients), int(lpb), seed, options, bma_betas=betas, deepspeed=on_steps)
    options["output_dir"] = str(runs / cell.key / "train")
    try:
        resolved = dataclasses.asdict(RunOptions(**options))
    except (ValueError, TypeError) as err:
        raise GridError(f"{where}: cell {cell.key}: {err}") from None
    if resolved["micro_batch"] is None:
        resolved["micro_batch"] = 1
    if resolved["grad_accum"] is None:
        resolved["grad_accum"] = 1
    return dataclasses.replace(cell, options=resolved)


def _check_budgets(cells: list[Cell], budgets: dict, where: str) -> None:
    groups: dict[tuple, list[Cell]] = {}
    for c in cells:
        groups.setdefault(c.group, []).append(c)
    for members in groups.values():
        seen = {budgets[c.key] for c in members}
        if len(seen) > 1:
            detail = ", ".join(f"{c.method}: {budgets[c.key][0]} steps x {budgets[c.key][1]} examples"
                               for c in members)
            raise GridError(f"{where}: unequal step budgets in {members[0].group} ({detail}); the paper compares "
                            "methods at the same number of model update steps and examples per step")
