"""FrozenPrefix: the layers below the active block run once per block, over all its micro-batches.
Training is bit-identical to computing them in every step, the offload streams exactly the bytes
the estimator says, and where caching would change the arithmetic (dropout, a trainable input)
the layers compute in every step as before."""

import copy
import warnings

import pytest
import torch

from deca_ds import DecaConfig, DecaOptimizer
from deca_ds.memory import ModelSpec, Workload, estimate_block, offload_block_stream
from deca_ds.models import enable_activation_checkpointing
from deca_ds.offload import FrozenLayerOffload
from deca_ds.optimizer import model_partition
from deca_ds.prefix import FrozenPrefix
from helpers import client_batches, tiny_llama

LAYERS, R = 4, 3


def train(model, *, offload: bool = False, prefix: bool = False, checkpointing: bool = True, keep: int = 0,
          config: DecaConfig | None = None, batches=None):
    """A DECA run over every block; the losses, and the bytes streamed during each block."""
    config = config or DecaConfig(layers_per_block=1, steps_per_block=R, rounds=1, lr=1e-2,
                                  master_dtype=torch.float32)
    model.train()
    if checkpointing:
        enable_activation_checkpointing(model)
    partition = model_partition(model, config)
    streamer = FrozenLayerOffload(model, partition, "cpu", keep=keep, simulate_on_cpu=True) if offload else None
    opt = DecaOptimizer(model, config, partition=partition, before_activate=streamer.activate if streamer else None)
    cache = FrozenPrefix(model, opt.partition, streamer) if prefix else None
    batches = batches or client_batches(1, steps=opt.total_steps)[0]
    losses, streamed, block_start = [], [], 0
    for step, batch in enumerate(batches[:opt.total_steps]):
        if opt.step_in_block == 0:
            if streamer:
                streamed.append(streamer.bytes_streamed - block_start)
                block_start = streamer.bytes_streamed
            if cache:
                cache.fill(model, opt.active.index, batches[step:step + config.steps_per_block])
        if cache:
            cache.next(batch)
        loss = model(**batch).loss
        loss.backward()
        trained = {id(p) for p in opt.active.params}
        assert all(p.grad is None for p in model.parameters() if id(p) not in trained)
        opt.step()
        losses.append(loss.item())
        if cache and not cache.pending:
            cache.clear()
    if streamer:
        streamed.append(streamer.bytes_streamed - block_start)
        streamer.close()
    return losses, streamed[1:]


@pytest.mark.parametrize("checkpointing", [False, True], ids=["plain", "checkpointing"])
@pytest.mark.parametrize("keep", [0, 1])
def test_cached_prefix_is_bit_identical_and_streams_what_the_estimator_says(checkpointing, keep):
    base = tiny_llama(layers=LAYERS, dtype=torch.float32)
    resident, streamed_only, cached = (copy.deepcopy(base) for _ in range(3))
    expected, _ = train(resident, checkpointing=checkpointing)
    losses, per_block = train(cached, offload=True, prefix=True, checkpointing=checkpointing, keep=keep)
    plain_losses, plain_per_block = train(streamed_only, offload=True, checkpointing=checkpointing, keep=keep)
    assert losses == expected == plain_losses and len(losses) == LAYERS * R
    for (name, a), b, c in zip(resident.named_parameters(), cached.parameters(), streamed_only.parameters()):
        assert torch.equal(a, b) and torch.equal(a, c), name

    # Every block's copies, with and without the prefix cache, equal the estimator's count.
    spec = ModelSpec.from_config(base.config)
    layer = spec.layer_params[0] * 4  # fp32 working weights
    for block in range(LAYERS):
        resident_layers = {block} | set(range(LAYERS - keep, LAYERS))
        below = [layer for k in range(block) if k not in resident_layers]
        above = [layer for k in range(block + 1, LAYERS) if k not in resident_layers]
        assert per_block[block] == offload_block_stream(below, above, R, prefix=True), block
        assert plain_per_block[block] == offload_block_stream(below, above, R, prefix=False), block
        est = estimate_block(spec, 1, block, Workload(working_dtype="fp32"), offload="frozen", offload_keep=keep,
                             steps_per_block=R)
        assert est.offload_stream_block == per_block[block]
    # Streaming the layers below once per block instead of once per step copies less.
    assert sum(per_block) < sum(plain_per_block)


