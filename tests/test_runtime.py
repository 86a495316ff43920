"""The distributed runtime on CPU ranks (gloo): equality with the simulator, exact resume after a
SIGKILL, failure of a dead or hung peer, export, and the input errors.

Ranks are started the way `deepspeed`/`torchrun` start them (RANK, WORLD_SIZE, MASTER_ADDR, …);
the reference run goes through the real `deepspeed` launcher.
"""

from __future__ import annotations

import dataclasses
import gzip
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import torch.distributed as dist
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

import deca_ds
from deca_ds.memory import ModelSpec, Workload, estimate_block, offload_block_stream
from deca_ds.models import tiny_config, tiny_llama
from deca_ds.reporting import commit
from deca_ds.runtime import plan, trainer
from deca_ds.runtime.dist import ClientLayout, Heartbeat
from deca_ds.runtime.parsing import parse_args
from deca_ds.runtime.rank import LAUNCH_VARS, cap_gpu_memory, free_port, init_process_group, torchrun_env
from deca_ds.train import main as train_main
from helpers import RANK_THREADS, assert_only_run_outputs, run_script, torch_threads
from ranks import Rank, start_rank, wait_all

ROOT = Path(__file__).resolve().parents[1]
LAUNCH = str(ROOT / "launch" / "train.py")
PRESET = str(ROOT / "ds_configs" / "cpu_demo.json")
N = 4
# 2 rounds × 2 blocks × 5 steps; checkpoints every 3 steps land mid-block (3, 6, 9, …).
RUN = ["--ds_config", PRESET, "--topology", "ring", "--layers-per-block", "2", "--steps-per-block", "5",
       "--rounds", "2", "--micro-batch", "4", "--lr", "1e-3", "--max-seq-len", "32", "--eval-limit", "64",
       "--consensus-interval", "2", "--checkpoint-interval", "3", "--save-clients", "--timeout", "60",
       "--eval-interval", "7", "--eval-clients"]  # x̄ is swapped in and out mid-run: results must not change
# RUN as a run file, its DeepSpeed keys inline; YAML 1.1 reads 1e-3 (no dot) as a string
RUN_FILE = """\
deepspeed: {train_micro_batch_size_per_gpu: 4, steps_per_print: 1000000000, wall_clock_breakdown: false,
            zero_optimization: {stage: 0}}
topology: ring
layers_per_block: 2
steps_per_block: 5
rounds: 2
lr: 1e-3
bma_betas: [0.9, 0.999]
max_seq_len: 32
eval_limit: 64
consensus_interval: 2
checkpoint_interval: 3
save_clients: true
timeout: 60
eval_interval: 7
eval_clients: true
"""


def start_ranks(args: list[str], world: int, logs: Path) -> list[Rank]:
    """`world` ranks of launch/train.py on this machine, numbered as torchrun numbers them."""
    logs.mkdir(parents=True, exist_ok=True)
    port = str(free_port())
    procs = []
    for rank in range(world):
        env = {**os.environ, **torchrun_env(rank, world, port), "DECA_RANK_THREADS": str(RANK_THREADS)}
        procs.append(start_rank(args, env, ROOT, logs / f"rank{rank}.out", logs / f"rank{rank}.err"))
    return procs


def last_step(out: Path, client: int = 0) -> int:
    path = out / "metrics" / f"client_{client:03d}.jsonl"
    lines = path.read_text().splitlines() if path.exists() else []
    return json.loads(lines[-1])["step"] if lines else -1


def client_params(out: Path, client: int) -> dict[str, torch.Tensor]:
    return load_file(out / "clients" / f"client_{client:03d}" / "model.safetensors")


@pytest.fixture(scope="module")
def reference_run(tmp_path_factory):
    """The uninterrupted run, through the real deepspeed launcher as a user starts it from any
    directory: `deepspeed --module deca_ds.train --config run.yaml`."""
    out = tmp_path_factory.mktemp("reference")
    run_file = out.parent / f"{out.name}.yaml"
    run_file.write_text(RUN_FILE)
    cmd = [sys.executable, "-m", "deepspeed.launcher.runner", "--num_gpus", str(N), "--master_port", str(free_port()),
           "--module", "deca_ds.train", "--config", str(run_file), "--output-dir", str(out)]
    done = subprocess.run(cmd, cwd=out.parent, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "DECA_RANK_THREADS": str(RANK_THREADS)})
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return out, done.stdout


def test_reference_run_file_is_the_command_line_and_is_written_back(reference_run):
    """The run file resolves to RUN (so the comparisons below, built from RUN, are the run's); its
    lr, a string to YAML, is the declared float; the run writes its resolved config as a run file."""
    out, _ = reference_run
    given = ["--config", str(out.parent / f"{out.name}.yaml"), "--output-dir", str(out)]
    assert parse_args(given) == parse_args([*RUN, "--output-dir", str(out)])
    run = json.loads((out / "run_config.json").read_text())
    assert run["options"]["lr"] == 1e-3 and run["ds_config"]["train_micro_batch_size_per_gpu"] == 4
    assert run["n_clients"] == N
    assert run["commit"] == commit() != "unknown"  # the checkout's (the tests run in one)
    assert run["cpu_kernels"] == torch.backends.cpu.get_cpu_capability()
    assert run["attn_implementation"] == "eager"  # the tiny Llama's; deca-eval --run loads the export with it
    assert parse_args(["--config", str(out / "config.yaml")]) == parse_args(given)


def test_distributed_run_equals_simulator(reference_run):
    out, _ = reference_run
    opts, _ = parse_args([*RUN, "--output-dir", "unused"])
    task = plan.build_task(opts, N)
    model = plan.build_model(opts, len(task.tokenizer))
    streams = [task.stream(opts, c) for c in range(N)]  # the trainer's own
    W = deca_ds.make_topology("ring", N).W
    with torch_threads():  # the ranks' count (DECA_RANK_THREADS)
        simulated = deca_ds.simulate(model, streams, W, opts.deca_config())
    init = dict(model.named_parameters())
    for c in range(N):
        got = client_params(out, c)
        moved = 0.0
        for name, want in simulated[c].items():
            torch.testing.assert_close(got[name], want, rtol=0, atol=1e-6)
            moved = max(moved, (want - init[name]).abs().max().item())
        assert moved > 1e-3, "training did not move the weights; the comparison would be vacuous"


def unlaunched_env() -> dict[str, str]:
    """This process's environment without a launcher's variables: a rank started so is a job of one."""
    launcher = (*LAUNCH_VARS, "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK")
    return {**{k: v for k, v in os.environ.items() if k not in launcher}, "DECA_RANK_THREADS": str(RANK_THREADS)}


def test_without_a_launcher_one_rank_trains_one_client_as_the_simulator_does(tmp_path):
    """`deca-train` started alone, none of a launcher's variables set: a job of one rank, its
    rendezvous store in memory (no port), training one client as the simulator does on a graph of one,
    with the weight decay --weight-decay gives and the preset's gradient_clipping (DeepSpeed's) as the
    simulator's grad_clip (the gradients' norms are 4-12 here: every step clips), in bf16 working
    weights, to the bit: both scale the bf16 gradient in place by the same fp32 factor. Either left
    out of the simulator, it ends about 5e-3 away; its factor computed in double precision (as
    clip_scale did), 1.1e-4 away: the run is that sensitive to the factor's last bit."""
    out = tmp_path / "run"
    preset = tmp_path / "clipped.json"
    preset.write_text(json.dumps({**json.loads(Path(PRESET).read_text()), "gradient_clipping": 1.0}))
    args = ["--ds_config", str(preset), "--layers-per-block", "2", "--steps-per-block", "3", "--rounds", "1",
            "--micro-batch", "4", "--lr", "1e-3", "--weight-decay", "0.1", "--max-seq-len", "32", "--eval-limit", "16",
            "--working-dtype", "bf16", "--save-clients", "--output-dir", str(out)]
    rank = start_rank(args, unlaunched_env(), ROOT, tmp_path / "out", tmp_path / "err")
    assert wait_all([rank], timeout=300) == [0], (tmp_path / "err").read_text()[-3000:]
    assert json.loads((out / "run_config.json").read_text())["n_clients"] == 1
    opts, _ = parse_args([*args[:-2], "--output-dir", "unused"])
    task = plan.build_task(opts, 1)
    model = plan.build_model(opts, len(task.tokenizer))
    config = dataclasses.replace(opts.deca_config(), grad_clip=1.0)
    with torch_threads():
        simulated = deca_ds.simulate(model, [task.stream(opts, 0)], np.ones((1, 1)), config)
    got, init = client_params(out, 0), dict(model.named_parameters())
    for name, want in simulated[0].items():
        assert torch.equal(got[name], want), name
    assert any((want - init[name]).abs().max() > 1e-3 for name, want in simulated[0].items())


