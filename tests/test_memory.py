"""deca_ds.memory and profiling/estimate.py: exact counts, optimizer state as DecaOptimizer holds it,
communication, the phase model's orderings, the (approximate) activation formula against the tensors
autograd really saves on CPU, and the command."""

from __future__ import annotations

import csv
import json
import math
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config

from deca_ds import DecaConfig, DecaOptimizer
from deca_ds.baseline_memory import estimate_method
from deca_ds.memory import (
    GPUS,
    ModelSpec,
    Workload,
    communication,
    estimate_block,
    estimate_blocks,
    estimate_memory,
    load_config,
    offload_block_stream,
)
from deca_ds.methods import AdamConfig, DecLoRA
from deca_ds.mixing import MIX_CHUNK
from deca_ds.models import causal_lm_loss, enable_activation_checkpointing
from deca_ds.runtime.options import TRAINS
from helpers import needs_bnb, run_script, run_script_in_fork, saved_bytes, tiny_llama
from ranks import run_on_ranks

ROOT = Path(__file__).resolve().parent.parent
CONFIGS = ROOT / "profiling" / "configs"
NAMES = ["qwen2-1.5b", "qwen2.5-3b-instruct", "llama-2-7b-hf", "llama-3.1-8b-instruct"]


@pytest.fixture(scope="module")
def specs():
    return {name: ModelSpec.from_config(CONFIGS / f"{name}.json") for name in NAMES}


