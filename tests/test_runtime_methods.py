"""The baselines through launch/train.py on 4 CPU ranks: same result as the in-process simulator
(LoRA's dropout too: each simulated client draws its masks as its rank does), the same metrics and
bytes accounting, and each method's export."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from peft import PeftModel
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

import deca_ds
from deca_ds import export
from deca_ds.data import ClientStream
from deca_ds.methods import load_adapters, saved_adapters
from deca_ds.optimizer import model_partition
from deca_ds.rng import ClientGenerators
from deca_ds.runtime import checkpoint as ckpt
from deca_ds.runtime import evaluate, plan
from deca_ds.runtime.checkpoint_consensus import checkpoint_model, checkpoint_step
from deca_ds.runtime.evaluate import load_export
from deca_ds.runtime.parsing import parse_args
from helpers import assert_umask_modes, torch_threads
from ranks import wait_all
from test_runtime import PRESET, N, client_params, start_ranks

STEPS = 6
RUN = ["--ds_config", PRESET, "--topology", "ring", "--steps", str(STEPS), "--micro-batch", "4", "--lr", "3e-3",
       "--max-seq-len", "32", "--eval-limit", "32", "--consensus-interval", "0", "--save-clients",
       "--timeout", "60", "--lora-rank", "4", "--adapter-size", "8", "--mix-every", "2",
       "--checkpoint-interval", "3", "--eval-interval", "3", "--eval-clients"]


def simulated(args: list[str]):
    opts, _ = parse_args(args)
    task = plan.build_task(opts, N)
    model = plan.build_model(opts, len(task.tokenizer))
    method = opts.build_method(model_partition(model, opts.deca_config()))
    streams = [ClientStream(task.features, task.client_indices[c], opts.micro_batch,
                            pad_id=task.tokenizer.pad_token_id, seed=opts.seed, client=c) for c in range(N)]
    with torch_threads():  # the ranks' count (start_ranks sets DECA_RANK_THREADS)
        return deca_ds.simulate(model, streams, deca_ds.make_topology("ring", N).W, method,
                                generators=ClientGenerators.seeded(opts.seed, N)), method, model


@pytest.mark.parametrize("name", ["dadam", "dec_lora", "dec_adapter", "decaf"])
def test_baseline_runs_distributed_like_the_simulator_and_exports(name, tmp_path):
    out = tmp_path / "run"
    args = [*RUN, "--method", name, "--output-dir", str(out)]
    procs = start_ranks(args, N, tmp_path / "logs")
    assert wait_all(procs, timeout=300) == [0] * N, (tmp_path / "logs" / "rank0.err").read_text()[-3000:]
    want, method, base = simulated([*args[:-2], "--output-dir", "unused"])
    # each client's export is a plain model directory that computes what the simulated client
    # computes, as deca-eval loads it (LoRA merged into W; Dec-Adapter's base with the adapters in
    # its adapter/): its tensors are the simulated client's plain_state, its logits the client's
    ids = torch.arange(8)[None]
    for c in range(N):
        client = method.prepare(copy.deepcopy(base)).eval()
        with torch.no_grad():
            for pname, p in client.named_parameters():
                p.copy_(want[c][pname])
        saved = out / "clients" / f"client_{c:03d}"
        got = load_file(saved / "model.safetensors")
        if name == "dec_adapter":
            got |= load_file(saved / "adapter" / "adapter_model.safetensors")
            expected = client.state_dict()
        else:
            expected = method.plain_state(client)
        assert got and set(got) <= set(expected), set(got) - set(expected)
        for tname, value in got.items():
            torch.testing.assert_close(value, expected[tname], rtol=0, atol=1e-6, msg=f"{name} client {c} {tname}")
        plain = load_export(str(saved), dtype=torch.float32).eval()
        assert AutoTokenizer.from_pretrained(saved)("a b c").input_ids
        with torch.no_grad():
            torch.testing.assert_close(plain(input_ids=ids).logits, client(input_ids=ids).logits,
                                       rtol=1e-5, atol=1e-5, msg=f"{name} client {c} export")

    run = json.loads((out / "run_config.json").read_text())
    assert run["method"] == name
    rows = [json.loads(line) for line in (out / "metrics" / "client_000.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(STEPS))
    assert {"t_local_update", "t_exchange", "t_aggregate"} <= set(rows[0]) and rows[0]["block"] is None
    # ring: 2 neighbors × the trainable vector × 4 bytes on every second step (--mix-every 2)
    assert [r["bytes_sent"] for r in rows] == [0, 2 * 4 * run["trainable_params"]] * (STEPS // 2)
    # deca-eval --checkpoint forms x̄ of the step-3 checkpoint in one process as the run formed it then
    # (--eval-interval 3: the clients' mean, DeCAF's combination) and scores it the same
    evaluated = {k.removeprefix("eval_consensus_"): v for k, v in rows[2].items() if k.startswith("eval_consensus_")}
    evaluate.main(["--run", str(out), "--checkpoint", "3", "--eval-limit", "32", "--out", str(tmp_path / "e.json")])
    scored = json.loads((tmp_path / "e.json").read_text())
    assert scored["checkpoint"] == 3 and scored["classification"] == evaluated, (scored, evaluated)
    with pytest.raises(ValueError, match=r"checkpoint step 4 .*\(steps complete for every client: \[3, 6\]\)"):
        checkpoint_step(out, N, 1, 4)
    # deca-export writes that x̄ as the run writes consensus/, which deca-eval scores alike
    x3 = tmp_path / "x3"
    export.main(["--run", str(out), "--checkpoint", "3", "--out", str(x3)])
    assert json.loads((x3 / "deca_export.json").read_text())["checkpoint"] == 3
    assert (saved_adapters(x3) is not None) == (name == "dec_adapter")  # LoRA's adapter/ is peft's, merged in
    check_checkpoint_export(x3, [ckpt.client_dir(out, 3, c) / "model.safetensors" for c in range(N)],
                            rank=4 if name == "decaf" else None)
    evaluate.main(["--run", str(out), "--model", str(x3), "--eval-limit", "32", "--out", str(tmp_path / "x.json")])
    assert json.loads((tmp_path / "x.json").read_text())["classification"] == evaluated
    for written in (out, x3):  # safetensors (0.8) alone would leave its files 0600
        assert_umask_modes(written)
    # the last step is checkpointed too: its x̄ is the run's own consensus/ (formed there by all-reduce)
    export.main(["--run", str(out), "--checkpoint", "latest", "--out", str(tmp_path / "x6")])
    final = {p.relative_to(out / "consensus"): load_file(p) for p in (out / "consensus").rglob("*.safetensors")}
    assert {p.relative_to(tmp_path / "x6") for p in (tmp_path / "x6").rglob("*.safetensors")} == set(final)
    for path, tensors in final.items():
        for tname, value in load_file(tmp_path / "x6" / path).items():
            torch.testing.assert_close(value, tensors[tname], rtol=0, atol=1e-6, msg=f"{path} {tname}")
    # --client: one client's own model of the step, scored as the run scored it then (--eval-clients)
    own = json.loads((out / "metrics" / "client_001.jsonl").read_text().splitlines()[2])
    evaluate.main(["--run", str(out), "--checkpoint", "3", "--client", "1", "--eval-limit", "32",
                   "--out", str(tmp_path / "c1.json")])
    assert json.loads((tmp_path / "c1.json").read_text())["classification"] == {
        k.removeprefix("eval_client_"): v for k, v in own.items() if k.startswith("eval_client_")}
    export.main(["--run", str(out), "--checkpoint", "3", "--client", "1", "--out", str(tmp_path / "c1")])
    check_checkpoint_export(tmp_path / "c1", [ckpt.client_dir(out, 3, 1) / "model.safetensors"], rank=None)
    with pytest.raises(ValueError, match=f"--client {N}: the run has clients 0 to {N - 1}"):
        checkpoint_model(out, 3, torch.device("cpu"), False, N)
    # a client's checkpoint that is elsewhere (nodes with disks of their own) is named
    ckpt.client_dir(out, 3, 2).rename(tmp_path / "elsewhere")
    with pytest.raises(ValueError, match=r"checkpoint step 3 .*\(steps complete for every client: \[6\]; "
                                         r"client 2: .*step_00000003/client_002/manifest_0.json is missing"):
        checkpoint_step(out, N, 1, 3)

    consensus = out / "consensus"
    if name in ("dec_lora", "decaf"):
        base = AutoModelForCausalLM.from_pretrained(consensus)  # the merged model, plain transformers
        peft_model = PeftModel.from_pretrained(plan.build_model(parse_args(args)[0], base.config.vocab_size),
                                               consensus / "adapter")
        ids = torch.arange(8)[None]
        torch.testing.assert_close(peft_model(input_ids=ids).logits, base(input_ids=ids).logits,
                                   rtol=1e-4, atol=1e-4)
    elif name == "dec_adapter":
        model = load_adapters(AutoModelForCausalLM.from_pretrained(consensus), consensus / "adapter")
        mean = np.mean([load_file(out / "clients" / f"client_{c:03d}" / "adapter" / "adapter_model.safetensors")
                        ["model.layers.0.mlp.adapter.up.weight"].numpy() for c in range(N)], 0)
        np.testing.assert_allclose(model.model.layers[0].mlp.adapter.up.weight.detach().numpy(), mean, atol=1e-6)
    else:
        model = AutoModelForCausalLM.from_pretrained(consensus)
        mean = sum(client_params(out, c)["model.layers.1.self_attn.q_proj.weight"] for c in range(N)) / N
        torch.testing.assert_close(model.model.layers[1].self_attn.q_proj.weight.detach(), mean, rtol=0, atol=1e-6)


def check_checkpoint_export(directory: Path, checkpoints: list[Path], rank: int | None) -> None:
    """The exported tensors (the model's and its adapter/'s) against the clients' checkpoints, by
    name: the clients' mean, or with `rank` (DeCAF) each LoRA pair's B·A the rank-`rank` truncation
    of the clients' mean product. Some tensor compared must differ between the clients (of several)."""
    def plain(name: str) -> str:
        return name.removeprefix("base_model.model.").replace(".default.", ".")

    clients = [{plain(k): v.double() for k, v in load_file(path).items()} for path in checkpoints]
    files = [directory / "model.safetensors", *(directory / "adapter").glob("*.safetensors")]
    got = {plain(k): v.double() for f in files for k, v in load_file(f).items()}
    if rank is None:
        compared = set(got) & set(clients[0])
        for k in compared:
            torch.testing.assert_close(got[k], sum(c[k] for c in clients) / len(clients), rtol=0, atol=1e-6, msg=k)
    else:
        compared = {k for k in got if ".lora_A." in k}
        for a in compared:
            b = a.replace(".lora_A.", ".lora_B.")
            U, S, Vh = torch.linalg.svd(sum(c[b] @ c[a] for c in clients) / len(clients))
            torch.testing.assert_close(got[b] @ got[a], U[:, :rank] * S[:rank] @ Vh[:rank], rtol=0, atol=1e-6, msg=a)
    assert compared and (len(clients) == 1 or any(not torch.equal(clients[0][k], c[k])
                                                  for k in compared for c in clients[1:]))