def test_embeddings_final_norm_and_lm_head_train_as_blocks_of_their_own_offloaded_as_simulated(tmp_path, monkeypatch):
    """--train-embeddings --train-final-norm --train-lm-head: five blocks (the embeddings, two of
    layers, the final norm, the LM head), trained with the frozen layers streamed for real on a CPU
    rank (FrozenPrefix before the norm's and the head's blocks), end where the simulator does, bit
    for bit, each of the three having moved."""
    monkeypatch.setenv("DECA_OFFLOAD_ON_CPU", "1")
    out = tmp_path / "run"
    args = ["--ds_config", PRESET, "--layers-per-block", "2", "--steps-per-block", "2", "--rounds", "1",
            "--micro-batch", "4", "--lr", "1e-3", "--max-seq-len", "32", "--eval-limit", "16", "--offload", "frozen",
            "--train-embeddings", "--train-final-norm", "--train-lm-head", "--save-clients", "--output-dir", str(out)]
    rank = start_rank(args, unlaunched_env(), ROOT, tmp_path / "out", tmp_path / "err")
    assert wait_all([rank], timeout=300) == [0], (tmp_path / "err").read_text()[-3000:]
    blocks = json.loads((out / "run_config.json").read_text())["blocks"]
    assert [b["name"] for b in blocks] == ["embeddings", "layers[0:2]", "layers[2:4]", "final_norm", "lm_head"]
    opts, _ = parse_args([*args[:-2], "--output-dir", "unused"])
    task = plan.build_task(opts, 1)
    model = plan.build_model(opts, len(task.tokenizer))
    # what each block streamed (the norm's and the head's: every layer once, FrozenPrefix) is the estimator's
    # count; the embeddings' block's also has the layers the evaluation before training left on the device
    rows = [json.loads(line) for line in (out / "metrics" / "client_000.jsonl").read_text().splitlines()]
    spec = ModelSpec.from_config(model.config)
    for k in range(1, 5):
        est = estimate_block(spec, 2, k, Workload(working_dtype="fp32"), offload="frozen", steps_per_block=2,
                             **opts.trains())
        assert sum(r["bytes_streamed"] for r in rows[2 * k:2 * k + 2]) == est.offload_stream_block, k
    with torch_threads():
        simulated = deca_ds.simulate(model, [task.stream(opts, 0)], np.ones((1, 1)), opts.deca_config())
    got, init = client_params(out, 0), dict(model.named_parameters())
    for name, want in simulated[0].items():
        assert torch.equal(got[name], want), name
    for name in ("model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"):
        assert not torch.equal(got[name], init[name]), name


def test_a_resumed_run_goes_on_along_its_presets_lr_schedule(tmp_path):
    """A preset's `scheduler` (torch's cosine annealing, which computes each step's lr from the one
    before; every step's lr differs): the run resumed from its checkpoint at step 2 of 6 ends with
    the bits of the run that went through. Before, the schedule started over at the resume, and a
    torch schedule was given a DeepSpeed schedule's state, which it kept beside its own. Each step's
    record has the lr it used: the closed form's after that many steps, the same after the resume."""
    preset = write_preset(tmp_path, scheduler={"type": "CosineAnnealingLR", "params": {"T_max": 7}})
    args = ["--ds_config", preset, "--layers-per-block", "2", "--steps-per-block", "3", "--rounds", "1",
            "--micro-batch", "4", "--lr", "1e-3", "--max-seq-len", "32", "--eval-limit", "16",
            "--consensus-interval", "0", "--checkpoint-interval", "2", "--keep-checkpoints", "3"]
    whole, resumed = tmp_path / "whole", tmp_path / "resumed"

    def run(out: Path, *extra: str) -> str:
        rank = start_rank([*args, "--output-dir", str(out), *extra], unlaunched_env(), ROOT, out.with_suffix(".out"),
                          out.with_suffix(".err"))
        assert wait_all([rank], timeout=300) == [0], out.with_suffix(".err").read_text()[-3000:]
        return out.with_suffix(".out").read_text()

    run(whole)
    shutil.copytree(whole, resumed)
    for step in (4, 6):  # as if stopped after its checkpoint at step 2
        shutil.rmtree(resumed / "checkpoints" / f"step_{step:08d}")
    assert "resumed from step 2 of 6" in run(resumed, "--resume")
    got, want = (load_file(out / "consensus" / "model.safetensors") for out in (resumed, whole))
    assert got.keys() == want.keys() and all(torch.equal(got[name], want[name]) for name in want)
    lrs = [[json.loads(line)["lr"] for line in (out / "metrics" / "client_000.jsonl").read_text().splitlines()]
           for out in (whole, resumed)]
    assert lrs[0] == pytest.approx([1e-3 * (1 + math.cos(math.pi * t / 7)) / 2 for t in range(6)], rel=1e-12, abs=0)
    assert lrs[1] == lrs[0]


@pytest.mark.parametrize("spec", [
    {"type": "WarmupLR", "params": {"warmup_num_steps": 10, "warmup_type": "linear"}},
    {"type": "CosineAnnealingLR", "params": {"T_max": 7}}], ids=["deepspeed", "torch"])
def test_a_schedule_stepped_to_a_checkpoint_goes_on_as_one_that_went_through(spec):
    """lr_schedule.go_to: a new schedule stepped 4 times, then given the optimizer's saved lr (as a
    checkpoint's state loads it), takes the next 3 steps' lr of a schedule stepped 7 times, to the bit."""
    from deca_ds.runtime import lr_schedule

    def lrs(optimizer, schedule, steps: int) -> list[float]:
        seen = []
        for _ in range(steps):
            optimizer.step()
            schedule.step()
            seen.append(optimizer.param_groups[0]["lr"])
        return seen

    def sgd():
        return torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)

    optimizer = sgd()
    whole = lrs(optimizer, lr_schedule.build(optimizer, spec), 7)
    assert len(set(whole)) == 7
    optimizer = sgd()
    schedule = lr_schedule.build(optimizer, spec)
    lr_schedule.go_to(schedule, 4)
    optimizer.param_groups[0]["lr"] = whole[3]
    assert lrs(optimizer, schedule, 3) == whole[4:]


def test_a_launch_with_some_of_its_variables_is_refused(monkeypatch):
    for var in LAUNCH_VARS[1:]:
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("RANK", "0")
    with pytest.raises(ValueError, match="WORLD_SIZE, MASTER_ADDR, MASTER_PORT not set, but RANK set"):
        init_process_group(5.0, "gloo")
    assert not dist.is_initialized()


def test_export_is_the_mean_of_clients_and_loads_with_transformers(reference_run):
    out, stdout = reference_run
    consensus = AutoModelForCausalLM.from_pretrained(out / "consensus")
    clients = [client_params(out, c) for c in range(N)]
    for name, p in consensus.named_parameters():
        mean = sum(c[name] for c in clients) / N
        torch.testing.assert_close(p.detach(), mean, rtol=0, atol=1e-6)
    assert not torch.equal(clients[0]["model.layers.0.mlp.up_proj.weight"],
                           clients[1]["model.layers.0.mlp.up_proj.weight"])
    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps"] == 20 and len(summary["clients"]) == N
    # ring: 2 neighbors × block numel × 4 bytes, every step
    run = json.loads((out / "run_config.json").read_text())
    sizes = [b["numel"] for b in run["blocks"]]
    assert summary["clients"][0]["bytes_sent"] == 2 * 4 * 5 * 2 * sum(sizes)
    assert (out / "loss_curve.png").stat().st_size > 10_000
    for c in range(N):
        rows = [json.loads(line) for line in (out / "metrics" / f"client_{c:03d}.jsonl").read_text().splitlines()]
        assert [r["step"] for r in rows] == list(range(20))
        assert {"loss", "t_forward", "t_backward", "t_mix_update", "bytes_sent"} <= set(rows[0])
        assert sum("consensus_distance" in r for r in rows) == 10
        evaluated = [r for r in rows if "eval_consensus_accuracy" in r]
        assert [r["step"] for r in evaluated] == [6, 13]
        assert all(r["eval_consensus_n"] == 64 and "eval_client_accuracy" in r for r in evaluated)
    assert "consensus model: accuracy" in stdout and "bytes sent" in stdout
    # in a file, progress is a line after the first step and each block (runtime/progress.py), not a bar
    losses = [json.loads(line)["loss"] for line in (out / "metrics" / "client_000.jsonl").read_text().splitlines()]
    progress = [line for line in stdout.splitlines() if line.startswith("deca: step ")]
    assert [line.split(",")[0] for line in progress] == [f"deca: step {n}/20 ({5 * n}%)" for n in (1, 5, 10, 15, 20)]
    assert [f"loss {losses[n - 1]:.4f}," in line for n, line in zip((1, 5, 10, 15, 20), progress)] == [True] * 5
    assert "\r" not in stdout
    before = summary["initial_eval"]  # what the run printed before its first step, kept in client 0's metrics
    assert before["n"] == 64 and f"accuracy before training: {before['accuracy']:.3f}" in stdout
    first = json.loads((out / "metrics" / "client_000.jsonl").read_text().splitlines()[0])
    assert {k: v for k, v in first.items() if k.startswith("eval_initial_")} == {
        f"eval_initial_{k}": v for k, v in before.items()}