def expected_counts(cfg: dict) -> tuple[int, int]:
    """(total, per layer) from the config numbers alone."""
    h, i, V = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    a = cfg["num_attention_heads"]
    kv = cfg.get("num_key_value_heads", a)
    hd = cfg.get("head_dim", h // a)
    qwen = cfg["model_type"] == "qwen2"
    attn = h * a * hd + 2 * h * kv * hd + a * hd * h  # q, k, v (GQA: kv heads), o
    if qwen or cfg.get("attention_bias"):
        attn += a * hd + 2 * kv * hd  # Qwen2: biases on q, k, v
    layer = attn + 3 * h * i + 2 * h  # SwiGLU MLP, two RMSNorms
    total = V * h + cfg["num_hidden_layers"] * layer + h  # embeddings, layers, final norm
    if not cfg.get("tie_word_embeddings", False):
        total += V * h  # untied LM head
    return total, layer


@pytest.mark.parametrize("name", NAMES)
def test_parameter_counts_from_config_arithmetic(specs, name):
    cfg = json.loads((CONFIGS / f"{name}.json").read_text())
    total, layer = expected_counts(cfg)
    spec, L = specs[name], cfg["num_hidden_layers"]
    assert spec.total_params == total
    assert spec.layer_params == (layer,) * L
    assert spec.non_layer_params == total - L * layer
    for lpb in (1, 2, 3, 4):
        blocks = spec.partition(lpb).blocks
        assert len(blocks) == math.ceil(L / lpb)
        assert [b.numel for b in blocks] == [min(lpb, L - k * lpb) * layer for k in range(len(blocks))]
        est = estimate_memory(spec, lpb)
        assert (est.total_params, est.num_blocks, est.block_params) == (total, len(blocks), lpb * layer)
        assert est.decoder_params == L * layer


def test_known_sizes(specs):
    # Sanity against the published sizes: Qwen2-1.5B 1.54 B (tied), Llama-3.1-8B 8.03 B, Llama-2-7B 6.74 B.
    assert specs["qwen2-1.5b"].total_params == 1_543_714_304
    assert specs["llama-3.1-8b-instruct"].total_params == 8_030_261_248
    assert specs["llama-2-7b-hf"].total_params == 6_738_415_616
    assert specs["qwen2-1.5b"].tied and not specs["llama-3.1-8b-instruct"].tied


def test_config_sources(tmp_path, specs):
    (tmp_path / "config.json").write_text((CONFIGS / "qwen2-1.5b.json").read_text())
    from_dir = ModelSpec.from_config(tmp_path)
    from_obj = ModelSpec.from_config(load_config(CONFIGS / "qwen2-1.5b.json"))
    assert from_dir.total_params == from_obj.total_params == specs["qwen2-1.5b"].total_params
    assert next(from_dir.model.parameters()).device.type == "meta"
    with pytest.raises(ValueError, match="no such file"):
        load_config(tmp_path / "missing.json")
    (tmp_path / "notes.json").write_text("not JSON")
    with pytest.raises(ValueError, match="model config .*notes.json.*not a valid JSON file"):
        load_config(tmp_path / "notes.json")


@pytest.mark.parametrize("layers_per_block", [1, 2])
@pytest.mark.parametrize("master_dtype,state_bits", [(torch.float32, 32), (torch.float64, 32),
                                                     pytest.param(torch.float32, 8, marks=needs_bnb)])
@pytest.mark.parametrize("trains", [False, True], ids=["layers", "all"])
def test_optimizer_state_equals_deca_optimizer(layers_per_block, master_dtype, state_bits, trains):
    """Block by block (with `all`, the embeddings, the final norm and the LM head too, each a block
    of its own): the estimate's state, gradient and x½ are the optimizer's."""
    model = tiny_llama(layers=3, dtype=torch.float32)
    extra = dict.fromkeys(TRAINS, trains)
    cfg = DecaConfig(layers_per_block=layers_per_block, steps_per_block=1, rounds=1, master_dtype=master_dtype,
                     state_bits=state_bits, **extra)
    opt = DecaOptimizer(model, cfg)
    spec = ModelSpec.from_config(model.config)
    master = "fp64" if master_dtype == torch.float64 else "fp32"
    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(0))
    seen = []
    while not opt.done:
        k = opt.active.index
        est = estimate_block(spec, layers_per_block, k, Workload(working_dtype="fp32"), master_dtype=master,
                             state_bits=state_bits, **extra)
        assert est.optimizer_state == opt.state_bytes()
        assert est.master == opt.active.master.numel() * opt.active.master.element_size()
        n = opt.active.master.numel()
        # 8-bit: a code per element and an fp32 absmax per 256 elements of each tensor
        want = est.master if state_bits == 32 else n + 4 * sum(-(-p.numel() // 256) for p in opt.active.params)
        assert est.m == est.v == want
        model(input_ids=ids, labels=ids).loss.backward()
        assert est.grad == sum(p.grad.numel() * p.grad.element_size() for p in opt.active.params)
        x_half = opt.adam_half_step()
        assert est.x_half == x_half.numel() * x_half.element_size()
        assert est.x_plus == 0  # master-dtype transfer: x⁺ is summed into an existing buffer
        opt.bma_correct(x_half.clone())
        seen.append(k)
    assert seen == list(range(math.ceil(3 / layers_per_block) + 3 * trains))
    assert opt.state_bytes() == 0


@pytest.mark.parametrize("transfer,master,working,size", [
    ("master", "fp32", "bf16", 4), ("master", "fp64", "fp32", 8),
    ("working", "fp32", "bf16", 2), ("working", "fp32", "fp32", 4),
])
def test_communication_bytes(specs, transfer, master, working, size):
    spec = specs["qwen2.5-3b-instruct"]
    for lpb, neighbors in ((1, 2), (4, 3)):
        blocks = spec.partition(lpb).blocks
        for k in (0, len(blocks) - 1):
            workload = Workload(transfer_dtype=transfer, working_dtype=working, n_neighbors=neighbors)
            est = estimate_block(spec, lpb, k, workload, master_dtype=master, steps_per_block=48)
            assert est.comm_per_step == neighbors * blocks[k].numel * size
            chunk = min(blocks[k].numel, MIX_CHUNK)  # DistributedMixer.mix receives chunk by chunk
            assert est.recv == neighbors * chunk * size
            assert est.comm_per_round == 48 * neighbors * size * sum(b.numel for b in blocks)
            cast = transfer == "working" and working != master
            assert est.send_copy == (chunk * size if cast else 0)
        comm = communication(spec, lpb, workload, master_dtype=master)
        assert comm["per_step"] == [neighbors * b.numel * size for b in blocks]


def test_phase_model_and_orderings(specs):
    spec = specs["llama-3.1-8b-instruct"]
    peaks = {}
    for offload in ("none", "frozen"):
        for lpb in (1, 2, 4):
            est = estimate_memory(spec, lpb, offload=offload)
            assert est.peak == max(est.phases.values()) and est.peak_phase in est.phases
            assert est.optimizer_state == est.master + est.m + est.v == 3 * est.block_params * 4
            assert est.trivial_bma_extra == 0
            peaks[offload, lpb] = est.peak
    # More layers per block = fewer, bigger blocks = more optimizer state and mixing buffers.
    for offload in ("none", "frozen"):
        assert peaks[offload, 1] < peaks[offload, 2] < peaks[offload, 4]
    for lpb in (1, 2, 4):
        assert peaks["frozen", lpb] < peaks["none", lpb]
    # The fused half step holds the gradient and x½ together; on this model the peak stays backward's.
    eager, fused = estimate_memory(spec, 1), estimate_memory(spec, 1, fused_update=True)
    assert fused.phases["update"] - eager.phases["update"] == min(eager.grad, eager.x_half) > 0
    assert fused.peak == eager.peak and fused.peak_phase == "backward"
    trivial = estimate_memory(spec, 1, variant="trivial_bma")
    assert trivial.trivial_bma_extra == 2 * trivial.master and trivial.peak > peaks["none", 1]
    # Fused, one client: no x½ is stored (bma_correct writes x⁺ = x½ over x), the gradient stays
    # until then, and trivial_bma copies no moments. With neighbors, or eager, x½ is stored.
    for v in ("deca", "trivial_bma", "no_bma"):
        one = estimate_memory(spec, 1, Workload(n_neighbors=0, loss_positions=2), variant=v, fused_update=True)
        assert one.x_half == one.trivial_bma_extra == 0 and one.grad_kept == one.grad == 2 * one.block_params
        base = one.weights + one.optimizer_state
        assert one.phases["update"] == one.phases["mixing"] == base + one.grad
        for fused, neighbors in ((True, 2), (False, 0)):
            est = estimate_memory(spec, 1, Workload(n_neighbors=neighbors, loss_positions=2), variant=v,
                                  fused_update=fused)
            assert est.x_half == 4 * est.block_params and est.grad_kept == 0
        # The H100 run's configuration (two labelled positions): the update no longer peaks.
        eager_one = estimate_memory(spec, 1, Workload(n_neighbors=0, loss_positions=2), variant=v)
        assert one.peak_phase == "backward" and one.peak == eager_one.phases["backward"]
    # Without neighbors the mixer returns x½ as it is: no cast copy, no receive or sum buffers.
    alone = estimate_memory(spec, 1, Workload(transfer_dtype="working", n_neighbors=0))
    assert alone.send_copy == alone.recv == alone.x_plus == 0
    assert estimate_memory(spec, 1, Workload(transfer_dtype="working", n_neighbors=1)).send_copy > 0
    # The peak over a round is block 0 (largest block, deepest backward).
    blocks = estimate_blocks(spec, 1)
    assert estimate_memory(spec, 1).block == 0 and max(e.peak for e in blocks) == blocks[0].peak
    # Checkpointing keeps less than saving every layer's tensors.
    assert estimate_memory(spec, 1, Workload(checkpointing=False)).activations > estimate_memory(spec, 1).activations
    # loss_chunk: one chunk's logits (b · chunk · V · 12 bytes with bf16 logits), never more than all of them.
    whole, chunked = (estimate_memory(spec, 1, Workload(micro_batch=8, loss_chunk=c)) for c in (0, 64))
    assert whole.act_logits == 8 * 512 * 128256 * 12 and chunked.act_logits == 8 * 64 * 128256 * 12
    assert whole.peak - chunked.peak == whole.act_logits - max(chunked.act_logits, chunked.act_recompute) > 4 * 2**30
    assert estimate_memory(spec, 1, Workload(loss_chunk=4096)).act_logits == estimate_memory(spec, 1).act_logits
    with pytest.raises(ValueError, match="loss_chunk must be >= 0"):
        estimate_memory(spec, 1, Workload(loss_chunk=-1))


@pytest.mark.parametrize("bad,message", [
    (dict(working_dtype="fp64"), "working_dtype must be one of"), (dict(transfer_dtype="fp8"), "transfer_dtype"),
    (dict(attn_implementation="flash"), "attn_implementation"), (dict(n_neighbors=-1), "n_neighbors must be >= 0"),
    (dict(micro_batch=0), "micro_batch must be >= 1"), (dict(seq_len=0), "seq_len must be >= 1"),
    (dict(loss_positions=0), "loss_positions must be >= 1"), (dict(eval_batch=-1), "eval_batch must be >= 0"),
    (dict(eval_positions=0), "eval_positions must be >= 1"),
])
def test_a_workload_is_checked_when_made(bad, message):
    """DECA's estimate and the baselines' take one Workload: a bad value is refused, named, before either runs."""
    with pytest.raises(ValueError, match=message):
        Workload(**bad)
    assert Workload(working_dtype="float32").working_dtype == torch.float32  # any name of the dtype, held as one


def test_decas_own_settings_are_refused_as_decaconfig_refuses_them(specs):
    with pytest.raises(ValueError, match="master_dtype must be float32 or float64"):
        estimate_memory(specs["qwen2-1.5b"], 1, master_dtype="bf16")
    with pytest.raises(ValueError, match="variant must be one of"):
        estimate_memory(specs["qwen2-1.5b"], 1, variant="adam")


def test_paper_formulas_llama_8b(specs):
    spec = specs["llama-3.1-8b-instruct"]
    d = spec.total_params
    est = estimate_memory(spec, 1)
    assert est.num_blocks == 32
    assert est.paper_deca == 2 * d + 20 * d // 32 and (20 * d) % 32 == 0
    assert est.paper_dadam_9m == 18 * d and est.paper_dadam_11m == 22 * d
    layers = spec.decoder_params
    assert est.dadam_runtime == 2 * d + layers * (4 + 4 + 4 + 2)
    assert est.weights == 2 * d


def test_offload_frozen_terms(specs):
    spec = specs["llama-3.1-8b-instruct"]
    est = estimate_memory(spec, 1, offload="frozen")
    layer = spec.layer_params[0]
    assert est.weights == 2 * (spec.non_layer_params + layer)
    assert est.offload_buffers == 2 * 2 * layer
    assert est.host_weights == 2 * spec.decoder_params


def test_deepspeed_allreduce_bucket(specs):
    spec = specs["llama-3.1-8b-instruct"]
    one = estimate_memory(spec, 1, Workload(deepspeed_allreduce=True))
    assert one.grad_allreduce == one.block_params * (2 + 4)  # bf16 flat copy + its fp32 communication copy
    # 872 M elements: the first bucket closes once it passes 5e8
    four = estimate_memory(spec, 4, Workload(deepspeed_allreduce=True))
    assert 5e8 < four.grad_allreduce / 6 < four.block_params
    assert estimate_memory(spec, 1).grad_allreduce == 0  # one rank per client: no all-reduce
    fp32 = estimate_memory(spec, 1, Workload(working_dtype="fp32", deepspeed_allreduce=True))
    assert fp32.grad_allreduce == one.block_params * 4


def test_gpu_fit(specs):
    est = estimate_memory(specs["qwen2-1.5b"], 1)
    for gpu, capacity in GPUS.items():
        assert est.headroom(gpu, reserve=0) == capacity - est.peak and est.fits(gpu)
    assert not est.fits(est.peak - 1, reserve=0) and est.fits(est.peak, reserve=0)


# ---- the activation formula against what autograd saves (CPU) -----------------------------------

@pytest.mark.parametrize("config_cls", [LlamaConfig, Qwen2Config])
@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("checkpointing", [False, True])
def test_activation_estimate_matches_saved_tensors(config_cls, attn, dtype, checkpointing):
    torch.manual_seed(0)
    cfg = config_cls(hidden_size=128, intermediate_size=352, num_hidden_layers=4, num_attention_heads=8,
                     num_key_value_heads=2, vocab_size=300, max_position_embeddings=256, tie_word_embeddings=False)
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation=attn).to(dtype).train()
    if checkpointing:
        enable_activation_checkpointing(model)
    opt = DecaOptimizer(model, DecaConfig(layers_per_block=1, steps_per_block=1))
    b, s = 2, 64
    ids = torch.randint(0, 300, (b, s), generator=torch.Generator().manual_seed(1))
    mask = torch.ones(b, s, dtype=torch.long)
    mask[0, :5] = 0  # padding, as deca-ds batches have: transformers then expands GQA keys/values
    batch = {"input_ids": ids, "attention_mask": mask, "labels": ids}
    spec = ModelSpec.from_config(cfg)
    working = "bf16" if dtype == torch.bfloat16 else "fp32"
    for block in (0, 2):
        while opt.active.index != block:
            opt.step()
        measured = saved_bytes(model, batch)
        est = estimate_block(spec, 1, block, Workload(working_dtype=working, micro_batch=b, seq_len=s,
                                                      checkpointing=checkpointing, attn_implementation=attn))
        predicted = est.act_saved + b * s * cfg.vocab_size * 4  # + the fp32 log-softmax output the loss saves
        assert abs(measured / predicted - 1) < 0.05, (block, measured, predicted)


@pytest.mark.parametrize("checkpointing", [False, True], ids=["plain", "checkpointing"])
def test_activation_estimate_of_the_embeddings_final_norm_and_head_blocks(checkpointing):
    """The blocks of no decoder layer, with the trainer's loss labelled at the last 4 positions:
    backward runs through every layer to the embeddings, and through none for the final norm (which
    keeps its normalized input in bf16 at every position) and the LM head (its input, at the 4)."""
    cfg = LlamaConfig(hidden_size=128, intermediate_size=352, num_hidden_layers=4, num_attention_heads=8,
                      num_key_value_heads=2, vocab_size=300, max_position_embeddings=256, tie_word_embeddings=False)
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa").to(torch.bfloat16).train()
    if checkpointing:
        enable_activation_checkpointing(model)
    trains = dict.fromkeys(TRAINS, True)
    opt = DecaOptimizer(model, DecaConfig(layers_per_block=1, steps_per_block=1, **trains))
    b, s = 2, 64
    ids = torch.randint(0, 300, (b, s), generator=torch.Generator().manual_seed(1))
    mask = torch.ones(b, s, dtype=torch.long)
    mask[0, :5] = 0
    labels = torch.full_like(ids, -100)
    labels[:, -4:] = ids[:, -4:]  # the head runs at the 4 positions that predict them
    batch = {"input_ids": ids, "attention_mask": mask, "labels": labels}
    spec = ModelSpec.from_config(cfg)
    workload = Workload(micro_batch=b, seq_len=s, checkpointing=checkpointing, loss_positions=4)
    for block, name in ((0, "embeddings"), (5, "final_norm"), (6, "lm_head")):
        while opt.active.index != block:
            opt.step()
        assert opt.partition.blocks[block].name == name
        measured = saved_bytes(model, batch, forward=causal_lm_loss)
        est = estimate_block(spec, 1, block, workload, **trains)
        assert abs(measured / (est.act_saved + b * 4 * cfg.vocab_size * 4) - 1) < 0.05, (name, measured, est.act_saved)


def test_checkpointing_keeps_lower_layer_inputs_unless_input_grads_are_disabled():
    """transformers 5's gradient_checkpointing_enable() makes the embedding output require grad, so
    the layers below the active block keep their inputs (and are recomputed in backward)."""
    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=128, intermediate_size=352, num_hidden_layers=4, num_attention_heads=8,
                      num_key_value_heads=2, vocab_size=300, max_position_embeddings=256, tie_word_embeddings=False)
    spec = ModelSpec.from_config(cfg)
    ids = torch.randint(0, 300, (2, 64), generator=torch.Generator().manual_seed(1))
    got = {}
    for disable in (False, True):
        model = AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa").to(torch.bfloat16).train()
        enable_activation_checkpointing(model)
        if not disable:  # what transformers' switch alone leaves behind
            model.enable_input_require_grads()
        opt = DecaOptimizer(model, DecaConfig(layers_per_block=1, steps_per_block=1))
        opt.step(), opt.step()  # block 2 active
        got[disable] = saved_bytes(model, {"input_ids": ids, "labels": ids})
        est = estimate_block(spec, 1, 2, Workload(micro_batch=2, seq_len=64), inputs_require_grad=not disable)
        assert abs(got[disable] / (est.act_saved + 2 * 64 * 300 * 4) - 1) < 0.01, (disable, got[disable])
    assert got[False] - got[True] == 2 * 2 * 64 * 128 * 2  # exactly two lower layers' bf16 inputs


