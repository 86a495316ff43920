"""The transport: layout rules and their refusals, the host-staged exchange driven with CPU tensors
(bit-identical to the direct exchange and to W @ X), and a distributed run through the staged
path equal to the simulator."""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist

from deca_ds import make_topology
from deca_ds.mixing import InProcessMixer, mixing_order
from deca_ds.runtime.options import RunOptions
from deca_ds.runtime.rank import free_port, torchrun_env
from deca_ds.runtime.transport import (
    HostStaging,
    RankPlace,
    check_placement,
    env_placement,
    node_places,
    parse_device_map,
    resolve_transport,
)
from helpers import run_script, torch_threads
from test_dist_mixer import SIZE, N, payload, run_ranks

ROOT = Path(__file__).resolve().parents[1]



# ---- layout rules ------------------------------------------------------------------------------

def test_auto_transport_is_nccl_on_gpus_and_gloo_on_cpus():
    assert resolve_transport("auto", True) == "nccl"
    assert resolve_transport("auto", False) == "gloo"
    assert resolve_transport("gloo", True) == "gloo"
    with pytest.raises(ValueError, match="--transport nccl needs GPU ranks"):
        resolve_transport("nccl", False)
    with pytest.raises(ValueError, match="--transport must be one of"):
        resolve_transport("mpi", True)


def test_unknown_transport_and_bad_device_map_are_refused_as_options():
    with pytest.raises(ValueError, match="transport must be one of"):
        RunOptions(transport="tcp")
    with pytest.raises(ValueError, match="--device-map takes 'auto' or GPU indices"):
        RunOptions(device_map="first")
    with pytest.raises(ValueError, match="must be >= 0"):
        RunOptions(device_map="0,-1")


def test_ranks_map_to_gpus_by_local_rank_modulo_the_gpus(monkeypatch):
    # node 1 of a job whose node 0 runs 3 ranks: its 4 ranks are 3 … 6, on 2 GPUs
    places = node_places(1, 3, 4, 2, None)
    assert [(p.node, p.gpu, p.rank) for p in places] == [(1, 0, 3), (1, 1, 4), (1, 0, 5), (1, 1, 6)]
    for var, value in {"WORLD_SIZE": "7", "RANK": "5", "LOCAL_RANK": "2", "LOCAL_WORLD_SIZE": "4",
                       "GROUP_RANK": "1"}.items():
        monkeypatch.setenv(var, value)
    assert env_placement("auto", n_gpus=2) == places  # what a rank of that node reads from torchrun
    assert [p.gpu for p in node_places(0, 0, 4, 1, None)] == [0, 0, 0, 0]
    assert [p.gpu for p in node_places(0, 0, 4, 2, parse_device_map("0,0,1,1"))] == [0, 0, 1, 1]
    assert [p.gpu for p in node_places(0, 0, 2, 0, None)] == [None, None]
    with pytest.raises(ValueError, match="only 2 are visible"):
        node_places(0, 0, 2, 2, [0, 2])
    with pytest.raises(ValueError, match="names 2 GPUs but this node runs local rank 2"):
        node_places(0, 0, 4, 2, [0, 1])


def test_deepspeed_is_given_the_ranks_own_gpu_not_local_rank(monkeypatch):
    """Local rank 3 of four clients on one GPU runs on GPU 0: DeepSpeed, which would select GPU
    LOCAL_RANK, gets the device's index (found on an H200, where ranks 1-3 failed)."""
    import deepspeed

    from deca_ds.runtime.ds_engine import ClientMPU, initialize

    seen = []
    optimizer = object()

    def fake_initialize(args=None, model=None, optimizer=None, config=None, mpu=None):
        seen.append(args)
        return model, optimizer, None, None

    monkeypatch.setenv("LOCAL_RANK", "3")
    monkeypatch.setattr(deepspeed, "initialize", fake_initialize)
    mpu = ClientMPU(None, [3], None)
    initialize(torch.nn.Linear(1, 1), optimizer, {}, mpu, torch.device("cuda", 0))
    initialize(torch.nn.Linear(1, 1), optimizer, {}, mpu, torch.device("cpu"))
    assert seen[0].device_rank == 0 and not hasattr(seen[0], "local_rank")
    assert seen[1] is None  # CPU ranks: DeepSpeed's own choice


