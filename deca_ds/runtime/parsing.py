"""deca-train's options from their four sources, lowest first: RunOptions' defaults < the DeepSpeed
preset's "deca" section < a run file (--config, YAML or JSON) < the command line. The command line
is generated from the dataclass, so every option has one name everywhere (`--steps-per-block` on
the command line, `steps_per_block` in files). Every value from a file is converted to the field's
declared type here, at the edge, with errors that name the file and the key.

The same conversion and flags serve the commands that take some of these options or options of
their own (deca-eval, deca-split, deca-pretrain, grid files): `convert_options`, `add_option`.
Like options.py, this module imports no torch at import time.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import functools
import json
import os
import types
import typing
from pathlib import Path

import yaml

from ..mapping_files import load_json, load_yaml
from .options import RunOptions, expand_home, option_groups
from .presets import HONORED, load_ds_config, preset_names, split_ds_config

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
