"""DeepSpeed presets: the shipped ones by name (ds_configs/*.json, packaged as deca_ds/presets), any
JSON file by path, or a mapping from a run file; validated and split into (DeepSpeed config,
deca-ds run options of its "deca" section). Imports no torch, so the command line stays fast,
unless a preset sets a `scheduler`, which is checked by building it (runtime.lr_schedule).
"""

from __future__ import annotations

import difflib
from pathlib import Path

from ..mapping_files import load_json

PRESET_DIR = Path(__file__).resolve().parent.parent / "presets"

HONORED = {
    "train_micro_batch_size_per_gpu": "micro-batch per rank",
    "gradient_accumulation_steps": "micro-batches per optimizer step (g is their mean)",
    "train_batch_size": "must equal micro-batch × accumulation × ranks per client",
    "gradient_clipping": "global-norm clipping of the trained gradient (DECA's: the active block's), as the "
                         "simulator's grad_clip computes it (default 0 = off, unlike DeepSpeed's 1.0)",
    "activation_checkpointing": "turns on non-reentrant activation checkpointing of the decoder layers",
    "scheduler": "LR schedule, stepped once a step taken and applied to the trained lr: `type` one of "
                 "DeepSpeed's lr_schedules (WarmupLR, WarmupDecayLR, WarmupCosineLR, OneCycle, LRRangeTest) or a "
                 "torch.optim.lr_scheduler class (CosineAnnealingLR, …), `params` its arguments; checked at once",
    "steps_per_print": "DeepSpeed's own log interval",
    "wall_clock_breakdown": "DeepSpeed's own timers",
    "zero_optimization": "stage 0 only",
    "bf16": "\"enabled\": false only",
    "fp16": "\"enabled\": false only",
    "deca": "deca-ds run options (any --option of deca-train, with _ for -)",
}

# The DeepSpeed keys that change what a step computes, which a grid's cells carry whichever runs them:
# on ranks DeepSpeed's engine applies them, in a simulated cell deca_ds.reproduce.simulated does.
STEP_KEYS = ("gradient_clipping", "scheduler")

_REFUSED = {
    "bf16": "DeepSpeed's bf16 wrapper keeps FP32 master copies of every parameter; "
            "set \"deca\": {\"working_dtype\": \"bf16\"} instead",
    "fp16": "DeepSpeed's fp16 wrapper keeps FP32 master copies of every parameter; "
            "set \"deca\": {\"working_dtype\": ...} instead",
    "zero_optimization": "ZeRO stages above 0 shard optimizer state across ranks and wrap the optimizer; "
                         "DECA keeps state for the active block only and must not shard across clients",
    "optimizer": "DECA supplies the optimizer; set lr, betas, eps and weight decay with deca-ds options",
}


def shipped_file(spec: str | Path, directory: Path, checkout: str, *, what: str, noun: str) -> Path:
    """An existing file, else the one of that name shipped in `directory` (with or without its
    suffix, or as `checkout`/NAME, its path in the checkout, so the documented commands run from any
    directory). ValueError naming the closest shipped name where there is neither."""
    path = Path(spec).expanduser()
    if path.is_file():
        return path
    suffix = Path(checkout).suffix
    name = path.name.removesuffix(suffix)
    shipped = directory / f"{name}{suffix}"
    if path.parent in (Path("."), Path(checkout).parent) and shipped.is_file():
        return shipped
    names = shipped_names(directory, suffix)
    close = difflib.get_close_matches(name, names, n=1)
    hint = f"did you mean {close[0]!r}? " if close else ""
    raise ValueError(f"{what} {spec}: no such file and no shipped {noun} of that name ({hint}{noun}s: "
                     f"{', '.join(names)})")


def shipped_names(directory: Path, suffix: str) -> list[str]:
    return sorted(p.stem for p in directory.glob(f"*{suffix}"))


def preset_names() -> list[str]:
    """Names of the shipped presets (`--preset NAME`)."""
    return shipped_names(PRESET_DIR, ".json")


def preset_path(spec: str | Path) -> Path:
    """A DeepSpeed JSON file, or a shipped preset's name (shipped_file)."""
    return shipped_file(spec, PRESET_DIR, "ds_configs/NAME.json", what="DeepSpeed config", noun="preset")


def split_ds_config(config: dict, source: str) -> tuple[dict, dict]:
    """Validate a DeepSpeed config and split it into (DeepSpeed keys, its "deca" run options)."""
    if not isinstance(config, dict):
        raise ValueError(f"DeepSpeed config {source} must hold a JSON object (a mapping)")
    config = dict(config)
    unknown = sorted(set(config) - set(HONORED) - set(_REFUSED))
    if unknown:
        raise ValueError(f"DeepSpeed config {source}: unknown key(s) {unknown}; deca-ds honors {sorted(HONORED)}")
    for key, why in _REFUSED.items():
        if key not in config:
            continue
        value = config[key]
        allowed = (key in ("bf16", "fp16") and isinstance(value, dict) and not value.get("enabled", False)
                   or key == "zero_optimization" and isinstance(value, dict)
                   and value.get("stage", 0) == 0 and set(value) <= {"stage"})
        if not allowed:
            raise ValueError(f"DeepSpeed config {source}: key {key!r} = {value!r} is not supported: {why}")
    if "scheduler" in config:  # a misspelt schedule stops here, not once the model has loaded
        from .lr_schedule import check

        check(config["scheduler"], f"DeepSpeed config {source}")
    deca = config.pop("deca", {})
    if not isinstance(deca, dict):
        raise ValueError(f"DeepSpeed config {source}: \"deca\" must be an object of run options")
    return config, deca


def load_ds_config(spec: str | Path) -> tuple[dict, dict]:
    """Read a preset (a path or a shipped preset's name) and split it as split_ds_config does."""
    path = preset_path(spec)
    try:
        config = load_json(path.read_text())
    except ValueError as err:  # not JSON, or a key given twice
        raise ValueError(f"DeepSpeed config {path} is not valid JSON: {err}") from None
    return split_ds_config(config, str(path))