def engine_on_a_cpu_rank(rank: int, port: int, extensions: str) -> dict:
    """A real DeepSpeed engine set up as a CPU rank's (ds_engine.initialize, in a gloo job of one):
    what DeepSpeed's communication backend loaded, and what it built into `extensions`."""
    import deepspeed.comm.comm as ds_comm

    from deca_ds.runtime.ds_engine import ClientMPU, initialize
    from ranks import gloo_group

    os.environ.update(TORCH_EXTENSIONS_DIR=extensions, LOCAL_RANK="0")
    with gloo_group(rank, port, 1):
        model = torch.nn.Linear(2, 2)
        group = dist.new_group([0])
        initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), {"train_micro_batch_size_per_gpu": 1},
                   ClientMPU(group, [0], group), torch.device("cpu"))
        return {"shm_comm_op": ds_comm.cdb.shm_comm_op is not None, "built": sorted(os.listdir(extensions))}


def test_deepspeed_builds_and_maps_nothing_of_its_own_on_cpu_ranks(tmp_path):
    """DeepSpeed's CPU backend would build its shared-memory all-reduce op at a machine's first run
    (some 40 s, with a compiler) and map 66 MB of /dev/shm per rank, for an inference all-reduce
    deca-ds never calls. The engine is set up without it: nothing is built or loaded."""
    from ranks import run_on_ranks

    extensions = tmp_path / "torch_extensions"
    extensions.mkdir()
    [seen] = run_on_ranks(engine_on_a_cpu_rank, 1, free_port(), str(extensions))
    assert seen == {"shm_comm_op": False, "built": []}


def test_the_engine_clears_gradients_through_the_optimizer(monkeypatch):
    """DeepSpeed's step ends with engine.zero_grad(), a walk over every module's parameters; the
    engine calls the optimizer's instead, which clears every gradient a step can have made."""
    import deepspeed

    from deca_ds.runtime.ds_engine import ClientMPU, initialize

    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 2))
    model[0].requires_grad_(False)  # a frozen layer: never a gradient
    optimizer = torch.optim.SGD(model[1].parameters(), lr=0.1)
    monkeypatch.setattr(deepspeed, "initialize", lambda args=None, model=None, optimizer=None, config=None,
                        mpu=None: (deepspeed.DeepSpeedEngine.__new__(deepspeed.DeepSpeedEngine), optimizer, None, None))
    engine = initialize(model, optimizer, {}, ClientMPU(None, [0], None), torch.device("cpu"))
    model(torch.ones(1, 2)).sum().backward()
    params = list(model.parameters())
    assert [p.grad is None for p in params] == [True, True, False, False]
    with monkeypatch.context() as walk:
        walk.setattr(torch.nn.Module, "named_parameters", lambda *a, **k: pytest.fail("walked the modules"))
        engine.zero_grad()
    assert [p.grad for p in params] == [None] * 4


def test_clients_sharing_a_gpu_need_gloo_and_are_counted():
    places = node_places(0, 0, 8, 1, None)  # 8 clients on one GPU
    with pytest.raises(ValueError, match="8 ranks share GPU 0 of node 0, which NCCL refuses; run them with "
                                         "--transport gloo"):
        check_placement(places, 1, "nccl")
    assert check_placement(places, 1, "gloo") == {0: 8}
    assert check_placement(node_places(1, 2, 2, 2, None), 1, "nccl") == {0: 1, 1: 1}  # a GPU each: NCCL is fine
    assert check_placement(node_places(0, 0, 4, 0, None), 2, "gloo") == {}


