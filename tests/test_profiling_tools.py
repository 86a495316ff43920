"""profiling/matmul_efficiency.py, profiling/offload_sweep.py and profiling/save_init.py (issue 17's
GPU measurements): the analytic FLOP count against torch's FlopCounterMode, each tool's smoke run on
CPU, and the saved initialisation against the run's own; profiling/decaf_refactor.py's two paths;
profiling/op_counts.py's phases; every command of gpu_checks.sh;
profiling/shared_device_exact.py on CPU ranks; and profiling/state_8bit.py's measurement of the
8-bit moments."""

from __future__ import annotations

import contextlib
import json
import math
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode
from transformers import LlamaConfig, LlamaForCausalLM

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "profiling"))

import decaf_refactor  # noqa: E402
import matmul_efficiency  # noqa: E402
import offload_sweep  # noqa: E402
import op_counts  # noqa: E402
import save_init  # noqa: E402
import state_8bit  # noqa: E402
from helpers import RANK_THREADS, needs_bnb, torch_threads  # noqa: E402

TINY = LlamaConfig(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                   num_key_value_heads=2, vocab_size=50, tie_word_embeddings=False)
# the sweep's runs at a CPU-sized sequence (its preset's 512 bf16 tokens cost minutes here)
SMALL = ["--max-seq-len", "64", "--eval-limit", "4"]


@pytest.mark.parametrize("batch,seq_len", [(1, 16), (3, 24)])
def test_model_flops_equals_flop_counter(batch, seq_len):
    """Eager attention: FlopCounterMode has no formula for CPU's fused SDPA kernel, while eager
    attention is two matmuls over the full s × s, as the analytic count (and CUDA's SDPA count) has."""
    torch.manual_seed(0)
    model = LlamaForCausalLM._from_config(TINY, attn_implementation="eager")
    ids = torch.randint(0, 50, (batch, seq_len))
    with FlopCounterMode(display=False) as forward:
        loss = model(input_ids=ids, logits_to_keep=1, use_cache=False).logits.float().sum()
    with FlopCounterMode(display=False) as backward:
        loss.backward()
    expected = matmul_efficiency.model_flops(TINY, batch, seq_len)
    # by hand for (1, 16): per layer 16·2·(64·64 + 2·64·32 + 64·64 + 3·64·96) + 4·16²·64, head 2·64·50
    if (batch, seq_len) == (1, 16):
        assert expected == 2 * (16 * 2 * (4096 + 4096 + 4096 + 18432) + 4 * 256 * 64) + 2 * 64 * 50
    assert forward.get_total_flops() == expected
    assert backward.get_total_flops() == 2 * expected


def test_matmul_efficiency_runs_on_cpu(tmp_path):
    TINY.save_pretrained(tmp_path / "tiny")
    out = tmp_path / "m.json"
    result = matmul_efficiency.main(["--config", str(tmp_path / "tiny"), "--micro-batches", "1", "2",
                                     "--seq-len", "32", "--dtype", "fp32", "--device", "cpu", "--gemm-size", "128",
                                     "--repeats", "3", "--out", str(out)])
    assert json.loads(out.read_text()) == result
    assert result["gemm_peak_tflops"] > 0 and result["commit"]
    assert [r["micro_batch"] for r in result["results"]] == [1, 2]
    for r in result["results"]:
        assert not r["oom"] and r["forward_ms"] > 0
        assert r["forward_flops"] == matmul_efficiency.model_flops(TINY, r["micro_batch"], 32)
        assert r["forward_tflops"] == pytest.approx(r["forward_flops"] / r["forward_ms"] / 1e9)
        assert r["forward_of_peak"] == pytest.approx(r["forward_tflops"] / result["gemm_peak_tflops"])
    with pytest.raises(SystemExit, match="needs --device cuda"):
        matmul_efficiency.main(["--config", str(tmp_path / "tiny"), "--device", "cpu", "--card-gb", "32"])


