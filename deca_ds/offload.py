"""CPU offload of frozen decoder layers (offload mode "frozen").

DECA trains one block at a time, so every other decoder layer is frozen; in mode "frozen" those
layers live in pinned host memory and are streamed to the device one at a time. The active block's
layers stay resident, and so do the embeddings, final norm and LM head (small next to the layers,
and some of them may be blocks of their own). On the device, an offloaded parameter's `.data` is an
empty placeholder except while its layer is in use:

- forward: a pre-hook on each decoder layer materializes it and prefetches the next layer on a
  side CUDA stream while it computes; at most two offloaded layers are on the device at any time.
- backward, for the layers above the active block (their weights carry the input gradient down to
  the active block): with activation checkpointing the layer's forward is recomputed, and
  transformers' GradientCheckpointingLayer checkpoints `forward`, not `__call__`, so the decoder
  layer's own hooks do not fire again; hooks on its parameter-owning submodules do, and
  materialize the layer. Without checkpointing autograd saves the weights themselves (views of
  them, e.g. `weight.t()`) for backward; a saved-tensors hook keeps only a reference to the
  parameter instead and materializes the layer again when backward unpacks it, so a weight is not
  held on the device from forward to backward.

Prefetch follows the order a training step uses the layers: up through the offloaded layers in
forward, down through those backward needs, then up again for the next step. Layers marked with
`skip` (deca_ds.prefix.FrozenPrefix runs the layers below the active block once per block and
hands their output over in the steps) are neither streamed nor prefetched meanwhile.
deca_ds.memory.offload_block_stream counts the bytes this policy copies per block.

Mode "none", and a run whose device is the CPU, do nothing: with no accelerator the "host" is the
device, and copying layers around would only cost time. `simulate_on_cpu=True` streams anyway
(synchronous copies, no side stream), so CPU tests exercise the whole mechanism.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch
from torch import nn

from .blocks import Partition, block_layers, find_decoder_layers

# none: every layer resident; frozen: the decoder layers outside the active block (but the top `keep`) in host memory.
OFFLOAD_MODES = ("none", "frozen")


def check_keep(num_layers: int, keep: int) -> None:
    """Refuse keeping more decoder layers resident than the model has."""
    if not 0 <= keep <= num_layers:
        raise ValueError(f"offload keep must be in [0, {num_layers}] (the model's decoder layers), got {keep}")


class FrozenLayerOffload:
    """Streams the decoder layers outside the active block to `device`. The model may still be in
    host memory (the runtime builds this before moving the model, so the device never holds every
    layer) or already on `device`; either way every decoder layer is copied to host memory here.

    Call `activate(k)` whenever the optimizer activates block k, before it reads the block's
    parameters (DecaOptimizer copies them into its master in `_activate`): an offloaded parameter
    holds no values on the device. Right after construction every decoder layer is offloaded, so
    call `activate` for the current block first. Whatever reads parameters outside forward
    (state_dict, checkpoints) sees empty placeholders for the offloaded layers unless it runs in
    `host_weights()`; `close()` makes every layer resident again.
    """

    def __init__(self, model: nn.Module, partition: Partition, device: str | torch.device, *,
                 mode: str = "frozen", keep: int = 0, simulate_on_cpu: bool = False) -> None:
        if mode not in OFFLOAD_MODES:
            raise ValueError(f"unknown offload mode {mode!r}; valid modes: {', '.join(OFFLOAD_MODES)}")
        self.device = torch.device(device)
        _, layers = find_decoder_layers(model)
        check_keep(len(layers), keep)
        # The top layers are the ones a step streams twice (forward, and backward for every block
        # below them): keeping them resident saves the most copying per byte of device memory.
        self._kept = set(range(len(layers) - keep, len(layers)))
        self._params = [list(layer.parameters()) for layer in layers]
        self.enabled = mode == "frozen" and (self.device.type == "cuda" or simulate_on_cpu)
        self.bytes_streamed = 0  # copied host -> device for frozen layers so far
        if not self.enabled:
            return
        cuda = self.device.type == "cuda"
        self._stream = torch.cuda.Stream(self.device) if cuda else None
        self._block_layers = [set(held) for _, held in block_layers(model, partition)]
        self._host = []
        for params in self._params:
            self._host.append([torch.empty(p.shape, dtype=p.dtype, pin_memory=cuda).copy_(p.detach())
                               for p in params])
            for p in params:
                p.data = p.data.new_empty(0)
        self._resident: set[int] = set()  # the active block's layers
        self._offloaded = list(range(len(layers)))
        self._materialized: dict[int, torch.cuda.Event | None] = {}  # offloaded layers on the device
        self._owner: dict[int, tuple[int, int]] = {}  # their storages' data_ptr -> (layer, param)
        self._graph: set[int] = set()  # offloaded layers whose forward built a graph: backward needs them
        self._current: int | None = None  # the offloaded layer computing now, or last
        self._skipped: set[int] = set()  # layers that hand over cached outputs (FrozenPrefix): never streamed
        self._saving = None
        self._hooks = []
        for k, layer in enumerate(layers):
            self._hooks.append(layer.register_forward_pre_hook(
                lambda m, args, kwargs, k=k: self._enter_layer(k, args, kwargs), with_kwargs=True))
            self._hooks.append(layer.register_forward_hook(lambda *_: self._exit_layer(), always_call=True))
            for sub in layer.modules():  # their hooks fire in checkpointing's recomputation too
                if sub is not layer and next(sub.parameters(recurse=False), None) is not None:
                    self._hooks.append(sub.register_forward_pre_hook(
                        lambda *_, k=k: self._use(k, backward=True)))

    # ---- runtime API ------------------------------------------------------------------------
    def activate(self, block: int) -> None:
        """Make block `block`'s layers (and the kept ones) resident; the previous active block's
        go back to the host."""
        if not self.enabled:
            return
        layers = self._block_layers[block] | self._kept
        for k in list(self._materialized):
            self._release(k)
        for k in self._resident - layers:
            for p, h in zip(self._params[k], self._host[k]):
                h.copy_(p.detach())  # it was trained on the device: the host copy is stale
                p.data = p.data.new_empty(0)
        for k in layers - self._resident:
            self._wait(self._copy_in(k))
        self._resident = set(layers)
        self._offloaded = [k for k in range(len(self._params)) if k not in layers]
        self._graph.clear()
        self._current = None

    def skip(self, layers) -> None:
        """`layers` do not compute until the next call (deca_ds.prefix.FrozenPrefix hands over their
        output): neither streamed nor prefetched."""
        if self.enabled:
            self._skipped = set(layers)

    @contextmanager
    def host_weights(self):
        """Between steps, for code that reads or writes every weight (checkpoints, the consensus,
        export): the offloaded layers' parameters are their host copies meanwhile (current: a
        layer's copy is refreshed whenever it leaves the active block), and writes land there. The
        device never holds them all."""
        if not self.enabled:
            yield
            return
        for k in list(self._materialized):
            self._release(k)
        for k in self._offloaded:
            for p, h in zip(self._params[k], self._host[k]):
                p.data = h
        try:
            yield
        finally:
            for k in self._offloaded:
                for p in self._params[k]:
                    p.data = torch.empty(0, dtype=p.dtype, device=self.device)

    def resident_bytes(self) -> int:
        """Device bytes held by decoder-layer parameters now."""
        return sum(p.numel() * p.element_size() for params in self._params for p in params)

    def close(self) -> None:
        """Every layer resident again, hooks removed."""
        if not self.enabled:
            return
        for k in list(self._materialized):
            self._release(k)
        for k in self._offloaded:
            self._wait(self._copy_in(k))
        for hook in self._hooks:
            hook.remove()
        self._host = []
        self.enabled = False

    # ---- streaming --------------------------------------------------------------------------
    def _enter_layer(self, k: int, args, kwargs) -> None:
        if k == 0:
            self._graph.clear()
        if k in self._resident or k in self._skipped:
            return
        # An input that requires grad means backward comes through here (the weights are frozen).
        if torch.is_grad_enabled() and any(isinstance(a, torch.Tensor) and a.requires_grad
                                           for a in (*args, *kwargs.values())):
            self._graph.add(k)
        self._use(k, backward=False)
        self._saving = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
        self._saving.__enter__()

    def _exit_layer(self) -> None:
        if self._saving is not None:
            self._saving.__exit__(None, None, None)
            self._saving = None

    def _use(self, k: int, backward: bool) -> None:
        """Layer k is about to compute: on the device, the next one on its way, the rest released."""
        if k in self._resident or (backward and k == self._current):
            return
        if any(p.requires_grad for p in self._params[k]):
            raise RuntimeError(f"decoder layer {k} has trainable parameters but is offloaded; call "
                               f"activate(block) whenever the optimizer activates a block")
        self._current = k
        following = self._next(k, backward)
        for j in list(self._materialized):
            if j not in (k, following):
                self._release(j)
        self._materialize(k)
        self._wait(self._materialized[k])
        if following != k:
            self._materialize(following)

    def _next(self, k: int, backward: bool) -> int:
        """The offloaded layer a training step uses after k."""
        streamed = [j for j in self._offloaded if j not in self._skipped]
        if not backward:
            later = [j for j in streamed if j > k]
            if later:
                return later[0]
            backward = k in self._graph
        if backward:
            below = [j for j in self._graph if j < k]
            if below:
                return max(below)
        return streamed[0] if streamed else k

    def _copy_in(self, k: int) -> torch.cuda.Event | None:
        """Start copying layer k to the device; the event marks the end of the copy."""
        host = self._host[k]
        if self._stream is None:
            bufs, event = [h.to(self.device, copy=True) for h in host], None
        else:
            # Allocated on the compute stream, so the allocator reuses them in its order; the copy
            # waits for that stream, whose queued kernels may still read the blocks handed out.
            bufs = [torch.empty_like(h, device=self.device) for h in host]
            self._stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(self._stream):
                for b, h in zip(bufs, host):
                    b.copy_(h, non_blocking=True)
            event = self._stream.record_event()
        for p, b in zip(self._params[k], bufs):
            p.data = b
        return event

    def _materialize(self, k: int) -> None:
        if k in self._materialized:
            return
        self._materialized[k] = self._copy_in(k)
        self.bytes_streamed += sum(h.nbytes for h in self._host[k])
        for i, p in enumerate(self._params[k]):
            self._owner[p.untyped_storage().data_ptr()] = (k, i)

    def _wait(self, event: torch.cuda.Event | None) -> None:
        if event is not None:
            torch.cuda.current_stream(self.device).wait_event(event)

    def _release(self, k: int) -> None:
        # A copy still in flight must end before the compute stream may reuse its blocks.
        self._wait(self._materialized.pop(k))
        for p in self._params[k]:
            del self._owner[p.untyped_storage().data_ptr()]
            p.data = p.data.new_empty(0)

    # ---- saved tensors (backward without checkpointing) ---------------------------------------
    def _pack(self, t: torch.Tensor):
        owner = self._owner.get(t.untyped_storage().data_ptr())
        if owner is None:
            return t
        return owner, t.size(), t.stride(), t.storage_offset()

    def _unpack(self, saved):
        if isinstance(saved, torch.Tensor):
            return saved
        (k, i), size, stride, offset = saved
        self._use(k, backward=True)
        return self._params[k][i].detach().as_strided(size, stride, offset)
