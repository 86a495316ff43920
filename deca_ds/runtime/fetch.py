"""--fetch (deca-train, deca-reproduce): the hub models and tasks runs read, into the Hugging Face
caches, so that machines without a network run them offline (HF_HUB_OFFLINE=1).

A model comes through huggingface_hub.snapshot_download, into the cache transformers'
from_pretrained reads: its config and tokenizer files, and its safetensors weights unless every
run draws it from its config (`from_config`); its own code only where a run trusts it. A task is
loaded as a run loads it (runtime.task.load_records), which leaves it in the `datasets` cache.
"""

from __future__ import annotations

from pathlib import Path
from typing import Mapping, Sequence

CONFIG_FILES = ("*.json", "*.txt", "*.model", "*.tiktoken")  # config, generation config, tokenizer
WEIGHTS = "*.safetensors"
# Llama's repos also hold the original consolidated checkpoint (16 GB for 8B), which transformers never reads
SKIPPED = ("original/*",)


def hub_needs(runs: Sequence[Mapping]) -> tuple[dict[str, list[str]], dict[str, Mapping]]:
    """({hub model id: its file patterns}, {hub task name: the options of the first run loading it})
    over the options (RunOptions as a dict) of `runs`."""
    from ..datasets.tasks import TASKS
    from ..models import is_hub_id

    models: dict[str, set[str]] = {}
    tasks: dict[str, Mapping] = {}
    for o in runs:
        if is_hub_id(o["model"]):
            patterns = models.setdefault(o["model"], set(CONFIG_FILES))
            if not o.get("from_config"):
                patterns.add(WEIGHTS)
            if o.get("trust_remote_code"):
                patterns.add("*.py")
        if o["dataset"] in TASKS and not o.get("data_files"):
            tasks.setdefault(o["dataset"], o)
    return {name: sorted(p) for name, p in models.items()}, tasks


def fetch_hub(runs: Sequence[Mapping], *, log=print) -> None:
    """Download what `runs` (their options) read from the hub (hub_needs); ValueError naming the
    model or task that could not be had, and why."""
    from huggingface_hub import snapshot_download

    from .options import RunOptions
    from .task import load_records

    models, tasks = hub_needs(runs)
    if not models and not tasks:
        log("nothing to fetch: no hub model or task is read (local files, the built-in ones)")
        return
    for name, patterns in models.items():
        try:
            path = Path(snapshot_download(name, allow_patterns=patterns, ignore_patterns=list(SKIPPED)))
        except Exception as err:  # offline and not cached, gated, unknown repo, network errors
            raise ValueError(f"--fetch: model {name}: {type(err).__name__}: {err} (a gated model needs its "
                             "license accepted on the hub and a token: `hf auth login`)") from None
        if WEIGHTS in patterns and not any(path.glob(WEIGHTS)):
            raise ValueError(f"--fetch: model {name} has no safetensors weights ({path}); deca-ds loads those only")
        size = sum(f.stat().st_size for f in path.rglob("*") if f.is_file())
        log(f"model {name}: {size / 2**30:.2f} GiB in {path}")
    for task, options in tasks.items():
        try:
            loaded = load_records(RunOptions(**options))
        except ValueError as err:
            raise ValueError(f"--fetch: task {task}: {err}") from None
        log(f"task {task}: {len(loaded.train)} training and {len(loaded.test)} test examples "
            f"({'; '.join(loaded.sources.values())})")
    log("the hub's files are in this machine's Hugging Face caches (HF_HOME); where those are shared, "
        "runs without a network read them with HF_HUB_OFFLINE=1")