# ---- the command ------------------------------------------------------------------------------

def test_command_writes_all_outputs(tmp_path, capsys):
    script = ROOT / "profiling" / "estimate.py"
    assert run_script(script, "--help") == 0
    help_text = capsys.readouterr().out
    assert "--layers-per-block" in help_text and "--offload" in help_text
    code = run_script(script, "--config", str(CONFIGS / "qwen2-1.5b.json"), "--layers-per-block", "1", "2",
                      "--out", str(tmp_path))
    printed = capsys.readouterr()
    assert code == 0, printed.err
    md = (tmp_path / "estimate.md").read_text()
    assert "estimated, not measured." in md and "qwen2-1.5b" in md
    assert md.strip() in printed.out
    with (tmp_path / "estimate.csv").open() as f:
        rows = list(csv.DictReader(f))
    deca = [r for r in rows if r["method"] == "deca"]
    assert len(deca) == 4 and {r["offload"] for r in deca} == {"none", "frozen"}
    assert [r["method"] for r in rows[4:]] == ["dadam", "dec_lora", "dec_adapter", "decaf"]
    for key in ("weights", "optimizer_state", "grad", "activations", "peak", "paper_deca", "comm_per_step",
                "x_half", "recv", "x_plus", "fits RTX 5090"):
        assert key in rows[0]
    data = json.loads((tmp_path / "estimate.json").read_text())
    assert len(data["rows"]) == 8 and "not measured" in data["meta"]["note"]
    expected = estimate_memory(CONFIGS / "qwen2-1.5b.json", 2, offload="frozen")
    row = next(r for r in data["rows"] if r["layers_per_block"] == 2 and r["offload"] == "frozen")
    assert row["peak"] == expected.peak and row["optimizer_state"] == expected.optimizer_state
    # the baselines with deca-train's defaults (LoRA rank 8, dropout 0.05, all linear layers)
    lora = estimate_method(CONFIGS / "qwen2-1.5b.json", DecLoRA(AdamConfig(steps=1)))
    row = next(r for r in data["rows"] if r["method"] == "dec_lora")
    assert row["peak"] == lora.peak and row["block_params"] == lora.block_params
    assert "| qwen2-1.5b | dadam |" in md
    code = run_script(script, "--config", str(CONFIGS / "qwen2-1.5b.json"), "--layers-per-block", "1",
                      "--offload", "none", "--baselines", "--out", str(tmp_path), "--name", "deca_only")
    assert code == 0 and len(json.loads((tmp_path / "deca_only.json").read_text())["rows"]) == 1
    # --train: Qwen2-1.5B's embeddings (its LM head too: tied), a block of DECA's and in D-Adam's set
    code = run_script(script, "--config", str(CONFIGS / "qwen2-1.5b.json"), "--layers-per-block", "1",
                      "--offload", "none", "--train", "embeddings", "--baselines", "dadam", "--out", str(tmp_path),
                      "--name", "trained")
    deca, dadam = json.loads((tmp_path / "trained.json").read_text())["rows"]
    expected = estimate_memory(CONFIGS / "qwen2-1.5b.json", 1, train_embeddings=True)
    assert code == 0 and deca["peak"] == expected.peak and deca["num_blocks"] == 28 + 1 and deca["block"] == 0
    assert dadam["block_params"] == 151936 * 1536 + sum(ModelSpec.from_config(CONFIGS / "qwen2-1.5b.json").layer_params)
    assert "--train, one each for the embeddings)" in (tmp_path / "trained.md").read_text()
    png = (tmp_path / "estimate.png").read_bytes()
    assert len(png) > 1000 and png[:8] == b"\x89PNG\r\n\x1a\n"


