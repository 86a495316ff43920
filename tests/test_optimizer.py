"""DecaOptimizer: degenerate cases of ALGORITHM.md, state lifetime, precision, resume, config."""

import copy

import pytest
import torch

from deca_ds import DecaConfig, DecaOptimizer, make_topology, partition_model, simulate
from deca_ds.mixing import ClientView
from helpers import assert_resume_mid_block_is_bit_identical, client_batches, tiny_llama


def config(**kw):
    base = dict(lr=1e-3, steps_per_block=3, rounds=2, layers_per_block=1, master_dtype=torch.float64)
    return DecaConfig(**{**base, **kw})


def test_beta_one_deca_is_no_bma():
    model, batches = tiny_llama(), client_batches(4, steps=18)
    W = make_topology("ring", 4).W
    deca = simulate(model, batches, W, config(bma_betas=(1.0, 1.0), variant="deca"))
    plain = simulate(model, batches, W, config(variant="no_bma"))
    for a, b in zip(deca, plain):
        assert all(torch.equal(a[n], b[n]) for n in a)


def test_a_nonfinite_loss_or_update_stops_the_simulation_naming_the_clients(monkeypatch):
    """A NaN is an error, not a result: simulate() stops at the step where a client's loss or update
    (x½) is not finite, naming the clients, before on_step sees it."""
    W, seen = make_topology("ring", 2).W, []
    model = tiny_llama()
    with torch.no_grad():
        model.model.embed_tokens.weight[:, 0] = float("nan")
    with pytest.raises(ValueError, match=r"non-finite loss on client\(s\) \[0, 1\] and update on client\(s\) "
                                         r"\[0, 1\] at step 0 \(round 0, block 0, r 0\)"):
        simulate(model, client_batches(2, steps=6), W, config(), on_step=seen.append)
    assert seen == []

    # a finite loss, but client 1's update at step 2 (its gradient, say, overflowed)
    local_step, calls = DecaOptimizer.local_step, []

    def poisoned(self):
        payload = local_step(self)
        calls.append(self)
        if len(calls) == 2 * 2 + 2:  # the third step's second client
            payload[0] = float("inf")
        return payload

    monkeypatch.setattr(DecaOptimizer, "local_step", poisoned)
    with pytest.raises(ValueError, match=r"^non-finite update on client\(s\) \[1\] at step 2 \(round 0, block 0, "
                                         r"r 2\): the simulation stops here"):
        simulate(tiny_llama(), client_batches(2, steps=6), W, config(), on_step=seen.append)
    assert [info.step for info in seen] == [0, 1]


@pytest.mark.parametrize("variant", ["deca", "trivial_bma", "no_bma"])
def test_complete_uniform_graph_gives_identical_clients(variant):
    model, batches = tiny_llama(), client_batches(4, steps=18)
    W = make_topology("complete", 4, weights="uniform").W
    seen = []

    def check(info):
        seen.append(info.losses)

    finals = simulate(model, batches, W, config(variant=variant), on_step=check)
    assert len(seen) == 18 and len(set(seen[-1])) > 1, "clients saw different data"
    for other in finals[1:]:
        assert all(torch.equal(finals[0][n], other[n]) for n in other)


def test_single_client_no_bma_is_block_adam_with_resets():
    """N = 1, no_bma: torch.optim.Adam re-created (moments reset) at every block switch."""
    cfg = config(variant="no_bma", rounds=2, steps_per_block=4, layers_per_block=2)
    model, batches = tiny_llama(layers=3), client_batches(1, steps=16)
    got = simulate(model, batches, [[1.0]], cfg)[0]

    ref = copy.deepcopy(model)
    stream = iter(batches[0])
    blocks = [[f"model.layers.{i}." for i in ls] for ls in ([0, 1], [2])]
    for _ in range(cfg.rounds):
        for prefixes in blocks:
            params = [p for n, p in ref.named_parameters() if n.startswith(tuple(prefixes))]
            adam = torch.optim.Adam(params, lr=cfg.lr, betas=cfg.adam_betas, eps=cfg.eps)
            for _ in range(cfg.steps_per_block):
                ref.zero_grad()
                ref(**next(stream)).loss.backward()
                adam.step()
    for n, p in ref.named_parameters():
        torch.testing.assert_close(got[n], p.detach(), rtol=1e-12, atol=1e-14)


