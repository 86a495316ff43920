"""The simulator against an independent float64 re-derivation of Algorithm 1.

The reference below is written from the equations of ALGORITHM.md only: it holds each client's
parameters as a plain dict of float64 tensors, takes gradients with torch.func.functional_call,
and never touches DecaOptimizer, the mixer or the partition code.
"""

import math

import numpy as np
import pytest
import torch
from torch.func import functional_call

from deca_ds import DecaConfig, make_topology, simulate
from helpers import client_batches, tiny_llama

LAYERS, LPB, R, T, N = 3, 2, 3, 2, 4


def reference_blocks(layers: int, lpb: int) -> list[list[str]]:
    return [[f"model.layers.{i}." for i in range(k, min(k + lpb, layers))]
            for k in range(0, layers, lpb)]


def reference_deca(model, batches, W, cfg: DecaConfig):
    a1, a2 = cfg.adam_betas
    b1, b2 = cfg.bma_betas
    init = {n: p.detach().clone() for n, p in model.named_parameters()}
    xs = [{n: t.clone() for n, t in init.items()} for _ in range(len(W))]
    streams = [iter(b) for b in batches]
    blocks = reference_blocks(len(model.model.layers), cfg.layers_per_block)
    for _t in range(cfg.rounds):
        for prefixes in blocks:
            names = [n for n in init if any(n.startswith(p) for p in prefixes)]
            flat = lambda x: torch.cat([x[n].reshape(-1) for n in names])  # noqa: E731
            # 1 − γλ for each weight weight_decay_on decays ('matrices': not the 1-D norm weights), else 1
            keep = torch.cat([torch.full((init[n].numel(),), 1 - cfg.lr * cfg.weight_decay
                                         if cfg.weight_decay_on == "all" or init[n].ndim >= 2 else 1.0,
                                         dtype=torch.float64) for n in names])
            m = [torch.zeros_like(flat(x)) for x in xs]
            v = [torch.zeros_like(flat(x)) for x in xs]
            for r in range(cfg.steps_per_block):
                x_half, x_old, halves = [], [], []
                for i, x in enumerate(xs):
                    active = {n: x[n].clone().requires_grad_(True) for n in names}
                    loss = functional_call(model, {**x, **active}, args=(), kwargs=next(streams[i])).loss
                    grads = torch.autograd.grad(loss, [active[n] for n in names])
                    g = torch.cat([gr.reshape(-1) for gr in grads])
                    m_half = a1 * m[i] + (1 - a1) * g
                    v_half = a2 * v[i] + (1 - a2) * g * g
                    m_hat = m_half / (1 - a1 ** (r + 1))
                    v_hat = v_half / (1 - a2 ** (r + 1))
                    x_old.append(flat(x))
                    x_half.append(keep * x_old[i] - cfg.lr * m_hat / (torch.sqrt(v_hat) + cfg.eps))
                    halves.append((m_half, v_half))
                stacked = torch.stack(x_half)
                x_plus = torch.tensor(W, dtype=torch.float64) @ stacked
                for i, x in enumerate(xs):
                    (m_half, v_half), m_prev, v_prev = halves[i], m[i], v[i]
                    d = x_old[i] - x_plus[i]
                    norm = torch.sqrt(torch.sum(d * d))
                    h = d / norm if norm > 0 else torch.zeros_like(d)
                    if cfg.variant == "deca":
                        m[i], v[i] = b1 * m_half + (1 - b1) * h, b2 * v_half + (1 - b2) * h * h
                    elif cfg.variant == "trivial_bma":
                        m[i], v[i] = a1 * m_prev + (1 - a1) * h, a2 * v_prev + (1 - a2) * h * h
                    else:
                        m[i], v[i] = m_half, v_half
                    offset = 0
                    for n in names:
                        k = x[n].numel()
                        x[n] = x_plus[i, offset:offset + k].view_as(x[n]).clone()
                        offset += k
    return init, xs


def relative_update_error(init, got, want) -> float:
    """‖Δ_got − Δ_want‖ / ‖Δ_want‖ over all parameters, Δ = final − initial: errors are measured
    against what training changed, not against the (much larger) weights themselves."""
    num = sum(torch.sum((got[n] - want[n]) ** 2).item() for n in init)
    den = sum(torch.sum((want[n] - init[n]) ** 2).item() for n in init)
    assert den > 0, "reference did not move"
    return math.sqrt(num / den)


@pytest.mark.parametrize("fused_update", [False, True])
@pytest.mark.parametrize("topology", ["ring", "erdos_renyi", "one client"])
@pytest.mark.parametrize("variant", ["deca", "trivial_bma", "no_bma"])
def test_simulator_matches_float64_reference(topology, variant, fused_update):
    """One client (W = [1]) takes the fused update's in-place path, the others the general one.
    The fused cases cut 2 layers into 2 blocks: a compiled kernel is specialised to the number of
    tensors it is given, so uneven blocks (3 layers by 2) would compile each one twice; a last,
    shorter block is the partition's, which the eager cases cover. The ring decays the matrices
    (weight_decay_on 'matrices': each block holds tensors that decay and tensors that do not), the
    others nothing (the in-place path's decay: test_fused, against the eager path this holds)."""
    layers, lpb = (2, 1) if fused_update else (LAYERS, LPB)
    W = np.ones((1, 1)) if topology == "one client" else make_topology(topology, N, p=0.5, seed=3).W
    decay = dict(weight_decay=0.5, weight_decay_on="matrices") if topology == "ring" else {}
    cfg = DecaConfig(lr=1e-3, bma_betas=(0.3, 0.333), steps_per_block=R, rounds=T, layers_per_block=lpb,
                     variant=variant, master_dtype=torch.float64, fused_update=fused_update, **decay)
    model = tiny_llama(layers)
    batches = client_batches(len(W), steps=T * 2 * R)
    got = simulate(model, batches, W, cfg)
    init, want = reference_deca(model, batches, W, cfg)
    for i in range(len(W)):
        assert relative_update_error(init, got[i], want[i]) <= 1e-10


def test_variants_and_clients_really_differ():
    """Guards the test above against passing vacuously."""
    W = make_topology("ring", N).W
    model = tiny_llama(LAYERS)
    batches = client_batches(N, steps=T * 2 * R)
    finals = {}
    for variant in ("deca", "trivial_bma", "no_bma"):
        cfg = DecaConfig(lr=1e-3, bma_betas=(0.3, 0.333), steps_per_block=R, rounds=T,
                         layers_per_block=LPB, variant=variant, master_dtype=torch.float64)
        finals[variant] = simulate(model, batches, W, cfg)
    name = "model.layers.0.mlp.up_proj.weight"
    assert not torch.equal(finals["deca"][0][name], finals["no_bma"][0][name])
    assert not torch.equal(finals["deca"][0][name], finals["trivial_bma"][0][name])
    assert not torch.equal(finals["deca"][0][name], finals["deca"][1][name])
    assert np.allclose(W.sum(1), 1)