def test_matmul_efficiency_caps_the_current_gpu(tmp_path, monkeypatch):
    """--card-gb on `--device cuda` (faked: this machine has none) caps the current GPU, named by
    its index as torch.cuda.set_per_process_memory_fraction requires (an H200 run failed on `cuda`)."""
    class Capped(Exception):
        pass

    def set_fraction(fraction, device):
        assert isinstance(device, int) or device.index is not None, device  # torch raises otherwise
        raise Capped(fraction, device)

    TINY.save_pretrained(tmp_path / "tiny")
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda d: type("P", (), {"total_memory": 64e9}))
    monkeypatch.setattr(torch.cuda, "set_per_process_memory_fraction", set_fraction)
    with pytest.raises(Capped) as capped:
        matmul_efficiency.main(["--config", str(tmp_path / "tiny"), "--device", "cuda", "--card-gb", "32"])
    assert capped.value.args == (0.5, torch.device("cuda", 1))


def test_offload_sweep_ratios_from_measured_times(tmp_path, profiling_runs):
    """One resident and one offloaded run (keep 1) of the built-in tiny model on one CPU rank at R = 2."""
    out = tmp_path / "sweep.json"
    result = offload_sweep.main(["--steps-per-block", "2", "--keep", "1", "--warmup", "1",
                                 "--work-dir", str(tmp_path / "runs"), "--out", str(out), "--timeout", "600",
                                 "--train-args", *SMALL])
    assert json.loads(out.read_text()) == result
    rows = result["results"]
    assert [(r["offload"], r["offload_keep"]) for r in rows] == [("none", 0), ("frozen", 1)]
    assert all(r["steps_per_block"] == 2 and r["step_ms"] > 0 and r["peak_gib"] > 0 for r in rows)
    assert rows[0]["step_over_resident"] == 1.0
    assert rows[1]["step_over_resident"] == rows[1]["step_ms"] / rows[0]["step_ms"]
    assert rows[1]["meets_targets"] == (rows[1]["step_over_resident"] <= 1.5 and rows[1]["peak_gb"] <= 10)
    assert result["best_keep"] == (1 if rows[1]["meets_targets"] else None) and result["commit"]
    # --merge with no new run: the rows kept, the ratios recomputed from the (here doubled) resident time
    out.write_text(json.dumps({**result, "results": [{**rows[0], "step_ms": 2 * rows[0]["step_ms"]}, rows[1]]}))
    merged = offload_sweep.main(["--steps-per-block", "2", "--no-resident", "--keep", "--out", str(out),
                                 "--merge"])["results"]
    assert [(r["offload"], r["offload_keep"]) for r in merged] == [("none", 0), ("frozen", 1)]
    assert merged[1]["step_over_resident"] == pytest.approx(rows[1]["step_ms"] / (2 * rows[0]["step_ms"]))


def test_preset_r_is_the_papers():
    assert offload_sweep.preset_steps_per_block(str(ROOT / "ds_configs" / "rtxpro6000_llama-3.1-8b.json")) == 48


def test_a_failing_run_is_named_with_its_error(tmp_path):
    """runs.train as the tools run it, real processes: a rank's failure ends the tool naming the run,
    the rank and the rank's own message (kept in a file, so a long run's output cannot block it)."""
    import runs

    failed = r"(?s)the bad run: rank 0 exited 2:.*argument --steps-per-block: invalid int value"
    with pytest.raises(SystemExit, match=failed):
        runs.train(["--steps-per-block", "ten"], 2, tmp_path / "run", 60, "the bad run")
    assert not (tmp_path / "run").exists()