def _decaf_consensus_mid_run(rank: int, init: str, world: int) -> dict:
    """Rank `rank` of a gloo job: a DeCAF client whose factors differ from the other clients',
    evaluated mid-run (consensus_weights). Each pair's B A of its own, inside x̄ and afterwards."""
    import torch.distributed as dist

    from deca_ds.methods import AdamConfig, DeCAF
    from deca_ds.runtime.consensus import consensus_weights
    from helpers import tiny_llama

    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    try:
        method = DeCAF(AdamConfig(steps=1), rank=2, dropout=0.0)
        model = method.prepare(tiny_llama(layers=1, dtype=torch.float32))
        noise = torch.Generator().manual_seed(rank)
        with torch.no_grad():
            for p in method.trainable(model):  # B starts at zero: every client's own factors
                p.add_(torch.randn(p.shape, generator=noise), alpha=0.1)
        optimizer = method.optimizer(model)
        weights, master = [p.detach().clone() for p in model.parameters()], optimizer.master.clone()

        def products() -> list[torch.Tensor]:
            return [(B @ A).detach().clone() for A, B in method.lora_pairs(model)]

        own = products()
        with consensus_weights(model, optimizer):
            inside = products()
        kept = (all(torch.equal(p, w) for p, w in zip(model.parameters(), weights))
                and torch.equal(optimizer.master, master))
        return {"own": own, "inside": inside, "kept": kept}
    finally:
        dist.destroy_process_group()


