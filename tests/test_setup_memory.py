"""The setup phase (before the first training step): no second copy of the weights while loading a
checkpoint, no KV cache in the scoring forward, and the estimator's setup terms.

The memory claims are measured: each path runs in a process of its own (forked after the imports),
every tensor in pages of its own, its resident peak above the resident set before it (VmHWM reset
through /proc/self/clear_refs), old and new side by side. The setup phases against the estimator
are counted exactly, by the tensor memory operators allocate (deca_ds.runtime.allocated)."""

from __future__ import annotations

import json
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from deca_ds.models import labelled_logits
from deca_ds.runtime.checkpoint import load_weights, save_client
from ranks import run_on_ranks

ROOT = Path(__file__).resolve().parents[1]
MiB = 2**20
linux_peak = pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="needs Linux's VmHWM reset")


def small_llama(layers: int = 2, tied: bool = False, seed: int = 0) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    return LlamaForCausalLM(LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                                        num_attention_heads=4, num_key_value_heads=2, vocab_size=100,
                                        tie_word_embeddings=tied)).eval()


def _peak(rank: int, code: str) -> int:
    namespace: dict = {}
    exec(code, namespace)
    return namespace["peak"]


def peak_in_fork(setup: str, measured: str) -> int:
    """Run `setup`, then `measured`, in a process forked from one that has only imported the
    libraries (tests/ranks.py), every tensor in pages of its own (peaks.map_each_allocation): the
    resident peak of `measured` above the resident set after `setup`, in bytes."""
    code = textwrap.dedent(f"""
        import sys
        sys.path.insert(0, {str(ROOT / "profiling")!r})
        from peaks import map_each_allocation
        map_each_allocation()
    """) + textwrap.dedent(setup) + textwrap.dedent("""
        import gc
        from peaks import rss, rss_peak, reset_rss_peak
        gc.collect()
        start = rss()
        reset_rss_peak()
    """) + textwrap.dedent(measured) + "\npeak = rss_peak() - start\n"
    return run_on_ranks(_peak, 1, code, timeout=600)[0]


def _setup_peaks(rank: int) -> dict:
    sys.path.insert(0, str(ROOT / "profiling"))
    import setup_peaks

    return setup_peaks.main(["--layers", "2"])  # the evaluation's forward still the setup peak


# ---- the scoring forward holds no KV cache --------------------------------------------------------

def test_labelled_logits_fill_no_cache_and_equal_the_cached_forward(monkeypatch):
    """Exactly what the measurement below shows in bytes: labelled_logits stores no layer's keys and
    values (no Cache.update), the eval-mode forward as it was called stores every layer's."""
    from transformers.cache_utils import Cache

    stored = []
    update = Cache.update
    monkeypatch.setattr(Cache, "update", lambda self, *a, **k: stored.append(1) or update(self, *a, **k))
    model = small_llama()
    ids = torch.randint(0, 100, (3, 12))
    labels = torch.full_like(ids, -100)
    labels[:, -2:] = ids[:, -2:]
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": labels}
    with torch.no_grad():
        logits, targets = labelled_logits(model, batch)
        assert stored == []
        keep = (labels[:, 1:] != -100).any(0).nonzero().squeeze(1)
        cached = model(input_ids=ids, attention_mask=batch["attention_mask"], logits_to_keep=keep).logits
        assert len(stored) == model.config.num_hidden_layers
    torch.testing.assert_close(logits, cached, rtol=0, atol=0)
    assert torch.equal(targets, labels[:, 1:][:, keep])


EVAL_SETUP = """
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM
    from deca_ds.models import labelled_logits
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(hidden_size=128, intermediate_size=256, num_hidden_layers=16,
                                         num_attention_heads=4, num_key_value_heads=4, vocab_size=64)).eval()
    ids = torch.randint(0, 64, (16, 512))
    labels = torch.full_like(ids, -100)
    labels[:, -1] = ids[:, -1]
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": labels}
"""


@linux_peak
def test_scoring_forward_holds_no_kv_cache():
    """Old: the eval-mode forward as it was called (config.use_cache, True) keeps every layer's keys
    and values until it returns. New: labelled_logits. The cache is 16 layers × (k, v) × 16 × 512
    × 4 kv heads × 32 × 4 bytes = 128 MiB, and the old peak is higher by that, to 5 %."""
    cache = 16 * 2 * 16 * 512 * 4 * 32 * 4
    old = peak_in_fork(EVAL_SETUP, """
        with torch.no_grad():
            keep = (labels[:, 1:] != -100).any(0).nonzero().squeeze(1)
            model(input_ids=ids, attention_mask=batch["attention_mask"], logits_to_keep=keep)
    """)
    new = peak_in_fork(EVAL_SETUP, """
        with torch.no_grad():
            labelled_logits(model, batch)
    """)
    assert abs((old - new) / cache - 1) < 0.05, (old / MiB, new / MiB, cache / MiB)