def test_two_ranks_of_one_client_on_one_gpu_are_refused_whatever_the_transport():
    # G = 2 on one node with 2 GPUs and 4 ranks, mapped 0,0,1,1: client 0 is ranks 0 and 1, both on GPU 0
    places = node_places(0, 0, 4, 2, [0, 0, 1, 1])
    for transport in ("gloo", "nccl"):
        with pytest.raises(ValueError, match="client 0 would have 2 of its 2 ranks on GPU 0 of node 0"):
            check_placement(places, 2, transport)
    # the same on a node whose first rank is 4: its clients are 2 and 3
    with pytest.raises(ValueError, match="client 2 would have 2 of its 2 ranks on GPU 0 of node 1"):
        check_placement(node_places(1, 4, 4, 2, [0, 0, 1, 1]), 2, "gloo")
    # by modulo instead, each client's two ranks are on GPUs 0 and 1, and two clients share each GPU
    assert check_placement(node_places(0, 0, 4, 2, None), 2, "gloo") == {0: 2, 1: 2}
    # a client whose ranks straddle two nodes: the same GPU index on two nodes is two GPUs
    assert check_placement([RankPlace(0, 0, 2), RankPlace(1, 0, 3)], 2, "nccl") == {0: 1}


# ---- the staged exchange on CPU ranks ----------------------------------------------------------

@pytest.mark.parametrize("chunk", [5, 2**25])
def test_staged_mix_equals_the_direct_exchange_bit_for_bit(chunk):
    """Chunks of 5 of a 23-element block: 5 chunks, the last one short, so both send slots and the
    receive buffers' resizing are exercised."""
    W = make_topology("ring", N).W
    got = run_ranks(W, chunk, staged=True)
    xs = [payload(i) for i in range(N)]
    want = [view.mix(x) for view, x in zip(InProcessMixer(W).views(xs), xs)]
    X = np.stack([x.double().numpy() for x in xs])
    for i, r in enumerate(got):
        assert torch.equal(r["x_plus"], want[i]), f"client {i}"
        assert r["in_place"]
        assert r["bytes"] == 2 * 2 * SIZE * 4  # ring: 2 neighbors, mix + exchange
        order = mixing_order(W, i)
        assert [w for w, _ in r["terms"]] == [float(W[i, j]) for j in order]
        assert all(torch.equal(t, xs[j]) for (_, t), j in zip(r["terms"], order))  # own + 2 neighbors, in order
    np.testing.assert_allclose(np.stack([r["x_plus"].double().numpy() for r in got]), W @ X, rtol=1e-6, atol=1e-6)


def test_host_staging_alternates_send_slots_and_reuses_buffers():
    staging = HostStaging(torch.device("cpu"))
    a, b, c = (torch.full((7,), float(v)) for v in (1, 2, 3))
    ha, _ = staging.stage_out(a)
    hb, _ = staging.stage_out(b)
    assert ha.data_ptr() != hb.data_ptr() and ha.data_ptr() != a.data_ptr()
    assert torch.equal(ha, a) and torch.equal(hb, b), "slot k+1 must not overwrite slot k"
    hc, _ = staging.stage_out(c[:5])  # a shorter last chunk reuses slot 0's buffer
    assert hc.data_ptr() == ha.data_ptr() and torch.equal(hc, c[:5])
    recv = staging.recv_buffers(hc, [1, 3])
    recv[1].fill_(4.0)
    recv[3].fill_(5.0)
    device = {j: torch.empty(5) for j in (1, 3)}
    staging.stage_in(recv, device)
    assert torch.equal(device[1], torch.full((5,), 4.0)) and torch.equal(device[3], torch.full((5,), 5.0))


# ---- a whole run through the staged path -------------------------------------------------------