def test_decaf_is_evaluated_mid_run_as_its_consensus_not_the_mean_of_its_factors(tmp_path):
    """--eval-interval scores DeCAF's x̄ as the run's end forms it, TSVD_r((1/N) Σ_i B_i A_i) per LoRA
    pair (derived here by an SVD of the clients' mean product), and each client's weights and master
    come back bit for bit afterwards."""
    from ranks import run_on_ranks

    world = 2
    got = run_on_ranks(_decaf_consensus_mid_run, world, f"file://{tmp_path / 'store'}", world)
    assert all(g["kept"] for g in got)
    for k in range(len(got[0]["own"])):
        mean = sum(g["own"][k] for g in got).double() / world
        U, S, Vh = torch.linalg.svd(mean, full_matrices=False)
        want = (U[:, :2] * S[:2]) @ Vh[:2]
        assert torch.linalg.matrix_rank(mean) > 2  # so the truncation is not the mean itself
        for g in got:
            torch.testing.assert_close(g["inside"][k].double(), want, rtol=1e-4, atol=1e-5)


def test_a_resumed_lora_run_ends_as_the_uninterrupted_one(tmp_path):
    """A baseline's --resume (Dec-LoRA, dropout on: the masks come from the restored RNG) from its
    checkpoint at step 3 of 6 ends with the uninterrupted run's weights, bit for bit; one rank
    without a launcher."""
    import shutil

    from ranks import start_rank
    from test_runtime import ROOT, unlaunched_env

    # no evaluation mid-run, so no --eval-clients (which acts only at --eval-interval's steps)
    args = [*(a for a in RUN if a != "--eval-clients"), "--method", "dec_lora", "--clients", "1",
            "--eval-interval", "0"]

    def train(out: Path, *extra: str) -> str:
        rank = start_rank([*args, "--output-dir", str(out), *extra], unlaunched_env(), ROOT, out.with_suffix(".out"),
                          out.with_suffix(".err"))
        assert wait_all([rank], timeout=300) == [0], out.with_suffix(".err").read_text()[-3000:]
        return out.with_suffix(".out").read_text()

    train(tmp_path / "whole")
    shutil.copytree(tmp_path / "whole", tmp_path / "resumed")
    shutil.rmtree(tmp_path / "resumed" / "clients")  # the resumed run's own, compared below
    shutil.rmtree(tmp_path / "resumed" / "checkpoints" / "step_00000006")  # as if stopped before the end
    assert "resumed from step 3 of 6" in train(tmp_path / "resumed", "--resume")
    assert json.loads((tmp_path / "whole" / "run_config.json").read_text())["options"]["lora_dropout"] > 0
    whole, resumed = (load_file(tmp_path / d / "clients" / "client_000" / "model.safetensors")
                      for d in ("whole", "resumed"))
    assert whole.keys() == resumed.keys() and all(torch.equal(whole[k], resumed[k]) for k in whole)