def test_state_exists_only_for_the_active_block_and_is_released():
    model = tiny_llama(layers=3, dtype=torch.bfloat16)
    cfg = config(master_dtype=torch.float32, steps_per_block=2, rounds=2)
    opt = DecaOptimizer(model, cfg)
    partition = opt.partition
    stream = iter(client_batches(1, steps=12)[0])
    seen_blocks = []
    while not opt.done:
        k = opt.active.index
        seen_blocks.append(k)
        expected = 3 * partition.blocks[k].numel * 4  # master, m, v in fp32
        assert opt.state_bytes() == expected
        active = {n for n in partition.blocks[k].param_names}
        for n, p in model.named_parameters():
            assert p.requires_grad == (n in active), n
        model(**next(stream)).loss.backward()
        for n, p in model.named_parameters():
            assert (p.grad is not None) == (n in active), n
        opt.step()
    assert seen_blocks == [0, 0, 1, 1, 2, 2] * 2
    assert opt.state_bytes() == 0 and opt.active is None and len(opt.state) == 0
    assert all(p.grad is None and not p.requires_grad for p in model.parameters())
    with pytest.raises(RuntimeError, match="rounds are done"):
        opt.step()


def test_bf16_working_weights_follow_fp32_master():
    model = tiny_llama(layers=2, dtype=torch.bfloat16)
    opt = DecaOptimizer(model, config(master_dtype=torch.float32, steps_per_block=5, rounds=1))
    batch = client_batches(1, steps=1)[0][0]
    model(**batch).loss.backward()
    opt.step()
    blk = opt.active
    assert blk.master.dtype == torch.float32
    for p, x in blk.segments(blk.master):
        assert p.dtype == torch.bfloat16
        assert torch.equal(p, x.to(torch.bfloat16))


@pytest.mark.parametrize("variant", ["deca", "no_bma"])
def test_x_plus_becomes_the_master_without_a_copy(variant):
    """The mixer's x⁺ buffer is kept as the new x (Mixer.mix hands it over): no block-sized copy,
    whether the mixer sums into a new buffer (the simulator's views) or returns x½ (the identity)."""
    model = tiny_llama(layers=2, dtype=torch.bfloat16)
    opt = DecaOptimizer(model, config(master_dtype=torch.float32, variant=variant))
    model(**client_batches(1, steps=1)[0][0]).loss.backward()
    x_half = opt.local_step()
    view = ClientView([(0.5, x_half), (0.5, x_half.clone())], x_half)
    returned = []
    view.mix = lambda x: returned.append(ClientView.mix(view, x)) or returned[-1]  # a new buffer
    opt.combine(view, x_half)
    assert opt.active.master is returned[0] and returned[0] is not x_half
    model(**client_batches(1, steps=1)[0][0]).loss.backward()
    x_half = opt.local_step()
    opt.combine(opt.mixer, x_half)  # the identity: x⁺ is x½ itself
    assert opt.active.master is x_half
    for p, x in opt.active.segments(x_half):
        assert torch.equal(p, x.to(torch.bfloat16))


def test_frozen_parameters_are_bit_identical_after_training():
    model = tiny_llama(layers=3, dtype=torch.float32)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    finals = simulate(model, client_batches(2, steps=18), make_topology("ring", 2).W,
                      config(master_dtype=torch.float32))
    frozen = partition_model(model, 1).frozen
    assert set(frozen) == {"model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"}
    for final in finals:
        for n in frozen:
            assert torch.equal(final[n], before[n])
        assert not torch.equal(final["model.layers.2.mlp.down_proj.weight"],
                               before["model.layers.2.mlp.down_proj.weight"])
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters()), "caller's model changed"


