"""Tiny models and data shared by the tests (no network: everything is built from configs)."""

from __future__ import annotations

import contextlib
import socket

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
