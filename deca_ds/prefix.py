"""The frozen decoder layers below the active block, run once per block (with offload "frozen").

While block k trains for R steps, every layer below it is frozen and its input does not depend on
anything that trains, so its output for a micro-batch is the same whenever it is computed. A
streamed step would copy each of those layers to the device once per step; `FrozenPrefix.fill`
instead runs them layer by layer over all the micro-batches of the block's remaining steps (each
layer copied once per block), keeps the hidden states entering the block's lowest layer, and
during the steps the layers below hand those over without computing. The arithmetic is the one a
step would do, kernel for kernel, so training is bit-identical; what changes is that a step copies
only the layers above the active block (R = 48: 1/48 of the lower layers' bytes per step). While it
runs the device holds one hidden state per micro-batch (deca_ds.memory's prefix_cache): what
entered a layer is freed as its output replaces it; only the masks and position embeddings the
model passes every layer are kept beside.

Caching needs two things a check verifies at every fill, falling back to computing the layers in
every step (with a warning, and nothing changed) where either fails: nothing trainable feeds the
layers below (the embeddings, or an LM head tied to them, as the active block: that block only),
and nothing up to the block draws random numbers (dropout, which a different order of computation
would hand out otherwise: the rest of the run).
"""

from __future__ import annotations

import warnings
from collections import deque
from collections.abc import Mapping, Sequence

import torch
from torch import nn

from .blocks import Partition, block_layers, find_decoder_layers
from .offload import FrozenLayerOffload


class _Reached(Exception):
    """Raised by the recorder of the last layer below the block: the rest of the model need not run."""


