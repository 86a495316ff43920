"""DistributedMixer on real gloo ranks: chunked mixing equals W @ X exactly as the in-process mixer does."""

import numpy as np
import pytest
import torch

from deca_ds import make_topology
from deca_ds.mixing import InProcessMixer, weighted_sum
from deca_ds.runtime.dist import ClientGroups, ClientLayout, DistributedMixer
from deca_ds.runtime.rank import free_port
from deca_ds.runtime.transport import HostStaging
from ranks import gloo_group, run_on_ranks

N, SIZE = 4, 23


def payload(i: int, dtype=torch.float32) -> torch.Tensor:
    return torch.randn(SIZE, generator=torch.Generator().manual_seed(i), dtype=torch.float64).to(dtype)


def worker(rank: int, port: int, W: np.ndarray, chunk: int, transfer=None, staged: bool = False) -> dict:
    """Rank `rank` of N mixes payload(rank), then exchanges it (DeCAF's path: every neighbor's
    vector), directly or staged through host buffers (test_transport)."""
    with gloo_group(rank, port, N):
        layout = ClientLayout(rank, N, 1)
        mixer = DistributedMixer(W, layout, ClientGroups(layout, W, 30.0), timeout_s=30.0, transfer_dtype=transfer,
                                 chunk=chunk, staging=HostStaging(torch.device("cpu")) if staged else None)
        x_half = payload(rank)
        x_plus = mixer.mix(x_half)
        mixed = {"x_plus": x_plus.clone(), "in_place": x_plus.data_ptr() == x_half.data_ptr(),
                 "mix_bytes": mixer.total_bytes_sent}
        terms = mixer.exchange(payload(rank))
        return {**mixed, "terms": [(w, t.clone()) for w, t in terms], "bytes": mixer.total_bytes_sent}


def run_ranks(W, chunk, transfer=None, staged=False) -> list[dict]:
    return run_on_ranks(worker, N, free_port(), W, chunk, transfer, staged)


@pytest.mark.parametrize("chunk", [5, SIZE, 2**25])
def test_chunked_mix_equals_in_process_mixer_bit_for_bit(chunk):
    W = make_topology("ring", N).W
    got = run_ranks(W, chunk)
    xs = [payload(i) for i in range(N)]
    want = [view.mix(x) for view, x in zip(InProcessMixer(W).views(xs), xs)]
    degree = [(W[i] > 0).sum() - 1 for i in range(N)]
    for i, r in enumerate(got):
        assert torch.equal(r["x_plus"], want[i]), f"client {i}"
        assert r["in_place"], "x⁺ is written over x½ (no block-sized output buffer)"
        assert r["mix_bytes"] == degree[i] * SIZE * 4
    X = np.stack([payload(i).double().numpy() for i in range(N)])
    np.testing.assert_allclose(np.stack([r["x_plus"].double().numpy() for r in got]), W @ X, rtol=1e-6, atol=1e-6)


def test_chunked_mix_in_working_dtype_sends_half_the_bytes():
    W = make_topology("ring", N).W
    got = run_ranks(W, 5, transfer=torch.bfloat16)
    X = np.stack([payload(i).double().numpy() for i in range(N)])
    for i, r in enumerate(got):
        assert r["x_plus"].dtype == torch.float32 and r["mix_bytes"] == 2 * SIZE * 2
        np.testing.assert_allclose(r["x_plus"].double().numpy(), W[i] @ X, rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_weighted_sum_scales_and_adds_in_the_output_dtype(dtype):
    """Σ w·x left to right in fp32 whatever the terms' dtype: a bf16 term is widened before it is
    scaled (a bf16 product would be rounded to 8 bits first)."""
    xs = [payload(i, dtype) for i in range(3)]
    w = [0.2, 0.3, 0.5]
    want = xs[0].float() * w[0]
    for wi, x in zip(w[1:], xs[1:]):
        want = want + wi * x.float()
    got = weighted_sum(list(zip(w, xs)), dtype=torch.float32)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7)  # a bf16 product is off by ~1e-3
    if dtype == torch.float32:
        own = xs[0].clone()
        assert weighted_sum(list(zip(w, [own, *xs[1:]])), out=own) is own
        assert torch.equal(own, got)