def test_a_stopped_tool_stops_its_ranks_and_shows_their_last_output(tmp_path, monkeypatch):
    """gpu_checks.sh stops a step past its time limit with SIGTERM: the ranks must not live on (they
    would hold the GPU through the next step) and the tool says where they were. Each is sent
    SIGTERM (a rank then prints where it was: test_safety) and SIGKILL if it does not exit."""
    import runs

    started = []

    def start_rank(argv, env, log):  # a rank that reports its phase, then hangs; rank 1 ignores SIGTERM
        ignore = "import signal; signal.signal(signal.SIGTERM, signal.SIG_IGN); " if started else ""
        with open(log, "w") as out:
            started.append(subprocess.Popen([sys.executable, "-c", ignore + "print('offloading layers\\r"
                                             "layer 7 of 32', flush=True); import time; time.sleep(600)"], stdout=out))
        return started[-1]

    def stop_when_running():
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            logs = list(tmp_path.glob("logs/*"))  # made once train() handles SIGTERM
            if len(logs) == 2 and all("layer 7" in log.read_text() for log in logs):
                break
            time.sleep(0.05)
        os.kill(os.getpid(), signal.SIGTERM)

    monkeypatch.setattr(runs, "start_rank", start_rank)
    monkeypatch.setattr(runs, "STOP_GRACE_S", 1.0)
    monkeypatch.setattr(runs.tempfile, "TemporaryDirectory", lambda: contextlib.nullcontext(tmp_path / "logs"))
    (tmp_path / "logs").mkdir()
    handler = signal.getsignal(signal.SIGTERM)
    threading.Thread(target=stop_when_running, daemon=True).start()
    with pytest.raises(SystemExit, match=r"(?s)the hung run: the ranks were stopped.*rank 1:\noffloading layers\n"
                                         r"layer 7 of 32"):
        runs.train([], 2, tmp_path / "run", 300, "the hung run")
    assert [p.poll() for p in started] == [-signal.SIGTERM, -signal.SIGKILL]  # told first, killed if it stays
    assert signal.getsignal(signal.SIGTERM) is handler


def test_save_init_writes_the_model_and_tokenizer_the_run_draws(tmp_path):
    """profiling/save_init.py: loaded as a checkpoint (--model DIR), the directory gives the model a
    --from-config run draws, bit for bit and in its working dtype, and the same encoded examples."""
    from deca_ds.runtime.parsing import parse_args
    from deca_ds.runtime.plan import build_model, build_task

    LlamaConfig(**{**TINY.to_dict(), "vocab_size": 512}).save_pretrained(tmp_path / "config")
    run = ["--ds_config", str(ROOT / "ds_configs" / "cpu_demo.json"), "--seed", "3", "--working-dtype", "bf16"]
    drawn = [*run, "--from-config", "--model", str(tmp_path / "config")]
    out = save_init.main(["--out", str(tmp_path / "init"), "--train-args", *drawn])

    def start(args):
        opts, _ = parse_args(args)
        task = build_task(opts, 2)
        return build_model(opts, len(task.tokenizer)).state_dict(), task.data_fingerprints

    (want, want_data), (got, got_data) = start(drawn), start([*run, "--model", str(out)])
    assert list(got) == list(want) and all(got[k].dtype == torch.bfloat16 and torch.equal(got[k], want[k])
                                           for k in want)
    assert got_data == want_data
    with pytest.raises(SystemExit, match="exists; give a new directory"):  # never over an existing directory
        save_init.main(["--out", str(out), "--train-args", *drawn])
    with pytest.raises(SystemExit):  # only a drawn initialisation
        save_init.main(["--out", str(tmp_path / "other"), "--train-args", *run])


