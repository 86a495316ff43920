"""deca-reproduce --fetch: the hub models and tasks a grid's cells read, into the Hugging Face
caches, so that compute nodes without a network run the cells offline (HF_HUB_OFFLINE=1).

A model comes through huggingface_hub.snapshot_download, into the cache transformers'
from_pretrained reads: its config and tokenizer files, and its safetensors weights unless every
cell draws it from its config (`from_config`); its own code only where a cell trusts it. A task
is loaded as a cell loads it (runtime.task.load_records), which leaves it in the `datasets` cache.
"""

from __future__ import annotations

from pathlib import Path

from .grid import Cell, GridError

CONFIG_FILES = ("*.json", "*.txt", "*.model", "*.tiktoken")  # config, generation config, tokenizer
WEIGHTS = "*.safetensors"
# Llama's repos also hold the original consolidated checkpoint (16 GB for 8B), which transformers never reads
SKIPPED = ("original/*",)


def hub_needs(cells: list[Cell]) -> tuple[dict[str, list[str]], list[str]]:
    """({hub model id: its file patterns}, [task names loaded from the hub]) over `cells`."""
    from ..datasets.tasks import TASKS
    from ..models import is_hub_id

    models: dict[str, set[str]] = {}
    tasks: dict[str, None] = {}
    for cell in cells:
        o = cell.options
        if is_hub_id(o["model"]):
            patterns = models.setdefault(o["model"], set(CONFIG_FILES))
            if not o.get("from_config"):
                patterns.add(WEIGHTS)
            if o.get("trust_remote_code"):
                patterns.add("*.py")
        if o["dataset"] in TASKS and not o.get("data_files"):
            tasks[o["dataset"]] = None
    return {name: sorted(p) for name, p in models.items()}, list(tasks)


def fetch_cells(grid, select, *, log=print) -> None:
    """Download what the selected cells of `grid` read from the hub (hub_needs); GridError naming
    the model or task that could not be had."""
    from huggingface_hub import snapshot_download

    from ..runtime.options import RunOptions
    from ..runtime.task import load_records

    cells = [c for c in grid.cells if select(c)]
    models, tasks = hub_needs(cells)
    if not models and not tasks:
        log(f"{grid.name}: its cells read no hub model or task (local files, the built-in ones): nothing to fetch")
        return
    for name, patterns in models.items():
        try:
            path = Path(snapshot_download(name, allow_patterns=patterns, ignore_patterns=list(SKIPPED)))
        except Exception as err:  # offline and not cached, gated, unknown repo, network errors
            raise GridError(f"--fetch: model {name}: {type(err).__name__}: {err} (a gated model needs its license "
                            "accepted on the hub and a token: `hf auth login`)") from None
        if WEIGHTS in patterns and not any(path.glob(WEIGHTS)):
            raise GridError(f"--fetch: model {name} has no safetensors weights ({path}); deca-ds loads those only")
        size = sum(f.stat().st_size for f in path.rglob("*") if f.is_file())
        log(f"model {name}: {size / 2**30:.2f} GiB in {path}")
    for task in tasks:
        cell = next(c for c in cells if c.options["dataset"] == task and not c.options.get("data_files"))
        try:
            loaded = load_records(RunOptions(**cell.options))
        except ValueError as err:
            raise GridError(f"--fetch: task {task}: {err}") from None
        log(f"task {task}: {len(loaded.train)} training and {len(loaded.test)} test examples "
            f"({'; '.join(loaded.sources.values())})")
    log("the hub's files are in this machine's Hugging Face caches (HF_HOME); on compute nodes that share them, "
        "run the grid with HF_HUB_OFFLINE=1")