def test_block_stream_by_hand():
    # two layers below (sizes 1, 2), three above (10, 20, 40), R = 2
    below, above = [1, 2], [10, 20, 40]
    # prefix: 1 2 once, 10 prefetched; step 1: up 20 40, down 20 40 are still there, 10 is not (let go
    # when 20 came); at the bottom 10 serves backward and the next forward alone: step 2 the same
    assert offload_block_stream(below, above, 2, prefix=True) == 3 + 10 + 70 + 70
    # no prefix: step 1: 1 2 10 20 40, down 10, prefetch 1; step 2: 2 10 20 40 (1 was there), down 10,
    # prefetch 1 for a step that never comes
    assert offload_block_stream(below, above, 2, prefix=False) == (3 + 70 + 10 + 1) + (2 + 70 + 10 + 1)
    assert offload_block_stream([], above, 2) == (70 + 10) + (60 + 10)
    # the top block: the prefix run's last layer prefetches layer 0 for a step that never needs it
    assert offload_block_stream([1, 2, 4], [], 2, prefix=True) == 7 + 1
    assert offload_block_stream([], [], 2) == 0


def test_estimator_counts_the_cached_hidden_states():
    spec = ModelSpec.from_config(tiny_llama(layers=LAYERS).config)
    est = estimate_block(spec, 1, 2, Workload(micro_batch=3, seq_len=16), offload="frozen", steps_per_block=5,
                         grad_accum=2)
    assert est.prefix_cache == 5 * 2 * 3 * 16 * spec.hidden * 2  # bf16 hidden states of 5 steps × 2 micro-batches
    # on the device while the layers below run, not in the steps
    assert (est.phases["prefix"] - est.phases["backward"]
            == est.prefix_cache + est.act_recompute - est.grad - est.activations)
    assert estimate_block(spec, 1, 0, offload="frozen").prefix_cache == 0  # nothing below block 0
    assert estimate_block(spec, 1, 2, offload="none").prefix_cache == 0


def test_fill_holds_one_hidden_state_per_micro_batch():
    """While the layers below run, the device holds each micro-batch's hidden state once: what
    entered layer 0 is freed when layer 0's output replaces it (the estimator's prefix_cache),
    not kept through the fill by the recorded calls. Counted on CPU, every tensor the fill allocates."""
    from deca_ds.runtime.allocated import TensorBytes

    model = tiny_llama(layers=LAYERS, hidden=256, dtype=torch.float32).train()  # wide: the hidden states dominate
    partition = model_partition(model, DecaConfig(layers_per_block=1))
    model.requires_grad_(False)
    n, batch, seq = 32, 2, 8
    batches = client_batches(1, steps=n, batch=batch, seq=seq)[0]
    hidden = batch * seq * 256 * 4  # one micro-batch's fp32 hidden state
    prefix = FrozenPrefix(model, partition)
    with TensorBytes() as counter:
        assert prefix.fill(model, 3, batches)
    assert prefix.pending == n
    # the n cached states with each micro-batch's mask and rotary tables (0.3 of a state here), and
    # one layer's forward on one micro-batch (its MLP: 6 states); holding what entered layer 0 too
    # would be 2n states and more
    assert n * hidden <= counter.peak < (1.5 * n + 12) * hidden, counter.peak / hidden


def test_lm_head_block_caches_every_decoder_layer():
    """A block of no decoder layer (the LM head) has every layer below it: its steps compute only
    the final norm and the head."""
    base = tiny_llama(layers=LAYERS, dtype=torch.float32)
    config = DecaConfig(layers_per_block=2, steps_per_block=R, rounds=1, lr=1e-2, master_dtype=torch.float32,
                        train_lm_head=True)
    resident, cached = copy.deepcopy(base), copy.deepcopy(base)
    calls = {}
    for name, model in (("resident", resident), ("cached", cached)):
        for layer in model.model.layers:  # a pre-hook: checkpointing's recomputation stops inside the MLP
            layer.mlp.register_forward_pre_hook(lambda *_, name=name: calls.__setitem__(name, calls.get(name, 0) + 1))
    expected, _ = train(resident, config=config)
    losses, per_block = train(cached, offload=True, prefix=True, config=config)
    assert losses == expected
    spec = ModelSpec.from_config(base.config)
    for block in range(3):  # the head's block streams every layer once, as the estimator counts
        est = estimate_block(spec, 2, block, Workload(working_dtype="fp32"), offload="frozen", steps_per_block=R,
                             train_lm_head=True)
        assert est.offload_stream_block == per_block[block], block
    assert per_block[2] == offload_block_stream([spec.layer_params[0] * 4] * LAYERS, [], R, prefix=True)
    # The same layer computations, rearranged. Blocks: layers 0-1, layers 2-3, LM head; per block the
    # layers from the block up compute in forward and in the recomputation, those below once per
    # micro-batch (R of them) - by FrozenPrefix in the run that caches.
    assert calls["cached"] == calls["resident"] == (2 * LAYERS * R) + (2 * R + 2 * 2 * R) + (LAYERS * R)
    for (name, a), b in zip(resident.named_parameters(), cached.parameters()):
        assert torch.equal(a, b), name


