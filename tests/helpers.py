"""Tiny models and data shared by the tests (no network: everything is built from configs)."""

from __future__ import annotations

import contextlib
import runpy
import socket
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig

VOCAB = 64
# Torch threads of every rank a test starts (DECA_RANK_THREADS) and of the simulator it is compared
# with: CPU matmuls round differently at another count, and Adam amplifies that past the 1e-6 bounds.
RANK_THREADS = 1


@contextlib.contextmanager
def torch_threads(n: int = RANK_THREADS):
    """Run the body at `n` torch threads, then restore the count."""
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def tiny_llama(layers: int = 3, hidden: int = 32, dtype: torch.dtype = torch.float64, seed: int = 0):
    torch.manual_seed(seed)
    config = LlamaConfig(
        hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, vocab_size=VOCAB,
        max_position_embeddings=64, tie_word_embeddings=False,
    )
    return AutoModelForCausalLM.from_config(config, attn_implementation="eager").to(dtype)


def client_batches(n_clients: int, steps: int, batch: int = 2, seq: int = 8, seed: int = 1):
    """Per client, `steps` language-modelling batches drawn from a client-specific token range,
    so clients' data differ (non-IID)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n_clients):
        low = (i * VOCAB) // (2 * n_clients)
        ids = torch.randint(low, low + VOCAB // 2, (steps, batch, seq), generator=g)
        out.append([{"input_ids": x, "labels": x} for x in ids])
    return out


PORTS: list[int] = []  # every port handed to a job in this session (conftest checks /dev/shm for them)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        PORTS.append(s.getsockname()[1])
        return PORTS[-1]


def exit_status(done: SystemExit) -> int:
    """The status the interpreter exits with on `done`: None is 0, a message is printed and is 1."""
    if done.code is None or isinstance(done.code, int):
        return done.code or 0
    print(done.code, file=sys.stderr)
    return 1


def run_script(path: Path, *args: str) -> int:
    """`python path args` in this process (the script's __main__ block, its folder first on the
    path), without a new interpreter's imports; its exit status."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(sys, "argv", [str(path), *args])
        mp.syspath_prepend(str(path.parent))
        try:
            runpy.run_path(str(path), run_name="__main__")
        except SystemExit as done:
            return exit_status(done)
    return 0


def run_script_in_fork(rank: int, path: Path, *args: str) -> int:
    """run_script in a forked process (ranks.run_on_ranks), for a script that changes process-wide state."""
    return run_script(path, *args)


def descendants(pid: int, marker: str, *, recursive: bool = True) -> list:
    """The processes below `pid` (psutil; its children only unless `recursive`) whose command line
    holds `marker`. A short-lived helper (lscpu, say) may end between the listing and the read of
    its command line: it is passed over."""
    import psutil

    found = []
    for p in psutil.Process(pid).children(recursive=recursive):
        try:
            if marker in " ".join(p.cmdline()):
                found.append(p)
        except psutil.Error:
            pass
    return found
