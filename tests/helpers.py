"""Tiny models and data shared by the tests (no network: everything is built from configs)."""

from __future__ import annotations

import socket

import torch
from transformers import AutoModelForCausalLM, LlamaConfig

VOCAB = 64


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


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