def test_shared_device_exact_on_cpu_ranks(tmp_path, profiling_runs, monkeypatch):
    """profiling/shared_device_exact.py (gpu_checks.sh's `exact`) on 2 CPU ranks: each client's
    weights equal the simulator's within the tool's bound, after the run moved them."""
    import shared_device_exact

    monkeypatch.setenv("DECA_RANK_THREADS", str(RANK_THREADS))
    out = tmp_path / "exact.json"
    with torch_threads():  # the tool sets the simulator's threads to the ranks'
        result = shared_device_exact.main(["--ranks", "2", "--out", str(out), "--work-dir", str(tmp_path / "run"),
                                           "--timeout", "300"])
    assert json.loads(out.read_text()) == result
    assert result["device_type"] == "cpu" and [c["client"] for c in result["clients"]] == [0, 1]
    assert result["within_bound"] and result["max_abs_diff"] <= result["bound"] == 1e-6
    assert all(c["max_change_from_init"] > 1e-4 for c in result["clients"])
    # the run writes no model (--no-export): 8B ones filled a lent machine's disk
    assert (tmp_path / "run" / "run_config.json").is_file() and not (tmp_path / "run" / "consensus").exists()


@needs_bnb
def test_state_8bit_measures_the_quantization_error_alone(tmp_path):
    """Fed the fp32 optimizer's x, g and x⁺ every step, the 8-bit one differs by its rounded moments
    only: about 1 % of a step (the committed results). It measured 40 % once both optimizers were
    handed the same x⁺, which bma_correct keeps as its master and the other's next step overwrote."""
    summary = state_8bit.main(["--lr", "1e-3", "--variants", "deca", "--layers", "2", "--clients", "2",
                               "--steps-per-block", "4", "--rounds", "1", "--out", str(tmp_path)])
    row, = summary["rows"]
    assert 0 < row["update_err_mean"] <= row["update_err_max"] < 0.05
    assert json.loads((tmp_path / "state_8bit.json").read_text())["rows"] == [row]
    # the state's bytes by hand: fp32 master + one byte per m and v value + an fp32 absmax per 256 of each tensor
    sizes = [p.numel() for p in state_8bit.tiny(2).model.layers[0].parameters()]
    n = sum(sizes)
    assert row["state_bytes_fp32"] == 12 * n
    assert row["state_bytes_8bit"] == 4 * n + 2 * n + 2 * 4 * sum(math.ceil(k / 256) for k in sizes)


def test_decaf_refactor_times_both_paths_to_the_same_factors(tmp_path):
    """profiling/decaf_refactor.py on CPU: every LoRA pair of the model (7 linear layers a decoder
    layer), both paths timed on each repeat, and the same B·A from both, to the bit."""
    TINY.save_pretrained(tmp_path / "model")
    payload = decaf_refactor.main(["--config", str(tmp_path / "model"), "--terms", "3", "--repeats", "2",
                                   "--out", str(tmp_path)])
    assert payload["pairs"] == 7 * TINY.num_hidden_layers and payload["max_relative_difference_of_BA"] == 0.0
    assert [r["path"] for r in payload["rows"]] == ["pair_by_pair", "batched"]
    assert all(len(r["ms_runs"].split(", ")) == 2 for r in payload["rows"])
    assert json.loads((tmp_path / "decaf_refactor.json").read_text())["rows"] == payload["rows"]


def test_op_counts_attributes_each_operation_to_its_phase(tmp_path):
    """profiling/op_counts.py on the synthetic grid's model (4 layers, 8 clients): Dec-LoRA and
    DeCAF differ only in their combination, and Dec-LoRA's local step issues exactly the eager
    half step's operations (kernels.half_step, P tensors, no weight decay or clipping): 3 scalars,
    a view of each gradient, 2 splits, the fold's 4 foreach calls, x½'s buffer and the step's 5 ops
    over the flat vectors, P + 15, nothing of the forward or backward."""
    grid = ROOT / "deca_ds" / "grids" / "cpu_synthetic.yaml"
    payload = op_counts.main(["--grid", str(grid), "--vocab", "64", "--methods", "deca", "dec_lora", "decaf",
                              "--cells", str(tmp_path / "none"), "--threads", "1", "--out", str(tmp_path)])
    rows = {r["method"]: r for r in payload["rows"]}
    lora, decaf = rows["dec_lora"], rows["decaf"]
    for phase in ("forward", "backward", "local_step"):
        assert lora[f"{phase}_ops"] == decaf[f"{phase}_ops"] > 0
    assert decaf["combine_ops"] > lora["combine_ops"] > 0
    P = 2 * 7 * 4  # A and B of every linear layer of 4 decoder layers
    assert lora["local_step_ops"] == P + 15
    assert rows["deca"]["forward_ops"] < lora["forward_ops"]  # no LoRA factors, dropout
    assert round(lora["step_ops"] / 8) == lora["client_step_ops"] and lora["gpu_s_per_step"] is None  # 8 clients
    assert json.loads((tmp_path / "op_counts.json").read_text())["rows"] == payload["rows"]
    assert "| dec_lora |" in (tmp_path / "op_counts.md").read_text()


