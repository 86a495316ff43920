"""Every client starts from the same model: the fingerprint (exact bit sums, so the same on any
device) and the refusal naming the clients that differ. The gather itself runs in every
distributed test."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from deca_ds.data import build_word_tokenizer
from deca_ds.models import tiny_llama
from deca_ds.runtime.options import NOT_RESULT, PER_SITE, RunOptions
from deca_ds.runtime.same_start import (
    bit_sum,
    compare_starts,
    shared_options,
    start_fingerprint,
    weights_fingerprint,
)
from deca_ds.runtime.transport import spans_nodes


@pytest.mark.parametrize("dtype, bits", [(torch.bfloat16, np.int16), (torch.float32, np.int32),
                                         (torch.float64, np.int32), (torch.int8, np.int8)])
def test_bit_sum_is_the_exact_sum_of_the_bits_in_any_chunking(dtype, bits):
    """An 8-byte element counts as its two 32-bit halves: no chunk's sum can overflow."""
    x = (torch.randn(1001, generator=torch.Generator().manual_seed(0)) * 1e6).to(dtype)
    raw = x.view(torch.int16).numpy() if dtype == torch.bfloat16 else x.numpy().view(bits)
    want = sum(int(v) for v in raw)
    assert bit_sum(x) == want == bit_sum(x, chunk=7) == bit_sum(x.reshape(7, 143).t())


def test_the_weights_fingerprint_sees_one_ulp_and_the_dtype():
    a, b = tiny_llama(40, seed=3), tiny_llama(40, seed=3)
    assert weights_fingerprint(a) == weights_fingerprint(b)
    with torch.no_grad():
        w = b.model.layers[1].mlp.up_proj.weight
        w[2, 5] = torch.nextafter(w[2, 5], torch.tensor(float("inf")))
    assert weights_fingerprint(a) != weights_fingerprint(b)
    assert weights_fingerprint(tiny_llama(40, seed=3, dtype=torch.bfloat16)) != weights_fingerprint(a)
    assert weights_fingerprint(tiny_llama(40, seed=4)) != weights_fingerprint(a)


def test_clients_that_start_elsewhere_are_named():
    model, opts = tiny_llama(40, seed=3), RunOptions()
    same = start_fingerprint(model, build_word_tokenizer(["a", "b"]), opts, {"gradient_clipping": 0.0})
    compare_starts([same] * 4, ranks_per_client=2)
    other_weights = {**same, "weights": "0" * 64}
    with pytest.raises(ValueError, match=r"client\(s\) \[1\] start from other weights than client 0: every site "
                                         "must load the same model"):
        compare_starts([same, same, same, other_weights], ranks_per_client=2)
    other_tokenizer = start_fingerprint(model, build_word_tokenizer(["a", "c"]), opts, {"gradient_clipping": 0.0})
    with pytest.raises(ValueError, match=r"client\(s\) \[1, 4\] start from other tokenizer than client 0"):
        compare_starts([same, other_tokenizer, same, same, other_tokenizer, same], ranks_per_client=1)


def test_a_site_with_other_options_is_refused_naming_them():
    """Result options, and those that decide when the ranks talk, must agree; paths, memory
    placement and what a site keeps need not."""
    base = RunOptions(eval_interval=10, checkpoint_interval=5)
    mine = shared_options(base, {"gradient_clipping": 0.0, "steps_per_print": 10})
    site = RunOptions(eval_interval=10, checkpoint_interval=5, output_dir="/elsewhere/run", model="tiny",
                      token_cache="none", timeout=60, keep_checkpoints=1, save_clients=True)
    assert shared_options(site, {"gradient_clipping": 0.0, "steps_per_print": 99}) == mine
    theirs = shared_options(RunOptions(eval_interval=0, checkpoint_interval=5, lr=1e-3), {"gradient_clipping": 1.0})
    fingerprint = {"weights": "w", "tokenizer": "t"}
    with pytest.raises(ValueError) as refused:
        compare_starts([{**fingerprint, "options": mine}] * 2 + [{**fingerprint, "options": theirs}], 1)
    assert str(refused.value).startswith(
        "client 2 runs with other options than client 0: ds_config.gradient_clipping: 0.0 at client 0, 1.0 at "
        "client 2; eval_interval: 10 at client 0, 0 at client 2; lr: 5e-05 at client 0, 0.001 at client 2. Every "
        "site must pass the same options, but for data_files, device_map, eval_clients")
    assert PER_SITE <= NOT_RESULT | {"model", "data_files", "trust_remote_code"}, "a per-site option changes results"


def test_the_weights_are_summed_only_where_nodes_load_them_from_their_own_disks(monkeypatch):
    for var in ("WORLD_SIZE", "LOCAL_WORLD_SIZE", "LOCAL_SIZE"):
        monkeypatch.delenv(var, raising=False)
    assert not spans_nodes()  # one process
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("LOCAL_SIZE", "4")  # deepspeed's launcher, one node
    assert not spans_nodes()
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")  # torchrun, a site of 1 rank beside others
    assert spans_nodes()
    unsummed = start_fingerprint(tiny_llama(40, seed=3), build_word_tokenizer(["a"]), RunOptions(), {}, weights=False)
    assert unsummed["weights"] is None
