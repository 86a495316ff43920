"""One training step's update and mixing, counted on CPU ranks against the estimator.

Each rank is one client of a ring (two neighbours each) or a client alone, exchanging through the
runtime's DistributedMixer over gloo. A deca_ds.runtime.allocated.TensorBytes counter (the tensor memory
operators allocate: on CPU what torch.cuda's allocated counter is on a GPU) runs from before the
model exists, so after backward it holds exactly the weights, the optimizer state and the
gradient, and the peak of `optimizer.step()` is what the update and the mixing hold at once: the
estimator's `update` and `mixing` phases (deca_ds.memory, deca_ds.baseline_memory), which are
exact arithmetic, unlike the activations. The fused update is not counted here: torch.compile'd
code allocates out of sight of a dispatch mode (and refuses to compile under one)."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig

from deca_ds import DecaConfig, make_topology
from deca_ds.baseline_memory import estimate_method, refactor_elements
from deca_ds.memory import Workload, estimate_block
from deca_ds.methods import AdamConfig, DAdam, Deca, DecAdapter, DeCAF, DecLoRA
from deca_ds.mixing import mixing_order
from deca_ds.models import causal_lm_loss, draw_from_config
from deca_ds.runtime.allocated import TensorBytes
from deca_ds.runtime.consensus import consensus_distance, to_consensus_
from deca_ds.runtime.dist import ClientGroups, ClientLayout, DistributedMixer
from deca_ds.runtime.rank import free_port
from helpers import needs_bnb
from ranks import gloo_group, run_on_ranks

CONFIG = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
                     num_key_value_heads=2, vocab_size=100, tie_word_embeddings=False)
SEQ = 16
# the step's 0-d scalars (−γ/(1−α1^t), 1−α2^t, a zero), 4 bytes each, which the estimator leaves out
SCALARS = 64


def build(method: str, variant: str, bits: int = 32):
    """The method as the trainer builds it (RunOptions.build_method), at one step per block: each
    step ends a block, so the next block's state is made inside the step counted."""
    deca = DecaConfig(layers_per_block=1, steps_per_block=1, rounds=1, variant=variant, state_bits=bits)
    if method == "deca":
        return Deca(deca)
    adam = AdamConfig(steps=3, **deca.adam_settings())
    return {"dadam": lambda: DAdam(adam), "dec_lora": lambda: DecLoRA(adam, rank=4),
            "decaf": lambda: DeCAF(adam, rank=4), "dec_adapter": lambda: DecAdapter(adam, size=8)}[method]()


def step_peaks(rank: int, port: int, world: int, method: str, variant: str, transfer: str, bits: int = 32) -> list[int]:
    """Counted on this rank: each step's peak above the weights, state and gradient it starts from."""
    with gloo_group(rank, port, world):
        W = make_topology("ring", world).W
        layout = ClientLayout(rank, world, 1)
        ids = torch.randint(0, CONFIG.vocab_size, (1, SEQ), generator=torch.Generator().manual_seed(rank))
        batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids}
        counter, peaks = TensorBytes(), []
        with counter:
            how = build(method, variant, bits)
            model = how.prepare(draw_from_config(CONFIG, dtype=torch.bfloat16, seed=0, device="cpu")).train()
            mixer = DistributedMixer(W, layout, ClientGroups(layout, W, 30.0), timeout_s=30.0,
                                     transfer_dtype=torch.bfloat16 if transfer == "working" else None)
            optimizer = how.optimizer(model, mixer)
            buffers = sum(b.nbytes for b in model.buffers())
            for _ in range(2):
                causal_lm_loss(model, batch).backward()
                counter.reset_peak()
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
                peaks.append(counter.peak - buffers)
        return peaks


def estimate(method: str, variant: str, transfer: str, neighbors: int, bits: int = 32):
    workload = Workload(working_dtype="bf16", transfer_dtype=transfer, n_neighbors=neighbors, micro_batch=1,
                        seq_len=SEQ)
    if method == "deca":
        return estimate_block(CONFIG, 1, 0, workload, variant=variant, steps_per_block=1, state_bits=bits)
    return estimate_method(CONFIG, build(method, variant), workload)


def decaf_refactor_on_cpu(neighbors: int) -> int:
    """DeCAF's re-factorization on a CPU rank, from the LoRA pairs' (fan_in, fan_out) in CONFIG."""
    h, kv = CONFIG.hidden_size, CONFIG.num_key_value_heads * CONFIG.hidden_size // CONFIG.num_attention_heads
    inter = CONFIG.intermediate_size
    layer = [(h, h), (h, kv), (h, kv), (h, h), (h, inter), (h, inter), (inter, h)]  # q k v o gate up down
    return 4 * refactor_elements(layer * CONFIG.num_hidden_layers, 4, neighbors + 1, host_is_device=True)


def expected_peak(est, method: str, rank: int, world: int) -> int:
    """The estimate of what `rank` holds at its step's peak. Transferred in the working dtype, the
    estimate holds a chunk's cast send copy and its x⁺ together, as the staged path (gloo on a
    GPU) may, which casts chunk k+1 before it sums chunk k; the direct path frees the copy when the
    chunk's exchange returns, and a linear method's client whose own term comes first in the sum
    sums into its x½, with no x⁺ chunk at all (mixing.weighted_sum's `out`)."""
    mixing = est.phases["mixing"]
    if method == "decaf":  # on CPU ranks the re-factorization's SVDs, on the host, count too
        mixing += decaf_refactor_on_cpu(neighbors=min(2, world - 1)) - est.refactor
    if est.send_copy:
        own_first = mixing_order(make_topology("ring", world).W, rank)[0] == rank
        mixing -= est.x_plus if own_first and method != "decaf" else est.send_copy
    return max(est.phases["update"], mixing)