# ---- checkpoint weights load in place, one tensor at a time ---------------------------------------

@pytest.mark.parametrize("tied", [False, True])
def test_load_weights_round_trip(tmp_path, tied):
    saved, other = small_llama(tied=tied, seed=0), small_llama(tied=tied, seed=1)
    save_client(tmp_path, 1, 0, 0, model=saved, optimizer_state={}, rank_state={})
    path = tmp_path / "checkpoints" / "step_00000001" / "client_000" / "model.safetensors"
    before = {n: p.data_ptr() for n, p in other.named_parameters()}
    load_weights(other, path)
    for (name, a), (_, b) in zip(saved.state_dict().items(), other.state_dict().items()):
        assert torch.equal(a, b), name
    assert {n: p.data_ptr() for n, p in other.named_parameters()} == before  # in place
    if tied:
        assert other.lm_head.weight is other.model.embed_tokens.weight


def test_load_weights_refuses_another_architecture(tmp_path):
    save_client(tmp_path, 1, 0, 0, model=small_llama(layers=2), optimizer_state={}, rank_state={})
    path = tmp_path / "checkpoints" / "step_00000001" / "client_000" / "model.safetensors"
    with pytest.raises(ValueError, match=r"missing \['model.layers.2"):
        load_weights(small_llama(layers=3), path)
    with pytest.raises(ValueError, match=r"unexpected \['model.layers.1"):
        load_weights(small_llama(layers=1), path)


LOAD_SETUP = """
    import torch
    from torch import nn
    from safetensors.torch import load_model, save_model
    from deca_ds.runtime.checkpoint import load_weights
    torch.manual_seed(0)
    # 16 tensors of 16 MiB: 256 MiB of weights, the largest tensor 1/16 of them
    model = nn.Sequential(*[nn.Linear(2048, 2048, bias=False) for _ in range(16)])
    save_model(model, PATH)
"""


@linux_peak
def test_load_weights_holds_one_tensor_not_a_second_model(tmp_path):
    """safetensors.torch.load_model (old) reads the whole file, then copies it in: at least the
    model's 256 MiB again. load_weights (new) holds one 16 MiB tensor besides the model; the bound
    leaves room for the reader's own buffers (safetensors' pread backend: 1.1 to 1.5 tensors
    measured, varying between machines)."""
    setup = LOAD_SETUP.replace("PATH", repr(str(tmp_path / "m.safetensors")))
    path = repr(str(tmp_path / "m.safetensors"))
    model_bytes, tensor_bytes = 256 * MiB, 16 * MiB
    old = peak_in_fork(setup, f"""
        load_model(model, {path})
    """)
    new = peak_in_fork(setup, f"""
        load_weights(model, {path})
    """)
    assert old >= 0.9 * model_bytes, old / MiB
    assert new <= 4 * tensor_bytes, new / MiB


# ---- the estimator's setup phase, against independent arithmetic ----------------------------------

SMALL = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                    num_key_value_heads=2, vocab_size=100, tie_word_embeddings=False)
# per layer: q, o 64×64; k, v 64×32; gate, up, down 64×128; two norms of 64
LAYER = 2 * 64 * 64 + 2 * 64 * 32 + 3 * 64 * 128 + 2 * 64
TOTAL = 4 * LAYER + 2 * 100 * 64 + 64  # layers, embedding and untied head, final norm


