"""fused_update: the optimizers' elementwise math as torch.compile'd kernels.

The fused simulator is checked against the independent float64 re-derivation of Algorithm 1 in
test_simulator_exact.py (the same bound as the eager run); here each phase against the eager one
in fp32 with bf16 working weights, compiling once however t, lr and tensor sizes change, new
constants reaching the same kernel, D-Adam, resume and config errors.
"""

import copy
import math
import re
import types
from unittest import mock

import pytest
import torch

from deca_ds import DecaConfig, DecaOptimizer, make_topology, simulate
from deca_ds.kernels import carry_and_write, discrepancy_, fused, moments_, step_alone
from deca_ds.methods import AdamConfig, DAdam
from helpers import client_batches, needs_bnb, tiny_llama


def close(got: torch.Tensor, want: torch.Tensor) -> None:
    """Equal up to a few fp32 roundings of the tensor's scale (elements near 0 come from cancellation)."""
    torch.testing.assert_close(got, want, rtol=1e-6, atol=8 * torch.finfo(torch.float32).eps * want.abs().max().item())


class GivenMix:
    """A mixer with neighbors whose x⁺ the test sets."""

    alone = False
    x_plus: torch.Tensor

    def mix(self, x_half: torch.Tensor) -> torch.Tensor:
        return self.x_plus


@pytest.mark.parametrize("variant", ["deca", "trivial_bma", "no_bma"])
def test_fused_step_equals_eager_in_fp32_with_bf16_weights(variant):
    """Each phase from identical inputs: the same gradients, state and x⁺ every step. (Otherwise
    d = x − x⁺, a difference of nearly equal numbers, turns the paths' last-bit differences into
    relative differences of h, and bf16 weights one rounding apart give different gradients.)"""
    base = tiny_llama(layers=2, dtype=torch.bfloat16)
    cfg = dict(lr=1e-3, steps_per_block=3, rounds=1, layers_per_block=1, variant=variant,
               weight_decay=0.01, grad_clip=0.5)
    eager, fused = copy.deepcopy(base), copy.deepcopy(base)
    given = GivenMix()
    opts = DecaOptimizer(eager, DecaConfig(**cfg)), DecaOptimizer(fused, DecaConfig(**cfg, fused_update=True),
                                                                   mixer=given)
    state = lambda opt: [getattr(opt.active, k) for k in ("master", "m", "v")]  # noqa: E731
    for batch in client_batches(1, steps=6)[0]:
        eager(**batch).loss.backward()
        for p, q in zip(opts[0].active.params, opts[1].active.params):
            q.grad = p.grad.clone()
        want, got = (opt.local_step() for opt in opts)
        for g, w in zip([got, *state(opts[1])[1:]], [want, *state(opts[0])[1:]]):  # x½, m½, v½
            close(g, w)
        opts[0].combine(opts[0].mixer, want)
        given.x_plus = want.clone()
        opts[1].combine(given, got)
        if not opts[0].done:
            for g, w in zip(state(opts[1]), state(opts[0])):  # x = x⁺, carried m, v
                close(g, w)
                g.copy_(w)
    for (n, a), b, c in zip(eager.named_parameters(), fused.parameters(), base.parameters()):
        assert torch.equal(b, a), n
        assert torch.equal(a, c) != n.startswith("model.layers."), n  # both blocks moved, nothing else


