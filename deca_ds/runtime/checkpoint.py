"""Per-client checkpoints, written atomically, and the choice of where to resume.

Layout: <output>/checkpoints/step_<S>/client_<c>/
    model.safetensors, optimizer.pt        (written by the client's first rank)
    rank_<l>.pt                            (every rank: its data position and RNG state)
    manifest_<l>.json                      (every rank, written last: size and sha256 of its files)
Every file is written to a temporary name and renamed. A client's step is complete only when the
manifest of each of its ranks exists and every file it lists has that size (and, when resuming,
that sha256): a file cut short on disk, or a rank killed before its manifest, leaves the step
incomplete. The run resumes from the latest step complete for every client (the ranks agree on
it with one all-gather, so nodes need not share a file system) and says which newer steps it
skipped and why.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file, save_model

from ..files import atomic_write, sha256, write_json

_STEP = re.compile(r"step_(\d+)$")


def step_dir(root: Path, step: int) -> Path:
    return root / "checkpoints" / f"step_{step:08d}"


def client_dir(root: Path, step: int, client: int) -> Path:
    return step_dir(root, step) / f"client_{client:03d}"


def rank_files(local_rank: int) -> list[str]:
    """What rank `local_rank` of a client writes into its step folder (besides its manifest)."""
    return [*(("model.safetensors", "optimizer.pt") if local_rank == 0 else ()), f"rank_{local_rank}.pt"]


def manifest_name(local_rank: int) -> str:
    return f"manifest_{local_rank}.json"


def save_client(root: Path, step: int, client: int, local_rank: int, *, model: torch.nn.Module | None,
                optimizer_state: dict | None, rank_state: dict) -> None:
    """Write this rank's part of checkpoint `step`; model and optimizer only on a client's first rank,
    then (last) the rank's manifest of what it wrote."""
    d = client_dir(root, step, client)
    if (model is not None) != (local_rank == 0):
        raise ValueError("the model and optimizer are saved by a client's first rank, and only by it")
    if model is not None:
        atomic_write(d / "model.safetensors", lambda tmp: save_model(model, tmp))  # tied weights stored once
        atomic_write(d / "optimizer.pt", lambda tmp: torch.save(optimizer_state, tmp))
    atomic_write(d / f"rank_{local_rank}.pt", lambda tmp: torch.save(rank_state, tmp))
    write_json(d / manifest_name(local_rank), {"step": step, "client": client, "files": {
        name: {"bytes": (d / name).stat().st_size, "sha256": sha256(d / name)} for name in rank_files(local_rank)}})


def step_problem(root: Path, step: int, client: int, ranks_per_client: int, *, hashes: bool) -> str | None:
    """Why `client`'s checkpoint `step` cannot be resumed from (None: it verifies)."""
    d = client_dir(root, step, client)
    for local_rank in range(ranks_per_client):
        try:
            manifest = json.loads((d / manifest_name(local_rank)).read_text())
            listed = manifest["files"]
        except (OSError, ValueError, KeyError, TypeError) as e:
            return f"{d / manifest_name(local_rank)} is missing or unreadable ({type(e).__name__}), so the step " \
                   "was not finished"
        for name in rank_files(local_rank):
            path, want = d / name, listed.get(name, {})
            if not path.is_file():
                return f"{path} is missing"
            size = path.stat().st_size
            if size != want.get("bytes"):
                return f"{path} has {size} bytes, its manifest says {want.get('bytes')}"
            if hashes and sha256(path) != want.get("sha256"):
                return f"{path} does not match the sha256 in its manifest"
    return None


def step_dirs(root: Path) -> dict[int, Path]:
    """{step: folder} of every checkpoints/step_N folder of the run in `root`."""
    base = root / "checkpoints"
    return {int(m.group(1)): d for d in (base.iterdir() if base.is_dir() else ()) if (m := _STEP.match(d.name))}


def scan_steps(root: Path, client: int, ranks_per_client: int, *,
               hashes: bool = True) -> tuple[list[int], dict[int, str]]:
    """(steps whose every file of `client` verifies, ascending; {other step: why not})."""
    complete, problems = [], {}
    for step in step_dirs(root):
        problem = step_problem(root, step, client, ranks_per_client, hashes=hashes)
        if problem is None:
            complete.append(step)
        else:
            problems[step] = problem
    return sorted(complete), problems


