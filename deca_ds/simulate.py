"""simulate(): N clients of any method in one process, one model copy each, mixed through W."""

from __future__ import annotations

import contextlib
import copy
import math
from dataclasses import dataclass
from typing import Callable, Iterable, Mapping, Sequence

import torch
from torch import nn

from .config import DecaConfig
from .finite import MAX_CONSECUTIVE_SKIPS, largest_magnitude, nonfinite_problem
from .methods import Deca, Method
from .mixing import InProcessMixer
from .models import causal_lm_loss
from .rng import ClientGenerators


@dataclass(frozen=True)
class StepInfo:
    """What `on_step` sees after each synchronous step of all clients."""

    step: int  # global inner step, 0-based
    round: int
    block: int | None  # None: the method trains every trainable tensor at once
    step_in_block: int
    losses: list[float]  # one per client


def simulate(
    model: nn.Module,
    client_batches: Sequence[Iterable[Mapping[str, torch.Tensor]]],
    mixing_matrix,
    config: DecaConfig | Method,
    *,
    on_step: Callable[[StepInfo], None] | None = None,
    before_step: Callable[[int], None] | None = None,
    generators: ClientGenerators | None = None,
    grad_accum: int = 1,
    loss_chunk: int = 0,
    transfer_dtype: torch.dtype | None = None,
    skip_nonfinite: bool = False,
    on_skip: Callable[[int, str], None] | None = None,
) -> list[dict[str, torch.Tensor]]:
    """Run Algorithm 1 (a DecaConfig) or another method for N clients and return each client's
    final parameters by name.

    `model` is a transformers causal LM and every batch holds input_ids, attention_mask and labels
    (-100 where not trained); the loss is models.causal_lm_loss, as in the distributed runtime.
    The model is deep-copied per client, so every client starts from the same weights and the
    caller's model is left untouched. Client i takes `grad_accum` batches from `client_batches[i]`
    per local step, T·B·R·grad_accum in all; its g is their mean, accumulated as DeepSpeed's engine
    does (each loss divided by grad_accum before its backward), and its loss the mean of theirs, as
    deca-train logs it. `before_step(step)` is called as each step begins (where deca-train
    measures the consensus distance), `on_step` once it has ended. `loss_chunk` as deca-train's
    --loss-chunk; `transfer_dtype` (the working dtype, as --mix-dtype working) rounds each client's
    x½ to it on its way to the neighbours. With `generators` each client draws its dropout masks
    from its own (as deca-train's ranks do: ClientGenerators.seeded), else all from the process's.
    A client's loss or update that is NaN or infinite stops the run with a ValueError naming the
    clients and the step, as in deca-train. With `skip_nonfinite` (deca-train's --skip-nonfinite) a
    step whose loss or gradient is non-finite on any client is skipped by every client, as ranks
    skip it: no update, no mixing, the gradients cleared, the schedule where it was (the step is
    taken again on the next batches); `on_skip(step, what)` is told, and more than
    MAX_CONSECUTIVE_SKIPS in a row stop the run. The clients then hold their gradients until all
    are checked, where each otherwise frees its own in its local step.
    """
    mixer = InProcessMixer(mixing_matrix, transfer_dtype)
    if not (isinstance(grad_accum, int) and grad_accum >= 1):
        raise ValueError(f"grad_accum must be a whole number >= 1, got {grad_accum!r}")
    if len(client_batches) != mixer.n:
        raise ValueError(f"mixing matrix is {mixer.n}x{mixer.n} but {len(client_batches)} "
                         "clients' batches were given")
    method = Deca(config) if isinstance(config, DecaConfig) else config
    clients = [method.prepare(copy.deepcopy(model)).train() for _ in range(mixer.n)]
    optimizers = [method.optimizer(c, mixer.client(i)) for i, c in enumerate(clients)]
    streams = [iter(b) for b in client_batches]
    lead = optimizers[0]
    skipping = SkippedSteps(clients, on_skip) if skip_nonfinite else None
    while not lead.done:
        if before_step is not None:
            before_step(lead.global_step)
        where = lead.where()
        info = dict(step=lead.global_step, round=where["round"], block=where["block"], step_in_block=where["r"])
        losses, payloads = [], []
        for i, (client, opt, stream) in enumerate(zip(clients, optimizers, streams)):
            for _ in range(grad_accum):
                batch = next(stream, None)
                if batch is None:
                    raise ValueError(f"client {i} ran out of batches at step {info['step']} of {lead.total_steps}")
                with generators.drawing(i) if generators else contextlib.nullcontext():
                    loss = causal_lm_loss(client, batch, loss_chunk=loss_chunk)
                    (loss / grad_accum).backward()
                losses.append(loss.detach())  # read once all clients' work is queued: .item() would wait for each
            if skipping is None:  # the local step frees this client's gradient before the next one's backward
                payloads.append(opt.local_step())
        if skipping is not None:
            if skipping.skips(info["step"], losses):
                continue
            payloads = [opt.local_step() for opt in optimizers]
        # a NaN is an error, not a result: each client's loss and update (x½'s largest magnitude, NaN
        # if any value is), queued before the mixing may overwrite x½ and read with the losses
        largest = torch.stack([largest_magnitude(p) for p in payloads])
        mixer.post(payloads)
        for opt, payload in zip(optimizers, payloads):
            opt.combine(opt.mixer, payload)
        values = torch.cat([torch.stack(losses).double(), largest]).tolist()  # one wait for the device a step
        # each client's mean over its micro-batches, summed in their order, as deca-train's rank does
        means = [sum(values[i * grad_accum:(i + 1) * grad_accum]) / grad_accum for i in range(mixer.n)]
        check_finite(means, values[-mixer.n:], info)
        if on_step is not None:
            on_step(StepInfo(losses=means, **info))
    return [{name: p.detach().clone() for name, p in c.named_parameters()} for c in clients]