def test_gpu_carry_fetches_only_wheels_the_lock_pins():
    """profiling/gpu_carry.sh --dry-run: the wheels for a lent GPU machine come at the lock's
    versions (pip download -c requirements/cpu.lock), so every one it names must be pinned there."""
    import re
    import shlex
    import subprocess

    done = subprocess.run(["bash", "profiling/gpu_carry.sh", "--dry-run"], cwd=ROOT, capture_output=True, text=True,
                          timeout=60, env={"PATH": "/usr/bin:/bin", "HOME": "/nonexistent"})
    assert done.returncode == 0, done.stderr
    download = next(shlex.split(line)[1:] for line in done.stdout.splitlines() if " pip download " in line)
    assert download[download.index("-c") + 1] == "requirements/cpu.lock"
    names = download[download.index("-d") + 2:]
    normal = lambda name: re.sub(r"[-_.]+", "-", name).lower()  # noqa: E731
    pinned = {normal(line.split("==")[0]) for line in (ROOT / "requirements" / "cpu.lock").read_text().splitlines()
              if "==" in line and not line.startswith("#")}
    assert len(names) == 23 and {normal(n) for n in names} <= pinned, set(map(normal, names)) - pinned
    # no DeepSpeed wheel in pip's cache here: it is built at the lock's version
    assert re.search(r"pip wheel --no-deps -w \.whl deepspeed==[\d.]+\n", done.stdout), done.stdout