def test_sigkill_mid_block_then_resume_is_bit_identical(reference_run, tmp_path):
    ref, _ = reference_run
    out = tmp_path / "run"
    args = [*RUN, "--output-dir", str(out)]
    procs = start_ranks(args, N, tmp_path / "logs1")
    victim = 2
    deadline = time.monotonic() + 300
    while last_step(out) < 7:
        assert time.monotonic() < deadline and all(p.poll() is None for p in procs), "run ended before the kill"
        time.sleep(0.01)
    procs[victim].send_signal(signal.SIGSTOP)  # freeze at once; the kill below is the real SIGKILL
    procs[victim].send_signal(signal.SIGKILL)
    codes = wait_all(procs, timeout=120)
    assert codes[victim] == -signal.SIGKILL
    survivors = [r for r in range(N) if r != victim]
    assert all(codes[r] != 0 for r in survivors), codes
    for r in survivors:  # neighbors lose its link, the others see it go silent: all name it
        err = (tmp_path / "logs1" / f"rank{r}.err").read_text()
        assert "client 2 (rank 2)" in err and "failed at step" in err, err[-2000:]
    assert not (out / "consensus").exists()

    procs = start_ranks([*args, "--resume"], N, tmp_path / "logs2")
    assert wait_all(procs, timeout=300) == [0] * N, (tmp_path / "logs2" / "rank0.err").read_text()[-3000:]
    assert "resumed from step 6" in (tmp_path / "logs2" / "rank0.out").read_text()
    for c in range(N):
        got, want = client_params(out, c), client_params(ref, c)
        assert got.keys() == want.keys()
        for name in want:
            assert torch.equal(got[name], want[name]), (c, name)
    steps = [json.loads(line)["step"] for line in (out / "metrics" / "client_000.jsonl").read_text().splitlines()]
    assert steps == list(range(20)), "metrics must read as one run after resume"
    summary = lambda run: json.loads((run / "summary.json").read_text())  # noqa: E731
    assert summary(out)["initial_eval"] == summary(ref)["initial_eval"] is not None


def test_hung_peer_fails_every_rank_within_the_timeout(tmp_path):
    out = tmp_path / "run"
    args = [*RUN, "--output-dir", str(out), "--timeout", "8", "--steps-per-block", "50",
            "--checkpoint-interval", "0", "--consensus-interval", "0"]
    procs = start_ranks(args, N, tmp_path / "logs")
    deadline = time.monotonic() + 300
    while last_step(out) < 2:
        assert time.monotonic() < deadline and all(p.poll() is None for p in procs), "run ended early"
        time.sleep(0.01)
    procs[1].send_signal(signal.SIGSTOP)
    stopped = time.monotonic()
    try:
        codes = wait_all(procs[:1] + procs[2:], timeout=90)
    finally:
        procs[1].kill()
    assert all(c != 0 for c in codes), codes
    assert time.monotonic() - stopped < 60
    # its ring neighbors time out on its link, or in the step's finite check where it hung after its
    # exchange: either way they name it and the timeout
    for r in (0, 2):
        err = (tmp_path / "logs" / f"rank{r}.err").read_text()
        assert "client 1 (rank 1)" in err and "within 8 s" in err, err[-2000:]
    err = (tmp_path / "logs" / "rank3.err").read_text()
    assert "silent" in err and "client 1 (rank 1)" in err, err[-2000:]


def finite_check_alone(rank: int, port: int) -> str:
    """Rank 0's finite check, an all-reduce of every rank, which rank 1 never joins: the error, as text."""
    from datetime import timedelta

    from deca_ds.runtime.dist import PeerError
    from deca_ds.runtime.nonfinite import nonfinite_ranks

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                            timeout=timedelta(seconds=2))
    try:
        if rank == 1:
            return ""
        # gloo's own error is a plain RuntimeError, a timeout or a closed connection as rank 1 leaves
        with pytest.raises(PeerError) as caught:
            nonfinite_ranks(0, ClientLayout(rank, 2, 1), torch.device("cpu"), 2)
        return str(caught.value)
    finally:
        dist.destroy_process_group()


def test_a_collective_without_answer_names_itself_and_the_timeout():
    """A rank that hangs between its exchange and the step's finite check stops its neighbours in
    that all-reduce, not on its link: the error says so and gives the run's timeout, as a link's does."""
    from ranks import run_on_ranks

    err, _ = run_on_ranks(finite_check_alone, 2, free_port())
    assert err.startswith("no answer to the finite check (an all-reduce of every rank) within 2 s (a rank hung or "
                          "was lost): "), err


def test_heartbeat_board_names_the_silent_and_rank0_waits_only_for_its_readers():
    """Rank 2 stopped at step 4; rank 1 reports its own failure and reads the board, then rank 0
    does. Rank 0, which hosts the store, has then no one left to wait for: rank 1 has read and
    rank 2 is silent. Before a rank has read, rank 0 waits for it (to the timeout)."""
    store = dist.HashStore()
    boards = [Heartbeat(store, ClientLayout(r, 3, 1)) for r in range(3)]
    for r, step in enumerate([5, 5, 4]):
        boards[r].beat(step)
    assert boards[0].wait_for_readers(0.0) == [1, 2]
    boards[1].silent_ranks(5, 0.0)
    said = boards[0].silent_ranks(5, 0.0)
    assert said == "silent for 0 s (dead or hung): client 2 (rank 2) at step 4", said
    assert boards[0].wait_for_readers(60.0) == []


def test_bad_world_layout_fails_on_every_rank(tmp_path):
    out = tmp_path / "run"
    procs = start_ranks(["--ds_config", PRESET, "--ranks-per-client", "3", "--output-dir", str(out)], 2,
                        tmp_path / "logs")
    assert wait_all(procs, timeout=120) == [1, 1]
    for r in range(2):
        assert "world size 2 is not divisible by ranks per client G=3" in \
            (tmp_path / "logs" / f"rank{r}.err").read_text()
    assert not out.exists()


# ---- input errors, checked in-process (they all happen before any rank talks) -----------------

@pytest.fixture
def previous_run(tmp_path, monkeypatch):
    """An output directory that already holds a run; bad inputs must leave it untouched."""
    monkeypatch.setenv("WORLD_SIZE", "4")
    out = tmp_path / "run"
    (out / "metrics").mkdir(parents=True)
    (out / "run_config.json").write_text('{"earlier": true}')
    (out / "metrics" / "client_000.jsonl").write_text('{"step": 0, "loss": 1.0}\n')
    return out


def snapshot(out: Path) -> dict:
    return {p: (p.read_bytes(), p.stat().st_mtime_ns) for p in sorted(out.rglob("*")) if p.is_file()}


def write_preset(tmp_path: Path, **keys) -> str:
    """The test preset with `keys` added, as a file."""
    path = tmp_path / "preset.json"
    path.write_text(json.dumps({**json.loads(Path(PRESET).read_text()), **keys}))
    return str(path)


def write_matrix(tmp_path: Path, W) -> str:
    path = tmp_path / "W.json"
    path.write_text(json.dumps(np.asarray(W).tolist()))
    return str(path)


def write_tied_config(tmp_path: Path) -> str:
    """A tiny Llama's config whose LM head is the embeddings' matrix (Qwen2-1.5B's and 2.5-3B's kind)."""
    tiny_config(64, tie_word_embeddings=True).save_pretrained(tmp_path / "tied")
    return str(tmp_path / "tied" / "config.json")