def test_distributed_run_through_host_staging_equals_simulator(tmp_path, monkeypatch):
    """4 CPU ranks with DECA_STAGE_ON_CPU=1 (every block goes out and back through separate host
    buffers, as gloo on GPU ranks does) against the simulator at the ranks' thread count."""
    import deca_ds
    from deca_ds.data import ClientStream
    from deca_ds.runtime import plan
    from deca_ds.runtime.parsing import parse_args
    from ranks import wait_all
    from test_runtime import PRESET, client_params, start_ranks

    run = ["--ds_config", PRESET, "--topology", "ring", "--layers-per-block", "2", "--steps-per-block", "3",
           "--rounds", "1", "--micro-batch", "4", "--lr", "1e-3", "--max-seq-len", "32", "--eval-limit", "16",
           "--save-clients", "--timeout", "60", "--transport", "gloo"]
    out = tmp_path / "staged"
    monkeypatch.setenv("DECA_STAGE_ON_CPU", "1")
    codes = wait_all(start_ranks([*run, "--output-dir", str(out)], N, tmp_path / "logs"), timeout=600)
    assert codes == [0] * N, (tmp_path / "logs" / "rank0.err").read_text()[-3000:]
    config = json.loads((out / "run_config.json").read_text())
    assert config["host_staging"] is True and config["transport"] == "gloo" and config["clients_per_gpu"] == {}

    opts, _ = parse_args([*run, "--output-dir", "unused"])
    task = plan.build_task(opts, N)
    model = plan.build_model(opts, len(task.tokenizer))
    streams = [ClientStream(task.features, task.client_indices[c], opts.micro_batch,
                            pad_id=task.tokenizer.pad_token_id, seed=opts.seed, client=c) for c in range(N)]
    with torch_threads():  # the ranks' count (start_ranks sets DECA_RANK_THREADS)
        simulated = deca_ds.simulate(model, streams, make_topology("ring", N).W, opts.deca_config())
    init = dict(model.named_parameters())
    for c in range(N):
        got = client_params(out, c)
        for name, want in simulated[c].items():
            torch.testing.assert_close(got[name], want, rtol=0, atol=1e-6)
        assert max((w - init[n]).abs().max().item() for n, w in simulated[c].items()) > 1e-4, "vacuous"


# ---- several clients per GPU: memory -----------------------------------------------------------

def test_clients_sharing_a_gpu_each_need_their_peak_and_reserve():
    from deca_ds.memory import GPUS, GiB, Workload, estimate_memory

    est = estimate_memory(ROOT / "profiling" / "configs" / "qwen2-1.5b.json", 2,
                          Workload(micro_batch=4, seq_len=512, checkpointing=True, n_neighbors=2))
    for k in (1, 3, 8):
        assert est.headroom("H100 80GB", GiB, clients=k) == GPUS["H100 80GB"] - k * (GiB + est.peak)
    assert est.fits(GPUS["H100 80GB"], GiB, clients=1) and not est.fits(8 * (est.peak + GiB) - 1, GiB, clients=8)
    with pytest.raises(ValueError, match="clients per GPU must be >= 1"):
        est.headroom("H100 80GB", clients=0)


def test_the_one_gpu_preset_fits_eight_clients_on_an_h100_and_the_estimator_says_so(tmp_path):
    from dataclasses import asdict

    from deca_ds.memory import GiB
    from deca_ds.runtime.footprint import estimate_run
    from deca_ds.runtime.parsing import parse_args
    opts, ds = parse_args(["--ds_config", str(ROOT / "ds_configs" / "one_gpu_8x_qwen2-1.5b.json")])
    assert opts.transport == "gloo" and opts.topology == "ring"
    est = estimate_run(asdict(opts), ROOT / "profiling" / "configs" / "qwen2-1.5b.json", ds, n_neighbors=2,
                       loss_positions=opts.max_seq_len)
    assert est.fits("H100 80GB", GiB, clients=8) and est.fits("RTX PRO 6000", GiB, clients=8)
    assert not est.fits("RTX 5090", GiB, clients=8)
    assert run_script(ROOT / "profiling" / "estimate.py", "--config",
                      str(ROOT / "profiling" / "configs" / "qwen2-1.5b.json"), "--layers-per-block", "2",
                      "--offload", "none", "--micro-batch", "4", "--clients-per-gpu", "8", "--out", str(tmp_path)) == 0
    row = json.loads((tmp_path / "estimate.json").read_text())["rows"][0]
    assert row["clients_per_gpu"] == 8 and row["peak"] == est.peak
    assert row["headroom H100 80GB"] == est.headroom("H100 80GB", GiB, clients=8)


# ---- multi-node without a shared file system ---------------------------------------------------

SITE_RANKS = (1, 3)  # ranks (clients) of each site: sites need not run as many


def start_nodes(args: list[str], sites: list[Path], logs: Path) -> list:
    """The sites as "nodes" on this machine, as torchrun --nnodes numbers their ranks, each node
    running in its own site folder and writing to its own output directory there."""
    from ranks import start_rank

    logs.mkdir(parents=True, exist_ok=True)
    port, world, procs = str(free_port()), sum(SITE_RANKS), []
    for node, (site, size) in enumerate(zip(sites, SITE_RANKS)):
        for local in range(size):
            rank = sum(SITE_RANKS[:node]) + local
            env = {**os.environ, **torchrun_env(rank, world, port), "LOCAL_RANK": str(local),
                   "LOCAL_WORLD_SIZE": str(size), "GROUP_RANK": str(node)}
            procs.append(start_rank([*args, "--output-dir", "run"], env, site,
                                    logs / f"rank{rank}.out", logs / f"rank{rank}.err"))
    return procs


