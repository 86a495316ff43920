"""CPU offload of frozen decoder layers, exercised on CPU with simulate_on_cpu=True: the same
training run as with every layer resident, bit for bit, while offloaded layers hold no device
memory between uses."""

import copy

import pytest
import torch
from torch.multiprocessing.reductions import StorageWeakRef

from deca_ds import DecaConfig, DecaOptimizer
from deca_ds.models import enable_activation_checkpointing
from deca_ds.offload import FrozenLayerOffload
from deca_ds.optimizer import model_partition
from helpers import client_batches, tiny_llama

LAYERS = 4


def offloaded(model, config: DecaConfig, **options) -> tuple[DecaOptimizer, FrozenLayerOffload]:
    """The optimizer and the offload wired the way the runtime does: the offload first, then the
    optimizer, whose hook makes each block resident before it reads it, the first block's included."""
    partition = model_partition(model, config)
    offload = FrozenLayerOffload(model, partition, "cpu", simulate_on_cpu=True, **options)
    return DecaOptimizer(model, config, partition=partition, before_activate=offload.activate), offload


def nbytes(params) -> int:
    return sum(p.numel() * p.element_size() for p in params)


def train(model, offload: bool, checkpointing: bool, steps_per_block: int = 2, rounds: int = 2, keep: int = 0):
    """Losses of a DECA run over all blocks (layers_per_block=1), and the device bytes of decoder-layer
    parameters sampled whenever a layer computes, in forward and in backward."""
    config = DecaConfig(layers_per_block=1, steps_per_block=steps_per_block, rounds=rounds, lr=1e-2,
                        master_dtype=torch.float32)
    model.train()
    if checkpointing:
        enable_activation_checkpointing(model)
    opt, streamer = offloaded(model, config, keep=keep) if offload else (DecaOptimizer(model, config), None)
    layers = model.model.layers
    layer_bytes = nbytes(layers[0].parameters())
    non_layer = [p for n, p in model.named_parameters() if not n.startswith("model.layers.")]
    kept = set(range(LAYERS - keep, LAYERS))
    samples = []

    def sample(*_):
        if offload:
            samples.append(streamer.resident_bytes())

    def sample_in_backward(module, args, out):
        if out.requires_grad:
            out.register_hook(sample)

    for layer in layers:  # registered after the offload's hooks, so they see the layer materialized
        layer.mlp.down_proj.register_forward_pre_hook(sample)  # forward, and recomputation in backward
        layer.register_forward_hook(sample_in_backward)

    losses = []
    for batch in client_batches(1, steps=opt.total_steps)[0]:
        active = opt.active.index
        if offload:
            # Offloaded layers are empty placeholders between uses. Right after a block switch only the
            # active block is on the device; between steps also the layer backward used last and the
            # one prefetched for the next forward.
            # The kept layers are always there.
            on_device = [k for k, layer in enumerate(layers)
                         if k != active and k not in kept and layer.mlp.up_proj.weight.numel()]
            assert all(layers[k].mlp.up_proj.weight.numel() for k in kept)
            resident = 1 + len(kept - {active})
            assert len(on_device) <= (0 if opt.step_in_block == 0 else 2)
            assert streamer.resident_bytes() == (resident + len(on_device)) * layer_bytes
            if opt.step_in_block == 0:
                assert nbytes(model.parameters()) == resident * layer_bytes + nbytes(non_layer)
        opt.zero_grad()
        loss = model(**batch).loss
        loss.backward()
        trained = {id(p) for p in opt.active.params}
        assert all(p.grad is None for p in model.parameters() if id(p) not in trained), "a frozen parameter got a .grad"
        opt.step()
        losses.append(loss.item())
    assert opt.done
    return streamer, losses, samples, layer_bytes


@pytest.mark.parametrize("checkpointing", [False, True], ids=["plain", "checkpointing"])
def test_offload_is_bit_identical_to_resident(checkpointing):
    base = tiny_llama(layers=LAYERS, dtype=torch.float32)
    resident, offloaded = copy.deepcopy(base), copy.deepcopy(base)
    _, expected, _, _ = train(resident, offload=False, checkpointing=checkpointing)
    offload, losses, samples, layer_bytes = train(offloaded, offload=True, checkpointing=checkpointing)
    assert losses == expected and len(losses) == 2 * LAYERS * 2
    # at most two offloaded layers (the one computing and the one prefetched) besides the active
    # block; sampled in every forward of every layer, and more (in backward)
    assert max(samples) == 3 * layer_bytes and len(samples) > LAYERS * len(losses)

    batch = client_batches(1, steps=1, seed=7)[0][0]
    with torch.no_grad():  # evaluation streams too
        torch.testing.assert_close(offloaded(**batch).logits, resident(**batch).logits, rtol=0, atol=0)
    offload.close()
    assert offload.resident_bytes() == nbytes(offloaded.model.layers.parameters())
    # only the test's own samplers are left
    assert sum(len(m._forward_pre_hooks) for m in offloaded.model.layers.modules()) == LAYERS
    for (name, a), b in zip(resident.named_parameters(), offloaded.parameters()):
        assert torch.equal(a, b), name


