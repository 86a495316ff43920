"""deca_ds.reproduce.placement: where each cell goes. A deepspeed cell's ranks, resolved by
DeepSpeed's own launcher code (its hostfile parser and --include filter) to the slots meant, held
while it runs so that cells at once never share a GPU; a simulated cell's GPU; and every cell that
cannot fit refused before any runs."""

from __future__ import annotations

import threading
from contextlib import ExitStack

import pytest
import torch
from deepspeed.launcher.runner import fetch_hostfile, parse_inclusion_exclusion

from deca_ds.reproduce import Cell, GridError, build_grid
from deca_ds.reproduce.placement import Launch, placement


def grid(tmp_path, clients=(8,), **top):
    """A deepspeed grid of one method whose clients table has these numbers of clients."""
    return build_grid({"name": "placed", "backend": "deepspeed", "ds_config": "ds_configs/cpu_demo.json",
                       "options": {"model": "tiny", "dataset": "synthetic", "clients": clients[0]},
                       "tasks": {"synthetic": {}}, "methods": ["deca"], "seeds": [0],
                       "sweeps": [{"table": "main"}, {"table": "clients", "clients": list(clients)}], **top},
                      runs_dir=tmp_path / "runs")


def cell(clients: int, ranks_per_client: int = 1) -> Cell:
    return Cell("synthetic", "deca", "ring", clients, 1, 0, options={"ranks_per_client": ranks_per_client})


def args_of(place, clients: int, ranks_per_client: int = 1) -> list[str]:
    """The launcher's arguments of a cell that runs alone."""
    with place.cell(cell(clients, ranks_per_client), lambda: False) as launch:
        return launch.args


def resolved(args: list[str], pool: dict[str, int]) -> dict[str, list[int]]:
    """The slots the deepspeed launcher gives a launch with these arguments, from its pool."""
    include = args[args.index("--include") + 1]
    return dict(parse_inclusion_exclusion(pool, include, ""))


def port(args: list[str]) -> int:
    return int(args[args.index("--master_port") + 1])