def test_embeddings_block_has_every_layer_above_it_and_the_others_still_cache():
    """The embeddings' block has no layer below it (nothing to cache, nothing to warn about): every
    layer streams up and down in each of its steps, as the estimator counts."""
    base = tiny_llama(layers=LAYERS, dtype=torch.float32)
    config = DecaConfig(layers_per_block=1, steps_per_block=R, rounds=1, lr=1e-2, master_dtype=torch.float32,
                        train_embeddings=True)
    resident, cached = copy.deepcopy(base), copy.deepcopy(base)
    expected, _ = train(resident, config=config)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        losses, per_block = train(cached, offload=True, prefix=True, config=config)
    assert losses == expected
    for (name, a), b in zip(resident.named_parameters(), cached.parameters()):
        assert torch.equal(a, b), name
    # blocks: embeddings, then layers 0..3; layer k's block streams the layers below it once
    spec = ModelSpec.from_config(base.config)
    layer = spec.layer_params[0] * 4
    assert per_block[0] == offload_block_stream([], [layer] * LAYERS, R, prefix=True)
    for k in range(1, LAYERS):
        below, above = [layer] * k, [layer] * (LAYERS - 1 - k)
        assert per_block[k + 1] == offload_block_stream(below, above, R, prefix=True), k
    for block in range(LAYERS + 1):
        est = estimate_block(spec, 1, block, Workload(working_dtype="fp32"), offload="frozen", steps_per_block=R,
                             train_embeddings=True)
        assert est.offload_stream_block == per_block[block], block
        assert (est.prefix_cache == 0) == (block <= 1)  # nothing below the embeddings' block nor layer 0's


def test_a_block_whose_trainable_tensor_feeds_the_layers_below_it_computes_them_every_step():
    """A custom block of the embeddings and layer 2: what enters layers 0-1 trains, so they cannot
    be cached while it is active (a warning, once); the other blocks still cache, bit for bit."""
    base = tiny_llama(layers=LAYERS, dtype=torch.float32)
    config = DecaConfig(steps_per_block=R, rounds=1, lr=1e-2, master_dtype=torch.float32,
                        custom_blocks=[["model.embed_tokens", "model.layers.2"], "model.layers.0", "model.layers.1",
                                       "model.layers.3"])
    resident, cached = copy.deepcopy(base), copy.deepcopy(base)
    expected, _ = train(resident, config=config)
    with pytest.warns(UserWarning, match="block 0 trains a tensor that feeds the layers below") as caught:
        losses, _ = train(cached, offload=True, prefix=True, config=config)
    assert losses == expected and len(caught) == 1
    for (name, a), b in zip(resident.named_parameters(), cached.parameters()):
        assert torch.equal(a, b), name


def test_dropout_falls_back_to_computing_every_step():
    base = tiny_llama(layers=LAYERS, dtype=torch.float32)
    for layer in base.model.layers:
        layer.self_attn.attention_dropout = 0.1
    resident, cached = copy.deepcopy(base), copy.deepcopy(base)
    torch.manual_seed(3)
    expected, _ = train(resident)
    torch.manual_seed(3)
    with pytest.warns(UserWarning, match="draw random numbers"):
        losses, _ = train(cached, offload=True, prefix=True)
    assert losses == expected


def test_trainable_input_falls_back():
    """An LM head tied to the embeddings, as the active block, trains what enters every layer:
    nothing below can be cached."""
    model = tiny_llama(layers=LAYERS, dtype=torch.float32).train()
    opt = DecaOptimizer(model, DecaConfig(layers_per_block=1, steps_per_block=1, rounds=1))
    prefix = FrozenPrefix(model, opt.partition)
    model.model.embed_tokens.weight.requires_grad_(True)
    batches = client_batches(1, steps=2)[0]
    with pytest.warns(UserWarning, match="block 2 trains a tensor that feeds the layers below"):
        assert not prefix.fill(model, 2, batches)
    assert prefix.pending == 0 and not any("forward" in vars(layer) for layer in model.model.layers)
    prefix.next(batches[0])  # nothing cached: every layer computes, nothing to hand over
    # only while that block trains: once the input is frozen again, the next block caches
    model.model.embed_tokens.weight.requires_grad_(False)
    assert prefix.enabled and prefix.fill(model, 3, batches) and prefix.pending == 2


def test_batches_out_of_order_are_refused():
    model = tiny_llama(layers=LAYERS, dtype=torch.float32).train()
    opt = DecaOptimizer(model, DecaConfig(layers_per_block=1, steps_per_block=2, rounds=1))
    prefix = FrozenPrefix(model, opt.partition)
    first, second = client_batches(1, steps=2)[0]
    assert prefix.fill(model, 2, [first, second]) and prefix.pending == 2
    with pytest.raises(RuntimeError, match="not the one the cached hidden state was computed for"):
        prefix.next(second)
    prefix.next(second)
    with pytest.raises(RuntimeError, match="no cached hidden state left"):
        prefix.next(first)
    prefix.clear()
    assert not any("forward" in vars(layer) for layer in model.model.layers)