def test_two_sites_that_share_no_files_train_summarize_and_resume(tmp_path, monkeypatch):
    """Two sites of 1 and 3 clients, no shared file system, each holding only its own clients'
    data files: every client trains on its own file, the run's record has every client's counts,
    the summary and --resume need nothing from the other site."""
    from safetensors.torch import load_file

    from helpers import SITE_LABELS, client_rows, write_site
    from ranks import wait_all
    from test_runtime import PRESET

    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf_home"))  # the datasets cache of the data files
    sizes = {0: 6, 1: 9, 2: 7, 3: 8}
    site_of = [k for k, n in enumerate(SITE_RANKS) for _ in range(n)]  # each client's site
    sites = [write_site(tmp_path / f"site_{name}", [c for c in range(4) if site_of[c] == k], sizes)
             for k, name in enumerate("ab")]
    run = ["--ds_config", PRESET, "--model", "model", "--dataset", "files",
           "--data-files", "train=data/client_{client}.jsonl", "test=data/test.jsonl",
           "--topology", "ring", "--layers-per-block", "2", "--steps-per-block", "3",
           "--rounds", "1", "--micro-batch", "4", "--lr", "1e-3", "--max-seq-len", "32", "--eval-limit", "16",
           "--save-clients", "--timeout", "60", "--checkpoint-interval", "2", "--keep-checkpoints", "2"]
    outs = [site / "run" for site in sites]
    codes = wait_all(start_nodes(run, sites, tmp_path / "logs"), timeout=600)
    assert codes == [0] * 4, (tmp_path / "logs" / "rank0.err").read_text()[-3000:]
    counts = [np.bincount([SITE_LABELS.index(r["label"]) for r in client_rows(c, sizes[c])], minlength=4).tolist()
              for c in range(4)]
    for out in outs:  # each site's record of the run: every client's counts, no example indices
        config = json.loads((out / "run_config.json").read_text())
        assert config["client_sizes"] == [sizes[c] for c in range(4)] and config["split_histogram"] == counts
        assert config["split_keys"] == list(SITE_LABELS) and config["loss_positions_max"] == 4 * 2
        assert len(set(config["data_fingerprints"])) == 4 and None not in config["data_fingerprints"]
        report = json.loads((out / "partition" / "partition.json").read_text())
        assert report["sizes"] == config["client_sizes"] and "partition" not in report
    summary = json.loads((outs[0] / "summary.json").read_text())
    assert len(summary["clients"]) == 4 and len(summary["final_consensus_distance"]) == 4
    assert summary["transport"] == "gloo" and summary["host_staging"] is False and summary["clients_per_gpu"] == {}
    losses = [json.loads(line)["loss"] for line in (outs[1] / "metrics" / "client_003.jsonl").read_text().splitlines()]
    assert len(losses) == 6  # node b's records reached rank 0 over the process group:
    assert summary["clients"][3]["loss_end"] == losses[-1]  # a run this short: its last step
    assert not (outs[1] / "summary.json").exists() and not (outs[1] / "consensus").exists()
    for node, out in enumerate(outs):
        mine = [f"client_{c:03d}" for c in range(4) if site_of[c] == node]
        assert (out / "run_config.json").is_file()
        assert sorted(p.stem for p in (out / "metrics").glob("*.jsonl")) == mine
        assert sorted(p.name for p in (out / "clients").iterdir()) == mine
        checkpoints = sorted(p.name for p in (out / "checkpoints").iterdir())
        assert checkpoints == ["step_00000004", "step_00000006"], "--keep-checkpoints 2 prunes on every node"
        assert sorted(p.name for p in (out / "checkpoints" / checkpoints[-1]).iterdir()) == mine
        shutil.rmtree(out / "checkpoints" / checkpoints[-1])  # the last step's: as if stopped before the end
    first = {c: load_file(outs[site_of[c]] / "clients" / f"client_{c:03d}" / "model.safetensors") for c in range(4)}

    codes = wait_all(start_nodes([*run, "--resume"], sites, tmp_path / "logs_resume"), timeout=600)
    assert codes == [0] * 4, (tmp_path / "logs_resume" / "rank0.err").read_text()[-3000:]
    assert "resumed from step 4" in (tmp_path / "logs_resume" / "rank0.out").read_text()
    for c in range(4):
        again = load_file(outs[site_of[c]] / "clients" / f"client_{c:03d}" / "model.safetensors")
        assert all(torch.equal(again[k], v) for k, v in first[c].items()), f"client {c} after resume"
    resumed = json.loads((outs[0] / "summary.json").read_text())
    assert [c["loss_end"] for c in resumed["clients"]] == [c["loss_end"] for c in summary["clients"]]

    # requeued with node b on a machine without its files: --auto-resume must not start the run over on
    # node a (its checkpoints replaced); every rank refuses, naming node b's clients and host
    shutil.move(outs[1], sites[1] / "elsewhere")
    before = {p: p.read_bytes() for p in outs[0].rglob("*") if p.is_file()}
    codes = wait_all(start_nodes([*run, "--auto-resume"], sites, tmp_path / "logs_requeued"), timeout=600)
    assert codes == [1] * 4, codes
    err = (tmp_path / "logs_requeued" / "rank0.err").read_text()
    host = re.escape(socket.gethostname())
    assert re.search(rf"--auto-resume: some nodes hold the run in run, but not those of client 1 \({host}\), "
                     rf"client 2 \({host}\), client 3 \({host}\): give those nodes its files", err), err[-3000:]
    assert {p: p.read_bytes() for p in outs[0].rglob("*") if p.is_file()} == before