BAD_INPUTS = {
    "clients_vs_topology": (lambda t: ["--topology", "file", "--matrix-file",
                                       write_matrix(t, np.full((3, 3), 1 / 3))],
                            "mixing matrix file .* is for 3 clients but n=4"),
    "clients_vs_world": (lambda t: ["--clients", "3"], "--clients 3 but world size 4"),
    "world_vs_G": (lambda t: ["--ranks-per-client", "3"], "world size 4 is not divisible by ranks per client G=3"),
    "disconnected_W": (lambda t: ["--topology", "file", "--matrix-file",
                                  write_matrix(t, np.kron(np.eye(2), np.full((2, 2), 0.5)))],
                       "not connected"),
    "non_stochastic_W": (lambda t: ["--topology", "file", "--matrix-file",
                                    write_matrix(t, np.full((4, 4), 0.2))], "row .* sums to"),
    "layers_per_block": (lambda t: ["--layers-per-block", "9"], "layers_per_block"),
    # from the config, before the weights load: a tied head has no tensor of its own to train
    "tied_lm_head": (lambda t: ["--from-config", "--model", write_tied_config(t), "--train-lm-head"],
                     "the LM head is tied to the input embeddings .* use train_embeddings=True"),
    "lm_head_of_adapters": (lambda t: ["--method", "dec_lora", "--train-lm-head"],
                            r"--method dec_lora does not read --train-lm-head \(read by deca/dadam only\)"),
    "bad_lr": (lambda t: ["--lr", "-1"], "lr must be > 0"),
    "existing_run": (lambda t: [], "already holds a run"),
    "offload_with_mid_run_eval": (lambda t: ["--offload", "frozen", "--eval-interval", "3"],
                                  "--offload frozen does not combine with eval_interval"),
    "offload_with_compiled_layers": (lambda t: ["--offload", "frozen", "--compile-layers"],
                                     "--offload frozen does not combine with --compile-layers"),
    "offload_keep_without_offload": (lambda t: ["--offload-keep", "2"], "--offload-keep needs --offload frozen"),
    "offload_keep_beyond_layers": (lambda t: ["--offload", "frozen", "--offload-keep", "9"], "offload keep must be in"),
    "offload_budget_without_offload": (lambda t: ["--offload-budget", "10"], "--offload-budget needs --offload frozen"),
    "offload_budget_and_keep": (lambda t: ["--offload", "frozen", "--offload-budget", "10", "--offload-keep", "1"],
                                "--offload-budget chooses --offload-keep"),
    "offload_budget_too_small": (lambda t: ["--offload", "frozen", "--offload-budget", "0.0001"],
                                 r"--offload-budget 0.0001 GB: even with every frozen decoder layer offloaded"),
    "loss_chunk": (lambda t: ["--loss-chunk", "-1"], "loss_chunk must be >= 0"),
    "trace_past_the_end": (lambda t: ["--trace-steps", "4", "--trace-start", "478"],
                           "--trace-start 478 --trace-steps 4 goes past the run's 480 steps"),
    "trace_start_alone": (lambda t: ["--trace-start", "5"], "--trace-start needs --trace-steps"),
    # it scores each client at the steps --eval-interval scores x̄: without one it did nothing, silently
    "eval_clients_alone": (lambda t: ["--eval-clients"], r"--eval-clients needs --eval-interval \(it scores each "
                                                         r"client at the steps that one scores x̄ at\)"),
    "max_new_tokens_alone": (lambda t: ["--max-new-tokens", "64"], r"--max-new-tokens needs --questions \(it bounds "
                                                                   r"the answers to that one's question sets\)"),
    # which tensors decay, without a decay: it did nothing, silently
    "weight_decay_on_alone": (lambda t: ["--weight-decay-on", "matrices"],
                              r"--weight-decay-on needs --weight-decay \(it chooses the tensors that one decays\)"),
    "keep_checkpoints_alone": (lambda t: ["--keep-checkpoints", "3"], r"--keep-checkpoints needs "
                               r"--checkpoint-interval \(it prunes the checkpoints that one writes\)"),
    # without checkpoints every requeue would start the run over
    "auto_resume_alone": (lambda t: ["--auto-resume"], r"--auto-resume needs --checkpoint-interval \(it resumes "
                          r"from the checkpoints that one writes\)"),
    "auto_resume_and_overwrite": (lambda t: ["--auto-resume", "--checkpoint-interval", "2", "--overwrite"],
                                  "--auto-resume chooses between continuing the run and starting it: leave out "
                                  "--overwrite"),
    "negative_time_limit": (lambda t: ["--time-limit", "-5"], "time_limit must be >= 0, got -5.0"),
    "gpu_memory_without_gpu": (lambda t: ["--gpu-memory-gb", "31"],
                               "--gpu-memory-gb 31 caps the CUDA allocator, but this rank runs on the CPU"),
    "lora_targets": (lambda t: ["--method", "dec_lora", "--lora-targets", "no_such_proj"], "LoRA targets"),
    "lora_dropout": (lambda t: ["--method", "decaf", "--lora-dropout", "1.5"], "lora dropout"),
    # the adapters' scale alpha / r: at 0 they add nothing and get no gradient, and the run trained nothing
    "lora_alpha": (lambda t: ["--method", "dec_lora", "--lora-alpha", "0"], r"lora alpha must be > 0, got 0\.0"),
    # inf and nan parse as floats: --timeout inf crashed at the first wait, --lora-alpha nan was "other options
    # than client 0" (nan != nan), --dirichlet-alpha inf failed writing run_config.json
    "infinite_timeout": (lambda t: ["--timeout", "inf"], "timeout must be a finite number, got inf"),
    "nan_option": (lambda t: ["--method", "dec_lora", "--lora-alpha", "nan"], "lora_alpha must be a finite number"),
    # numpy's generators take none: the run stopped in its set-up with "expected non-negative integer"
    "negative_seed": (lambda t: ["--seed", "-1"], "seed must be >= 0, got -1"),
    # the built-in tiny Llama's 128 positions: a learned position table would be indexed past its end
    # a preset's schedule DeepSpeed has no class of, or params its class does not take: it stopped the
    # run in deepspeed.initialize, once the model had loaded
    "unknown_schedule": (lambda t: ["--ds_config", write_preset(t, scheduler={"type": "WarmupCosine"})],
                         r"scheduler type 'WarmupCosine' is not one deca-ds can run: DeepSpeed's .*WarmupCosineLR"),
    "schedule_params": (lambda t: ["--ds_config", write_preset(t, scheduler={
        "type": "WarmupLR", "params": {"warmup_steps": 10}})], "got an unexpected keyword argument 'warmup_steps'"),
    "beyond_the_context": (lambda t: ["--max-seq-len", "512"],
                           r"--max-seq-len 512 is longer than the model's context \(max_position_embeddings 128\): "
                           r"give --max-seq-len 128"),
}


@pytest.mark.parametrize("case", BAD_INPUTS)
def test_bad_input_is_refused_before_anything_is_written(case, previous_run, tmp_path, capsys):
    extra, message = BAD_INPUTS[case]
    before = snapshot(previous_run)
    with pytest.raises(SystemExit) as exit_info:
        train_main(["--ds_config", PRESET, "--output-dir", str(previous_run), *extra(tmp_path)])
    assert exit_info.value.code == 1
    err = capsys.readouterr().err
    assert "error:" in err
    assert __import__("re").search(message, err), err
    assert snapshot(previous_run) == before


def test_a_context_too_short_is_refused_from_the_config_before_the_weights_load(previous_run, monkeypatch, capsys):
    def no_weights(*args, **kwargs):
        raise AssertionError("the model was loaded")

    monkeypatch.setattr(plan, "build_model", no_weights)
    with pytest.raises(SystemExit):
        train_main(["--ds_config", PRESET, "--output-dir", str(previous_run), "--max-seq-len", "129"])
    assert "--max-seq-len 129 is longer than the model's context (max_position_embeddings 128)" in \
        capsys.readouterr().err


@pytest.mark.parametrize("preset, message", [
    ({"train_micro_batch_size_per_gpu": 2, "foo": 1}, "unknown key\\(s\\) \\['foo'\\]"),
    ({"bf16": {"enabled": True}}, "FP32 master copies"),
    ({"zero_optimization": {"stage": 2}}, "ZeRO stages above 0"),
    ({"optimizer": {"type": "Adam"}}, "DECA supplies the optimizer"),
    ({"deca": {"stepz_per_block": 3}}, "unknown option 'stepz_per_block' \\(did you mean 'steps_per_block'\\?\\)"),
    # as text: json.loads would keep the second value
    ('{"deca": {"lr": 0.001, "lr": 0.01}}', "preset.json is not valid JSON: the key 'lr' is given twice in one object"),
])
def test_bad_preset_is_refused(preset, message, previous_run, tmp_path, capsys):
    path = tmp_path / "preset.json"
    path.write_text(preset if isinstance(preset, str) else json.dumps(preset))
    before = snapshot(previous_run)
    with pytest.raises(SystemExit):
        train_main(["--ds_config", str(path), "--output-dir", str(previous_run), "--overwrite"])
    assert __import__("re").search(message, capsys.readouterr().err)
    assert snapshot(previous_run) == before


def test_gpu_memory_cap_is_the_fraction_of_the_card_it_names(monkeypatch):
    """--gpu-memory-gb on a GPU (faked: this machine has none): the allocator's fraction is the cap
    over the card's memory; a cap above the card, or caps of the ranks sharing it that add up to
    more, are refused."""
    cuda, caps = torch.device("cuda", 1), []
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda d: SimpleNamespace(total_memory=80e9))
    monkeypatch.setattr(torch.cuda, "set_per_process_memory_fraction", lambda f, d: caps.append((f, d)))
    cap_gpu_memory(0, cuda)
    cap_gpu_memory(31, cuda)
    assert caps == [(31 / 80, cuda)]
    with pytest.raises(ValueError, match="--gpu-memory-gb 96: GPU 1 has only 80.00 GB"):
        cap_gpu_memory(96, cuda)
    cap_gpu_memory(40, cuda, {0: 3, 1: 2})  # two ranks on GPU 1: 2 × 40 GB fit its 80
    assert caps[-1] == (0.5, cuda)
    with pytest.raises(ValueError, match="--gpu-memory-gb 31: 3 ranks share GPU 1, so 3 × 31 GB must fit its 80.00"):
        cap_gpu_memory(31, cuda, {1: 3})


