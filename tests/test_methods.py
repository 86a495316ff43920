"""DECA and the baselines (D-Adam, Dec-LoRA, Dec-Adapter, DeCAF) through one method interface.

Expected values are computed independently: mixing with numpy in float64 from the clients'
payloads, DeCAF's re-factorization against numpy's SVD of the explicitly formed Σ_j w_ij B_j A_j,
parameter counts from the model's shape by hand.
"""

import copy

import numpy as np
import pytest
import torch

from deca_ds import DecaConfig, make_topology, simulate
from deca_ds.kernels import segments
from deca_ds.methods import METHODS, AdamConfig, DAdam, Deca, DecAdapter, DeCAF, DecLoRA, truncated_factors
from deca_ds.mixing import InProcessMixer
from deca_ds.models import tiny_llama
from helpers import VOCAB, client_batches

LAYERS, HIDDEN, N = 3, 32, 4
INTER, KV = 2 * HIDDEN, HIDDEN // 2  # tiny_llama: intermediate 2h; 2 of 4 heads carry k, v
RANK, SIZE = 4, 8


def base_model(layers: int = LAYERS):
    # deca-ds's tiny Llama: its larger init lets the frozen head express the clients' skewed tokens
    return tiny_llama(VOCAB, num_hidden_layers=layers, hidden_size=HIDDEN, intermediate_size=INTER)


def make(name: str, steps: int = 6, lr: float = 1e-2, mix_every: int = 1):
    adam = AdamConfig(steps=steps, lr=lr, mix_every=mix_every)
    return {
        "deca": lambda: Deca(DecaConfig(lr=lr, steps_per_block=2, rounds=1, layers_per_block=2)),
        "dadam": lambda: DAdam(adam),
        "dec_lora": lambda: DecLoRA(adam, rank=RANK, alpha=2 * RANK, dropout=0.0),
        "dec_adapter": lambda: DecAdapter(adam, size=SIZE),
        "decaf": lambda: DeCAF(adam, rank=RANK, alpha=2 * RANK, dropout=0.0),
    }[name]()


def clients(method, n: int = N):
    base = base_model()
    models = [method.prepare(copy.deepcopy(base)).train() for _ in range(n)]
    return models, [method.optimizer(m) for m in models]


def local_steps(models, optimizers, batches, step: int) -> list[torch.Tensor]:
    payloads = []
    for i, (model, opt) in enumerate(zip(models, optimizers)):
        model(**batches[i][step]).loss.backward()
        payloads.append(opt.local_step())
    return payloads


def trainable_flat(method, model) -> np.ndarray:
    return torch.cat([p.detach().reshape(-1) for p in method.trainable(model)]).double().numpy()


def test_registry_names_every_method():
    assert set(METHODS) == {"deca", "dadam", "dec_lora", "dec_adapter", "decaf"}


def test_the_interfaces_are_declared_and_combine_now_is_refused_where_the_consensus_is_the_mean():
    """Also: the block-activation hook goes through the constructor and sees the first block too; a
    method without blocks refuses it."""
    from deca_ds import DecentralizedOptimizer
    from deca_ds.methods import Method

    assert {"trainable", "optimizer"} <= Method.__abstractmethods__
    assert {"local_step", "combine", "consensus_vector", "total_steps"} <= DecentralizedOptimizer.__abstractmethods__
    model = base_model(2)
    deca = Deca(DecaConfig(steps_per_block=1, rounds=1)).optimizer(model)
    with pytest.raises(NotImplementedError, match="DecaOptimizer combines linearly: its consensus is the clients'"):
        deca.combine_now(InProcessMixer(make_topology("ring", 2).W).client(0))
    seen = []
    Deca(DecaConfig(steps_per_block=1, rounds=1, layers_per_block=1, block_order="descending")).optimizer(
        base_model(2), before_activate=seen.append)
    assert seen == [1]  # the last of 2 blocks, descending: activated in the constructor, the hook called first
    for name in sorted(set(METHODS) - {"deca"}):
        with pytest.raises(ValueError, match=f"{name} trains all its parameters at every step: it activates no"):
            make(name).optimizer(base_model(2), before_activate=seen.append)
    # a method says, before any optimizer exists, whether its consensus is the mean (deca-eval --checkpoint)
    for name in sorted(METHODS):
        method = make(name)
        assert method.linear == method.optimizer(method.prepare(base_model(2))).linear == (name != "decaf")