@pytest.mark.parametrize("keep", [1, 3])
def test_kept_top_layers_stay_resident_and_change_nothing(keep):
    base = tiny_llama(layers=LAYERS, dtype=torch.float32)
    resident, offloaded = copy.deepcopy(base), copy.deepcopy(base)
    _, expected, _, _ = train(resident, offload=False, checkpointing=True)
    offload, losses, samples, layer_bytes = train(offloaded, offload=True, checkpointing=True, keep=keep)
    assert losses == expected
    # the active block, the kept layers and at most two streamed ones; never fewer than the kept
    assert max(samples) == min(LAYERS, keep + 3) * layer_bytes and min(samples) >= keep * layer_bytes
    offload.close()
    for (name, a), b in zip(resident.named_parameters(), offloaded.parameters()):
        assert torch.equal(a, b), name


def test_keep_beyond_the_model_is_an_error():
    model = tiny_llama(layers=LAYERS, dtype=torch.float32)
    opt = DecaOptimizer(model, DecaConfig(layers_per_block=1, steps_per_block=1, rounds=1))
    with pytest.raises(ValueError, match=r"offload keep must be in \[0, 4\]"):
        FrozenLayerOffload(model, opt.partition, "cpu", keep=5, simulate_on_cpu=True)


def test_backward_does_not_keep_offloaded_weights_alive():
    """Without checkpointing autograd would save the weights of the layers above the active block
    (as weight.t() views) from forward to backward; the offload saves references instead."""
    layers = 6
    model = tiny_llama(layers=layers, dtype=torch.float32).train()
    opt, _ = offloaded(model, DecaConfig(layers_per_block=1, master_dtype=torch.float32))
    refs = {}
    for k, layer in enumerate(model.model.layers):
        layer.register_forward_pre_hook(
            lambda m, a, k=k: refs.__setitem__(k, [StorageWeakRef(p.untyped_storage()) for p in m.parameters()]))
    loss = model(**client_batches(1, steps=1)[0][0]).loss
    # still on the device: the top layer and the next one backward needs (prefetched)
    assert [k for k in range(1, layers) if not all(r.expired() for r in refs[k])] == [layers - 2, layers - 1]
    loss.backward()
    assert all(p.grad is not None for p in opt.active.params)


def test_forgotten_activate_is_an_error():
    model = tiny_llama(layers=LAYERS, dtype=torch.float32)
    opt = DecaOptimizer(model, DecaConfig(layers_per_block=1, master_dtype=torch.float32))
    FrozenLayerOffload(model, opt.partition, "cpu", simulate_on_cpu=True)  # every layer offloaded, block 0 too
    with pytest.raises(RuntimeError, match="layer 0 has trainable parameters but is offloaded"):
        model(**client_batches(1, steps=1)[0][0])


@pytest.mark.parametrize("mode, simulate", [("none", True), ("frozen", False)], ids=["mode-none", "cpu"])
def test_disabled_offload_changes_nothing(mode, simulate):
    model = tiny_llama(layers=LAYERS, dtype=torch.float32)
    opt = DecaOptimizer(model, DecaConfig(layers_per_block=1, master_dtype=torch.float32))
    before = {n: p.data_ptr() for n, p in model.named_parameters()}
    offload = FrozenLayerOffload(model, opt.partition, "cpu", mode=mode, simulate_on_cpu=simulate)
    offload.activate(1)
    assert not offload.enabled and not any(m._forward_pre_hooks for m in model.modules())
    assert {n: p.data_ptr() for n, p in model.named_parameters()} == before
    assert offload.resident_bytes() == nbytes(model.model.layers.parameters())
    offload.close()


def test_unknown_mode_is_rejected():
    model = tiny_llama(layers=LAYERS, dtype=torch.float32)
    opt = DecaOptimizer(model, DecaConfig(layers_per_block=1, master_dtype=torch.float32))
    with pytest.raises(ValueError, match="'everything'.*none, frozen"):
        FrozenLayerOffload(model, opt.partition, "cpu", mode="everything")