def test_out_of_gpu_memory_is_an_error_naming_the_cap(monkeypatch, tmp_path, capsys):
    """A run that does not fit under --gpu-memory-gb ends with that answer, not a traceback."""
    def out_of_memory(opts, ds_config):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB.\nthe allocator's details")

    monkeypatch.setattr(trainer, "train", out_of_memory)
    with pytest.raises(SystemExit) as exit_info:
        train_main(["--ds_config", PRESET, "--output-dir", str(tmp_path / "run"), "--gpu-memory-gb", "33"])
    assert exit_info.value.code == 1
    err = capsys.readouterr().err
    assert ("error: out of GPU memory within --gpu-memory-gb 33: it does not fit a card with that much room" in err
            and "Tried to allocate 2.00 GiB." in err and "details" not in err), err
    assert "--offload frozen, --loss-chunk or a smaller micro-batch lower it" in err
    with pytest.raises(SystemExit):  # a baseline cannot offload: the answer does not offer it
        train_main(["--ds_config", PRESET, "--output-dir", str(tmp_path / "run"), "--method", "dadam"])
    err = capsys.readouterr().err
    assert "out of GPU memory on this GPU" in err and "--offload" not in err
    assert "only DECA offloads frozen layers" in err


def test_trace_of_two_steps(tmp_path, profiling_runs):
    """--trace-steps 2 --trace-start 1 on one CPU rank, run by profile_resources.py (which keeps the
    trace beside its tables): the Chrome trace holds the three phases of steps 1 and 2 only, and the
    summary gives each phase's time per step within the step's, as the metrics timed it (with
    --phase-timing events: the trainer's times read after each step, here from the host's clock)."""
    import profile_resources

    profile_resources.main(["--ranks", "1", "--methods", "deca", "--updates", "eager", "--steps-per-block", "2",
                            "--warmup", "1", "--work-dir", str(tmp_path / "runs"), "--out", str(tmp_path / "out"),
                            "--train-args", "--layers-per-block", "2", "--micro-batch", "2", "--phase-timing", "events",
                            "--trace-steps", "2", "--trace-start", "1"])
    trace = tmp_path / "out" / "profile_resources_trace" / "deca"
    with gzip.open(trace / "rank0.trace.json.gz", "rt") as f:
        names = [e.get("name") for e in json.load(f)["traceEvents"]]
    assert {phase: names.count(f"deca.{phase}") for phase in ("forward", "backward", "step")} == \
        {"forward": 2, "backward": 2, "step": 2}
    summary = json.loads((trace / "rank0.json").read_text())
    assert summary["steps"] == [1, 3] and summary["device"] == "cpu"
    assert_only_run_outputs(tmp_path / "runs" / "deca")  # trace/ too
    metrics = tmp_path / "runs" / "deca" / "metrics" / "client_000.jsonl"
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    step_ms = max(1e3 * (r["t_forward"] + r["t_backward"] + r["t_mix_update"]) for r in records if r["step"] in (1, 2))
    assert all(r["t_step"] > r["t_forward"] + r["t_backward"] + r["t_mix_update"] for r in records)  # the wall
    for phase in ("forward", "backward", "step"):
        timed = summary["phases"][phase]
        assert timed["calls_per_step"] == 1 and timed["device_ms"] == 0 and 0 < timed["host_ms"] < step_ms, timed
        # the operators inside the phase: their self times add up to at most the phase's own
        assert 0 < sum(op["self_host_ms"] for op in timed["ops"]) <= timed["host_ms"]
    ops = {op["name"]: op for op in summary["phases"]["step"]["ops"]}
    assert ops["Optimizer.step#DecaOptimizer.step"]["calls_per_step"] == 1  # DECA's step is inside DeepSpeed's
    # the step's wall time holds its phases and the work between them, whose operators are listed apart
    phases_ms = sum(summary["phases"][phase]["host_ms"] for phase in ("forward", "backward", "step"))
    assert phases_ms < summary["wall_ms"] and "host_ops" not in summary["phases"]["step"]  # on CPU: "ops"
    outside = {op["name"] for op in summary["outside"]}
    assert outside and not outside & {"deca.forward", "deca.backward", "deca.step"}
    assert "aten::mm" in {op["name"] for op in summary["phases"]["forward"]["ops"]}
    assert "Self CPU" in (trace / "rank0.ops.txt").read_text()


def test_deepspeed_clipping_default_is_turned_off(tmp_path):
    """DeepSpeed clips at norm 1.0 by default; DECA must not clip unless the preset says so."""
    _, ds_config = parse_args(["--ds_config", PRESET])
    assert ds_config["gradient_clipping"] == 0.0
    path = tmp_path / "preset.json"
    path.write_text(json.dumps({"gradient_clipping": 0.5}))
    assert parse_args(["--ds_config", str(path)])[1]["gradient_clipping"] == 0.5


def pad_cat(a: dict, b: dict, pad_id: int) -> dict:
    """One batch holding a's and b's rows (right padding, as collate does)."""
    length = max(a["input_ids"].shape[1], b["input_ids"].shape[1])
    fill = {"input_ids": pad_id, "attention_mask": 0, "labels": -100}
    return {k: torch.cat([torch.nn.functional.pad(x[k], (0, length - x[k].shape[1]), value=fill[k])
                          for x in (a, b)]) for k in fill}


def test_ranks_per_client_do_data_parallelism_inside_the_client(tmp_path):
    """2 clients × G=2 ranks: each client's step uses the mean gradient of two micro-batches, one
    per rank, which is the simulator fed the two micro-batches as one batch. (The fused update,
    which takes the gradient however it was formed, is held to the eager one in test_fused and runs
    on ranks in the bf16 test below: compiled here too, its kernels cost 30 s to build on a fresh
    machine.)"""
    out = tmp_path / "run"
    args = [*RUN, "--output-dir", str(out), "--ranks-per-client", "2", "--checkpoint-interval", "0",
            "--rounds", "1"]
    opts, _ = parse_args(args)
    task = plan.build_task(opts, 2)
    model = plan.build_model(opts, len(task.tokenizer))
    pad = task.tokenizer.pad_token_id

    def merged(c):
        stream = task.stream(opts, c)
        while True:
            yield pad_cat(next(stream), next(stream), pad)

    # The ranks ran at DECA_RANK_THREADS; at another thread count the CPU matmuls round differently,
    # and Adam amplifies that as below (1.4e-4 at 2 threads against 1 here).
    with torch_threads():
        simulated = deca_ds.simulate(model, [merged(0), merged(1)], deca_ds.make_topology("ring", 2).W,
                                     opts.deca_config())
    procs = start_ranks(args, 4, tmp_path / "logs")
    assert wait_all(procs, timeout=300) == [0] * 4, (tmp_path / "logs" / "rank0.err").read_text()[-3000:]
    init = dict(model.named_parameters())
    for c in range(2):
        got = client_params(out, c)
        # The mean of two micro-batch gradients (DeepSpeed's all-reduce) and the gradient of one
        # merged batch round differently, and Adam's m/sqrt(v) amplifies that on near-cancelling
        # coordinates (the same reformulation in one process, no DeepSpeed: 7e-6 after 20 steps);
        # so the check is on the norm of the whole update, not on every coordinate.
        err = sum(torch.sum((got[n] - w) ** 2) for n, w in simulated[c].items()).sqrt()
        moved = sum(torch.sum((w - init[n]) ** 2) for n, w in simulated[c].items()).sqrt()
        print(f"client {c}: relative update error {err / moved:.2e}")
        assert err / moved < 1e-4


def test_bf16_working_weights_with_working_dtype_mixing(tmp_path):
    out = tmp_path / "run"
    args = [*RUN, "--output-dir", str(out), "--working-dtype", "bf16", "--mix-dtype", "working",
            "--checkpoint-interval", "0", "--steps-per-block", "10", "--tensorboard", "--fused-update",
            "--loss-chunk", "7"]
    procs = start_ranks(args, 2, tmp_path / "logs")
    assert wait_all(procs, timeout=300) == [0, 0], (tmp_path / "logs" / "rank0.err").read_text()[-3000:]
    consensus = AutoModelForCausalLM.from_pretrained(out / "consensus")
    assert consensus.dtype == torch.bfloat16
    summary = json.loads((out / "summary.json").read_text())
    blocks = json.loads((out / "run_config.json").read_text())["blocks"]
    # one neighbor (ring of 2), bf16 on the wire: 2 bytes per parameter of the active block
    assert summary["clients"][0]["bytes_sent"] == 2 * 10 * 2 * sum(b["numel"] for b in blocks)
    assert all(c["loss_end"] < c["loss_start"] - 0.5 for c in summary["clients"]), summary["clients"]
    for c in range(2):
        assert list((out / "tensorboard" / f"client_{c:03d}").glob("events.out.tfevents.*"))
    assert_only_run_outputs(out)
    # deca-eval --run scores the bf16 export in the run's dtype (on a CPU it would default to fp32) and
    # attention (with the default, sdpa, it scored another macro-F1 on a CPU with AMX's bf16 matmuls)
    from deca_ds.runtime import evaluate

    result = evaluate.evaluate(evaluate.build_parser().parse_args(
        ["--run", str(out), "--eval-limit", "64", "--out", str(tmp_path / "eval.json")]))
    assert result["working_dtype"] == "bf16" and result["classification"] == summary["consensus_eval"]