def test_setup_phases_by_hand():
    from deca_ds.memory import Workload, estimate_block

    workload = Workload(working_dtype="bf16", micro_batch=1, seq_len=16, eval_batch=4, eval_positions=2)
    est = estimate_block(SMALL, 1, 0, workload, master_dtype="fp32")
    assert (est.total_params, est.block_params) == (TOTAL, LAYER)
    tokens = 4 * 16
    # per token: residual + normalised input (2·2·64) + fp32 norm temporary (4·64) + the MLP's three
    # 2-byte rows of 128 (768), larger than attention's four of 64 (512)
    eval_forward = tokens * (2 * 2 * 64 + 4 * 64 + 3 * 2 * 128)
    assert est.eval_forward == eval_forward
    # the evaluation runs before the first block's master, m, v exist: never both at once
    assert est.setup_phases == {"init": 2 * TOTAL + 2 * 64 * 128,  # the largest tensor: an MLP matrix
                                "evaluate": 2 * TOTAL + eval_forward,
                                "optimizer": 2 * TOTAL + 3 * 4 * LAYER}
    assert est.setup_peak == 2 * TOTAL + max(2 * 64 * 128, eval_forward, 12 * LAYER)
    assert est.process_peak == max(est.setup_peak, est.peak)
    d = est.to_dict()
    assert (d["setup_peak"], d["process_peak"], d["setup_evaluate"]) == (est.setup_peak, est.process_peak,
                                                                         est.setup_phases["evaluate"])
    # no evaluation before training: setup ends with the first block's state
    assert estimate_block(SMALL, 1, 0, Workload(seq_len=16)).setup_peak == 2 * TOTAL + 12 * LAYER
    # offloaded: drawn on the host, so no transient on the device; the streaming buffers from the start
    off = estimate_block(SMALL, 1, 0, Workload(seq_len=16), offload="frozen")
    assert off.setup_phases["init"] == off.weights + off.offload_buffers == 2 * (TOTAL - 3 * LAYER) + 2 * 2 * LAYER


def test_eval_forward_kv_cache_is_what_transformers_keeps():
    """The KV-cache term (the old scoring path) equals the bytes of the cache an eval-mode forward returns."""
    from deca_ds.memory import ModelSpec, eval_forward_bytes

    spec = ModelSpec.from_config(SMALL)
    torch.manual_seed(0)
    model = LlamaForCausalLM(SMALL).to(torch.bfloat16).eval()
    ids = torch.randint(0, 100, (3, 10))
    with torch.no_grad():
        cache = model(input_ids=ids, attention_mask=torch.ones_like(ids), use_cache=True).past_key_values
    held = sum(t.numel() * t.element_size() for layer in cache.layers for t in (layer.keys, layer.values))
    assert held == 4 * 2 * 3 * 10 * 2 * 16 * 2  # layers × (k, v) × tokens × kv heads × head_dim × bf16
    assert (eval_forward_bytes(spec, 3, 10, 2, kv_cache=True) - eval_forward_bytes(spec, 3, 10, 2)) == held


@pytest.mark.parametrize("result, kv_cache", [("gpu_h100/profile_memory.json", True),
                                              ("gpu_h200/profile_memory_2clients_llama-3.1-8b.json", False)])
def test_estimator_terms_reproduce_the_gpu_setup_peaks(result, kv_cache):
    """Llama-3.1-8B, resident, measured when the evaluation before training ran after the optimizer
    had made the first block's state (H100 at 17f96e9: its forward kept the KV cache; H200 at
    7b7f8a3: not): its forward of 32 sequences of 512 tokens beside the weights and that state was
    the setup peak, and the estimator's terms add up to it within 2 %. Now the evaluation runs
    before the state exists, so the setup peak is the larger of the two alone, below training's."""
    from deca_ds.memory import GiB, Workload, estimate_memory

    measured = json.loads((ROOT / "profiling" / "results" / result).read_text())
    resident = next(r for r in measured["results"] if r["offload"] == "none")
    config = ROOT / "profiling" / "configs" / "llama-3.1-8b-instruct.json"
    est = estimate_memory(config, 1, Workload(n_neighbors=0, loss_positions=2, eval_batch=32, seq_len=512),
                          eval_kv_cache=kv_cache)
    assert abs((est.weights + est.optimizer_state + est.eval_forward) / GiB / resident["setup_peak_gib"] - 1) < 0.02
    assert est.setup_peak == est.weights + max(est.init_transient, est.eval_forward, est.optimizer_state)
    if not kv_cache:
        assert est.setup_peak < est.peak < resident["setup_peak_gib"] * GiB