def why_incomplete(step: int, complete: list[list[int]], problems: list[dict[int, str]],
                   per_client: int = 1) -> list[str]:
    """Why `step` is not complete everywhere, once per client: "client c: <problem>", or "client c:
    not written". Entry i of `complete` and `problems` (scan_steps') is client i // per_client's
    (a rank's, or with per_client 1 a client's own)."""
    return sorted({f"client {i // per_client}: {p.get(step, 'not written')}"
                   for i, (c, p) in enumerate(zip(complete, problems)) if step not in c})


def choose_resume_step(complete: list[list[int]], problems: list[dict[int, str]],
                       ranks_per_client: int) -> tuple[int, list[str]]:
    """From every rank's verified steps and reasons: the newest step complete everywhere, and a
    line for each newer step skipped (client and reason)."""
    common = set.intersection(*(set(c) for c in complete))
    if not any(complete) and not any(problems):
        raise ValueError("--resume: the run wrote no checkpoint (--checkpoint-interval N writes one every N steps); "
                         "--overwrite starts it afresh")
    if not common:
        reasons = "; ".join(f"client {r // ranks_per_client}: step {s}: {why}"
                            for r, p in enumerate(problems) for s, why in sorted(p.items()))
        raise ValueError(f"--resume: no checkpoint is complete for every client{f' ({reasons})' if reasons else ''}")
    start = max(common)
    newer = sorted({s for c in complete for s in c} | {s for p in problems for s in p})
    skipped = []
    for step in (s for s in newer if s > start):
        why = why_incomplete(step, complete, problems, ranks_per_client)
        skipped.append(f"skipped checkpoint step {step} ({'; '.join(why)})")
    if skipped:
        skipped.append(f"resuming from step {start}, the newest checkpoint complete for every client")
    return start, skipped


def choose_auto_start(holds: list[bool], hosts: list[str], complete: list[list[int]], problems: list[dict[int, str]],
                      ranks_per_client: int, *, root: Path) -> tuple[int | None, list[str]]:
    """--auto-resume, from whether each rank's node holds the run and its verified steps and reasons:
    None to start the run (no node holds it, or it wrote no checkpoint yet), else choose_resume_step's
    step. Refused where only some nodes hold it: starting over would replace their checkpoints."""
    if not any(holds):
        return None, []
    if not all(holds):
        missing = sorted({f"client {r // ranks_per_client} ({hosts[r]})" for r, held in enumerate(holds) if not held})
        raise ValueError(f"--auto-resume: some nodes hold the run in {root}, but not those of {', '.join(missing)}: "
                         "give those nodes its files (a job requeued onto other nodes finds none), or start it "
                         "afresh with --overwrite")
    if not any(complete) and not any(problems):
        return None, [f"the run in {root} wrote no checkpoint yet: starting it from step 0"]
    return choose_resume_step(complete, problems, ranks_per_client)


def complete_steps(root: Path, client: int, ranks_per_client: int, *, hashes: bool = True) -> list[int]:
    """Checkpoint steps whose every file of `client` verifies, ascending."""
    return scan_steps(root, client, ranks_per_client, hashes=hashes)[0]


def resume_note(root: Path, client: int, ranks_per_client: int, interval: int, *, auto: bool = False) -> str:
    """Where the same command with --resume (`auto`: the same command, which has --auto-resume) would
    go on from, as far as `client` can tell now: its newest step whose files have the sizes their
    manifests give (a resume then also checks their sha256, and takes the newest step every client
    completed)."""
    if not interval:
        return "it wrote no checkpoints (--checkpoint-interval 0): a run of it starts from the beginning"
    steps = complete_steps(root, client, ranks_per_client, hashes=False)
    if not steps:
        return f"no checkpoint was complete yet (one every {interval} steps): a run of it starts from the beginning"
    return (f"client {client}'s newest checkpoint is step {steps[-1]} ({step_dir(root, steps[-1])}): the same "
            f"command{'' if auto else ' with --resume'} goes on from the newest step every client completed")


def load_client(root: Path, step: int, client: int, local_rank: int, model: torch.nn.Module,
                device: torch.device) -> dict:
    """Load the model's weights in place, where the model is; return the optimizer state (on
    `device`) and this rank's state."""
    d = client_dir(root, step, client)
    load_weights(model, d / "model.safetensors")
    try:
        return {
            "optimizer": torch.load(d / "optimizer.pt", map_location=device, weights_only=True),
            "rank": torch.load(d / f"rank_{local_rank}.pt", weights_only=True),
        }
    except (OSError, RuntimeError, EOFError) as e:  # verified by its manifest, so changed since the check
        raise ValueError(f"--resume: cannot read checkpoint {d}: {type(e).__name__}: {e}") from e