def test_a_client_without_neighbors_updates_in_place():
    """N = 1, fused: the local step stores no x½ (its payload is x itself, the gradients stay),
    and the correction writes x⁺ = x½ over x. Against the eager path from identical state each
    step (the matrices decayed, the norms not): x, m, v agree to rounding. DECA's correction only:
    the in-place path of each variant is held to its float64 re-derivation in
    test_simulator_exact (N = 1), and each variant here cost a compile of about 12 s with
    Inductor's cache empty, as in CI."""
    base = tiny_llama(layers=2, dtype=torch.bfloat16)
    cfg = dict(lr=1e-3, steps_per_block=3, rounds=1, layers_per_block=1, variant="deca",
               weight_decay=0.01, weight_decay_on="matrices", grad_clip=0.5)
    eager, fused = copy.deepcopy(base), copy.deepcopy(base)
    opts = DecaOptimizer(eager, DecaConfig(**cfg)), DecaOptimizer(fused, DecaConfig(**cfg, fused_update=True))
    state = lambda opt: [getattr(opt.active, k) for k in ("master", "m", "v")]  # noqa: E731
    for batch in client_batches(1, steps=6)[0]:
        eager(**batch).loss.backward()
        for p, q in zip(opts[0].active.params, opts[1].active.params):
            q.grad = p.grad.clone()
        before = [t.clone() for t in state(opts[1])]
        x = opts[1].active.master
        payload = opts[1].local_step()
        assert payload is x and all(torch.equal(a, b) for a, b in zip(state(opts[1]), before))
        assert all(p.grad is not None for p in opts[1].active.params)
        want = opts[0].local_step()
        opts[0].combine(opts[0].mixer, want)
        opts[1].combine(opts[1].mixer, payload)
        if opts[1].step_in_block:  # still the same block: compare its state
            assert opts[1].active.master is x and all(p.grad is None for p in opts[1].active.params)
            # x⁺ from x, m, v and g alike to a few roundings; h = (x − x⁺)/‖x − x⁺‖ inherits
            # one rounding of x⁺ relative to |x − x⁺| ≈ γ, so the moments get a looser bound.
            close(opts[1].active.master, opts[0].active.master)
            for g, w in zip(state(opts[1])[1:], state(opts[0])[1:]):
                torch.testing.assert_close(g, w, rtol=1e-3, atol=1e-3 * w.abs().max().item())
            for g, w in zip(state(opts[1]), state(opts[0])):
                g.copy_(w)
            for p, x_p in opts[1].active.segments(opts[1].active.master):
                p.detach().copy_(x_p)
    for (n, a), b in zip(eager.named_parameters(), fused.parameters()):
        torch.testing.assert_close(b, a, rtol=0, atol=2 * torch.finfo(torch.bfloat16).eps * a.abs().max().item())


def test_the_in_place_step_is_one_compiled_call_that_stores_nothing_block_sized():
    """The step without neighbors runs as one call (two would cost the host a second round of guards
    and wrappers), and the code it compiles to allocates scalars and a norm per tensor only: x½ is
    formed twice in registers, never held, which the estimator counts on (x_half = 0 in place)."""
    from torch._inductor.graph import GraphLowering

    sizes = [(8, 6), (6,), (12, 6)]
    xs, ms, vs, gs, ws = ([torch.randn(s, dtype=dtype).reshape(-1) for s in sizes]
                          for dtype in (torch.float64, torch.float64, torch.float64, torch.bfloat16, torch.bfloat16))
    vs = [v.abs() for v in vs]
    scalar = lambda value: torch.tensor(value, dtype=torch.float64)  # noqa: E731
    # a fresh code object: dynamo compiles it anew whatever other tests compiled step_alone for
    fresh = types.FunctionType(step_alone.__code__.replace(), step_alone.__globals__)
    codes = []
    with (mock.patch.object(GraphLowering, "save_output_code", codes.append),
          torch._inductor.config.patch(force_disable_caches=True)):
        keep = scalar(0.99)  # the 1-D tensor not decayed, as weight_decay_on 'matrices' leaves it
        fused(fresh)(xs, ms, vs, gs, ws, 0.9, 0.999, scalar(-1e-3), scalar(0.5), 1e-8, [keep, None, keep], "deca",
                     0.9, 0.99)
    assert len(codes) == 1  # one graph
    shapes = re.findall(r"empty_strided_\w+\(\(([^)]*)\)", codes[0])
    assert shapes, "no buffer found in the compiled code: has its form changed?"
    for shape in shapes:
        dims = [d.strip() for d in shape.split(",") if d.strip()]
        assert all(d.isdigit() for d in dims) and math.prod(map(int, dims)) <= len(sizes), shape


def test_the_in_place_update_refuses_a_mix_with_neighbors():
    model = tiny_llama(layers=2, dtype=torch.float32)
    opt = DecaOptimizer(model, DecaConfig(lr=1e-3, steps_per_block=3, rounds=1, fused_update=True))
    model(**client_batches(1, steps=1)[0][0]).loss.backward()
    payload = opt.local_step()
    given = GivenMix()
    given.x_plus = payload.clone()
    with pytest.raises(RuntimeError, match="no neighbors"):
        opt.combine(given, payload)


def test_fused_kernels_compile_once_whatever_t_lr_and_sizes():
    """Bias corrections change every step and a schedule changes lr: neither may recompile."""
    cfg = DecaConfig(lr=1e-3, steps_per_block=3, rounds=1, layers_per_block=1, weight_decay=0.1,
                     fused_update=True, bma_betas=(0.5, 0.6), adam_betas=(0.8, 0.9))
    batches = client_batches(1, steps=6, seed=7)[0]
    model = tiny_llama(layers=2, dtype=torch.float32)
    opt = DecaOptimizer(model, cfg)
    model(**batches[0]).loss.backward()
    opt.step()  # compiles
    with torch._dynamo.config.patch(error_on_recompile=True):
        for step, batch in enumerate(batches[1:], start=1):
            opt.param_groups[opt.active.index]["lr"] = 1e-3 / step
            model(**batch).loss.backward()
            opt.step()
    assert opt.done