class SkippedSteps:
    """simulate(skip_nonfinite=True): a step whose loss or gradient is NaN or infinite on any client,
    checked before any client updates (finite.nonfinite_problem, as a rank checks its own), is skipped
    by every client, as ranks skip it; more than MAX_CONSECUTIVE_SKIPS in a row stop the run."""

    def __init__(self, clients: list[nn.Module], on_skip: Callable[[int, str], None] | None) -> None:
        self.clients, self.on_skip, self.in_a_row = clients, on_skip, 0

    def skips(self, step: int, losses: list[torch.Tensor]) -> bool:
        """Whether `step` is skipped, given each micro-batch's loss, client by client; if so, every
        client's gradient is cleared and `on_skip(step, what)` told."""
        per_client = len(losses) // len(self.clients)
        values = torch.stack(losses).double().tolist()
        problems = [nonfinite_problem(values[i * per_client:(i + 1) * per_client], c)
                    for i, c in enumerate(self.clients)]
        if not any(problems):
            self.in_a_row = 0
            return False
        for client in self.clients:
            client.zero_grad(set_to_none=True)
        self.in_a_row += 1
        if self.in_a_row > MAX_CONSECUTIVE_SKIPS:
            raise ValueError(f"{self.in_a_row} consecutive steps non-finite up to step {step}: the simulation has "
                             "diverged and stops here (a smaller lr)")
        if self.on_skip is not None:
            self.on_skip(step, "; ".join(f"non-finite {('loss', 'gradient')[p - 1]} on client {i}"
                                         for i, p in enumerate(problems) if p))
        return True


def check_finite(losses: list[float], updates: list[float], where: dict) -> None:
    """A ValueError naming the clients whose loss or update at the step `where` is NaN or infinite."""
    bad = [f"{what} on client(s) {clients}" for what, values in (("loss", losses), ("update", updates))
           if (clients := [i for i, v in enumerate(values) if not math.isfinite(v)])]
    if bad:
        raise ValueError(f"non-finite {' and '.join(bad)} at step {where['step']} (round {where['round']}, block "
                         f"{where['block']}, r {where['step_in_block']}): the simulation stops here (a smaller lr, "
                         "or check the data and the model's weights)")