def load_weights(model: torch.nn.Module, path: Path) -> None:
    """Copy the tensors of a save_model file into `model`'s own, in place and one at a time, each
    read into host memory and copied to wherever that tensor lives.

    safetensors.torch.load_model loads the whole file onto the device first and then copies it
    in: a second copy of every weight (15 GiB for Llama-3.1-8B in bf16) on top of the model. Here
    the most held besides the model is one tensor. A tied tensor is stored under one of its names
    (save_model keeps one); every tensor of the model must be in the file and nothing else."""
    own = model.state_dict(keep_vars=True)
    aliases: dict[tuple, list[str]] = {}
    for name, tensor in own.items():
        aliases.setdefault((tensor.device, tensor.data_ptr(), tuple(tensor.shape)), []).append(name)
    # pread: each tensor is read into its own buffer, freed after the copy (a memory map would
    # keep every page read resident until the file is closed)
    with safe_open(str(path), framework="pt", device="cpu", backend="pread") as f:
        stored = set(f.keys())
        unexpected = sorted(stored - set(own))
        missing = sorted(names[0] for names in aliases.values() if not stored.intersection(names))
        if missing or unexpected:
            raise ValueError(f"checkpoint {path} does not match the model: missing {missing}, unexpected {unexpected}")
        with torch.no_grad():
            for name in sorted(stored):
                own[name].copy_(f.get_tensor(name))


def save_hf_model(model: torch.nn.Module, directory: Path, tokenizer=None,
                  state: dict[str, torch.Tensor] | None = None) -> None:
    """config.json + model.safetensors (+ the tokenizer's files), a model directory that
    AutoModelForCausalLM / AutoTokenizer.from_pretrained and deca-eval load, from any rank.
    `state`: the weights to write by name (default: the model's own).

    (transformers' save_pretrained writes only on global rank 0 once torch.distributed is up;
    a tokenizer's save_pretrained writes on every rank.)"""
    directory.mkdir(parents=True, exist_ok=True)
    model.config.to_json_file(directory / "config.json")
    if state is None:
        atomic_write(directory / "model.safetensors", lambda tmp: save_model(model, tmp, metadata={"format": "pt"}))
    else:
        atomic_write(directory / "model.safetensors",
                     lambda tmp: save_file(_once(state), tmp, metadata={"format": "pt"}))
    if tokenizer is not None:
        tokenizer.save_pretrained(directory)


def _once(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Tensors that share memory (tied embeddings) stored once, under their first name, as
    save_model stores them; from_pretrained re-ties the others."""
    seen, out = set(), {}
    for name, tensor in state.items():
        key = (tensor.untyped_storage().data_ptr(), tensor.storage_offset(), tuple(tensor.shape))
        if key not in seen:
            seen.add(key)
            out[name] = tensor.detach().cpu().contiguous()
    return out


def prune(root: Path, client: int, keep: list[int]) -> None:
    """Remove this client's checkpoints of steps not in `keep`, and step folders left empty.

    Called only after a barrier that follows the newest save, so no other client can still
    need an older step to resume from."""
    for step, d in step_dirs(root).items():
        if step not in keep:
            shutil.rmtree(d / f"client_{client:03d}", ignore_errors=True)
            try:
                d.rmdir()
            except OSError:
                pass  # other clients' files are still there


def prune_rank(root: Path, client: int, local_rank: int, keep: int) -> None:
    """A client's other rank (local_rank > 0) keeps its own files (state and manifest) of its `keep`
    newest steps and removes the older ones, and the folders that leaves empty: on a node apart from
    the client's first rank, no one else would (on a shared file system prune has removed them already)."""
    mine = sorted(step for step, d in step_dirs(root).items()
                  if (d / f"client_{client:03d}" / f"rank_{local_rank}.pt").is_file())
    for step in mine[:-keep]:
        d = client_dir(root, step, client)
        for name in (*rank_files(local_rank), manifest_name(local_rank)):
            (d / name).unlink(missing_ok=True)
        for empty in (d, d.parent):
            try:
                empty.rmdir()
            except OSError:
                break  # other files are still there