def test_state_dict_resume_is_bit_identical():
    """Stop mid-block, rebuild model and optimizer from the checkpoint, continue: same bits."""
    cfg = config(master_dtype=torch.float32, steps_per_block=4, rounds=1, variant="deca")
    assert_resume_mid_block_is_bit_identical(tiny_llama(layers=3, dtype=torch.bfloat16), cfg,
                                             lambda model, opt: (copy.deepcopy(model), copy.deepcopy(opt)))


def test_resume_with_another_config_is_refused():
    model = tiny_llama(layers=2)
    state = DecaOptimizer(model, config()).state_dict()
    with pytest.raises(ValueError, match="different DecaConfig.*lr"):
        DecaOptimizer(model, config(lr=2e-3)).load_state_dict(state)


def test_state_saved_before_a_setting_existed_resumes_as_its_default():
    """A checkpoint's config without weight_decay_on (saved before it existed, when every tensor
    decayed) resumes under its default 'all', and is refused under 'matrices'."""
    model = tiny_llama(layers=2)
    state = DecaOptimizer(model, config(weight_decay=0.1)).state_dict()
    del state["config"]["weight_decay_on"]
    DecaOptimizer(model, config(weight_decay=0.1)).load_state_dict(state)
    with pytest.raises(ValueError, match=r"different DecaConfig .*'weight_decay_on': \('all', 'matrices'\)"):
        DecaOptimizer(model, config(weight_decay=0.1, weight_decay_on="matrices")).load_state_dict(state)


def test_grad_clip_bounds_the_first_update():
    """With clipping at c, Adam's first step is unchanged in direction (sign) but g is scaled; with
    a tiny clip, m̂/√v̂ is still ±1, so compare m directly."""
    model = tiny_llama(layers=2)
    opt = DecaOptimizer(model, config(grad_clip=1e-3, variant="no_bma"))
    batch = client_batches(1, steps=1)[0][0]
    model(**batch).loss.backward()
    g = torch.cat([p.grad.reshape(-1) for p in opt.active.params])
    opt.step()
    a1 = opt.config.adam_betas[0]
    torch.testing.assert_close(opt.active.m, (1 - a1) * g * (1e-3 / (g.norm() + 1e-6)))


@pytest.mark.parametrize("on", ["all", "matrices"])
def test_weight_decay_is_decoupled(on):
    """x½ = (1 − γλ)·x − γ·m̂/(√v̂ + ε) on every tensor weight_decay_on decays; on the others (with
    'matrices' the layer's two RMSNorm weights, its only 1-D tensors) x½ = x − γ·m̂/(√v̂ + ε)."""
    model = tiny_llama(layers=2)
    cfg = config(weight_decay=0.1, weight_decay_on=on, variant="no_bma")
    opt = DecaOptimizer(model, cfg)
    x0 = opt.active.master.clone()
    model(**client_batches(1, steps=1)[0][0]).loss.backward()
    x_half = opt.adam_half_step()
    m_hat = opt.active.m / (1 - cfg.adam_betas[0])
    v_hat = opt.active.v / (1 - cfg.adam_betas[1])
    decayed = torch.cat([torch.full((p.numel(),), on == "all" or p.ndim == 2) for p in opt.active.params])
    assert 0 < decayed.sum() and (on == "all") == bool(decayed.all())
    want = x0 - cfg.lr * m_hat / (v_hat.sqrt() + cfg.eps) - cfg.lr * 0.1 * x0 * decayed
    torch.testing.assert_close(x_half, want, rtol=1e-13, atol=1e-15)