class FrozenPrefix:
    """Hidden states entering the active block, for the micro-batches of its remaining steps.

    `fill(model, block, batches)` computes them (the offload, if given, streams each layer once);
    then before each forward `next(batch)` hands the next one to the model, whose layers below the
    block pass it on instead of computing; `clear()` gives those layers their forward back. The
    batches must reach `next` in the order they were given to `fill`.
    """

    def __init__(self, model: nn.Module, partition: Partition, offload: FrozenLayerOffload | None = None) -> None:
        _, self.layers = find_decoder_layers(model)
        # The layers below each block's entry (the final norm's and the LM head's: all of them; the
        # embeddings': none) are what a fill runs.
        self._first = [entry for entry, _ in block_layers(model, partition)]
        self.offload = offload
        self.enabled = True  # False for the rest of the run once the layers are found to draw random numbers
        self._uncached: set[int] = set()  # blocks whose layers below take a trainable input
        self._queue: deque[tuple[torch.Tensor, torch.Tensor]] = deque()  # (input_ids, hidden state)
        self._current: torch.Tensor | None = None
        self._skipped = 0

    @property
    def pending(self) -> int:
        """Micro-batches filled and not yet handed to the model."""
        return len(self._queue)

    def fill(self, model: nn.Module, block: int, batches: Sequence[Mapping[str, torch.Tensor]]) -> bool:
        """Run the layers below `block` over `batches` (the micro-batches of the block's remaining steps,
        on the model's device, in the order they will be trained on); False, and nothing cached,
        where the prefix cannot be cached."""
        self.clear()
        first = self._first[block]
        if not (self.enabled and first and batches):
            return False
        rng = _rng_states()
        recorded = [self._record(model, first, batch) for batch in batches]
        hidden = [state for state, _ in recorded]  # what enters layer 0, then each layer in turn
        calls = [layer_calls for _, layer_calls in recorded]  # each layer's other arguments
        del recorded  # so what entered a layer is freed once its output replaces it
        if any(t.requires_grad for t in hidden) or any(t.requires_grad for c in calls for t in _tensors(c)):
            if block not in self._uncached:
                self._uncached.add(block)
                warnings.warn(f"block {block} trains a tensor that feeds the layers below it: they are computed "
                              "in every step while it trains", stacklevel=2)
            return False
        with torch.no_grad():
            for k in range(first):
                for i, layer_calls in enumerate(calls):
                    args, kwargs = layer_calls[k]
                    hidden[i] = self.layers[k](hidden[i], *args, **kwargs)
        if not all(isinstance(h, torch.Tensor) for h in hidden):
            return self._disable("the decoder layers return tuples, not the hidden state (transformers < 5)")
        if not _same(rng, _rng_states()):
            _set_rng_states(rng)
            return self._disable("the layers below the block, or what feeds them, draw random numbers (dropout)")
        # Kept in host memory until their step (pinned, copied back asynchronously): the device then
        # holds them all only while this runs, not through the block's steps.
        self._queue.extend((b["input_ids"].cpu(), _to_host(h)) for b, h in zip(batches, hidden))
        self._skip(first)
        return True

    def next(self, batch: Mapping[str, torch.Tensor]) -> None:
        """The next forward is on `batch`: the layers below the block hand over its cached hidden state."""
        if not self._skipped:
            return
        if not self._queue:
            raise RuntimeError("no cached hidden state left for this micro-batch: fill() at the start of every block")
        ids, hidden = self._queue.popleft()
        if not torch.equal(ids, batch["input_ids"].cpu()):
            raise RuntimeError("the micro-batch is not the one the cached hidden state was computed for: "
                               "the batches must come in the order given to fill()")
        self._current = hidden.to(batch["input_ids"].device, non_blocking=True)

    def clear(self) -> None:
        """Every layer computes again; nothing is cached."""
        for layer in self.layers[:self._skipped]:
            del layer.forward
        self._skipped, self._current = 0, None
        self._queue.clear()
        if self.offload is not None:
            self.offload.skip(())

    # ---- internals ---------------------------------------------------------------------------
    def _record(self, model: nn.Module, first: int, batch: Mapping[str, torch.Tensor]) -> tuple[torch.Tensor, list]:
        """(the hidden state entering layer 0, the other (args, kwargs) the model's own forward passes
        to each layer below `first`: masks and position embeddings are the model's business), with
        those layers passing their input on."""
        calls, entering = [], []

        def recorder(k):
            def forward(hidden, *args, **kwargs):
                if k == 0:
                    entering.append(hidden)
                calls.append((args, kwargs))
                if k == first - 1:
                    raise _Reached
                return hidden
            return forward

        if self.offload is not None:
            self.offload.skip(range(first))
        for k in range(first):
            self.layers[k].forward = recorder(k)
        inputs = {k: v for k, v in batch.items() if k != "labels"}
        try:
            # grad enabled: a trainable tensor feeding the layers shows as an input that requires grad
            with torch.enable_grad():
                model(**inputs, use_cache=False)
        except _Reached:
            pass
        finally:
            for k in range(first):
                del self.layers[k].forward
            if self.offload is not None:
                self.offload.skip(())
        return entering[0], calls

    def _skip(self, first: int) -> None:
        """Layer 0 returns the cached hidden state and the others up to `first` pass it on."""
        def cached(*args, **kwargs):
            return self._current

        def passthrough(hidden, *args, **kwargs):
            return hidden

        self.layers[0].forward = cached
        for layer in self.layers[1:first]:
            layer.forward = passthrough
        self._skipped = first
        if self.offload is not None:
            self.offload.skip(range(first))

    def _disable(self, why: str) -> bool:
        self.enabled = False
        warnings.warn(f"the layers below the active block are computed in every step: {why}", stacklevel=3)
        return False


def _to_host(t: torch.Tensor) -> torch.Tensor:
    return t if t.device.type == "cpu" else torch.empty(t.shape, dtype=t.dtype, pin_memory=True).copy_(t)


def _tensors(call: list[tuple]):
    for args, kwargs in call:
        for value in (*args, *kwargs.values()):
            if isinstance(value, torch.Tensor):
                yield value
            elif isinstance(value, (tuple, list)):
                yield from (v for v in value if isinstance(v, torch.Tensor))


def _rng_states() -> list[torch.Tensor]:
    states = [torch.get_rng_state()]
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        states += torch.cuda.get_rng_state_all()
    return states


def _same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


def _set_rng_states(states: list[torch.Tensor]) -> None:
    torch.set_rng_state(states[0])
    if len(states) > 1:
        torch.cuda.set_rng_state_all(states[1:])
