"""x̄ of a run's checkpoint, formed in one process from every client's saved state (deca-eval
--checkpoint, deca-export): the consensus the run would have had at that step, as the run forms it
(the clients' mean, or a non-linear method's own combination with uniform weights), without
resuming the run; or one client's model of the step (--client)."""

from __future__ import annotations

import dataclasses
import json
from contextlib import ExitStack
from pathlib import Path
from typing import NamedTuple

import torch
from safetensors import safe_open

from ..methods import Method
from ..mixing import ClientView
from ..optimizer import model_partition
from . import checkpoint as ckpt
from .options import RunOptions, read_options
from .parsing import convert_options


def run_options(root: Path) -> tuple[RunOptions, int]:
    """(the run's options, its number of clients) from its run_config.json, converted and checked as
    a run file's (an option this version does not know is named)."""
    config = root / "run_config.json"
    if not config.is_file():
        raise ValueError(f"--run {root}: no run_config.json there (not a deca-train output directory)")
    saved = json.loads(config.read_text())
    return RunOptions(**convert_options(read_options(saved["options"]), str(config))), saved["n_clients"]


def checkpoint_step(root: Path, n_clients: int, ranks_per_client: int, step: int | None) -> int:
    """`step` (None: the newest) if every client's checkpoint of it verifies (sizes and sha256);
    else a ValueError naming the steps that do and why the others do not."""
    scans = [ckpt.scan_steps(root, c, ranks_per_client) for c in range(n_clients)]
    common = sorted(set.intersection(*(set(complete) for complete, _ in scans)))
    if step in common or (step is None and common):
        return common[-1] if step is None else step
    why = "; ".join(f"client {c}: {problems[s]}" for c, (_, problems) in enumerate(scans)
                    for s in ([step] if step is not None else sorted(problems)) if s in problems)
    held = f"steps complete for every client: {common}" if common else "no step is complete for every client"
    asked = "no checkpoint" if step is None else f"checkpoint step {step}"
    raise ValueError(f"--checkpoint: {asked} to form x̄ from in {root / 'checkpoints'} ({held}"
                     + (f"; {why}" if why else "") + ")")


def mean_of_weights(model: torch.nn.Module, paths: list[Path]) -> None:
    """Each tensor of `model` the mean of the save_model files' (in at least fp32, as the run forms
    x̄), one tensor at a time: besides the model, one tensor's sum is held."""
    ckpt.load_weights(model, paths[0])  # checks that the files hold the model's tensors
    own = model.state_dict(keep_vars=True)
    with ExitStack() as files, torch.no_grad():
        first, *others = [files.enter_context(safe_open(str(p), framework="pt", device="cpu", backend="pread"))
                          for p in paths]
        names = sorted(first.keys())
        for path, f in zip(paths[1:], others):
            if sorted(f.keys()) != names:
                raise ValueError(f"checkpoint {path} holds other tensors than {paths[0]}")
        for name in names:
            tensor = own[name]
            total = tensor.to(torch.promote_types(tensor.dtype, torch.float32), copy=True)
            for f in others:
                total += f.get_tensor(name).to(total.device)
            tensor.copy_(total.div_(len(paths)))


class CheckpointModel(NamedTuple):
    model: torch.nn.Module  # x̄ (or one client's model), in the run's working dtype
    method: Method  # the run's, whose save_consensus writes the model as the run exports x̄
    tokenizer: object  # the run's model's
    step: int
    opts: RunOptions  # the run's
    n_clients: int


def checkpoint_model(run: Path, step: int | str, device: torch.device, trust_remote_code: bool,
                     client: int | None = None) -> CheckpointModel:
    """x̄ of the run's checkpoint `step` ('latest': the newest complete for every client) on `device`,
    or with `client` that client's own model of the step. The model repo's own code runs only if the
    caller allows it, never because the run did."""
    from ..models import load_tokenizer
    from .task import build_task

    opts, n_clients = run_options(run)
    if client is not None and not 0 <= client < n_clients:
        raise ValueError(f"--client {client}: the run has clients 0 to {n_clients - 1}")
    opts = dataclasses.replace(opts, trust_remote_code=trust_remote_code)
    step = checkpoint_step(run, n_clients, opts.ranks_per_client, None if step == "latest" else step)
    # the built-in tiny Llama's vocabulary is the task's word tokenizer's, made as the run made it
    tokenizer = (build_task(opts, n_clients).tokenizer if opts.model == "tiny" else
                 load_tokenizer(opts.model, trust_remote_code=trust_remote_code))
    model, method = form_consensus(run, step, opts, n_clients, len(tokenizer), device, client)
    return CheckpointModel(model, method, tokenizer, step, opts, n_clients)


def form_consensus(root: Path, step: int, opts: RunOptions, n_clients: int, vocab_size: int,
                   device: torch.device, client: int | None = None) -> tuple[torch.nn.Module, Method]:
    """(x̄ of checkpoint `step` on `device`, the run's method): the run's model as its method trains
    it, with the clients' mean weights, or for a method whose combination is not linear (DeCAF)
    client 0's with its own combination of every client's vector, as the run forms x̄ at its end.
    With `client`: that client's weights of the step instead."""
    from .plan import build_model

    model = build_model(dataclasses.replace(opts, offload="none", device_map="auto"), vocab_size)
    method = opts.build_method(model_partition(model, opts.deca_config()))
    model = method.prepare(model).to(device)
    dirs = [ckpt.client_dir(root, step, c) for c in range(n_clients)]
    if client is not None:
        ckpt.load_weights(model, dirs[client] / "model.safetensors")
        return model, method
    if method.linear:
        mean_of_weights(model, [d / "model.safetensors" for d in dirs])
        return model, method
    ckpt.load_weights(model, dirs[0] / "model.safetensors")
    optimizer = method.optimizer(model)
    states = [torch.load(d / "optimizer.pt", map_location=device, weights_only=True) for d in dirs]
    optimizer.load_state_dict(states[0])
    optimizer.combine_now(ClientView([(1 / n_clients, s["master"]) for s in states], optimizer.consensus_vector()))
    return model, method