def test_local_files_train_and_evaluate_end_to_end(tmp_path):
    """--dataset files: JSON Lines written here, string labels, column options; 2 clients."""
    from deca_ds.data import SyntheticTask

    task = SyntheticTask(train_size=400, test_size=64, seed=3)
    names = ["red", "green", "blue", "gold"]
    for split, rows in zip(("train", "test"), task.generate()):
        (tmp_path / f"{split}.jsonl").write_text("".join(
            json.dumps({"sentence": ex.text, "colour": names[ex.label]}) + "\n" for ex in rows))
    out = tmp_path / "run"
    args = [*RUN, "--output-dir", str(out), "--dataset", "files", "--data-files", f"train={tmp_path / 'train.jsonl'}",
            f"test={tmp_path / 'test.jsonl'}", "--text-column", "sentence", "--label-column", "colour",
            "--label-names", *names, "--checkpoint-interval", "0", "--rounds", "1", "--max-seq-len", "48"]
    procs = start_ranks(args, 2, tmp_path / "logs")
    assert wait_all(procs, timeout=300) == [0, 0], (tmp_path / "logs" / "rank0.err").read_text()[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["consensus_eval"]["n"] == 64 and summary["consensus_eval"]["chance"] == 0.25
    run = json.loads((out / "run_config.json").read_text())
    assert run["split_keys"] == names and sum(run["client_sizes"]) == 400
    assert np.array(run["split_histogram"]).sum() == 400
    partition = json.loads((out / "partition" / "partition.json").read_text())
    assert sorted(i for ix in partition["partition"] for i in ix) == list(range(400))
    assert partition["label_names"] == names
    assert (out / "partition" / "label_histogram.png").stat().st_size > 1000


def test_standalone_evaluation_of_the_export(reference_run, tmp_path):
    """launch/evaluate.py --run scores the run's consensus as the run itself did (its data options,
    --max-seq-len 32 here, read from run_config.json), and answers a questions file with ROUGE-L
    against its references."""
    out, _ = reference_run
    questions = tmp_path / "questions.jsonl"
    questions.write_text(json.dumps({"question_id": 1, "turns": ["w1 w2 =>", "w3 =>"],
                                     "reference": ["label0", "label1"]}) + "\n"
                         + json.dumps({"question_id": 2, "text": "k0.1 =>"}) + "\n")
    result_path = tmp_path / "eval.json"
    assert run_script(ROOT / "launch" / "evaluate.py", "--run", str(out), "--eval-limit", "64",
                      "--questions", str(questions), "--max-new-tokens", "3", "--out", str(result_path)) == 0
    result = json.loads(result_path.read_text())
    summary = json.loads((out / "summary.json").read_text())
    assert result["model"] == str(out / "consensus") and result["options"]["max_seq_len"] == 32
    assert result["classification"] == summary["consensus_eval"]
    rows = [json.loads(line) for line in Path(result["answers"]).read_text().splitlines()]
    assert [len(r["answers"]) for r in rows] == [2, 1]
    assert result["rouge"]["n"] == 2 and 0.0 <= result["rouge"]["rouge_l"] <= 1.0


def test_client_exports_are_complete_model_directories(reference_run, tmp_path):
    """clients/client_NNN holds the tokenizer beside the weights: transformers loads both, and
    launch/evaluate.py scores it as the client's own weights score in-process."""
    from transformers import AutoTokenizer

    from deca_ds.runtime import evaluate

    out, _ = reference_run
    consensus_tok = AutoTokenizer.from_pretrained(out / "consensus")
    for c in range(N):
        directory = out / "clients" / f"client_{c:03d}"
        model = AutoModelForCausalLM.from_pretrained(directory)
        weights = client_params(out, c)
        assert all(torch.equal(p.detach(), weights[n]) for n, p in model.named_parameters())
        tok = AutoTokenizer.from_pretrained(directory)
        assert tok.get_vocab() == consensus_tok.get_vocab() and tok.pad_token_id == consensus_tok.pad_token_id
        assert tok("w1 w2 =>")["input_ids"] == consensus_tok("w1 w2 =>")["input_ids"]
    client = out / "clients" / "client_001"
    result = evaluate.evaluate(evaluate.build_parser().parse_args([
        "--model", str(client), "--dataset", "synthetic", "--max-seq-len", "32", "--eval-limit", "64",
        "--out", str(tmp_path / "eval.json")]))
    opts, _ = parse_args([*RUN, "--output-dir", "unused"])
    task = plan.build_task(opts, N)
    model = plan.build_model(opts, len(task.tokenizer))
    model.load_state_dict(client_params(out, 1), strict=False)
    assert result["classification"] == task.evaluate(model, 64)
    assert json.loads((tmp_path / "eval.json").read_text())["classification"]["n"] == 64


def test_profile_memory_tool(tmp_path, profiling_runs, monkeypatch):
    """profiling/profile_memory.py runs training per granularity and reports memory per client."""
    import profile_memory

    profile_memory.main(["--ranks", "2", "--layers-per-block", "2", "4", "--offload", "none", "frozen",
                         "--steps-per-block", "2", "--warmup", "1", "--work-dir", str(tmp_path / "runs"),
                         "--out", str(tmp_path / "out"), "--train-args", "--topology", "ring", "--micro-batch", "4"])
    summary = json.loads((tmp_path / "out" / "profile_memory.json").read_text())
    rows = summary["results"]
    assert [(r["layers_per_block"], r["offload"], r["blocks"], r["steps"]) for r in rows] == [
        (2, "none", 2, 4), (2, "frozen", 2, 4), (4, "none", 1, 2), (4, "frozen", 1, 2)]
    assert all(r["kind"] == "process RSS (CPU)" and 0.1 < r["mean_gib"] <= r["peak_gib"] < 8 for r in rows)
    assert all(0 < r["update_ms"] < r["step_ms"] and r["setup_peak_gib"] > 0.1 for r in rows)
    assert all(r["estimate_gib"] is None for r in rows), "RSS is not compared with a device-memory estimate"
    assert [r["step_over_resident"] for r in rows][::2] == [1.0, 1.0]
    assert [r["first_loss"] for r in rows][::2] == [r["first_loss"] for r in rows][1::2]  # the same start
    assert (tmp_path / "out" / "profile_memory.png").stat().st_size > 1000
    # section peaks come from GPU ranks only; given them, the table says where each run peaks
    assert all(r[f"peak_{k}_gib"] is None and r["end_peak_gib"] is None for r in rows for k in profile_memory.SECTIONS)
    gpu = [{**rows[0], "peak_prefix_gib": None, "peak_forward_gib": 1.5, "peak_backward_gib": 2.25,
            "peak_step_gib": 2.5, "peak_other_gib": 1.25, "end_peak_gib": 1.75,
            **{f"estimate_{k}_gib": 2.0 for k in profile_memory.PHASES}}]
    profile_memory.write({**summary, "results": gpu, "card": "RTX 5090",
                          "gpu_memory_gb": profile_memory.card_cap_gb("RTX 5090")}, tmp_path / "gpu", "pm")
    table = (tmp_path / "gpu" / "pm.md").read_text()
    assert "| 2 | none | — | 1.50 | 2.25 | 2.50 | 1.25 | 1.75 | 2.00 | 2.00 | 2.00 | 2.00 |" in table
    # --card: the runs capped at the card's 32607 MiB less 1 GiB; without a GPU, refused before any run
    assert "Run as on an RTX 5090: every rank's allocator capped at 33.12 GB" in table
    assert summary["card"] is None
    with pytest.raises(SystemExit):
        profile_memory.parse_args(["--card", "RTX 5090"])

    # the results are written after every run: a run that fails or is stopped keeps those before it
    def rerun(args, lpb, offload, keep):  # the finished runs again, until the first offloaded one
        if offload == "frozen":
            raise SystemExit(f"layers_per_block={lpb}, offload={offload}: stopped")
        return tmp_path / "runs" / f"lpb{lpb}_{offload}"

    monkeypatch.setattr(profile_memory, "run", rerun)
    with pytest.raises(SystemExit, match="offload=frozen: stopped"):
        profile_memory.main(["--layers-per-block", "2", "--offload", "none", "frozen", "--warmup", "1",
                             "--out", str(tmp_path / "cut")])
    kept = json.loads((tmp_path / "cut" / "profile_memory.json").read_text())["results"]
    assert kept == [{**rows[0], "step_over_resident": 1.0}]


def test_offloaded_run_equals_resident_run_bit_for_bit(tmp_path, monkeypatch):
    """--offload frozen, streamed for real on CPU ranks (DECA_OFFLOAD_ON_CPU=1): set up before the
    model moves, re-activated at every block switch, checkpoints and the consensus export taken
    from host memory, resume loading weights before offloading. Checkpoints, the exported
    clients and x̄, the losses and the final evaluation equal those of the resident run exactly."""
    monkeypatch.setenv("DECA_OFFLOAD_ON_CPU", "1")
    args = ["--ds_config", PRESET, "--topology", "ring", "--layers-per-block", "1", "--steps-per-block", "3",
            "--rounds", "2", "--micro-batch", "4", "--max-seq-len", "32", "--eval-limit", "32",
            "--consensus-interval", "2", "--checkpoint-interval", "5", "--keep-checkpoints", "10",
            "--save-clients", "--timeout", "60"]

    def run(mode: str, out: Path, *extra: str) -> None:
        logs = tmp_path / f"logs_{out.name}"
        procs = start_ranks([*args, "--offload", mode, "--output-dir", str(out), *extra], 2, logs)
        assert wait_all(procs, 300) == [0, 0], (logs / "rank0.err").read_text()[-3000:]

    resident, offloaded = tmp_path / "none", tmp_path / "frozen"
    run("none", resident)
    run("frozen", offloaded)
    files = ["consensus/model.safetensors", *(f"clients/client_{c:03d}/model.safetensors" for c in range(2)),
             *(f"checkpoints/step_{s:08d}/client_{c:03d}/model.safetensors"
               for s in (5, 10, 15, 20) for c in range(2))]
    for f in files:
        a, b = load_file(resident / f), load_file(offloaded / f)
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), f

    def losses(out: Path) -> list[float]:
        return [json.loads(line)["loss"] for line in (out / "metrics" / "client_000.jsonl").read_text().splitlines()]

    assert losses(resident) == losses(offloaded) and len(losses(resident)) == 4 * 3 * 2

    # The frozen layers copied per block visit are the estimator's count: the layers below the block
    # once (FrozenPrefix), those above up and down in each of the 3 steps. A checkpoint inside a block
    # sends every streamed layer back to the host, so those visits are left out. Client 1: rank 0's
    # evaluation before training leaves layers on the device.
    records = [json.loads(line) for line in (offloaded / "metrics" / "client_001.jsonl").read_text().splitlines()]
    layer = 4 * sum(p.numel() for p in tiny_llama(64).model.layers[0].parameters())  # fp32
    checked = 0
    for visit in range(8):
        steps = records[3 * visit:3 * visit + 3]
        if any((r["step"] + 1) % 5 == 0 for r in steps[:2]):
            continue
        block = visit % 4
        expected = offload_block_stream([layer] * block, [layer] * (3 - block), 3)
        assert sum(r["bytes_streamed"] for r in steps) == expected, visit
        assert all(r["t_prefix"] == 0 for r in steps[1:]) and (steps[0]["t_prefix"] > 0 or not block)
        checked += 1
    assert checked == 5  # visits 0, 2, 4, 5, 7: blocks 0, 2, 0, 1, 3
    summary = lambda out: json.loads((out / "summary.json").read_text())  # noqa: E731
    assert summary(resident)["consensus_eval"] == summary(offloaded)["consensus_eval"]

    # resume the offloaded run from its checkpoint at step 20 (mid-block), now keeping the top layer
    # resident: same end, bit for bit
    shutil.rmtree(offloaded / "consensus")
    run("frozen", offloaded, "--resume", "--offload-keep", "1")
    a, b = load_file(resident / files[0]), load_file(offloaded / files[0])
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_offload_with_ranks_per_client_and_accumulation_equals_resident(tmp_path, monkeypatch):
    """2 clients × G=2 ranks, 2 micro-batches accumulated per step, streamed for real on CPU: every
    rank runs the layers below each block once for its own 2 × R micro-batches, in the order it
    trains on them, and the run ends where the resident one does, bit for bit."""
    monkeypatch.setenv("DECA_OFFLOAD_ON_CPU", "1")
    args = ["--ds_config", PRESET, "--topology", "ring", "--layers-per-block", "1", "--steps-per-block", "2",
            "--rounds", "1", "--micro-batch", "2", "--grad-accum", "2", "--ranks-per-client", "2",
            "--max-seq-len", "32", "--eval-limit", "16", "--checkpoint-interval", "0", "--timeout", "60"]
    for mode in ("none", "frozen"):
        logs = tmp_path / f"logs_{mode}"
        procs = start_ranks([*args, "--offload", mode, "--output-dir", str(tmp_path / mode)], 4, logs)
        assert wait_all(procs, 300) == [0] * 4, (logs / "rank0.err").read_text()[-3000:]
    a, b = (load_file(tmp_path / mode / "consensus" / "model.safetensors") for mode in ("none", "frozen"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    for c in range(2):
        metrics = [(tmp_path / mode / "metrics" / f"client_{c:03d}.jsonl").read_text().splitlines()
                   for mode in ("none", "frozen")]
        assert [json.loads(r)["loss"] for r in metrics[0]] == [json.loads(r)["loss"] for r in metrics[1]]


def test_profile_resources_tool(tmp_path, profiling_runs, monkeypatch):
    """profiling/profile_resources.py trains each method on the same ranks, with the eager and the
    fused update, and reports Table 9's columns; a second call with --merge adds its method to the
    first call's table (the ratios over both; a baseline's fused rows are the same code as DECA's),
    and one with other settings is refused before it runs."""
    import profile_resources

    def call(method: str, *more: str, layers: str = "2", updates=("eager", "fused")) -> None:
        profile_resources.main(["--ranks", "2", "--methods", method, "--updates", *updates,
                                "--steps-per-block", "2", "--warmup", "1", "--work-dir", str(tmp_path / "runs"),
                                "--out", str(tmp_path / "out"), *more, "--train-args", "--topology", "ring",
                                "--micro-batch", "4", "--layers-per-block", layers])

    call("dadam", updates=("eager",))
    call("deca", "--merge")
    with pytest.raises(SystemExit, match=r"other settings \(train_args: .*'2'\] there, .*'1'\] here\)"):
        call("deca", "--merge", layers="1")
    assert sorted(p.name for p in (tmp_path / "runs").iterdir()) == ["dadam", "deca", "deca_fused"]
    summary = json.loads((tmp_path / "out" / "profile_resources.json").read_text())
    deca, dadam, deca_fused = summary["results"]
    assert [r["method"] for r in summary["results"]] == ["DECA", "D-Adam", "DECA (fused)"]
    assert deca["trainable_params"] == dadam["trainable_params"]  # the same decoder layers, one block at a time
    for r in summary["results"]:
        assert r["samples"] == 2 * (4 - 1)  # 2 blocks × 2 steps per client, first step left out
        assert 0 < r["agg_ms"] <= r["agg_up_ms"] < r["step_ms"]
        assert 0 < r["exchange_ms"] < r["agg_up_ms"] and r["agg_ms"] < r["update_ms"] < r["agg_up_ms"]
        assert abs(r["step_ms"] - (r["fwd_ms"] + r["bkwd_ms"] + r["agg_up_ms"])) < 0.5 * r["step_ms"]
    for run, fused in (("deca", False), ("deca_fused", True)):
        assert json.loads((tmp_path / "runs" / run / "run_config.json").read_text())["options"]["fused_update"] is fused
    # ring of 2: one neighbour; DECA sends its active block, D-Adam every decoder layer (fp32)
    blocks = json.loads((tmp_path / "runs" / "deca" / "run_config.json").read_text())["blocks"]
    assert deca["comm_mb"] * 1e6 == deca_fused["comm_mb"] * 1e6 == pytest.approx(4 * blocks[0]["numel"])
    assert dadam["comm_mb"] * 1e6 == pytest.approx(4 * deca["trainable_params"])
    ratios = summary["ratios"]
    assert ratios["deca_step_over_D-Adam"] == pytest.approx(deca["step_ms"] / dadam["step_ms"])
    assert "deca_fused_step_over_D-Adam_fused" not in ratios  # no fused D-Adam row to take it over
    assert ratios["deca_update_and_combination_share_of_step"] == pytest.approx(deca["update_ms"] / deca["step_ms"])
    assert ratios["deca_fused_agg_up_over_eager"] == pytest.approx(deca_fused["agg_up_ms"] / deca["agg_up_ms"])
    assert summary["command"].startswith("python profiling/profile_resources.py --ranks 2 --methods deca")
    # each row names its own call
    assert [r["command"].split()[5] for r in summary["results"]] == ["deca", "dadam", "deca"]
    assert (tmp_path / "out" / "profile_resources.png").stat().st_size > 1000
    # CPU ranks share no GPU, so the table says nothing of time-sharing one
    assert all(r["clients_per_gpu"] == {} for r in summary["results"])
    assert "time-share" not in (tmp_path / "out" / "profile_resources.md").read_text()
    # nor device memory (RSS is not), and the built-in tiny model has no estimate
    assert all(r["peak_gib"] is None and r["estimate_gib"] is None for r in summary["results"])
    assert "| — / — |" in (tmp_path / "out" / "profile_resources.md").read_text()

    # the results are written after every run: a run that fails or is stopped keeps those before it
    def rerun(train_args, ranks, out, timeout, what):  # DECA's finished run again; the fused one stopped
        if "--fused-update" in train_args:
            raise SystemExit(f"{what}: the ranks were stopped")
        return out

    monkeypatch.setattr(profile_resources.runs, "train", rerun)
    with pytest.raises(SystemExit, match="deca_fused: the ranks were stopped"):
        profile_resources.main(["--methods", "deca", "--updates", "eager", "fused", "--warmup", "1",
                                "--work-dir", str(tmp_path / "runs"), "--out", str(tmp_path / "cut")])
    kept = json.loads((tmp_path / "cut" / "profile_resources.json").read_text())["results"]
    assert [{k: v for k, v in r.items() if k != "command"} for r in kept] == [
        {k: v for k, v in deca.items() if k != "command"}]


def test_step_sections_keep_their_own_allocation_peaks(monkeypatch):
    """On a GPU a step's record says which section set its peak. The device's counter is faked:
    each read returns the next value and the counter restarts at every section's end."""
    from deca_ds.runtime.allocated import DeviceMemory
    from deca_ds.runtime.timing import Timer

    reads = iter([5, 9, 7, 6, 8, 4, 3, 2])  # outside, forward, backward, step, forward, ...
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda *a: next(reads))
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda *a: None)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda *a: 1)
    timer = Timer(DeviceMemory(torch.device("cuda", 0)))
    for section in ("other", "forward", "backward", "step", "forward"):  # two micro-batches' forwards
        timer.mark(section)
    # the last read (4): the work after the step, "other" with the work before the first forward (5)
    assert timer.memory() == {"mem_allocated": 1, "mem_peak": 9, "mem_peak_other": 5, "mem_peak_forward": 9,
                              "mem_peak_backward": 7, "mem_peak_step": 6}
    timer.mark("step")
    assert timer.memory() == {"mem_allocated": 1, "mem_peak": 9, "mem_peak_step": 3, "mem_peak_other": 2}
    assert Timer(DeviceMemory(torch.device("cpu"))).memory().keys() == {"mem_rss"}