def test_offload_weights_and_streamed_bytes_with_kept_layers():
    model = tiny_llama(layers=4, dtype=torch.float32)
    spec = ModelSpec.from_config(model.config)
    layer = spec.layer_params[0]
    w = 2  # bf16
    for keep, resident, above in ((0, [1], [2, 3]), (1, [1, 3], [2]), (3, [1, 2, 3], [])):
        est = estimate_block(spec, 1, 1, offload="frozen", offload_keep=keep)  # block 1 = layer 1 active
        assert est.weights == (spec.non_layer_params + len(resident) * layer) * w
        # layer 0 below, the streamed ones above (the count itself: tests/test_prefix.py)
        assert est.offload_stream_block == offload_block_stream([layer * w], [layer * w] * len(above), 48)
        assert est.offload_stream == round(est.offload_stream_block / 48)
        assert est.offload_buffers == min(2, 1 + len(above)) * layer * w  # one buffer when one layer streams
    assert estimate_block(spec, 1, 1, offload="frozen", offload_keep=4).offload_buffers == 0  # nothing streams
    with pytest.raises(ValueError, match=r"offload keep must be in \[0, 4\] \(the model's decoder layers\), got 5"):
        estimate_block(spec, 1, 0, offload="frozen", offload_keep=5)


def test_offload_budget_keeps_the_most_layers_that_fit():
    from dataclasses import asdict

    from deca_ds.runtime.footprint import estimate_run, offload_keep_for_budget
    from deca_ds.runtime.parsing import parse_args
    config = ModelSpec.from_config(CONFIGS / "llama-3.1-8b-instruct.json")
    opts, ds = parse_args(["--ds_config", str(ROOT / "ds_configs" / "profile_bf16.json"), "--offload", "frozen",
                           "--steps-per-block", "48", "--offload-budget", "1"])
    options = asdict(opts)
    peaks = [estimate_run(options, config, ds, n_neighbors=2, loss_positions=2, offload_keep=k).peak
             for k in range(33)]
    assert peaks == sorted(peaks) and peaks[0] < peaks[-1]  # every kept layer costs memory
    for keep in (0, 5, 17, 32):
        for budget in (peaks[keep], (peaks[keep] + peaks[keep + 1]) / 2 if keep < 32 else peaks[keep] * 2):
            options["offload_budget"] = budget / 1e9
            assert offload_keep_for_budget(options, config, ds, n_neighbors=2, loss_positions=2) == keep
    options["offload_budget"] = peaks[0] / 1e9 * 0.99
    with pytest.raises(ValueError, match="even with every frozen decoder layer offloaded"):
        offload_keep_for_budget(options, config, ds, n_neighbors=2, loss_positions=2)