@pytest.mark.parametrize("name", sorted(METHODS))
def test_each_method_lowers_the_loss_with_four_clients(name):
    method = make(name, steps=45, lr=3e-2)
    if name == "deca":
        method = Deca(DecaConfig(lr=1e-2, steps_per_block=5, rounds=3, layers_per_block=1))  # 3 blocks × 5 × 3
    W = make_topology("ring", N).W
    batches = client_batches(N, 45, seed=3)
    losses = []
    simulate(base_model(), batches, W, method,
             on_step=lambda info: losses.append(np.mean(info.losses)))
    first, last = np.mean(losses[:5]), np.mean(losses[-5:])
    assert last < first - 0.1, f"{name}: loss {first:.3f} -> {last:.3f}"


@pytest.mark.parametrize("name", ["deca", "dadam", "dec_lora", "dec_adapter"])
def test_mixing_step_equals_W_times_the_payloads(name):
    method = make(name)
    models, optimizers = clients(method)
    W = make_topology("erdos_renyi", N, p=0.6, seed=2).W
    payloads = local_steps(models, optimizers, client_batches(N, 1, seed=5), 0)
    expected = W @ np.stack([x.double().numpy() for x in payloads])
    for i, (view, opt) in enumerate(zip(InProcessMixer(W).views(payloads), optimizers)):
        opt.combine(view, payloads[i])
        # DECA mixes only its active block (block 0 here); after the BMA correction x = x⁺.
        params = opt.param_groups[0]["params"] if name == "deca" else method.trainable(models[i])
        got = torch.cat([p.detach().reshape(-1) for p in params]).double().numpy()
        np.testing.assert_allclose(got, expected[i], rtol=0, atol=1e-6)


def test_mix_every_k_skips_the_exchange_between_mixing_steps():
    method = make("dadam", mix_every=2)
    models, optimizers = clients(method, 2)
    W = make_topology("complete", 2).W
    batches = client_batches(2, 2, seed=6)
    for step in range(2):
        payloads = local_steps(models, optimizers, batches, step)
        for i, (view, opt) in enumerate(zip(InProcessMixer(W).views(payloads), optimizers)):
            opt.combine(view, payloads[i])
        same = np.allclose(trainable_flat(method, models[0]), trainable_flat(method, models[1]), atol=1e-7)
        assert same == (step == 1), f"step {step}: clients should {'' if step else 'not '}agree"


def test_decaf_combines_by_truncated_svd_of_the_weighted_product():
    method = make("decaf")
    models, optimizers = clients(method)
    W = make_topology("ring", N).W
    payloads = local_steps(models, optimizers, client_batches(N, 1, seed=7), 0)
    pairs_of = lambda x: list(segments(optimizers[0].params, x))  # noqa: E731
    for i, (view, opt) in enumerate(zip(InProcessMixer(W).views(payloads), optimizers)):
        opt.combine(view, payloads[i])
        got = DecLoRA.lora_pairs(models[i])
        for k, (A_new, B_new) in enumerate(got):
            M = sum(W[i, j] * pairs_of(payloads[j])[2 * k + 1][1].double().numpy()
                    @ pairs_of(payloads[j])[2 * k][1].double().numpy() for j in range(N) if W[i, j] > 0)
            U, S, Vt = np.linalg.svd(M)
            best = (U[:, :RANK] * S[:RANK]) @ Vt[:RANK]
            B, A = B_new.detach().double().numpy(), A_new.detach().double().numpy()
            np.testing.assert_allclose(B @ A, best, atol=1e-5 * max(1.0, np.abs(best).max()))
            # singular values split evenly: column j of B and row j of A both have norm √σ_j
            np.testing.assert_allclose(np.linalg.norm(B, axis=0), np.sqrt(S[:RANK]), rtol=1e-3, atol=1e-6)
            np.testing.assert_allclose(np.linalg.norm(A, axis=1), np.sqrt(S[:RANK]), rtol=1e-3, atol=1e-6)


@pytest.mark.parametrize("rank_of_product,r", [(3, 3), (3, 5), (6, 8)])
def test_truncated_svd_reproduces_the_product_when_r_covers_its_rank(rank_of_product, r):
    g = torch.Generator().manual_seed(rank_of_product)
    k = 3  # neighbors' factors stacked, as DeCAF forms them
    B_cat = torch.randn(20, rank_of_product, generator=g, dtype=torch.float64).repeat(1, k)
    A_cat = torch.randn(rank_of_product * k, 12, generator=g, dtype=torch.float64)
    B, A = truncated_factors(B_cat, A_cat, r)
    assert B.shape == (20, r) and A.shape == (r, 12)
    np.testing.assert_allclose((B @ A).numpy(), (B_cat @ A_cat).numpy(), atol=1e-12)


