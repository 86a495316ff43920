"""Backward stops at the active block, and activation checkpointing changes no gradient."""

import copy

import pytest
import torch
from transformers.models.llama.modeling_llama import LlamaMLP

from deca_ds import DecaConfig, DecaOptimizer
from deca_ds.models import enable_activation_checkpointing
from helpers import client_batches, tiny_llama

LAYERS = 4


def activate(model, block: int) -> DecaOptimizer:
    """An optimizer whose only (hence active) block is decoder layer `block`."""
    return DecaOptimizer(model, DecaConfig(custom_blocks=[f"model.layers.{block}"], master_dtype=torch.float32))


@pytest.mark.parametrize("block", range(LAYERS))
def test_graph_starts_at_the_active_block(block):
    """Layers below the active block build no graph; from it up, outputs carry gradients, and
    backward leaves .grad on the active block's parameters only."""
    model = tiny_llama(layers=LAYERS, dtype=torch.float32)
    opt = activate(model, block)
    needs_grad = {}
    for i, layer in enumerate(model.model.layers):
        layer.register_forward_hook(
            lambda mod, args, out, i=i: needs_grad.__setitem__(
                i, (out[0] if isinstance(out, tuple) else out).requires_grad))
    model(**client_batches(1, steps=1)[0][0]).loss.backward()
    assert needs_grad == {i: i >= block for i in range(LAYERS)}
    active = {id(p) for p in opt.active.params}
    for name, p in model.named_parameters():
        assert (p.grad is not None) == (id(p) in active), name


@pytest.mark.parametrize("block", [0, 2])
def test_activation_checkpointing_gives_identical_gradients(block, monkeypatch):
    base = tiny_llama(layers=LAYERS, dtype=torch.float32)
    batch = client_batches(1, steps=1)[0][0]
    # Count MLP forwards per layer by patching the method: the recomputation in backward runs
    # forward again, but (in transformers 5) not the module's hooks.
    calls: dict[int, int] = {}
    mlp_forward = LlamaMLP.forward

    def counting(self, x):
        calls[self.layer_index] = calls.get(self.layer_index, 0) + 1
        return mlp_forward(self, x)

    monkeypatch.setattr(LlamaMLP, "forward", counting)
    grads, counts = [], []
    for checkpointing in (False, True):
        model = copy.deepcopy(base).train()
        for i, layer in enumerate(model.model.layers):
            layer.mlp.layer_index = i
        opt = activate(model, block)
        if checkpointing:
            enable_activation_checkpointing(model)
        calls.clear()
        model(**batch).loss.backward()
        grads.append([p.grad.clone() for p in opt.active.params])
        counts.append([calls[i] for i in range(LAYERS)])
    # checkpointing recomputes exactly the layers from the active block up
    assert counts == [[1] * LAYERS, [1 + (i >= block) for i in range(LAYERS)]]
    assert len(grads[0]) > 0
    for plain, ckpt in zip(*grads):
        torch.testing.assert_close(ckpt, plain, rtol=0, atol=0)


def test_backward_cost_benchmark_runs(tmp_path):
    """The committed benchmark's script works and writes what it promises (numbers not asserted:
    timings are benchmarks, not tests)."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    subprocess.run([sys.executable, str(root / "profiling" / "backward_cost.py"), "--layers", "2", "--hidden", "64",
                    "--seq-len", "16", "--reps", "1", "--out", str(tmp_path)],
                   check=True, capture_output=True, cwd=root)
    summary = json.loads((tmp_path / "backward_cost.json").read_text())
    assert [r["block"] for r in summary["rows"]] == [0, 1] and summary["paper_ratio_block_count"] == 0.75
    assert (tmp_path / "backward_cost.png").stat().st_size > 1000 and (tmp_path / "backward_cost.md").exists()
