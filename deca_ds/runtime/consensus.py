"""The consensus model x̄: the clients' mean (or, for a method that does not combine linearly, its
own combination with uniform weights), formed in place across the process group, and exported."""

from __future__ import annotations

import math
from contextlib import contextmanager
from pathlib import Path

import torch

from ..files import atomic_directory
from ..methods import Method
from ..mixing import MIX_CHUNK, ClientView
from . import checkpoint as ckpt
from .dist import ClientLayout, all_gather_, all_mean_
from .options import RunOptions


def _chunk_means(x: torch.Tensor, buffer: torch.Tensor, chunk: int):
    """(piece, x̄ of it) for each `chunk` elements of the flat x, the mean formed in `buffer` (one
    buffer for every chunk: a collective may let go of its tensor after it returns, gloo's work
    object, so a fresh chunk each time could meet the last one's)."""
    for piece in x.split(chunk):
        yield piece, all_mean_(buffer[: piece.numel()].copy_(piece))


def consensus_distance(x: torch.Tensor, chunk: int = MIX_CHUNK) -> float:
    """‖x_i − x̄‖ of this client's flat vector x, `chunk` elements at a time (an all-reduce each):
    one chunk-sized buffer, as mixing's, where a copy of the vector and a difference would be two
    copies of the block (the peak of a run that asks for the distance, measured on a GPU)."""
    x = x.detach()
    buffer = torch.empty(min(chunk, x.numel()), dtype=x.dtype, device=x.device)
    return math.sqrt(sum(torch.linalg.vector_norm(mean.sub_(piece)).item() ** 2
                         for piece, mean in _chunk_means(x, buffer, chunk)))


def to_consensus_(model, device: torch.device | None = None, chunk: int = MIX_CHUNK) -> float:
    """Replace this client's weights by x̄ = mean over clients, `chunk` elements at a time (an
    all-reduce each, in at least fp32, on `device`: a weight in host memory goes there a chunk at a
    time) through two chunk buffers, the mean and x − x̄: the run's last phase holds the weights and
    those, where a tensor's fp32 copy and its mean were 8 bytes per element of the largest tensor (the
    embedding: 4.2 GB for Llama-3.1-8B, above its training peak). Returns ‖x_i − x̄‖ of this client."""
    sq, buffers = 0.0, {}
    size = min(chunk, max(p.numel() for p in model.parameters()))
    with torch.no_grad():
        for p in model.parameters():
            dtype, where = torch.promote_types(p.dtype, torch.float32), device or p.device
            if (dtype, where) not in buffers:
                buffers[dtype, where] = [torch.empty(size, dtype=dtype, device=where) for _ in range(2)]
            mean_buffer, diff = buffers[dtype, where]
            for piece, mean in _chunk_means(p.detach().view(-1), mean_buffer, chunk):
                sq += torch.linalg.vector_norm(diff[: piece.numel()].copy_(piece).sub_(mean)).item() ** 2
                piece.copy_(mean)
    return math.sqrt(sq)


@contextmanager
def consensus_weights(model, optimizer):
    """Evaluate x̄ in the middle of training, formed as at the run's end: the clients' mean, or a
    method's own combination where it does not combine linearly (DeCAF: the mean of its factors
    would stand for no client's update). The client's own weights wait in host memory and come back
    bit for bit, and so does such a method's trainable vector (the clients' mean leaves the
    optimizer's master copy alone)."""
    own = [p.detach().to("cpu", copy=True) for p in model.parameters()]
    if optimizer.linear:
        to_consensus_(model)
    else:
        vector = optimizer.consensus_vector().detach().to("cpu", copy=True)
        factor_consensus_(optimizer)
    try:
        yield
    finally:
        with torch.no_grad():
            for p, weights in zip(model.parameters(), own):
                p.copy_(weights)
            if not optimizer.linear:
                optimizer.consensus_vector().copy_(vector)


def factor_consensus_(optimizer) -> None:
    """x̄ of a method whose combination is not linear (DeCAF): its own combination of every
    client's vector with uniform weights (each client's G ranks hold the same vector; the frozen
    weights are the same everywhere)."""
    x = optimizer.consensus_vector()
    gathered = all_gather_(x)
    optimizer.combine_now(ClientView([(1 / len(gathered), g) for g in gathered], x))


def export_consensus(model, optimizer, method: Method, out: Path, tokenizer, layout: ClientLayout,
                     opts: RunOptions, device: torch.device) -> tuple[float, object]:
    """Write the clients (optionally) and x̄ (rank 0, the method's format, unless --no-export);
    return ‖x_i − x̄‖ and the model to evaluate (x̄ itself)."""
    if opts.save_clients and layout.local_rank == 0:
        with atomic_directory(out / "clients" / f"client_{layout.client:03d}", replace=True) as directory:
            ckpt.save_hf_model(model, directory, tokenizer, state=method.plain_state(model))
            method.save_extras(model, directory)
    if optimizer.linear:
        distance = to_consensus_(model, device)
    else:  # the trainable vector's distance to the clients' mean, as during training: DeCAF's combination
        # factorizes anew, so clients that agree to the bit would be at a distance from its factors
        distance = consensus_distance(optimizer.consensus_vector())
        factor_consensus_(optimizer)
    if layout.rank == 0 and opts.export:
        # whole or not at all: a resumed run's failed export keeps the x̄ it wrote before
        with atomic_directory(out / "consensus", replace=True) as directory:
            model = method.save_consensus(model, directory, tokenizer)
    return distance, model