# the local Adam's settings (deca_ds.config.AdamSettings), which DECA and the baselines share
ADAM_REFUSALS = [
    (dict(lr=0), "lr must be > 0"),
    (dict(lr=-1e-3), "lr must be > 0"),
    (dict(adam_betas=(0.9, 1.5)), "adam_betas must be two numbers in \\[0, 1\\)"),
    # α = 1: the bias correction 1 - α^(r+1) is 0, and the first step NaN
    (dict(adam_betas=(0.9, 1.0)), "adam_betas must be two numbers in \\[0, 1\\), got \\(0.9, 1.0\\)"),
    (dict(adam_betas=(1.0, 0.999)), "adam_betas must be two numbers in \\[0, 1\\)"),
    (dict(eps=0), "eps must be > 0"),
    (dict(master_dtype="bf16"), "master_dtype must be float32 or float64"),
    (dict(master_dtype="fp128"), "master_dtype must be one of"),
    (dict(grad_clip=0.0), "grad_clip must be > 0"),
    (dict(weight_decay=-1.0), "weight_decay must be >= 0"),
    (dict(weight_decay_on="norms"), r"weight_decay_on must be one of \('all', 'matrices'\), got 'norms'"),
    (dict(fused_update="yes"), "fused_update must be True or False"),
]


@pytest.mark.parametrize("kw, message", [
    *ADAM_REFUSALS,
    (dict(bma_betas=(-0.1, 0.9)), "bma_betas must be two numbers in \\[0, 1\\]"),
    (dict(bma_betas=(0.9,)), "bma_betas must be two numbers"),
    (dict(steps_per_block=0), "steps_per_block must be an integer >= 1"),
    (dict(rounds=0), "rounds must be an integer >= 1"),
    (dict(layers_per_block=0), "layers_per_block must be an integer >= 1"),
    (dict(layers_per_block=1.5), "layers_per_block must be an integer >= 1"),
    (dict(variant="adam"), "variant must be one of"),
    (dict(block_order="sideways"), "block_order must be one of"),
])
def test_config_rejects_bad_values(kw, message):
    with pytest.raises(ValueError, match=message):
        DecaConfig(**kw)


@pytest.mark.parametrize("kw, message", ADAM_REFUSALS)
def test_the_baselines_adam_refuses_what_decas_refuses(kw, message):
    from deca_ds.methods import AdamConfig

    with pytest.raises(ValueError, match=message):
        AdamConfig(steps=1, **kw)


def test_simulate_rejects_mismatched_inputs():
    model = tiny_llama(layers=2)
    with pytest.raises(ValueError, match="3x3 but 2 clients"):
        simulate(model, client_batches(2, steps=1), make_topology("ring", 3).W, config())
    with pytest.raises(ValueError, match="client 1 ran out of batches at step 0"):
        simulate(model, [client_batches(1, 1)[0], []], make_topology("ring", 2).W, config())
    with pytest.raises(ValueError, match="mixing matrix .*row"):
        simulate(model, client_batches(2, steps=1), [[0.5, 0.5], [0.5, 0.4]], config())
    for bad in (0, 1.5):
        with pytest.raises(ValueError, match=rf"grad_accum must be a whole number >= 1, got {bad}"):
            simulate(model, client_batches(2, steps=1), make_topology("ring", 2).W, config(), grad_accum=bad)


@pytest.mark.parametrize("variant", ["deca", "trivial_bma", "no_bma"])
def test_finished_block_state_is_freed_before_the_next_is_allocated(variant):
    """Two blocks' master, m, v are never alive at once (on a GPU that would add a whole block's
    state to the peak at every block switch)."""
    import weakref

    model = tiny_llama(layers=3)
    held = []

    def check(index):
        alive = [name for name, ref in held if ref() is not None]
        assert not alive, f"activating block {index} while the previous block's {alive} are alive"

    opt = DecaOptimizer(model, config(variant=variant, rounds=1), before_activate=check)
    for batch in client_batches(1, steps=opt.total_steps)[0]:
        blk = opt.active
        held[:] = [(name, weakref.ref(getattr(blk, name))) for name in ("master", "m", "v")]
        del blk
        model(**batch).loss.backward()
        opt.step()
    assert opt.done