def _setup_order(rank: int, out: str) -> list[str]:
    """A one-rank CPU run with the optimizer's block activation and the evaluation's scoring recorded."""
    import os

    import deca_ds.evaluation.classification as classification
    from deca_ds.optimizer import DecaOptimizer
    from deca_ds.runtime import trainer
    from deca_ds.runtime.parsing import parse_args

    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                      MASTER_PORT="0")  # port 0: rank 0's store binds any free port, and no one else joins
    events = []
    activate, score = DecaOptimizer._activate, classification.score_answers
    DecaOptimizer._activate = lambda self, *a, **k: events.append("activate") or activate(self, *a, **k)
    classification.score_answers = lambda *a, **k: events.append("evaluate") or score(*a, **k)
    opts, ds = parse_args(["--ds_config", str(ROOT / "ds_configs" / "cpu_demo.json"), "--output-dir", out,
                           "--rounds", "1", "--steps-per-block", "1", "--layers-per-block", "4", "--eval-limit", "8",
                           "--max-seq-len", "32", "--timeout", "60"])
    trainer.train(opts, ds)
    return events


def test_the_evaluation_before_training_runs_before_the_first_block_state_exists(tmp_path):
    events = run_on_ranks(_setup_order, 1, str(tmp_path / "run"), timeout=300)[0]
    assert events[:2] == ["evaluate", "activate"], events


def test_tensor_bytes_counts_what_operators_allocate():
    """TensorBytes (deca_ds.runtime.allocated), the CPU counterpart of torch.cuda's allocated counter, against sizes by
    hand: a new result counts until it is freed; a view, an in-place result, a tensor on another
    device and memory from before the count do not, and freeing the last lowers nothing."""
    from deca_ds.runtime.allocated import TensorBytes

    earlier = torch.zeros(1000)
    counter = TensorBytes()
    with counter:
        a = torch.ones(256, 4)  # 4,096 bytes
        view, same = a.t(), a.add_(1)  # a's memory
        b = a.to(torch.float64)  # 8,192
        torch.empty(1000, device="meta")
        del earlier
        assert (counter.live, counter.peak) == (4096 + 8192, 4096 + 8192)
        del b
        assert (counter.live, counter.peak) == (4096, 4096 + 8192)
        counter.reset_peak()
        c = a * 2  # 4,096
        del c
        assert (counter.live, counter.peak) == (4096, 4096 + 4096)
    del a, view, same
    assert counter.live == 0


@linux_peak
def test_setup_peaks_against_the_estimator():
    """profiling/setup_peaks.py on CPU (bf16, two layers: 13 M parameters), each phase counted by a
    TensorBytes counter (deca_ds.runtime.allocated: what operators allocate, as torch.cuda counts on a GPU). Drawn from
    its config: init holds exactly the model's weights and buffers and peaks at most at its term
    (which adds one largest tensor, for a checkpoint's copy); the scoring forward holds nothing once
    it is done (no KV cache) and peaks at its term to 5 %; the first block's fp32 master, m, v are
    the estimator's to the byte; the setup peak is the estimator's to 5 %. Loaded from a bf16
    safetensors checkpoint of the same model: no operator copies a weight (init allocates only
    the rotary buffers; the weights map the file), and the whole process's resident set holds no
    second copy anywhere in setup (one would add 26 MB to the 59 MB peak)."""
    result = run_on_ranks(_setup_peaks, 1, timeout=900)[0]
    drawn, loaded = result["loads"]["config"], result["loads"]["checkpoint"]
    weights, state = 2 * drawn["params"], 3 * 4 * drawn["block_params"]  # bf16; fp32 master, m, v
    assert weights < drawn["weight_bytes"] < weights + 1024, drawn  # the rest: the rotary buffers
    rows = {r["phase"]: r for r in drawn["rows"]}
    assert rows["init"]["held_bytes"] == drawn["weight_bytes"], rows
    assert rows["init"]["measured_bytes"] <= rows["init"]["estimated_bytes"], rows
    assert rows["evaluate"]["held_bytes"] == 0, rows
    assert abs(rows["evaluate"]["measured_over_estimated"] - 1) < 0.05, rows
    assert rows["optimizer"]["measured_bytes"] == rows["optimizer"]["estimated_bytes"] == state, rows
    assert rows["optimizer"]["held_bytes"] == state, rows
    assert abs(drawn["setup_peak_measured"] / drawn["setup_peak_estimated"] - 1) < 0.05, drawn
    assert max(drawn["setup_phases_estimated"].items(), key=lambda kv: kv[1])[0] == "evaluate", drawn
    rows = {r["phase"]: r for r in loaded["rows"]}
    assert rows["init"]["held_bytes"] == loaded["weight_bytes"] - weights, rows
    assert rows["optimizer"]["held_bytes"] == state, rows
    assert loaded["setup_peak_rss"] <= 1.05 * loaded["setup_peak_estimated"], loaded
    assert result["provenance"]["commit"] != "unknown"