def test_deca_train_estimate_is_the_estimator_for_the_runs_own_setting(tmp_path, capsys):
    """deca-train --estimate: the estimator for what the run would train, each input derived here by
    hand: the preset's model config, bf16, 2 layers per block, grad_accum 1; a ring of 4 clients,
    2 neighbours each; the synthetic task's answer (label word, eos) at micro-batch 4, so the LM
    head runs at 8 positions, not 512; rank 0's scoring before training. Nothing is trained or
    written; a baseline's is its own."""
    import re

    from deca_ds.memory import GiB
    from deca_ds.train import main as train_main

    qwen = CONFIGS / "qwen2.5-3b-instruct.json"
    run = ["--preset", "rtx5090_qwen2.5-3b", "--model", str(qwen), "--from-config", "--topology", "ring",
           "--micro-batch", "4", "--output-dir", str(tmp_path / "out")]
    args = [*run, "--clients", "4"]
    train_main([*args, "--estimate"])
    text = capsys.readouterr().out
    # rank 0 scores x̄ before training: 32 (prompt, label) sequences per forward, the head at the answer's 2
    workload = Workload(working_dtype="bf16", n_neighbors=2, micro_batch=4, seq_len=512, loss_positions=8,
                        eval_batch=32, eval_positions=2)
    expected = estimate_memory(qwen, 2, workload, master_dtype="fp32", grad_accum=1, steps_per_block=48)
    assert expected.setup_phases["evaluate"] > expected.setup_phases["init"]
    assert "4 client(s), at most 2 neighbour(s) each; micro-batch 4 × 512 tokens, the LM head at 8 position(s)" in text
    for line, value in (("peak of the process", expected.process_peak),
                        ("phase setup: evaluate", expected.setup_phases["evaluate"]),
                        ("phase end: consensus", expected.end)):
        assert float(re.search(line + r"\s+([\d.]+) GiB", text).group(1)) == round(value / GiB, 3), line
    assert f"the peak block: {expected.block} (layers[" in text
    # Qwen2.5-3B's embeddings (its LM head too: tied) as a block of their own: 311M parameters, the peak
    train_main([*args, "--train-embeddings", "--estimate"])
    text = capsys.readouterr().out
    embeddings = estimate_memory(qwen, 2, workload, master_dtype="fp32", grad_accum=1, steps_per_block=48,
                                 train_embeddings=True)
    assert "36 decoder layers in 18 blocks and 1 more (embeddings)" in text
    assert "the peak block: 0 (embeddings)" in text and embeddings.block_params == 151936 * 2048
    assert float(re.search(r"peak of the process\s+([\d.]+) GiB", text).group(1)) == \
        round(embeddings.process_peak / GiB, 3) > round(expected.process_peak / GiB, 3)
    # resident, one rank per client: no FrozenPrefix, no DeepSpeed all-reduce
    assert "phase backward" in text and "phase prefix" not in text and "phase grad_allreduce" not in text
    assert "RTX 5090 (31.8 GiB): yes" in text
    assert not (tmp_path / "out").exists()
    # four clients on one GPU each hold their own peak and CUDA context
    train_main([*args, "--device-map", "0,0,0,0", "--transport", "gloo", "--estimate"])
    shared = 4 * (expected.process_peak + GiB) <= GPUS["RTX 5090"]
    assert f"RTX 5090 (31.8 GiB): {'yes' if shared else 'no'}" in capsys.readouterr().out and not shared
    # a baseline: deca_ds.baseline_memory for the method the run builds (LoRA's defaults)
    train_main([*args, "--method", "dec_lora", "--estimate"])
    text = capsys.readouterr().out
    lora = estimate_method(qwen, DecLoRA(AdamConfig(steps=1)), workload)
    assert f"dec_lora training {lora.block_params:,} parameters at every step" in text
    assert float(re.search(r"peak of the process\s+([\d.]+) GiB", text).group(1)) == round(lora.process_peak / GiB, 3)
    with pytest.raises(SystemExit):  # no launcher, no --clients: the graph is unknown
        train_main([*run, "--estimate"])
    assert "--estimate: give --clients N" in capsys.readouterr().err
    with pytest.raises(SystemExit):  # Qwen2.5-3B's 32768 positions: a run the trainer refuses has no estimate
        train_main([*args, "--max-seq-len", "40000", "--estimate"])
    assert "--max-seq-len 40000 is longer than the model's context (max_position_embeddings 32768)" in \
        capsys.readouterr().err
    from deca_ds.runtime.split import main as split_main

    with pytest.raises(SystemExit) as code:  # deca-split writes a split; it has no --estimate to ignore
        split_main(["--out", str(tmp_path / "split"), "--clients", "2", "--estimate"])
    assert code.value.code == 2 and not (tmp_path / "split").exists()