def test_every_gpu_check_command_parses(tmp_path, monkeypatch):
    """gpu_checks.sh with DRY_RUN prints its commands, every step's: each tool's options parse, the
    runs' launch/train.py options resolve, and the grid passes --dry-run, so no lent GPU minute is
    lost to a typo."""
    import importlib
    import shlex
    import subprocess

    from deca_ds.reproduce import cli
    from deca_ds.runtime.parsing import parse_args as parse_run_args

    # bg: the steps after it, in the background
    steps = ("exact table9 memory offload setup terms ckpt trains matmul update aggshare compile aggpreset trace "
             "events fused4 fits fitsn decaf reproduce bg-finish bg reproduce").split()
    # the grid with an option of every cell set (the compiled cells' speed), in a runs directory of its own
    env = {"PATH": "/usr/bin:/bin", "DRY_RUN": "1", "OUT": str(tmp_path / "out"), "GRID_SET": "compile_layers=true",
           "GRID_RUNS": "runs/gpu_ag_news_compiled", "GRID_ARGS": "--only seed=0 method=dec_lora,decaf"}
    done = subprocess.run(["bash", "profiling/gpu_checks.sh", *steps], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 0 and not done.stderr, done.stderr
    commands = [shlex.split(line) for line in done.stdout.splitlines()]
    assert not (tmp_path / "out").exists()  # nothing set up, nothing packed
    monkeypatch.chdir(ROOT)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # --card asks for a GPU
    tools = set()
    for python, script, *args in commands:
        assert python == "python3", commands
        tools.add(script)
        if script == "launch/reproduce.py":
            args = [a for a in args if a != "--report-only"]
            assert cli.main([*args, "--dry-run", "--runs-dir", str(tmp_path / "runs")]) == 0
            continue
        parsed = importlib.import_module(Path(script).stem).parse_args(args)
        parsed = parsed[0] if isinstance(parsed, tuple) else parsed  # save_init: (args, run options)
        ds_config = ["--ds_config", parsed.ds_config] if hasattr(parsed, "ds_config") else []
        if parsed.__dict__.get("train_args") and "--ds_config" not in parsed.train_args:
            parse_run_args([*ds_config, *parsed.train_args])
    assert len(commands) == 36 and len(tools) == 9, sorted(tools)
    grids = [c for c in commands if c[1] == "launch/reproduce.py"]
    assert len(grids) == 4 and all(c[c.index("--set") + 1] == "compile_layers=true" for c in grids)
    assert all(c[c.index("--runs-dir") + 1] == "runs/gpu_ag_news_compiled" for c in grids)


def test_profile_resources_says_where_clients_time_share_a_gpu():
    """Several clients on one GPU take turns on it: the table must say so (not on CPU ranks, nor one per GPU)."""
    import profile_resources

    assert profile_resources.sharing([{"clients_per_gpu": {}}, {"clients_per_gpu": {"0": 1, "1": 1}}]) == ""
    text = profile_resources.sharing([{"clients_per_gpu": {"0": 4}}, {"clients_per_gpu": {"0": 4, "1": 1}}])
    assert "time-share their GPU (4 on GPU 0)" in text and "not one-GPU-per-client figures" in text


def test_profile_resources_repeats_alternate_the_settings_and_report_the_medians(tmp_path, monkeypatch):
    """--repeats 3: the settings run A B, B A, A B (the later of two runs has been the slower on a
    GPU), and each row is the median of its runs, with every run's step time kept."""
    import profile_resources

    ran, steps = [], iter([100.0, 80.0, 130.0, 90.0, 110.0, 70.0])  # step times in the order the runs go

    def measure(out, warmup):
        step = next(steps)
        return {"trainable_params": 7, "samples": 3, "fwd_ms": step / 2, "bkwd_ms": step / 2 - 5, "agg_up_ms": 5.0,
                "agg_ms": 1.0, "exchange_ms": 0.0, "update_ms": 4.0, "step_ms": step, "wall_ms": step + 1,
                "comm_mb": 0.0, "clients_per_gpu": {}, "peak_gib": 2.0 if step > 100 else 1.0, "estimate_gib": 1.5}

    monkeypatch.setattr(profile_resources.runs, "train", lambda args, ranks, out, limit, what: ran.append(what) or out)
    monkeypatch.setattr(profile_resources, "measure", measure)
    summary = profile_resources.main(["--methods", "deca", "--updates", "eager", "fused", "--repeats", "3",
                                      "--work-dir", str(tmp_path / "runs"), "--out", str(tmp_path)])
    assert ran == ["deca_1", "deca_fused_1", "deca_fused_2", "deca_2", "deca_3", "deca_fused_3"]
    eager, fused = summary["results"]
    assert (eager["method"], eager["runs"], eager["samples"]) == ("DECA", 3, 9)
    assert eager["step_ms_runs"] == [100.0, 90.0, 110.0] and fused["step_ms_runs"] == [80.0, 130.0, 70.0]
    assert (eager["step_ms"], eager["fwd_ms"], eager["wall_ms"]) == (100.0, 50.0, 101.0) and fused["step_ms"] == 80.0
    assert (eager["peak_gib"], fused["peak_gib"], eager["estimate_gib"]) == (2.0, 2.0, 1.5)  # the largest
    assert summary["ratios"]["deca_agg_up_share_of_step"] == 5.0 / 100.0
    md = (tmp_path / "profile_resources.md").read_text()
    assert "DECA 100.00, 90.00, 110.00; DECA (fused) 80.00, 130.00, 70.00." in md
    with pytest.raises(SystemExit):
        profile_resources.parse_args(["--repeats", "0"])


def test_profile_resources_compiled_runs_compile_the_layers_beside_the_fused_update(tmp_path, monkeypatch):
    """--updates fused compiled: the compiled runs are the fused ones with --compile-layers, each a row of
    its own, and the compiled step over the fused one is a ratio."""
    import profile_resources

    ran, steps = {}, iter([120.0, 40.0])

    def measure(out, warmup):
        step = next(steps)
        return {"trainable_params": 7, "samples": 3, "fwd_ms": step / 2, "bkwd_ms": step / 2 - 4, "agg_up_ms": 4.0,
                "agg_ms": 1.0, "exchange_ms": 0.0, "update_ms": 3.0, "step_ms": step, "wall_ms": step + 1,
                "comm_mb": 0.0, "clients_per_gpu": {}}

    monkeypatch.setattr(profile_resources.runs, "train",
                        lambda args, ranks, out, limit, what: ran.setdefault(what, args) and out)
    monkeypatch.setattr(profile_resources, "measure", measure)
    summary = profile_resources.main(["--methods", "deca", "--updates", "fused", "compiled",
                                      "--work-dir", str(tmp_path / "runs"), "--out", str(tmp_path)])
    flags = {what: [a for a in args if a in ("--fused-update", "--compile-layers")] for what, args in ran.items()}
    assert flags == {"deca_fused": ["--fused-update"], "deca_compiled": ["--fused-update", "--compile-layers"]}
    assert [(r["method"], r["update"]) for r in summary["results"]] == [
        ("DECA (fused)", "fused"), ("DECA (fused, compiled layers)", "compiled")]
    assert summary["ratios"]["deca_compiled_step_over_fused"] == 40.0 / 120.0
    assert summary["ratios"]["deca_compiled_agg_up_share_of_step"] == 4.0 / 40.0


def test_device_peak_is_a_gpu_runs_peak_beside_its_estimate(tmp_path, monkeypatch):
    """runs.device_peak (profile_resources' memory column): the largest mem_peak of any client's step
    beside the estimate of the run run_config.json describes, a baseline's from
    deca_ds.baseline_memory with the run's own options; nothing from CPU ranks (RSS)."""
    from dataclasses import asdict

    import runs
    from deca_ds.baseline_memory import estimate_method
    from deca_ds.memory import GiB, Workload
    from deca_ds.methods import AdamConfig, DecLoRA
    from deca_ds.runtime.parsing import parse_args

    config = ROOT / "profiling" / "configs" / "qwen2-1.5b.json"
    opts, ds = parse_args(["--preset", "rtx5090_qwen2-1.5b", "--from-config", "--model", str(config),
                           "--method", "dec_lora", "--lora-rank", "4"])
    run_config = {"options": asdict(opts), "ds_config": ds, "topology": {"neighbors": [[1], [0]]},
                  "loss_positions_max": 2}
    (tmp_path / "run_config.json").write_text(json.dumps(run_config))
    monkeypatch.setattr(runs, "metrics", lambda out: [[{"mem_peak": 3 * GiB}, {"mem_peak": 5 * GiB}],
                                                      [{"mem_peak": 4 * GiB}]])
    workload = Workload(working_dtype=opts.working_dtype, n_neighbors=1, micro_batch=opts.micro_batch,
                        seq_len=opts.max_seq_len, checkpointing="activation_checkpointing" in ds, loss_positions=2)
    expected = estimate_method(config, DecLoRA(AdamConfig(steps=1), rank=4), workload)
    assert runs.device_peak(tmp_path) == {"peak_gib": 5.0, "estimate_gib": expected.peak / GiB}
    monkeypatch.setattr(runs, "metrics", lambda out: [[{"mem_rss": 3 * GiB}]])
    assert runs.device_peak(tmp_path) == {"peak_gib": None, "estimate_gib": None}