def test_fused_dadam_equals_eager():
    base = tiny_llama(layers=2, dtype=torch.float32)
    batches = client_batches(2, steps=4)
    W = make_topology("ring", 2).W
    runs = [simulate(base, batches, W, DAdam(AdamConfig(steps=4, lr=1e-2, weight_decay=0.05, fused_update=f)))
            for f in (False, True)]
    for name, p in runs[0][0].items():
        torch.testing.assert_close(runs[1][0][name], p, rtol=1e-5, atol=1e-6)
    assert not torch.equal(runs[0][0]["model.layers.0.mlp.up_proj.weight"],
                           base.state_dict()["model.layers.0.mlp.up_proj.weight"])


def test_resume_across_the_fused_flag_is_allowed_and_other_changes_are_not():
    model = tiny_llama(layers=2)
    cfg = dict(lr=1e-3, steps_per_block=2, rounds=1, layers_per_block=1, master_dtype=torch.float64)
    state = DecaOptimizer(copy.deepcopy(model), DecaConfig(**cfg)).state_dict()
    DecaOptimizer(copy.deepcopy(model), DecaConfig(**cfg, fused_update=True)).load_state_dict(state)
    with pytest.raises(ValueError, match="lr"):
        DecaOptimizer(copy.deepcopy(model), DecaConfig(**{**cfg, "lr": 2e-3})).load_state_dict(state)


@pytest.mark.parametrize("make", [lambda: DecaConfig(fused_update="yes"),
                                  lambda: AdamConfig(steps=1, fused_update=1)])
def test_fused_flag_must_be_a_bool(make):
    with pytest.raises(ValueError, match="fused_update must be True or False"):
        make()


def test_fused_kernel_takes_each_call_s_constants():
    """torch 2.13 can compile a float that reaches `alpha=` as a stale constant (pytorch#194976):
    the same kernel called with other betas must use them. Also: the compiled carry over a
    block's tensors gives the eager flat one's m, v and writes x⁺ into the weights."""
    g = torch.Generator().manual_seed(0)
    sizes = [60, 40]
    for c1, c2 in ((0.3, 0.333), (0.9, 0.999), (0.3, 0.333), (1.0, 1.0)):
        x, x_plus, m, v = (torch.randn(sum(sizes), generator=g) for _ in range(4))
        v.abs_()
        want = [t.clone() for t in (x, x_plus, m, v)]
        moments_(want[2], want[3], discrepancy_(want[0], want[1]), c1, c2)
        weights = [torch.zeros(n, dtype=torch.bfloat16) for n in sizes]
        fused(carry_and_write)(*(list(t.split(sizes)) for t in (x, x_plus, m, v)), weights, c1, c2)
        for a, b in zip((m, v), want[2:]):
            close(a, b)
        assert torch.equal(torch.cat(weights), x_plus.bfloat16())
        assert torch.equal(x_plus, want[1])


@needs_bnb
def test_fused_half_step_on_8bit_moments_equals_eager():
    """state_bits=8 works tensor by tensor through the same kernels: the first step of a block
    (fresh moments) gives the same x½, and m½, v½ within one code step of the 8-bit map."""
    base = tiny_llama(layers=2, dtype=torch.float32)
    cfg = dict(lr=1e-3, steps_per_block=3, rounds=1, layers_per_block=1, state_bits=8)
    models = copy.deepcopy(base), copy.deepcopy(base)
    opts = [DecaOptimizer(m, DecaConfig(**cfg, fused_update=f)) for m, f in zip(models, (False, True))]
    models[0](**client_batches(1, steps=1)[0][0]).loss.backward()
    for p, q in zip(opts[0].active.params, opts[1].active.params):
        q.grad = p.grad.clone()
    want, got = (opt.adam_half_step() for opt in opts)
    close(got, want)
    for k in ("m", "v"):
        for i in range(len(opts[0].active.params)):
            a, b = getattr(opts[0].active, k).get(i), getattr(opts[1].active, k).get(i)
            assert a.abs().max() > 0
            torch.testing.assert_close(b, a, rtol=0, atol=a.abs().max().item() / 64)
