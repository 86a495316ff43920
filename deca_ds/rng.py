"""The random state dropout draws from (LoRA's): saved and set for checkpoints, and kept per client
in the simulator, so that a simulated client draws what it would draw in a process of its own."""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

import torch


def client_seed(seed: int, rank: int) -> int:
    """The seed of rank `rank`'s generators in a run seeded `seed` (each rank draws its own masks)."""
    return seed * 1_000_003 + rank


def random_state() -> dict:
    """Torch's generator and, on a GPU, the current device's."""
    return {"torch_rng": torch.get_rng_state(),
            **({"cuda_rng": torch.cuda.get_rng_state()} if torch.cuda.is_available() else {})}


def restore_random_state(state: dict) -> None:
    """Set the generators random_state() saved (loaded onto any device)."""
    torch.set_rng_state(state["torch_rng"].cpu())
    if "cuda_rng" in state:
        torch.cuda.set_rng_state(state["cuda_rng"].cpu())


class ClientGenerators:
    """Each simulated client's random state, swapped in while the client steps. Drawing one after
    another from the process's generators, the clients would get other masks than N processes
    seeded client_seed(seed, rank) get, and a simulated run would not equal the distributed one."""

    def __init__(self, states: list[dict]) -> None:
        self.states = states

    @classmethod
    def seeded(cls, seed: int, n: int) -> ClientGenerators:
        states = []
        with torch.random.fork_rng():
            for rank in range(n):
                torch.manual_seed(client_seed(seed, rank))
                states.append(random_state())
        return cls(states)

    @contextmanager
    def drawing(self, client: int) -> Iterator[None]:
        outer = random_state()
        restore_random_state(self.states[client])
        try:
            yield
        finally:
            self.states[client] = random_state()
            restore_random_state(outer)