def test_update_cost_tool(tmp_path):
    """profiling/update_cost.py times the update of one block, eager and fused, against a copy pass
    and writes its tables."""
    tiny_llama(layers=2).config.to_json_file(tmp_path / "config.json")
    # forked: the tool sets this process's malloc options
    assert run_on_ranks(run_script_in_fork, 1, ROOT / "profiling" / "update_cost.py", "--config", str(tmp_path),
                        "--steps", "2", "--warmup", "1", "--variants", "deca", "no_bma",
                        "--out", str(tmp_path / "out"), timeout=300) == [0]
    summary = json.loads((tmp_path / "out" / "update_cost.json").read_text())
    layer = sum(p.numel() for p in tiny_llama(layers=2).model.layers[0].parameters())
    assert summary["allocator"].startswith("glibc malloc keeping freed memory")  # the CPU default
    runs = [(v, u) for v in ("deca", "no_bma") for u in ("eager", "fused", "fused_alone")]
    assert [(row["variant"], row["update"]) for row in summary["rows"]] == runs
    # fp32 bytes per parameter. fused: g, x, m, v → m, v, x½ | x, x⁺ twice, m, v → m, v, weights
    # (no_bma: x⁺ → weights); in place: g, x, m, v | g, x, m, v → x, m, v, weights (no_bma: the second).
    floors = {("deca", "eager"): 4 + 24 + 32 + 4, ("deca", "fused"): 4 + 24 + 32 + 4,
              ("deca", "fused_alone"): 16 + 16 + 16, ("no_bma", "eager"): 4 + 24 + 4 + 4,
              ("no_bma", "fused"): 4 + 24 + 4 + 4, ("no_bma", "fused_alone"): 16 + 16}
    for row in summary["rows"]:
        assert row["block_params"] == layer and row["working_dtype"] == "fp32"
        assert row["update_ms"] == pytest.approx(row["half_step_ms"] + row["correct_ms"]) and row["copy_ms"] > 0
        assert row["update_in_copies"] == pytest.approx(row["update_ms"] / row["copy_ms"])
        assert 0 < row["host_ms"] <= row["update_ms"]  # the same calls, timed without the final wait
        assert row["floor_in_copies"] == floors[row["variant"], row["update"]] / 8
    md = (tmp_path / "out" / "update_cost.md").read_text()
    assert md.count("\n| deca | eager |") == 1 and md.count("\n| no_bma | fused_alone |") == 1