def test_decaf_refactors_all_pairs_at_once_as_pair_by_pair():
    """refactor_pairs (one batch of SVDs per core shape, on the host; the QRs and factors of the
    pairs of one shape and weights in one batch) gives each pair exactly truncated_factors' B and
    A, whatever mix of core shapes the pairs have: kr = 4 clients × rank 3 = 12 is above some
    fan-ins and fan-outs here, a client's B may be 0 (peft's start), and the last pair has weights
    of its own (DeCAF's pairs share their client's)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from deca_ds.methods.lora import LoRAPair, refactor_pairs

    g = torch.Generator().manual_seed(11)
    r, terms = 3, 4
    pairs, want = [], []
    weights = torch.rand(terms, generator=g).tolist()
    for p, (fan_in, fan_out) in enumerate([(16, 16), (16, 8), (10, 16), (16, 16), (30, 6), (16, 8), (16, 16)]):
        ws = weights if p < 6 else torch.rand(terms, generator=g).tolist()
        factors = [(ws[j], torch.randn(r, fan_in, generator=g),
                    torch.randn(fan_out, r, generator=g) * (j != 1)) for j in range(terms)]
        pairs.append(LoRAPair(fan_in, fan_out, torch.empty(r, fan_in), torch.empty(fan_out, r), factors))
        want.append(truncated_factors(torch.cat([w * B for w, _, B in factors], dim=1),
                                      torch.cat([A for _, A, _ in factors], dim=0), r))

    class Calls(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.names = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.names.append(func.__name__)
            return func(*args, **(kwargs or {}))

    with Calls() as calls:
        refactor_pairs(pairs)
    for pair, (B_want, A_want) in zip(pairs, want):
        assert torch.equal(pair.A_out, A_want) and torch.equal(pair.B_out, B_want)
    # one SVD per core shape, not per pair: (12, 12) three times, (8, 12) twice, (12, 10), (6, 12); two QRs a
    # pass per chunk: (16, 16) twice and the last pair, (16, 8) twice, (10, 16), (30, 6)
    assert sum(name.startswith("_linalg_svd") for name in calls.names) == 4, sorted(set(calls.names))
    assert sum(name.startswith("linalg_qr") for name in calls.names) == 2 * 2 * 5


@pytest.mark.parametrize("name", sorted(METHODS))
def test_complete_uniform_graph_makes_every_client_identical_after_each_mix(name):
    method = make(name, steps=3)
    models, optimizers = clients(method)
    W = np.full((N, N), 1 / N)
    batches = client_batches(N, 3, seed=8)
    for step in range(3):
        payloads = local_steps(models, optimizers, batches, step)
        for i, (view, opt) in enumerate(zip(InProcessMixer(W).views(payloads), optimizers)):
            opt.combine(view, payloads[i])
        flats = [trainable_flat(method, m) for m in models]
        for i in range(1, N):
            assert np.array_equal(flats[0], flats[i]), f"{name}: client {i} differs after step {step}"
        assert not np.array_equal(flats[0], trainable_flat(method, clients(method, 1)[0][0])), "nothing trained"


def test_trainable_parameter_counts_equal_exact_arithmetic():
    h, inter, kv, L, r, s = HIDDEN, INTER, KV, LAYERS, RANK, SIZE
    layer = 2 * h * h + 2 * h * kv + 3 * h * inter + 2 * h  # q, o; k, v; gate, up, down; two norms
    lora_layer = r * ((h + h) + 2 * (h + kv) + (h + h) + 2 * (h + inter) + (inter + h))  # r·(d_in + d_out) per linear
    adapter_layer = 2 * (h * s + s + s * h + h)  # after attention and after the MLP
    expected = {"deca": L * layer, "dadam": L * layer, "dec_lora": L * lora_layer, "decaf": L * lora_layer,
                "dec_adapter": L * adapter_layer}
    for name, count in expected.items():
        method = make(name)
        model = method.prepare(base_model())
        assert method.num_trainable(model) == count, name
        method.optimizer(model)
        assert sum(p.numel() for p in model.parameters() if p.requires_grad) == (
            count if name != "deca" else 2 * layer), name  # DECA: only the active block (2 layers)


def test_adapters_start_as_the_identity_and_lora_starts_at_the_base_model():
    base = base_model().eval()
    batch = client_batches(1, 1, seed=9)[0][0]
    want = base(**batch).logits
    for name in ("dec_adapter", "dec_lora"):
        model = make(name).prepare(copy.deepcopy(base)).eval()
        torch.testing.assert_close(model(**batch).logits, want, rtol=0, atol=1e-6)


def test_bad_method_options_are_named():
    adam = AdamConfig(steps=1)
    with pytest.raises(ValueError, match="mix_every"):
        AdamConfig(steps=1, mix_every=0)
    with pytest.raises(ValueError, match="steps"):
        AdamConfig(steps=0)
    with pytest.raises(ValueError, match="lora rank"):
        DecLoRA(adam, rank=0)
    with pytest.raises(ValueError, match="adapter size"):
        DecAdapter(adam, size=0)
    with pytest.raises(ValueError, match="LoRA targets"):
        DecLoRA(adam, targets=["no_such_proj"]).prepare(base_model(2))


def test_a_baselines_weight_decay_on_matrices_leaves_its_biases():
    """Dec-Adapter trains 2-D projections and 1-D biases: with weight_decay_on 'matrices' its first
    local step (m̂ = g, v̂ = g⊙g) is x½ = (1 − γλ)·x − γ·g/(|g| + ε) on the projections and
    x − γ·g/(|g| + ε) on the biases."""
    lr, decay = 1e-2, 0.5
    method = DecAdapter(AdamConfig(steps=1, lr=lr, weight_decay=decay, weight_decay_on="matrices",
                                   master_dtype=torch.float64), size=SIZE)
    model = method.prepare(base_model()).train()
    params = method.trainable(model)
    assert {p.ndim for p in params} == {1, 2}
    with torch.no_grad():  # the adapters start at zero: a decay of zero would show nothing
        for p in params:
            p.normal_(std=0.1)
    opt = method.optimizer(model)
    flat = lambda ts: torch.cat([t.detach().double().reshape(-1) for t in ts])  # noqa: E731
    x0 = flat(params)
    model(**client_batches(1, 1)[0][0]).loss.backward()
    g = flat([p.grad for p in params])
    keep = torch.cat([torch.full((p.numel(),), 1 - lr * decay if p.ndim == 2 else 1.0, dtype=torch.float64)
                      for p in params])
    torch.testing.assert_close(opt.local_step(), keep * x0 - lr * g / (g.abs() + 1e-8), rtol=1e-12, atol=1e-15)


@pytest.mark.parametrize("name", ["dadam", "decaf"])
def test_state_dict_round_trip_continues_identically(name):
    method = make(name, steps=4)
    W = make_topology("complete", 2).W
    batches = client_batches(2, 4, seed=10)

    def run(models, optimizers, steps):
        for step in steps:
            payloads = local_steps(models, optimizers, batches, step)
            for i, (view, opt) in enumerate(zip(InProcessMixer(W).views(payloads), optimizers)):
                opt.combine(view, payloads[i])

    models, optimizers = clients(method, 2)
    run(models, optimizers, range(2))
    saved = [(copy.deepcopy(m.state_dict()), opt.state_dict()) for m, opt in zip(models, optimizers)]
    run(models, optimizers, range(2, 4))
    fresh, fresh_opts = clients(method, 2)
    for m, opt, (weights, state) in zip(fresh, fresh_opts, saved):
        m.load_state_dict(weights)
        opt.load_state_dict(state)
    run(fresh, fresh_opts, range(2, 4))
    for a, b in zip(models, fresh):
        assert np.array_equal(trainable_flat(method, a), trainable_flat(method, b))
    with pytest.raises(ValueError, match="different config"):
        make(name, steps=5).optimizer(clients(method, 1)[0][0]).load_state_dict(saved[0][1])


@pytest.mark.parametrize("name", ["dadam", "dec_lora", "dec_adapter", "decaf"])
def test_a_client_export_is_a_plain_model_that_computes_what_the_client_computes(name, tmp_path):
    """clients/client_NNN/ as the runtime writes it (plain_state + save_extras) and deca-eval loads
    it; the client model itself is left as it was (training goes on after the export)."""
    from deca_ds.runtime.checkpoint import save_hf_model
    from deca_ds.runtime.evaluate import load_export

    method = make(name)
    client = method.prepare(base_model()).eval()
    with torch.no_grad():  # B = 0 and U = 0 at the start: give every trained tensor a value
        for p in method.trainable(client):
            p.normal_(std=0.05, generator=torch.Generator().manual_seed(p.numel()))
    ids = torch.arange(12)[None] % VOCAB
    with torch.no_grad():
        before = client(input_ids=ids).logits
    save_hf_model(client, tmp_path, state=method.plain_state(client))
    method.save_extras(client, tmp_path)
    plain = load_export(str(tmp_path), dtype=torch.float32).eval()
    with torch.no_grad():
        after = client(input_ids=ids).logits
        torch.testing.assert_close(plain(input_ids=ids).logits, before, rtol=1e-5, atol=1e-5)
    assert torch.equal(after, before) and type(plain).__name__ == "LlamaForCausalLM"
    assert not any("lora" in n for n in plain.state_dict())
