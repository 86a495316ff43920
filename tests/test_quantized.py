"""8-bit moments (DecaConfig(state_bits=8)): exact bytes, tensor-by-tensor work, drift, resume, errors."""

import io
import math
import sys

import pytest
import torch

from deca_ds import DecaConfig, DecaOptimizer, make_topology, simulate
from deca_ds.quantized import QUANT_BLOCK, QuantizedVector
from helpers import assert_resume_mid_block_is_bit_identical, client_batches, needs_bnb, tiny_llama


def config(**kw):
    base = dict(lr=1e-3, steps_per_block=4, rounds=3, layers_per_block=1, state_bits=8)
    return DecaConfig(**{**base, **kw})


@needs_bnb
@pytest.mark.parametrize("signed, step", [(True, 1 / 128), (False, 1 / 256)])
def test_quantized_vector_round_trip_error_is_within_half_a_code_step(signed, step):
    """Each 256-element block is off by at most half the map's largest gap times its absmax;
    the unsigned map (for v) halves that gap."""
    sizes = [1000, 32, 300]
    q = QuantizedVector.zeros(sizes, signed, torch.device("cpu"))
    assert all(torch.equal(q.get(i), torch.zeros(n)) for i, n in enumerate(sizes))
    torch.manual_seed(0)
    for i, n in enumerate(sizes):
        x = torch.randn(n) if signed else torch.rand(n) ** 2
        q.put(i, x)
        for a, b in zip(x.split(QUANT_BLOCK), q.get(i).split(QUANT_BLOCK)):
            assert (a - b).abs().max() <= step * a.abs().max()


@needs_bnb
def test_state_bytes_are_codes_absmax_and_master():
    model = tiny_llama(layers=2, dtype=torch.float32)
    opt = DecaOptimizer(model, config(steps_per_block=1, rounds=1))
    batch = client_batches(1, steps=1)[0][0]
    while not opt.done:
        params = opt.active.params
        numel = sum(p.numel() for p in params)
        absmax = sum(math.ceil(p.numel() / QUANT_BLOCK) for p in params)  # a new block per tensor
        assert opt.state_bytes() == numel * 4 + 2 * (numel * 1 + absmax * 4)
        assert opt.state_bytes() < 0.6 * 3 * numel * 4  # fp32 master, m, v
        model(**batch).loss.backward()
        opt.step()


@needs_bnb
def test_moments_are_dequantized_one_tensor_at_a_time(monkeypatch):
    """No block-sized fp32 m or v: every dequantized piece is one parameter tensor."""
    sizes = []
    get = QuantizedVector.get
    monkeypatch.setattr(QuantizedVector, "get", lambda self, i: sizes.append(self.sizes[i]) or get(self, i))
    simulate(tiny_llama(layers=2, dtype=torch.float32), client_batches(2, steps=8),
             make_topology("ring", 2).W, config(steps_per_block=2, rounds=2))
    block = sum(p.numel() for p in tiny_llama(layers=2).model.layers[0].parameters())
    assert sizes and max(sizes) == 32 * 64 < block


def held_out_loss(params: dict, batches) -> float:
    model = tiny_llama(layers=2, dtype=torch.float32)
    model.load_state_dict(params)
    with torch.no_grad():
        return sum(model(**b).loss.item() for b in batches) / len(batches)


@needs_bnb
@pytest.mark.parametrize("variant", ["deca", "trivial_bma", "no_bma"])
def test_8bit_run_trains_and_stays_close_to_the_fp32_state_run(variant):
    """3 clients on a ring, 24 steps: 8-bit moments lower the held-out loss, and every client ends
    within 15% of the fp32-moment run's own parameter change (measured: 2-8%)."""
    model, batches = tiny_llama(layers=2, dtype=torch.float32), client_batches(3, steps=24)
    held = [b for client in client_batches(3, steps=2, batch=8, seed=99) for b in client]
    W = make_topology("ring", 3).W
    fp32 = simulate(model, batches, W, config(variant=variant, state_bits=32))
    int8 = simulate(model, batches, W, config(variant=variant))
    start = dict(model.named_parameters())
    for a, b in zip(fp32, int8):
        drift = torch.cat([(b[n] - a[n]).flatten() for n in a]).norm()
        update = torch.cat([(a[n] - start[n]).flatten() for n in a]).norm()
        assert drift < 0.15 * update
    assert held_out_loss(int8[0], held) < held_out_loss(dict(start), held) - 1e-3


@needs_bnb
def test_state_dict_resume_is_bit_identical():
    """Checkpoint mid-block (through torch.save / torch.load(weights_only=True)), resume: same bits."""
    def through_a_file(model, opt):
        buffer = io.BytesIO()
        torch.save({"model": model, "optimizer": opt}, buffer)
        buffer.seek(0)
        saved = torch.load(buffer, weights_only=True)
        return saved["model"], saved["optimizer"]

    cfg = config(steps_per_block=4, rounds=1, variant="trivial_bma")
    assert_resume_mid_block_is_bit_identical(tiny_llama(layers=3, dtype=torch.float32), cfg, through_a_file)


def test_8bit_without_bitsandbytes_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "bitsandbytes", None)  # `import bitsandbytes...` now fails
    monkeypatch.setitem(sys.modules, "bitsandbytes.functional", None)
    with pytest.raises(ValueError, match=r"state_bits=8 needs bitsandbytes.*pip install 'deca-ds\[bnb\]'"):
        DecaConfig(state_bits=8)
    DecaConfig()  # the default needs no bitsandbytes


@pytest.mark.parametrize("kw, message", [
    (dict(state_bits=16), "state_bits must be 32 or 8"),
    (dict(state_bits=8, master_dtype=torch.float64), "state_bits=8 needs master_dtype float32"),
])
def test_config_rejects_bad_state_bits(kw, message):
    with pytest.raises(ValueError, match=message):
        DecaConfig(**kw)