@pytest.fixture
def gpus(monkeypatch):
    """A machine with 8 GPUs, as torch sees it."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 8)


def test_cpu_ranks_are_started_by_count_each_launch_on_its_own_port(tmp_path):
    g = grid(tmp_path, clients=(2, 3))
    place = placement(g, g.cells, env={})
    assert place.where == "CPU ranks"
    args = args_of(place, 3)
    assert args[:3] == ["--num_gpus", "3", "--master_port"] and 0 < port(args) < 65536 and len(args) == 4


def test_a_cell_takes_the_first_free_gpus_a_scheduler_gave_the_grid(tmp_path, gpus):
    g = grid(tmp_path, clients=(2, 4))
    # deepspeed's --num_gpus would drop CUDA_VISIBLE_DEVICES and take GPUs 0 and 1
    place = placement(g, g.cells, env={"CUDA_VISIBLE_DEVICES": "4,5,6,7"})
    assert place.where == "GPUs 4,5,6,7 of this machine (CUDA_VISIBLE_DEVICES)"
    assert resolved(args_of(place, 2), {"localhost": 8}) == {"localhost": [4, 5]}
    assert resolved(args_of(place, 4), {"localhost": 8}) == {"localhost": [4, 5, 6, 7]}
    assert "--master_port" in args_of(place, 2)
    # all of the machine's when nothing restricts them; two ranks per client, each on a GPU of its own
    assert resolved(args_of(placement(g, g.cells, env={}), 3, 2), {"localhost": 8}) == {"localhost": [0, 1, 2, 3, 4, 5]}


def test_cells_at_once_hold_gpus_of_their_own_and_a_cell_waits_for_enough(tmp_path, gpus):
    g = grid(tmp_path, clients=(4,), jobs=3)
    place = placement(g, g.cells, env={})
    pool = {"localhost": 8}
    got, started = [], threading.Event()

    def third() -> None:  # 4 clients, while only GPUs 6 and 7 are free
        with place.cell(cell(4), lambda: False) as launch:
            got.append(resolved(launch.args, pool))
            started.set()

    waiting = threading.Thread(target=third)
    with ExitStack() as second:
        with place.cell(cell(4), lambda: False) as first:
            launch = second.enter_context(place.cell(cell(2), lambda: False))
            assert resolved(first.args, pool) == {"localhost": [0, 1, 2, 3]}
            assert resolved(launch.args, pool) == {"localhost": [4, 5]} and port(launch.args) != port(first.args)
            with place.cell(cell(4), lambda: True) as stopped:  # the grid stopped while it waited
                assert stopped is None
            waiting.start()
            assert not started.wait(timeout=0.5)
        waiting.join(timeout=60)  # the first cell has ended: its GPUs, not the second's
        assert got == [{"localhost": [0, 1, 2, 3]}]


def test_cells_beyond_the_gpus_are_refused_before_any_runs(tmp_path, gpus):
    g = grid(tmp_path, clients=(4, 6, 8))
    with pytest.raises(GridError, match=r"2 cell\(s\) need more GPUs than GPUs 4,5,6,7 of this machine "
                                        r"\(CUDA_VISIBLE_DEVICES\), e\.g\. synthetic/ring-n6-lpb1/deca/seed0: "
                                        r"6 clients x 1 rank\(s\).*--hostfile.* or more clients a GPU "
                                        r"\(clients_per_gpu\), .*--only"):
        placement(g, g.cells, env={"CUDA_VISIBLE_DEVICES": "4,5,6,7"})
    # the cells that fit go on where --only leaves out the others
    assert placement(g, [c for c in g.cells if c.clients == 4], env={"CUDA_VISIBLE_DEVICES": "4,5,6,7"})
    with pytest.raises(GridError, match=r"CUDA_VISIBLE_DEVICES=GPU-1a2b: .* by GPU index"):
        placement(g, g.cells, env={"CUDA_VISIBLE_DEVICES": "GPU-1a2b"})


def test_a_hostfile_gives_each_cell_the_fewest_hosts_clients_spread_evenly(tmp_path):
    hosts = tmp_path / "hosts"
    hosts.write_text("# two 8-GPU nodes and a small one\nnode-a slots=8\nnode-b slots=8\nnode-c slots=4\n")
    g = grid(tmp_path, clients=(8, 12, 16, 20), deepspeed_args=["--hostfile", str(hosts), "--ssh_port", "2222"])
    place = placement(g, g.cells, env={"CUDA_VISIBLE_DEVICES": "0"})  # a hostfile's slots are not this machine's
    pool = fetch_hostfile(str(hosts))
    every = list(range(8))
    assert resolved(args_of(place, 8), pool) == {"node-a": every}
    assert resolved(args_of(place, 12), pool) == {"node-a": every[:6], "node-b": every[:6]}
    assert resolved(args_of(place, 16), pool) == {"node-a": every, "node-b": every}
    assert resolved(args_of(place, 20), pool) == {"node-a": every, "node-b": every, "node-c": [0, 1, 2, 3]}
    # two ranks per client, a client on one host: 3 clients on node-a, 3 on node-b
    assert resolved(args_of(place, 6, 2), pool) == {"node-a": every[:6], "node-b": every[:6]}
    args = args_of(place, 12)
    assert args[:4] == ["--hostfile", str(hosts), "--ssh_port", "2222"] and port(args) == 29500
    # cells at once: the freest hosts first, and on a host another cell uses, a port of their own
    with place.cell(cell(4), lambda: False) as first, place.cell(cell(4), lambda: False) as second, \
            place.cell(cell(4), lambda: False) as third:
        assert [(resolved(launch.args, pool), port(launch.args)) for launch in (first, second, third)] == [
            ({"node-a": [0, 1, 2, 3]}, 29500), ({"node-b": [0, 1, 2, 3]}, 29500), ({"node-a": [4, 5, 6, 7]}, 29504)]
    g = grid(tmp_path, clients=(8, 24), deepspeed_args=["--hostfile", str(hosts)])
    with pytest.raises(GridError, match=rf"1 cell\(s\) need more GPUs than hostfile {hosts} \(node-a: 8, node-b: 8, "
                                        r"node-c: 4 slots\), e\.g\. synthetic/ring-n24-lpb1/deca/seed0: 24") as refused:
        placement(g, g.cells, env={})
    assert "clients_per_gpu" not in str(refused.value)  # which a hostfile cannot take


def test_simulated_cells_spread_over_the_gpus(tmp_path, gpus):
    g = build_grid({"options": {"model": "tiny", "clients": 2}, "tasks": {"synthetic": {}}, "methods": ["deca"],
                    "seeds": [0], "jobs": 3}, runs_dir=tmp_path)
    place = placement(g, g.cells, env={"CUDA_VISIBLE_DEVICES": "2,3"})
    assert place.where == "GPUs 2,3 of this machine (CUDA_VISIBLE_DEVICES)"
    with place.cell(cell(8), lambda: False) as first, place.cell(cell(8), lambda: False) as second, \
            place.cell(cell(8), lambda: False) as third:
        assert [first, second, third] == [Launch(env={"CUDA_VISIBLE_DEVICES": gpu}) for gpu in ("2", "3", "2")]
    with place.cell(cell(8), lambda: False) as after:  # the least busy again
        assert after == Launch(env={"CUDA_VISIBLE_DEVICES": "2"})
    with placement(g, g.cells, env={"CUDA_VISIBLE_DEVICES": "3"}).cell(cell(8), lambda: False) as alone:
        assert alone == Launch()  # one GPU: the cell's process sees it as it is


def test_deepspeed_args_that_place_or_name_the_port_are_kept_and_bad_ones_refused(tmp_path):
    g = grid(tmp_path, deepspeed_args=["--include", "localhost:2,3", "--master_port", "29612"])
    assert args_of(placement(g, g.cells, env={}), 2) == ["--include", "localhost:2,3", "--master_port", "29612"]
    g = grid(tmp_path, deepspeed_args=["--num_gpus", "2"], jobs=2)
    with pytest.raises(GridError, match=r"jobs 2: deepspeed_args \['--num_gpus', '2'\] place every cell's ranks on "
                                        "the same GPUs"):
        placement(g, g.cells, env={})
    (tmp_path / "hosts").write_text("node-a 8\n")
    g = grid(tmp_path, deepspeed_args=["--hostfile", str(tmp_path / "hosts")])
    with pytest.raises(GridError, match=r"hostfile .*hosts: Hostfile contains a bad entry: node-a 8"):
        placement(g, g.cells, env={})
    (tmp_path / "hosts").write_text("node-a slots=8\n")
    g = grid(tmp_path, deepspeed_args=["--hostfile", str(tmp_path / "hosts"), "--launcher", "slurm"])
    with pytest.raises(GridError, match=r"--launcher slurm: deca-train joins its job through RANK, WORLD_SIZE and "
                                        r"MASTER_ADDR, which the pdsh launcher \(the default\) sets"):
        placement(g, g.cells, env={})
    g = grid(tmp_path, deepspeed_args=["--hostfile", str(tmp_path / "nowhere")])
    with pytest.raises(GridError, match=r"hostfile .*nowhere does not exist"):
        placement(g, g.cells, env={})
    g = grid(tmp_path, deepspeed_args=["--num_gpu", "2", "--no-such-flag"])
    with pytest.raises(GridError, match=r"deepspeed_args \['--num_gpu', '2', '--no-such-flag'\]: the deepspeed "
                                        "launcher refuses them"):
        placement(g, g.cells, env={})


def test_deca_reproduce_places_a_run_by_its_own_hostfile(tmp_path, capsys):
    """--deepspeed-args replaces the grid's for one run (a cluster job's own hosts); --dry-run says
    where the cells go, and a hostfile too small for a cell stops the command before anything runs."""
    import yaml

    from deca_ds.reproduce.cli import main

    hosts = tmp_path / "hosts.1234"
    hosts.write_text("node-a slots=8\nnode-b slots=8\n")
    path = tmp_path / "grid.yaml"
    path.write_text(yaml.safe_dump({"name": "placed", "backend": "deepspeed", "ds_config": "ds_configs/cpu_demo.json",
                                    "runs_dir": str(tmp_path / "runs"), "deepspeed_args": ["--hostfile", "nowhere"],
                                    "options": {"model": "tiny", "dataset": "synthetic", "clients": 12},
                                    "tasks": {"synthetic": {}}, "methods": ["deca"], "seeds": [0]}))
    assert main([str(path), "--dry-run", f"--deepspeed-args=--hostfile {hosts}"]) == 0
    assert f"(deepspeed, 1 at a time, timeout 3600 s per cell, on hostfile {hosts} (node-a: 8, node-b: 8 slots))" \
        in capsys.readouterr().out
    hosts.write_text("node-a slots=8\n")
    assert main([str(path), f"--deepspeed-args=--hostfile {hosts}"]) == 2
    assert "need more GPUs than hostfile" in capsys.readouterr().err and not (tmp_path / "runs").exists()
    assert main([str(path), "--dry-run"]) == 2  # the grid's own hostfile is not there
    assert "hostfile nowhere does not exist" in capsys.readouterr().err
    with pytest.raises(GridError, match=r"deepspeed_args must be a list .* got '--hostfile hosts'"):
        grid(tmp_path, deepspeed_args="--hostfile hosts")
    with pytest.raises(GridError, match=r"deepspeed_args \['--hostfile', 'hosts'\]: the simulate backend starts no"):
        build_grid({"options": {"model": "tiny", "clients": 2}, "tasks": {"synthetic": {}}, "methods": ["deca"],
                    "seeds": [0], "deepspeed_args": ["--hostfile", "hosts"]})


def test_clients_share_the_gpus_a_cell_takes_started_by_torchrun(tmp_path, gpus):
    """clients_per_gpu 4 on the two GPUs a scheduler gave the grid: a cell's ranks spread over both
    as evenly as their room allows, each local rank put on its GPU by --device-map, over gloo."""
    g = grid(tmp_path, clients=(3, 8), jobs=2, clients_per_gpu=4)
    place = placement(g, g.cells, env={"CUDA_VISIBLE_DEVICES": "6,7"})
    assert place.where == "GPUs 6,7 of this machine (CUDA_VISIBLE_DEVICES), up to 4 clients a GPU"
    with place.cell(cell(8), lambda: False) as full:
        assert full.launcher == "torchrun" and full.env == {"CUDA_VISIBLE_DEVICES": "6,7"}
        assert full.args[:4] == ["--nproc-per-node", "8", "--master-addr", "127.0.0.1"]
        assert full.args[-2] == "--master-port"
        assert full.train_args == ["--device-map", "0,0,0,0,1,1,1,1", "--transport", "gloo"]
        with place.cell(cell(1), lambda: True) as waited:  # no room left: it waits, here until stopped
            assert waited is None
    with place.cell(cell(3), lambda: False) as first, place.cell(cell(3), lambda: False) as second:
        # the first takes 2 + 1; the second the freest GPU first, 7 (3 free) then 6 (2 free): 1 + 2
        assert [launch.train_args[1] for launch in (first, second)] == ["0,0,1", "0,1,1"]
        assert first.args[-1] != second.args[-1]
        with place.cell(cell(3), lambda: True) as waited:  # 2 free, 3 needed
            assert waited is None
        with place.cell(cell(2), lambda: False) as third:
            assert third.train_args[1] == "0,1" and third.env == {"CUDA_VISIBLE_DEVICES": "6,7"}
    small = [c for c in g.cells if c.clients == 3]
    with placement(g, small, env={"CUDA_VISIBLE_DEVICES": "5"}).cell(cell(3), lambda: False) as one:
        assert one.env == {"CUDA_VISIBLE_DEVICES": "5"} and one.train_args[1] == "0,0,0"
    with pytest.raises(GridError, match=r"1 cell\(s\) need more GPUs than GPU 5 of this machine "
                                        r"\(CUDA_VISIBLE_DEVICES\), up to 4 clients a GPU, e\.g\. "
                                        r"synthetic/ring-n8-lpb1/deca/seed0: 8 clients x 1 rank\(s\), "
                                        r"up to 4 on a GPU"):
        placement(g, g.cells, env={"CUDA_VISIBLE_DEVICES": "5"})


def test_clients_per_gpu_is_refused_where_it_cannot_place_ranks(tmp_path):
    g = grid(tmp_path, clients_per_gpu=2)
    place = placement(g, g.cells, env={})  # CPU ranks share no GPU: started by count, as without it
    assert place.where == "CPU ranks" and args_of(place, 8)[:2] == ["--num_gpus", "8"]
    (tmp_path / "hosts").write_text("node-a slots=8\n")
    g = grid(tmp_path, clients_per_gpu=2, deepspeed_args=["--hostfile", str(tmp_path / "hosts")])
    with pytest.raises(GridError, match=r"clients_per_gpu 2: ranks that share a GPU are started by torchrun on this "
                                        r"machine, without the deepspeed launcher's hostfile .*hosts"):
        placement(g, g.cells, env={})
    g = grid(tmp_path, clients_per_gpu=2, deepspeed_args=["--include", "localhost:0"])
    with pytest.raises(GridError, match=r"without the deepspeed launcher's arguments \['--include', 'localhost:0'\]"):
        placement(g, g.cells, env={})
    for change, message in (({"clients_per_gpu": 0}, r"clients_per_gpu must be an integer >= 1, got 0"),
                            ({"clients_per_gpu": True}, r"clients_per_gpu must be an integer >= 1, got True"),
                            ({"clients_per_gpu": 2, "backend": "simulate"},
                             r"clients_per_gpu 2: the simulate backend runs every client of a cell in one process"),
                            ({"clients_per_gpu": 2, "options": {"model": "tiny", "clients": 4, "ranks_per_client": 2}},
                             r"cell synthetic/ring-n4-lpb1/deca/seed0 has 2 ranks per client, which need a GPU each"),
                            ({"clients_per_gpu": 2, "options": {"model": "tiny", "clients": 4, "transport": "nccl"}},
                             r"sets transport nccl, and ranks that share a GPU talk over gloo")):
        with pytest.raises(GridError, match=message):
            grid(tmp_path, **change)
