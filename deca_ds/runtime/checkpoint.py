"""Per-client checkpoints, written atomically, and the choice of where to resume.

Layout: <output>/checkpoints/step_<S>/client_<c>/
    model.safetensors, optimizer.pt        (written by the client's first rank)
    rank_<l>.pt                            (every rank: its data position and RNG state)
Every file is written to a temporary name and renamed, so a file that exists is complete. A
client's step is complete when all its files exist; the run resumes from the latest step that is
complete for every client (the ranks agree on it with one all-gather, so nodes need not share a
file system). A rank killed mid-write leaves that step incomplete and the previous one is used.
"""

from __future__ import annotations

import os
import re
import shutil
import tempfile
from pathlib import Path
from typing import Callable

import torch
from safetensors.torch import load_model, save_model

_STEP = re.compile(r"step_(\d+)$")


def atomic_write(path: Path, write: Callable[[str], None]) -> None:
    """Call write(tmp) on a temporary file beside `path`, then rename it into place."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.close(fd)
    try:
        write(tmp)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def step_dir(root: Path, step: int) -> Path:
    return root / "checkpoints" / f"step_{step:08d}"


def client_dir(root: Path, step: int, client: int) -> Path:
    return step_dir(root, step) / f"client_{client:03d}"


def client_files(ranks_per_client: int) -> list[str]:
    return ["model.safetensors", "optimizer.pt", *(f"rank_{l}.pt" for l in range(ranks_per_client))]


def save_client(root: Path, step: int, client: int, local_rank: int, *, model: torch.nn.Module | None,
                optimizer_state: dict | None, rank_state: dict) -> None:
    """Write this rank's part of checkpoint `step`; model and optimizer only on a client's first rank."""
    d = client_dir(root, step, client)
    if model is not None:
        atomic_write(d / "model.safetensors", lambda tmp: save_model(model, tmp))  # tied weights stored once
        atomic_write(d / "optimizer.pt", lambda tmp: torch.save(optimizer_state, tmp))
    atomic_write(d / f"rank_{local_rank}.pt", lambda tmp: torch.save(rank_state, tmp))


def complete_steps(root: Path, client: int, ranks_per_client: int) -> list[int]:
    """Checkpoint steps whose every file of `client` exists, ascending."""
    base = root / "checkpoints"
    steps = []
    for d in base.iterdir() if base.is_dir() else ():
        m = _STEP.match(d.name)
        if m and all((client_dir(root, int(m.group(1)), client) / f).is_file()
                     for f in client_files(ranks_per_client)):
            steps.append(int(m.group(1)))
    return sorted(steps)


def load_client(root: Path, step: int, client: int, local_rank: int, model: torch.nn.Module,
                device: torch.device) -> dict:
    """Load the model's weights in place, where the model is; return the optimizer state (on
    `device`) and this rank's state."""
    d = client_dir(root, step, client)
    load_model(model, d / "model.safetensors", strict=True, device=str(next(model.parameters()).device))
    return {
        "optimizer": torch.load(d / "optimizer.pt", map_location=device, weights_only=True),
        "rank": torch.load(d / f"rank_{local_rank}.pt", weights_only=True),
    }


def save_hf_model(model: torch.nn.Module, directory: Path) -> None:
    """config.json + model.safetensors, loadable by from_pretrained, from any rank.

    (transformers' save_pretrained writes only on global rank 0 once torch.distributed is up.)"""
    directory.mkdir(parents=True, exist_ok=True)
    model.config.to_json_file(directory / "config.json")
    atomic_write(directory / "model.safetensors", lambda tmp: save_model(model, tmp, metadata={"format": "pt"}))


def prune(root: Path, client: int, keep: list[int]) -> None:
    """Remove this client's checkpoints of steps not in `keep`, and step folders left empty.

    Called only after a barrier that follows the newest save, so no other client can still
    need an older step to resume from."""
    base = root / "checkpoints"
    for d in base.iterdir() if base.is_dir() else ():
        m = _STEP.match(d.name)
        if m and int(m.group(1)) not in keep:
            shutil.rmtree(d / f"client_{client:03d}", ignore_errors=True)
            try:
                d.rmdir()
            except OSError:
                pass  # other clients' files are still there