def test_a_cpu_run_that_counts_its_tensor_memory_records_it_as_a_gpu_run_does(monkeypatch):
    """DECA_COUNT_CPU_MEMORY=1: a CPU rank's sections keep the peaks of the tensor memory
    operators allocate (runtime.allocated.TensorBytes), in bytes counted by hand."""
    from deca_ds.runtime.allocated import COUNT_ON_CPU, DeviceMemory, counting, cpu_counter
    from deca_ds.runtime.timing import Timer

    cpu = torch.device("cpu")
    assert cpu_counter(cpu) is None
    monkeypatch.setenv(COUNT_ON_CPU, "1")
    counter = cpu_counter(cpu)
    with counting(counter):
        kept = torch.zeros(256)  # 1,024 bytes, from before the step
        timer = Timer(DeviceMemory(cpu, counter))
        timer.mark()
        batch = torch.ones(512)  # 2,048
        timer.mark("forward")
        grad = batch * 2  # 2,048 more
        del batch
        timer.mark("backward")
        del grad
        record = timer.memory()
    # "other": before the forward, and after the backward until the record (the gradient, then freed)
    assert record == {"mem_allocated": 1024, "mem_peak": 1024 + 2 * 2048, "mem_peak_other": 1024 + 2048,
                      "mem_peak_forward": 1024 + 2048, "mem_peak_backward": 1024 + 2 * 2048}
    del kept