def test_update_share_tool(tmp_path, capsys):
    """profiling/update_share.py swaps a measured eager update for the fused update's traffic at the
    given bandwidth: DECA's resident rows only, every number from the formula it states."""
    tiny_llama(layers=2).config.to_json_file(tmp_path / "config.json")
    ds = tmp_path / "ds.json"
    ds.write_text(json.dumps({"deca": {"working_dtype": "bf16", "max_seq_len": 64}}))
    common = {"device": "GPU X", "ds_config": str(ds), "train_args": ["--model", str(tmp_path / "config.json")]}
    resources = tmp_path / "resources.json"
    resources.write_text(json.dumps({**common, "results": [
        {"method": "DECA", "step_ms": 100.0, "agg_up_ms": 10.0},
        {"method": "Dec-LoRA", "step_ms": 300.0, "agg_up_ms": 30.0}]}))
    memory = tmp_path / "memory.json"
    memory.write_text(json.dumps({**common, "results": [
        {"offload": "none", "layers_per_block": 2, "micro_batch": 8, "step_ms": 50.0, "update_ms": 20.0},
        {"offload": "frozen", "layers_per_block": 2, "micro_batch": 8, "step_ms": 90.0, "update_ms": 20.0}]}))
    tool = ROOT / "profiling" / "update_share.py"
    assert run_script(tool, str(resources), str(memory), "--bandwidth", "1e-6", "--overhead-ms", "0.5",
                      "--out", str(tmp_path / "out")) == 0
    rows = json.loads((tmp_path / "out" / "update_share.json").read_text())["rows"]
    layer = sum(p.numel() for p in tiny_llama(layers=2).model.layers[0].parameters())
    bf16_floor = (2 + 3 * 4) + (2 + 3 * 4 + 3 * 4 + 2)  # one client, in place: g,x,m,v | g,x,m,v → x,m,v,w
    assert [(r["micro_batch"], r["layers_per_block"], r["seq_len"]) for r in rows] == [(1, 1, 64), (8, 2, 64)]
    for r, params, step, eager in zip(rows, (layer, 2 * layer), (100.0, 50.0), (10.0, 20.0)):
        fused = params * bf16_floor / 1e6 * 1e3 + 0.5
        assert r["block_params"] == params and r["bytes_per_param"] == bf16_floor
        assert r["fused_update_ms"] == pytest.approx(fused)
        assert r["fused_share"] == pytest.approx(fused / (step - eager + fused))
    md = (tmp_path / "out" / "update_share.md").read_text()
    assert "estimated" in md and md.count("| met |") + md.count("| not met |") == 2

    old = tmp_path / "old.json"
    old.write_text(json.dumps({**common, "results": [{"offload": "none", "step_ms": 50.0}]}))
    capsys.readouterr()
    assert run_script(tool, str(old), "--out", str(tmp_path / "out")) == 1
    assert "has no update time" in capsys.readouterr().err


def test_loss_memory_tool(tmp_path):
    """profiling/loss_memory.py measures a fresh process per loss chunk and sets the estimator's
    term for the loss beside it (the tool itself in this process: its children are the fresh ones)."""
    assert run_script(ROOT / "profiling" / "loss_memory.py", "--micro-batch", "2", "--seq-len", "16", "--vocab", "1000",
                      "--chunks", "0", "4", "--out", str(tmp_path)) == 0
    summary = json.loads((tmp_path / "loss_memory.json").read_text())
    assert [r["loss_chunk"] for r in summary["rows"]] == [0, 4]
    for row, positions in zip(summary["rows"], (15, 4)):  # every position but the last predicts a label
        assert row["estimated_logits_gib"] * 2**30 == 2 * positions * 1000 * 12
        assert row["measured_peak_gib"] > 0 and row["step_s"] > 0
    with (tmp_path / "loss_memory.csv").open() as f:
        assert len(list(csv.DictReader(f))) == 2