@pytest.mark.parametrize("world", [3, 1])
@pytest.mark.parametrize("method,variant,transfer", [
    ("deca", "deca", "master"), ("deca", "deca", "working"), ("deca", "trivial_bma", "working"),
    ("deca", "no_bma", "master"), ("dadam", "deca", "working"), ("dec_lora", "deca", "master"),
    ("decaf", "deca", "working"), ("dec_adapter", "deca", "master"),
])
def test_a_steps_update_and_mixing_hold_what_the_estimator_says(world, method, variant, transfer):
    est = estimate(method, variant, transfer, neighbors=min(2, world - 1))
    for rank, peaks in enumerate(run_on_ranks(step_peaks, world, free_port(), world, method, variant, transfer,
                                              timeout=300)):
        want = expected_peak(est, method, rank, world)
        for peak in peaks:
            assert 0 <= peak - want < SCALARS, (rank, peak, want, est.phases)


@needs_bnb
@pytest.mark.parametrize("world", [3, 1])
def test_8bit_moments_step_stays_within_the_estimate(world):
    """state_bits=8 works tensor by tensor (updates.QuantizedUpdate): the estimate counts one
    largest tensor's fp32 m, v and Adam result beside every gradient and x½ (quant_transient), a
    bound: by the largest tensor, gradients of the tensors before it are gone, and its Adam result
    is written into x½. The count stays under it by less than one largest tensor in fp32."""
    largest = 4 * CONFIG.hidden_size * CONFIG.intermediate_size
    for variant, transfer in (("deca", "master"), ("trivial_bma", "working")):
        est = estimate("deca", variant, transfer, neighbors=min(2, world - 1), bits=8)
        for rank, peaks in enumerate(run_on_ranks(step_peaks, world, free_port(), world, "deca", variant, transfer,
                                                  8, timeout=300)):
            want = expected_peak(est, "deca", rank, world)
            for peak in peaks:
                assert 0 <= want - peak < largest, (variant, rank, peak, want, est.phases)


def distance_and_peak(rank: int, port: int, chunk: int) -> tuple[float, int]:
    """consensus_distance of this rank's vector, and the tensor memory it allocated at its peak."""
    with gloo_group(rank, port, 2):
        x = torch.randn(1000, generator=torch.Generator().manual_seed(rank))
        counter = TensorBytes()
        with counter:
            distance = consensus_distance(x, chunk=chunk)
        return distance, counter.peak


def test_the_consensus_distance_holds_one_chunk_of_the_block():
    """‖x_i − x̄‖ (the trainer's consensus_interval) goes through the vector a chunk at a time: it
    allocates one chunk (the reduced copy) and the norms' scalars, where a clone of the block and
    a difference were two block-sized copies, the peak of a GPU run that asked for it
    (profiling/results/gpu_h200/README.md, `fits`). The value is the float64 distance's."""
    xs = [torch.randn(1000, generator=torch.Generator().manual_seed(r), dtype=torch.float32).double() for r in range(2)]
    mean = (xs[0] + xs[1]) / 2
    for chunk in (256, 2**25):
        for rank, (distance, peak) in enumerate(run_on_ranks(distance_and_peak, 2, free_port(), chunk)):
            assert distance == pytest.approx(torch.linalg.vector_norm(xs[rank] - mean).item(), rel=1e-6)
            assert 4 * min(chunk, 1000) <= peak < 4 * min(chunk, 1000) + SCALARS, (chunk, peak)


def consensus_model(rank: int, port: int, chunk: int) -> tuple[list[torch.Tensor], float, int]:
    """This rank's weights after to_consensus_, its distance, and the tensor memory allocated at the peak."""
    with gloo_group(rank, port, 2):
        model = draw_from_config(CONFIG, dtype=torch.bfloat16, seed=rank, device="cpu")
        counter = TensorBytes()
        with counter:
            distance = to_consensus_(model, chunk=chunk)
        return [p.detach().clone() for p in model.parameters()], distance, counter.peak


def test_the_consensus_model_is_formed_through_two_chunks():
    """x̄ of the weights at the end of a run (and for an evaluation during it) goes through a mean
    and a difference buffer of one chunk each, in fp32, whatever the size of the largest tensor (a
    copy of it and its mean were 8 bytes per element of the embedding). Both clients end with the
    fp32 mean of their bf16 weights, rounded to bf16, and each its distance from it."""
    own = [list(draw_from_config(CONFIG, dtype=torch.bfloat16, seed=r, device="cpu").parameters()) for r in range(2)]
    means = [(a.float() + b.float()) / 2 for a, b in zip(*own)]  # gloo's sum of two, in fp32
    chunk = 1000  # below the largest tensor (the embedding and the head: 6,400 elements), above others
    for rank, (weights, distance, peak) in enumerate(run_on_ranks(consensus_model, 2, free_port(), chunk)):
        assert all(torch.equal(w, m.to(torch.bfloat16)) for w, m in zip(weights, means))
        expected = sum(((x.double() - m.double()) ** 2).sum().item() for x, m in zip(own[rank], means)) ** 0.5
        assert distance == pytest.approx(expected, rel=1e-6)
        assert 2 * 4 * chunk <= peak < 2 * 4 * chunk + SCALARS, peak