def test_a_cpu_run_counts_its_steps_as_the_estimator_does(tmp_path, monkeypatch, profiling_runs):
    """DECA_COUNT_CPU_MEMORY=1 on two CPU ranks (one neighbour each; the demo's fp32 tiny Llama,
    one layer per block, a block a step): between steps the trainer holds the weights and the
    active block's master, m, v and nothing else, after the last the weights alone, and DeepSpeed's
    step (DECA's update and mixing) peaks at the estimate's update and mixing phases
    (deca-train --estimate's, deca_ds.memory), all beside the model's buffers, to 64 bytes of 0-d
    scalars. Nothing the trainer keeps around the optimizer (the engine, the checks, the records)
    adds a byte. The summary has each client's peak after training (mem_end_peak)."""
    from deca_ds.memory import GiB
    from deca_ds.runtime.allocated import COUNT_ON_CPU
    from deca_ds.runtime.footprint import estimate_run

    monkeypatch.setenv(COUNT_ON_CPU, "1")
    out = tmp_path / "run"
    args = ["--ds_config", PRESET, "--output-dir", str(out), "--rounds", "1", "--steps-per-block", "1",
            "--micro-batch", "4", "--eval-limit", "8", "--consensus-interval", "0"]
    assert wait_all(start_ranks(args, 2, tmp_path / "logs"), timeout=300) == [0, 0], \
        (tmp_path / "logs" / "rank0.err").read_text()[-3000:]
    run = json.loads((out / "run_config.json").read_text())
    est = estimate_run(run["options"], out / "consensus", run["ds_config"], n_neighbors=1,
                       loss_positions=run["loss_positions_max"])
    buffers = sum(b.nbytes for b in AutoModelForCausalLM.from_pretrained(out / "consensus").buffers())
    scalars = 64
    for client in range(2):
        rows = [json.loads(line) for line in (out / "metrics" / f"client_{client:03d}.jsonl").read_text().splitlines()]
        assert len(rows) == est.num_blocks
        for row in rows:
            held = est.weights + (est.optimizer_state if row is not rows[-1] else 0) + buffers
            assert 0 <= row["mem_allocated"] - held < scalars, (client, row)
            step = max(est.phases["update"], est.phases["mixing"]) + buffers
            assert 0 <= row["mem_peak_step"] - step < scalars, (client, row, est.phases)
    # After the last step client 1 holds the weights and forms x̄ through two fp32 chunk buffers (the
    # estimate's end: its largest tensor here); client 0 also exports x̄ and evaluates it.
    ends = json.loads((out / "summary.json").read_text())["mem_end_peak"]
    largest = max(p.numel() for p in AutoModelForCausalLM.from_pretrained(out / "consensus").parameters())
    assert est.end == est.weights + 2 * 4 * largest
    assert 0 <= ends[1] - (est.end + buffers) < scalars, ends
    assert ends[0] >= ends[1]
    import profile_memory  # its report of such a run says what it read (profiling/ is on sys.path)

    measured = profile_memory.measure(out, warmup=0)
    assert measured["kind"] == "tensor memory (counted on CPU, DECA_COUNT_CPU_MEMORY)"
    assert measured["peak_gib"] == max(r["mem_peak"] for client in profiling_runs.metrics(out) for r in client) / GiB
    assert measured["end_peak_gib"] == max(ends) / GiB


def test_start_and_end_loss_windows_never_overlap():
    """The summary's start/end loss: the mean of the first/last 10 steps, or of a tenth of a run
    shorter than 100 steps, so that a short run's start and end are different steps."""
    from deca_ds.runtime.metrics import summarize

    def ends(losses):
        client = summarize([[{"step": s, "loss": loss} for s, loss in enumerate(losses)]])["clients"][0]
        return client["loss_start"], client["loss_end"]

    assert ends([4.0, 3.0, 2.0]) == (4.0, 2.0)
    assert ends([float(s) for s in range(10, 0, -1)]) == (10.0, 1.0)
    assert ends([float(s) for s in range(35)]) == (1.0, 33.0)  # windows of 3
    assert ends([float(s) for s in range(200)]) == (4.5, 194.5)  # windows of 10


def test_rank_threads_from_the_environment(monkeypatch):
    from deca_ds.runtime.rank import rank_threads

    cpu, gpu = torch.device("cpu"), torch.device("cuda", 0)
    monkeypatch.delenv("DECA_RANK_THREADS", raising=False)
    assert rank_threads(1, cpu) == (os.cpu_count() or 1) and rank_threads(10**6, cpu) == 1
    assert rank_threads(4, gpu) is None
    monkeypatch.setenv("DECA_RANK_THREADS", "3")
    assert rank_threads(4, cpu) == 3 and rank_threads(4, gpu) == 3
    for bad in ("0", "-1", "two"):
        monkeypatch.setenv("DECA_RANK_THREADS", bad)
        with pytest.raises(ValueError, match=f"DECA_RANK_THREADS='{bad}'"):
            rank_threads(4, cpu)