# ---- bad input, before anything is written ------------------------------------------------------

def test_nccl_without_gpus_is_refused_before_anything_is_written(tmp_path, monkeypatch):
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    from deca_ds.runtime import trainer
    from deca_ds.runtime.parsing import parse_args
    from test_runtime import PRESET

    monkeypatch.setenv("WORLD_SIZE", "2")
    out = tmp_path / "run"
    opts, ds = parse_args(["--ds_config", PRESET, "--transport", "nccl", "--output-dir", str(out)])
    with pytest.raises(ValueError, match="--transport nccl needs GPU ranks"):
        trainer.train(opts, ds)
    assert not out.exists()


def test_a_rendezvous_port_that_cannot_be_bound_is_named(monkeypatch):
    import socket

    from deca_ds.runtime.rank import init_process_group

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        for var, value in {"RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1",
                           "MASTER_PORT": str(taken.getsockname()[1])}.items():
            monkeypatch.setenv(var, value)
        monkeypatch.delenv("TORCHELASTIC_USE_AGENT_STORE", raising=False)
        with pytest.raises(ValueError, match=f"cannot bind the rendezvous port 127.0.0.1:{taken.getsockname()[1]}"):
            init_process_group(5.0, "gloo")
    assert not dist.is_initialized()


def test_sites_with_other_options_stop_on_every_rank_before_anything_is_written(tmp_path):
    """Two sites, one with another learning rate: both ranks name the option with both values and
    exit before writing (their output directories do not exist)."""
    from ranks import start_rank, wait_all
    from test_runtime import PRESET

    port, procs = str(free_port()), []
    for rank, lr in enumerate(("1e-3", "2e-3")):
        env = {**os.environ, **torchrun_env(rank, 2, port, 1)}
        procs.append(start_rank(["--ds_config", PRESET, "--lr", lr, "--timeout", "60",
                                 "--output-dir", str(tmp_path / f"site_{rank}")], env, ROOT,
                                tmp_path / f"rank{rank}.out", tmp_path / f"rank{rank}.err"))
    assert wait_all(procs, timeout=300) == [1, 1]
    for rank in range(2):
        err = (tmp_path / f"rank{rank}.err").read_text()
        assert "client 1 runs with other options than client 0: lr: 0.001 at client 0, 0.002 at client 1." in err
        assert not (tmp_path / f"site_{rank}").exists()
