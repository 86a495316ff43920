"""The typed run config of deca-train: run files converted to the declared types, unknown keys
refused with a suggestion, presets by name, precedence, a fast torch-free --help, --print-config
round trips, and the commands the docs show still parse."""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import yaml

from deca_ds import estimate as estimate_module
from deca_ds.mapping_files import load_json, load_yaml
from deca_ds.runtime import options as options_module
from deca_ds.runtime.options import RunOptions
from deca_ds.runtime.parsing import build_parser, default_text, dump_config, parse_args
from deca_ds.runtime.presets import PRESET_DIR, preset_names
from deca_ds.train import main as train_main
from helpers import HAS_BNB, needs_bnb

ROOT = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "PYTHONPATH": str(ROOT)}


def run_file(tmp_path: Path, text: str, name: str = "run.yaml") -> str:
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def test_yaml_values_are_converted_to_the_declared_types(tmp_path):
    # YAML 1.1 reads 5e-5 and 1e2 (no dot) as strings; the declared types decide
    path = run_file(tmp_path, "lr: 5e-5\nsteps_per_block: 1e2\nrounds: '3'\nadam_betas: [0.8, 0]\n"
                              "iid: 'yes'\neps: 1e-6\n")
    assert yaml.safe_load(Path(path).read_text())["lr"] == "5e-5"
    opts, _ = parse_args(["--config", path])
    assert opts.lr == 5e-5 and type(opts.lr) is float
    assert opts.steps_per_block == 100 and type(opts.steps_per_block) is int
    assert opts.rounds == 3 and type(opts.rounds) is int
    assert opts.adam_betas == (0.8, 0.0) and all(type(b) is float for b in opts.adam_betas)
    assert opts.iid is True
    assert opts.eps == 1e-6
    # one module name becomes the list
    opts, _ = parse_args(["--config", run_file(tmp_path, "lora_targets: q_proj\n")])
    assert opts.lora_targets == ["q_proj"]


def test_a_path_options_tilde_is_the_home_wherever_no_shell_expands_it(tmp_path, monkeypatch):
    """A run file, a grid, deca-pretrain's options and `--flag=~/x` reach the command with `~` as
    written; each path option takes it as the home, where a run used to make a directory named `~`."""
    from deca_ds.reproduce.grid import build_grid
    from deca_ds.reproduce.pretrain import PretrainOptions

    home = tmp_path / "home"
    monkeypatch.setenv("HOME", str(home))
    path = run_file(tmp_path, "output_dir: ~/runs/a\ndataset: files\ndata_files: [train=~/d/train.jsonl, "
                              "test=~/d/test.jsonl]\ntoken_cache: ~/cache\nmodel: ~/models/m\n")
    opts, _ = parse_args(["--config", path, "--topology", "file", "--matrix-file=~/W.json",
                          "--questions=vicuna=~/q.jsonl"])
    assert (opts.output_dir, opts.data_files, opts.token_cache, opts.model, opts.matrix_file, opts.questions) == (
        f"{home}/runs/a", [f"train={home}/d/train.jsonl", f"test={home}/d/test.jsonl"], f"{home}/cache",
        f"{home}/models/m", f"{home}/W.json", [f"vicuna={home}/q.jsonl"])
    assert RunOptions(model="~alice/m", output_dir="runs/~").output_dir == "runs/~"  # only a leading ~ is the home
    pretrain = PretrainOptions("~/base", dataset="files", data_files=["train=~/d.jsonl"])
    assert (pretrain.output_dir, pretrain.data_files) == (f"{home}/base", [f"train={home}/d.jsonl"])
    grid = build_grid({"name": "g", "options": {"model": "tiny", "clients": 2, "data_files": ["train=~/d.jsonl"],
                                                "dataset": "files", "text_column": "text", "label_column": "label"},
                       "tasks": {"files": {}}, "methods": ["deca"], "seeds": [0], "runs_dir": "~/grid"})
    assert grid.runs_dir == home / "grid" and grid.results_dir == home / "grid" / "results"
    assert grid.cells[0].options["data_files"] == [f"train={home}/d.jsonl"]
    # every command's own path flags, and a preset or run file by path
    from deca_ds.estimate import parse_args as estimate_args
    from deca_ds.export import build_parser as export_parser
    from deca_ds.reproduce.cli import parser as reproduce_parser
    from deca_ds.runtime.evaluate import build_parser as eval_parser
    from deca_ds.runtime.split import split_parser

    flags = {
        eval_parser(): ["--model=~/m", "--run=~/r", "--out=~/o.json", "--questions=~/q.jsonl", "--answers=~/a.jsonl",
                        "--judge-references=~/ref.jsonl"],
        export_parser(): ["--run=~/r", "--checkpoint=latest", "--out=~/o"],
        reproduce_parser(): ["g.yaml", "--tables-from=~/results.json"],
        split_parser(): ["--out=~/sites"],
        build_parser(): ["--config=~/run.yaml"],
    }
    for parser, argv in flags.items():
        parsed = vars(parser.parse_args(argv))
        for flag in argv:
            if "=~/" in flag:
                name = flag.split("=")[0].removeprefix("--").replace("-", "_")
                assert parsed[name] in (f"{home}/{flag.split('/')[1]}", [f"{home}/{flag.split('/')[1]}"]), flag
    args = estimate_args(["--config=~/config.json", "--out=~/est"])
    assert (args.config, args.out) == ([f"{home}/config.json"], f"{home}/est")
    home.mkdir(exist_ok=True)
    (home / "ds.json").write_text(json.dumps({"train_micro_batch_size_per_gpu": 3}))
    (home / "run.yaml").write_text("deepspeed: ~/ds.json\nrounds: 2\n")
    opts, ds = parse_args(["--config=~/run.yaml"])
    assert (opts.rounds, opts.micro_batch or ds["train_micro_batch_size_per_gpu"]) == (2, 3)
    assert parse_args(["--preset=~/ds.json"])[1]["train_micro_batch_size_per_gpu"] == 3


@pytest.mark.parametrize("text, message", [
    ("lr: fast\n", "lr: expected a float, got 'fast'"),
    ("rounds: 1.5\n", "rounds: expected an integer, got 1.5"),
    ("rounds: true\n", "rounds: expected an integer, got True"),
    ("model: 3\n", "model: expected a string, got 3 (quote it)"),
    ("text_column: 3\n", "text_column: expected a string or null, got 3 (quote it)"),
    ("lr: null\n", "lr: expected a float, got null"),
    ("iid: maybe\n", "iid: expected a boolean, got 'maybe'"),
    ("adam_betas: [0.9]\n", "adam_betas: expected a list of 2 numbers, got [0.9]"),
    ("clients: many\n", "clients: expected an integer or null, got 'many'"),
    ("topology: star\n", "topology: expected one of ring, erdos_renyi"),
    ("state_bits: 16\n", "state_bits: expected one of 32, 8; got 16"),
    ("stepz_per_block: 3\n", "unknown option 'stepz_per_block' (did you mean 'steps_per_block'?)"),
    ("steps-per-block: 3\n", "unknown option 'steps-per-block' (did you mean 'steps_per_block'?)"),
    ("deepspeeed: {}\n", "unknown option 'deepspeeed' (did you mean 'deepspeed'?)"),
    ("- lr\n", "must hold a mapping of options"),
    ("lr: [\n", "is not valid YAML"),
    # parsers keep a repeated key's last value: the run would train with whichever came second
    ("lr: 1e-4\nrounds: 2\nlr: 3e-4\n",
     "is not valid YAML: the key 'lr' is given twice (lines 1 and 3); give each key once"),
    ("deepspeed:\n  gradient_clipping: 1.0\n  gradient_clipping: 0.5\n", "the key 'gradient_clipping' is given twice"),
    ("deepspeed: {zero_optimization: {stage: 2}}\n", "ZeRO stages above 0"),
    ("deepspeed: {optimiser: {}}\n", "unknown key(s) ['optimiser']"),
    ("deepspeed: 3\n", "expected a mapping of DeepSpeed keys or a preset's name or path"),
    ("deepspeed: {deca: {rounds: x}}\n", "\"deca\" section of "),
    ("deepspeed: {deca: {rounds: x}}\n", "run.yaml: deepspeed: rounds: expected an integer, got 'x'"),
])
def test_bad_run_file_names_the_key_and_the_expected_type(tmp_path, text, message):
    path = run_file(tmp_path, text)
    with pytest.raises(ValueError) as err:
        parse_args(["--config", path])
    assert message in str(err.value)
    if "deepspeed" not in text and "mapping" not in message and "YAML" not in message:
        assert str(err.value).startswith(path)  # the file is named, then the key


def test_a_key_given_twice_is_refused_at_any_depth_and_a_merge_key_may_be_overridden():
    """What the run file, preset and grid file loaders share (deca_ds.mapping_files): the
    parsers' results where keys are unique, an error naming the key where one repeats."""
    text = "base: &b {lr: 1.0e-3, rounds: 2}\nrun:\n  <<: *b\n  lr: 5.0e-4\n"
    assert load_yaml(text) == yaml.safe_load(text) == {"base": {"lr": 1e-3, "rounds": 2},
                                                       "run": {"lr": 5e-4, "rounds": 2}}
    with pytest.raises(yaml.YAMLError, match=r"the key 'lr' is given twice \(lines 3 and 5\)"):
        load_yaml("run:\n  deepspeed:\n    lr: 1\n    rounds: 2\n    lr: 3\n")
    with pytest.raises(yaml.YAMLError, match=r"the key 1 is given twice \(lines 1 and 2\)"):
        load_yaml("1: a\n1: b\n")
    assert load_json('{"lr": 0.5, "deca": {"a": [1, 2]}}') == {"lr": 0.5, "deca": {"a": [1, 2]}}
    with pytest.raises(ValueError, match="the key 'a' is given twice in one object"):
        load_json('{"x": [{"a": 1, "a": 2}]}')
    with pytest.raises(json.JSONDecodeError):
        load_json('{"x": ')


def test_run_file_holds_everything_and_the_command_line_wins(tmp_path):
    text = ("rounds: 2\nlr: 3e-4\nmax_seq_len: 16\n"
            "deepspeed:\n  train_micro_batch_size_per_gpu: 4\n  gradient_accumulation_steps: 2\n"
            "  gradient_clipping: 1.0\n")
    opts, ds = parse_args(["--config", run_file(tmp_path, text), "--rounds", "5"])
    assert (opts.rounds, opts.lr, opts.max_seq_len) == (5, 3e-4, 16)
    assert (opts.micro_batch, opts.grad_accum) == (4, 2)
    assert ds == {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2, "gradient_clipping": 1.0}
    # --micro-batch overrides the DeepSpeed key it names
    opts, ds = parse_args(["--config", run_file(tmp_path, text), "--micro-batch", "8"])
    assert opts.micro_batch == 8 and ds["train_micro_batch_size_per_gpu"] == 8


def test_precedence_defaults_preset_run_file_command_line(tmp_path):
    preset = json.loads((PRESET_DIR / "cpu_demo.json").read_text())
    deca = preset["deca"]
    assert deca["max_seq_len"] != RunOptions().max_seq_len  # the preset's deca section changes something
    opts, ds = parse_args(["--preset", "cpu_demo"])
    assert opts.max_seq_len == deca["max_seq_len"] and opts.rounds == deca.get("rounds", RunOptions().rounds)
    assert ds["train_micro_batch_size_per_gpu"] == preset["train_micro_batch_size_per_gpu"]
    # a run file naming the preset, then overriding one of its options; the command line over both
    path = run_file(tmp_path, f"deepspeed: cpu_demo\nmax_seq_len: {deca['max_seq_len'] + 8}\n")
    opts, _ = parse_args(["--config", path])
    assert opts.max_seq_len == deca["max_seq_len"] + 8
    assert opts.output_dir == deca["output_dir"]
    opts, _ = parse_args(["--config", path, "--max-seq-len", "5"])
    assert opts.max_seq_len == 5


def test_ds_config_is_optional_and_every_spelling_selects_a_preset(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # away from the checkout: ds_configs/NAME.json is the shipped preset NAME
    opts, ds = parse_args([])
    assert ds == {"gradient_clipping": 0.0, "train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1}
    assert (opts.micro_batch, opts.grad_accum) == (1, 1)
    path = str(ROOT / "ds_configs" / "cpu_demo.json")
    results = [parse_args([flag, value]) for flag in ("--preset", "--ds_config", "--ds-config")
               for value in ("cpu_demo", "cpu_demo.json", path, "ds_configs/cpu_demo.json")]
    assert all(r == results[0] for r in results)
    assert results[0][1]["train_micro_batch_size_per_gpu"] == 16


def test_wrong_preset_name_lists_the_available_presets(capsys):
    with pytest.raises(SystemExit) as exit_info:
        train_main(["--preset", "cpu_dmeo", "--print-config"])
    assert exit_info.value.code == 1
    err = capsys.readouterr().err
    assert "cpu_dmeo: no such file and no shipped preset of that name (did you mean 'cpu_demo'?" in err
    for name in preset_names():
        assert name in err


def test_shipped_presets_are_the_ds_configs_and_all_load():
    assert preset_names() == sorted(p.stem for p in (ROOT / "ds_configs").glob("*.json"))
    assert len(preset_names()) >= 6
    for name in preset_names():
        opts, ds = parse_args(["--preset", name])
        assert ds["train_micro_batch_size_per_gpu"] == opts.micro_batch


def test_help_shows_defaults_and_imports_no_torch():
    code = ("import sys\nfrom deca_ds.train import main\n"
            "try:\n    main(['--help'])\nexcept SystemExit as e:\n    assert e.code == 0\n"
            "heavy = ('torch', 'deepspeed', 'transformers', 'datasets', 'numpy')\n"
            "heavy = sorted(m for m in heavy if m in sys.modules)\n"
            "print('HEAVY', heavy)\n")
    out = subprocess.run([sys.executable, "-c", code], env=ENV, cwd=ROOT, capture_output=True, text=True,
                         timeout=120, check=True).stdout
    assert out.rstrip().endswith("HEAVY []")
    text = " ".join(out.split())
    assert "--lr LR learning rate γ (default: 5e-05)" in text
    assert "--topology {ring,erdos_renyi,complete_bipartite,complete,torus,exponential,file}" in text
    assert "(default: erdos_renyi)" in text
    for group in options_module.GROUP_STARTS.values():
        assert f"{group}:" in out


def test_print_config_round_trips(tmp_path, capsys):
    argv = ["--preset", "cpu_demo", "--lr", "2e-4", "--data-files", "train=a.jsonl", "test=b.jsonl",
            "--dataset", "files", "--adam-betas", "0.8", "0.95", "--clients", "3",
            "--output-dir", str(tmp_path / "never")]
    train_main([*argv, "--print-config"])
    text = capsys.readouterr().out
    assert not (tmp_path / "never").exists()
    loaded = yaml.safe_load(text)
    assert loaded["lr"] == 2e-4 and loaded["deepspeed"]["train_micro_batch_size_per_gpu"] == 16
    path = run_file(tmp_path, text, "resolved.yaml")
    assert parse_args(["--config", path]) == parse_args(argv)
    # and again: printing the printed config gives the same text
    train_main(["--config", path, "--print-config"])
    assert capsys.readouterr().out == text


def test_print_config_as_a_module(tmp_path):
    out = subprocess.run([sys.executable, "-m", "deca_ds.train", "--preset", "cpu_demo", "--rounds", "7",
                          "--print-config"], env=ENV, cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert yaml.safe_load(out.stdout)["rounds"] == 7


def test_dump_config_keeps_every_option():
    opts, ds = parse_args([])
    values = yaml.safe_load(dump_config(opts, ds))
    assert set(values) == {f for f in RunOptions.__dataclass_fields__} | {"deepspeed"}


def test_choice_lists_agree_with_the_algorithm_modules():
    from deca_ds.blocks import BLOCK_ORDERS, EXTRA_PARTS
    from deca_ds.config import VARIANTS, WEIGHT_DECAY_ON
    from deca_ds.datasets import TASKS
    from deca_ds.methods import METHODS
    from deca_ds.offload import OFFLOAD_MODES
    from deca_ds.runtime.timing import PHASE_TIMINGS
    from deca_ds.topology import TOPOLOGIES, WEIGHT_SCHEMES

    assert set(options_module.VARIANTS) == set(VARIANTS)
    assert set(options_module.WEIGHT_DECAY_ON) == set(WEIGHT_DECAY_ON)
    assert set(options_module.TASK_NAMES) == set(TASKS)
    assert set(options_module.METHOD_NAMES) == set(METHODS)
    assert set(options_module.OFFLOAD_MODES) == set(OFFLOAD_MODES)
    assert set(options_module.TOPOLOGIES) == set(TOPOLOGIES)
    assert set(options_module.WEIGHT_SCHEMES) == set(WEIGHT_SCHEMES)
    assert set(options_module.BLOCK_ORDERS) == set(BLOCK_ORDERS)
    assert set(options_module.PHASE_TIMINGS) == set(PHASE_TIMINGS)
    assert options_module.TRAINS == tuple(f"train_{part}" for part in EXTRA_PARTS)
    assert estimate_module.EXTRA_PARTS == EXTRA_PARTS


def test_algorithm_options_default_to_deca_configs_defaults():
    """RunOptions declares Algorithm 1's options again (it imports no torch, for a fast --help): each
    defaults to DecaConfig's own default, and the default options build the default DecaConfig."""
    from deca_ds.config import DecaConfig, dtype_name

    config = DecaConfig()
    shared = set(RunOptions.__dataclass_fields__) & set(DecaConfig.__dataclass_fields__)
    assert len(shared) == 18  # all but grad_clip (the preset's gradient_clipping) and custom_blocks (the library's)
    defaults = options_module.option_defaults()
    for name in shared:
        expected = getattr(config, name)
        assert defaults[name] == (dtype_name(expected) if name == "master_dtype" else expected), name
    assert RunOptions().deca_config() == config


def test_one_dtype_table_parses_names_and_refuses_with_the_allowed_ones():
    import torch

    from deca_ds.config import DTYPES, dtype_name, parse_dtype

    assert parse_dtype("BF16") is torch.bfloat16 and parse_dtype(torch.float64) is torch.float64
    assert all(parse_dtype(dtype_name(d)) is d for d in set(DTYPES.values()))
    assert [dtype_name(d) for d in (torch.float32, torch.bfloat16)] == ["fp32", "bf16"]
    low = (torch.bfloat16, torch.float16, torch.float32)
    with pytest.raises(ValueError, match=re.escape("working_dtype must be one of ['bf16', 'bfloat16', 'float16', "
                                                   "'float32', 'fp16', 'fp32'], got 'fp64'")):
        parse_dtype("fp64", "working_dtype", low)
    with pytest.raises(ValueError, match=re.escape("dtype must be one of [")):
        parse_dtype("int8")


def test_public_api_loads_lazily():
    """`import deca_ds` loads no torch (a fresh interpreter); every public name then resolves."""
    code = "import sys, deca_ds\nprint(sorted(m for m in ('torch', 'transformers') if m in sys.modules))\n"
    out = subprocess.run([sys.executable, "-c", code], env=ENV, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.stdout.strip() == "[]", out.stderr
    import deca_ds

    assert callable(deca_ds.simulate) and deca_ds.simulate.__name__ == "simulate"
    assert [n for n in deca_ds.__all__ if getattr(deca_ds, n, None) is None] == []


def documented_commands() -> list[tuple[str, list[str]]]:
    """(where, arguments) of every deca-train / launch/train.py command in README.md and docs/."""
    found = []
    for path in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), ROOT / "launch" / "demo.sh"]:
        text = re.sub(r"\\\n\s*", " ", path.read_text())
        for match in re.finditer(r"(?:launch/train\.py|deca-train|-m deca_ds\.train)((?: +[^`\s#][^`\s]*)*)", text):
            args = [a for a in shlex.split(match.group(1)) if a != "$@"]
            if args and args[0].startswith("-") and args != ["--help"]:  # a command, not prose
                found.append((path.name, args))
    return found


def test_documented_commands_parse(monkeypatch, tmp_path):
    commands = documented_commands()
    assert any(where.startswith("README.md") for where, _ in commands)
    assert len(commands) >= 8
    # `--config run.yaml` in the docs means the run file docs/options.md shows
    example = re.search(r"```yaml\n(.*?)```", (ROOT / "docs" / "options.md").read_text(), re.S).group(1)
    run_yaml = run_file(tmp_path, example)
    monkeypatch.chdir(ROOT)  # the docs' preset paths are relative to the checkout
    for where, args in commands:
        args = [run_yaml if a == "run.yaml" else a for a in args]
        try:
            parse_args(args)
        except (ValueError, SystemExit) as err:
            pytest.fail(f"{where}: {shlex.join(args)}: {err!r}")


def test_wheel_ships_the_presets_grids_and_commands(tmp_path):
    # build from a copy (the build writes build/ and *.egg-info next to pyproject.toml), no network
    src = tmp_path / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        if (ROOT / name).exists():
            shutil.copy(ROOT / name, src / name)
    shutil.copytree(ROOT / "ds_configs", src / "ds_configs")
    (src / "reproduce").mkdir()
    for grid in (ROOT / "reproduce").glob("*.yaml"):
        shutil.copy(grid, src / "reproduce")
    shutil.copytree(ROOT / "deca_ds", src / "deca_ds", symlinks=True, ignore=shutil.ignore_patterns("__pycache__"))
    build = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index",
                            "-w", str(tmp_path / "wheel"), str(src)], capture_output=True, text=True, timeout=300)
    assert build.returncode == 0, build.stderr
    wheel = next((tmp_path / "wheel").glob("deca_ds-*.whl"))
    with zipfile.ZipFile(wheel) as z:
        names = z.namelist()
        entry_points = z.read(next(n for n in names if n.endswith(".dist-info/entry_points.txt"))).decode()
        z.extractall(tmp_path / "site")
    assert {f"deca_ds/presets/{p}.json" for p in preset_names()} <= set(names)
    assert {f"deca_ds/grids/{p.name}" for p in (ROOT / "reproduce").glob("*.yaml")} <= set(names)
    assert "deca_ds/reproduce/paper_tables.yaml" in names  # the paper's numbers, which grids may name
    for line in ("deca-train = deca_ds.train:main", "deca-eval = deca_ds.eval:main",
                 "deca-export = deca_ds.export:main", "deca-estimate = deca_ds.estimate:main",
                 "deca-split = deca_ds.split:main",
                 "deca-reproduce = deca_ds.reproduce.cli:main", "deca-pretrain = deca_ds.reproduce.pretrain:main"):
        assert line in entry_points
    # the unpacked wheel, away from this checkout, finds its presets and grids by name
    code = ("from deca_ds.runtime.parsing import parse_args\nimport deca_ds\n"
            "print(deca_ds.__file__)\nprint(parse_args(['--preset', 'cpu_demo'])[0].max_seq_len)\n"
            "from deca_ds.reproduce.cli import main\nmain(['paper_qwen2.5-3b', '--dry-run'])\n")
    out = subprocess.run([sys.executable, "-c", code], env={**os.environ, "PYTHONPATH": str(tmp_path / "site")},
                         cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    where, seq_len, *dry_run = out.stdout.splitlines()
    assert Path(where).is_relative_to(tmp_path / "site")
    assert int(seq_len) == json.loads((ROOT / "ds_configs" / "cpu_demo.json").read_text())["deca"]["max_seq_len"]
    assert dry_run[-1].startswith("72 cells, 72 to run (deepspeed")  # the paper's Qwen2.5-3B grid, its preset found


@pytest.mark.parametrize("module, expected", [
    ("deca_ds.train", "--print-config"),
    ("deca_ds.eval", "--questions"),
    ("deca_ds.export", "--checkpoint"),
    ("deca_ds.estimate", "--layers-per-block"),
])
def test_commands_run_as_modules(module, expected):
    """`python -m <command> --help` answers without loading torch, transformers or DeepSpeed."""
    code = (f"import runpy, sys\nsys.argv = ['{module}', '--help']\n"
            f"try:\n    runpy.run_module('{module}', run_name='__main__', alter_sys=True)\n"
            "except SystemExit as e:\n    assert e.code == 0, e.code\n"
            "print('HEAVY', sorted(m for m in ('torch', 'deepspeed', 'transformers') if m in sys.modules))\n")
    out = subprocess.run([sys.executable, "-c", code], env=ENV, cwd=ROOT, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    assert expected in out.stdout and out.stdout.rstrip().endswith("HEAVY []")


def test_eval_and_pretrain_flags_are_their_options_own(capsys):
    """deca-eval's data flags and deca-pretrain's flags are generated from the options they set
    (RunOptions, PretrainOptions): each with its help and default; --model of deca-pretrain is a
    JSON object, refused by argparse otherwise."""
    from deca_ds.reproduce.pretrain import PretrainOptions
    from deca_ds.reproduce.pretrain import main as pretrain_main
    from deca_ds.runtime import evaluate

    helps = {a.dest: a.help for a in evaluate.build_parser()._actions}
    fields = {f.name: f for f in dataclasses.fields(RunOptions)}
    for name in (*evaluate.TEST_SET[1:], "trust_remote_code"):
        assert helps[name] == f"{fields[name].metadata['help']} (default: {default_text(fields[name])})"
    assert helps["eval_limit"].endswith("(default: 0)")  # deca-eval scores the whole test split
    with pytest.raises(SystemExit):
        pretrain_main(["--help"])
    text = capsys.readouterr().out
    for f in dataclasses.fields(PretrainOptions):
        assert "--" + f.name.replace("_", "-") in text
    assert "(default: 8000)" in text and "(default: {})" in text
    for bad in ("[1]", "{hidden"):
        with pytest.raises(SystemExit) as code:
            pretrain_main(["--output-dir", "x", "--model", bad])
        assert code.value.code == 2 and "argument --model: " in capsys.readouterr().err


def test_estimate_command_requires_a_model_config(capsys):
    from deca_ds.estimate import main as estimate_main

    with pytest.raises(SystemExit) as exit_info:
        estimate_main([])
    assert exit_info.value.code == 2
    assert "--config" in capsys.readouterr().err


@pytest.mark.parametrize("flag,message", [
    ("--micro-batch", "micro_batch must be >= 1, got 0"),
    ("--layers-per-block", "--layers-per-block 0: qwen2-1.5b has 28 decoder layers"),
])
def test_estimate_command_names_a_bad_setting_and_writes_nothing(tmp_path, capsys, flag, message):
    from deca_ds.estimate import main as estimate_main

    out = tmp_path / "out"
    config = str(ROOT / "profiling" / "configs" / "qwen2-1.5b.json")
    assert estimate_main(["--config", config, flag, "0", "--out", str(out)]) == 2
    assert capsys.readouterr().err == f"deca-estimate: error: {message}\n"
    assert not out.exists()


def test_estimate_command_refuses_a_file_for_its_directory(tmp_path, capsys):
    from deca_ds.estimate import main as estimate_main

    out = tmp_path / "notes.txt"
    out.write_text("mine")
    assert estimate_main(["--config", str(ROOT / "profiling" / "configs" / "qwen2-1.5b.json"), "--out", str(out)]) == 2
    # was a FileExistsError's traceback, after the table was computed
    assert capsys.readouterr().err == f"deca-estimate: error: --out {out} is a file: give the directory the " \
                                      "results go to\n"
    assert out.read_text() == "mine"


@pytest.mark.parametrize("flag, value, message", [
    ("--h2d-gbps", "0", "must be a finite number > 0, got 0"),  # was a ZeroDivisionError
    ("--h2d-gbps", "nan", "must be a finite number > 0, got nan"),  # was a table of nan copy times
    ("--reserve-gib", "-1", "must be a finite number >= 0, got -1"),  # was fits on less than the card
    ("--reserve-gib", "inf", "must be a finite number >= 0, got inf"),  # was an OverflowError
])
def test_estimate_command_refuses_a_rate_or_reserve_that_is_no_amount(tmp_path, capsys, flag, value, message):
    from deca_ds.estimate import main as estimate_main

    out = tmp_path / "out"
    with pytest.raises(SystemExit) as exit_info:
        estimate_main(["--config", str(ROOT / "profiling" / "configs" / "qwen2-1.5b.json"), flag, value,
                       "--out", str(out)])
    assert exit_info.value.code == 2 and f"error: argument {flag}: {message}\n" in capsys.readouterr().err
    assert not out.exists()


def test_option_reference_is_generated_from_the_parser(tmp_path):
    from deca_ds.docs import main as docs_main
    from deca_ds.docs import render_options

    text = render_options()
    assert (ROOT / "docs" / "options.md").read_text() == text, "docs/options.md is stale: python -m deca_ds.docs"
    for f in RunOptions.__dataclass_fields__.values():
        assert f"| `--{f.name.replace('_', '-')}` |" in text
    assert "| `--lr` | a float | `5e-05` | learning rate γ |" in text
    assert "| `--clients` | an integer or null | `none` |" in text
    # the run file the reference shows is one
    example = re.search(r"```yaml\n(.*?)```", text, re.S).group(1)
    opts, ds = parse_args(["--config", run_file(tmp_path, example)])
    assert opts.lr == 5e-5 and opts.dataset == "agnews" and ds["train_micro_batch_size_per_gpu"] >= 1
    # --check fails on a stale file and passes on a fresh one
    stale = tmp_path / "options.md"
    stale.write_text(text.replace("learning rate", "step size"))
    assert docs_main(["--check", "--out", str(stale)]) == 1
    assert docs_main(["--out", str(stale)]) == 0 and docs_main(["--check", "--out", str(stale)]) == 0
    assert stale.read_text() == text


def test_option_help_is_short():
    for f in RunOptions.__dataclass_fields__.values():
        assert len(f.metadata["help"]) <= 160, f"--{f.name}: keep the help to one short sentence; detail goes to docs/"


def test_a_baseline_runs_decas_local_adam():
    """The run gives a baseline the local Adam it gives DECA (one AdamSettings): every setting of
    the DecaConfig it builds, the clipping a simulated cell takes from its preset, and the
    baseline's own steps and mixing schedule."""
    import torch

    from deca_ds.blocks import partition_model
    from deca_ds.models import tiny_llama

    opts = RunOptions(method="dadam", lr=3e-3, adam_betas=(0.8, 0.99), eps=1e-6, weight_decay=0.1,
                      weight_decay_on="matrices", master_dtype="fp64", fused_update=True, steps=5, mix_every=2)
    adam = opts.build_method(partition_model(tiny_llama(64), 1), grad_clip=0.5).config
    assert adam.adam_settings() == opts.deca_config(grad_clip=0.5).adam_settings() == {
        "lr": 3e-3, "adam_betas": (0.8, 0.99), "eps": 1e-6, "weight_decay": 0.1, "weight_decay_on": "matrices",
        "grad_clip": 0.5, "master_dtype": torch.float64, "fused_update": True}
    assert opts.deca_config().grad_clip is None
    assert (adam.steps, adam.mix_every) == (5, 2)


@pytest.mark.parametrize("lr, weight_decay, message", [
    (1e-3, -0.1, "weight_decay must be >= 0, got -0.1"),
    (0.01, 100.0, r"lr × weight_decay must be < 1 \(each step scales the weights by 1 − lr·weight_decay\), "
                  r"got 0.01 × 100.0"),
])
def test_a_weight_decay_that_cannot_shrink_the_weights_is_refused(lr, weight_decay, message):
    """--weight-decay λ scales the weights by 1 − γλ each step: a negative λ, or one with γλ >= 1
    (the weights zeroed or flipped in sign), is refused before anything runs."""
    with pytest.raises(ValueError, match=message):
        parse_args(["--lr", str(lr), "--weight-decay", str(weight_decay)])


@needs_bnb  # DecaConfig checks that 8-bit moments can run
def test_a_yaml_string_becomes_state_bits_int(tmp_path):
    opts, _ = parse_args(["--config", run_file(tmp_path, "state_bits: '8'\n")])
    assert opts.state_bits == 8 and type(opts.state_bits) is int


def test_an_option_the_method_does_not_read_is_refused():
    """Each of DECA's options the baselines ignore and the baselines' DECA ignores, set away from
    its default: a method that reads it builds something else than with the default (so READ_BY
    is what the methods read), and any other method refuses the run before it starts, naming it."""
    from deca_ds.blocks import partition_model
    from deca_ds.models import tiny_llama

    partition = partition_model(tiny_llama(64), 1)
    changed = {"variant": "no_bma", "bma_betas": (0.8, 0.99), "block_order": "random", "state_bits": 8,
               "steps": 7, "mix_every": 2, "train_embeddings": True, "train_final_norm": True, "train_lm_head": True}
    assert changed.keys() == options_module.READ_BY.keys()

    def built(**values) -> dict:
        method = RunOptions(**values).build_method(partition)
        return {k: v for k, v in vars(method).items() if k != "partition"}

    for method in options_module.METHOD_NAMES:
        for name, value in changed.items():
            if method in options_module.READ_BY[name]:
                if name == "state_bits" and not HAS_BNB:
                    continue  # building 8-bit moments needs the optional bnb extra (CI has it)
                assert built(method=method, **{name: value}) != built(method=method), (method, name)
            else:
                flag = "--" + name.replace("_", "-")
                with pytest.raises(ValueError, match=f"--method {method} does not read {flag} "):
                    RunOptions(method=method, **{name: value})


def test_the_random_graphs_options_with_another_graph_are_refused():
    """--er-p and --topology-seed draw the Erdős–Rényi graph's edges and nothing else's: every other
    graph is the same whatever they say (so RANDOM_GRAPH is what the graphs read), and a run of one
    with either set is refused before it starts, naming both."""
    import numpy as np

    from deca_ds.topology import TOPOLOGIES, make_topology

    assert options_module.RANDOM_GRAPH == ("er_p", "topology_seed")
    assert not np.array_equal(make_topology("erdos_renyi", 8, p=0.3).W, make_topology("erdos_renyi", 8).W)
    assert not np.array_equal(make_topology("erdos_renyi", 8, seed=5).W, make_topology("erdos_renyi", 8).W)
    for topology in (t for t in TOPOLOGIES if t != "erdos_renyi"):
        assert np.array_equal(make_topology(topology, 8, p=0.3, seed=5).W, make_topology(topology, 8).W), topology
        with pytest.raises(ValueError, match=f"--topology {topology} does not read --er-p \\(read by --topology "
                                             "erdos_renyi only\\), --topology-seed \\(.*\\): leave them at their "
                                             "defaults \\(in a grid, they go to its erdos_renyi cells only\\)"):
            RunOptions(topology=topology, er_p=0.3, topology_seed=5)
        RunOptions(topology=topology)
    RunOptions(er_p=0.3, topology_seed=5)  # the default graph, Erdős–Rényi's
    # with a method's refusal, the grid's hint is the method's
    with pytest.raises(ValueError, match=r"--method dadam does not read --variant .*; --topology ring does not read "
                                         r"--er-p .*: leave them at their defaults \(in a grid, under method_options"):
        RunOptions(method="dadam", variant="no_bma", topology="ring", er_p=0.3)
    # a run recorded before they were refused is read without them (deca-eval, deca-export)
    assert options_module.read_options({"topology": "ring", "er_p": 0.3, "lr": 0.5}) == {"topology": "ring", "lr": 0.5}


def test_an_option_the_task_or_split_does_not_read_is_refused():
    """What names a user's data, beside the built-in synthetic task (`--data-files train=mine.jsonl`
    without `--dataset files` trained on the synthetic task), and the Dirichlet split's settings
    beside --iid: refused before anything loads, naming each; the same values are taken where
    they are read."""
    data = {"data_files": ["train=mine.jsonl"], "text_column": "body", "text_pair_column": "second",
            "label_column": "topic", "label_names": ["a", "b"], "response_column": "output", "chat_template": True}
    assert data.keys() == set(options_module.TASK_DATA)
    for name, value in data.items():
        flag = "--" + name.replace("_", "-")
        with pytest.raises(ValueError, match=f"--dataset synthetic does not read {flag} \\(read by --dataset files "
                                             "and the hub tasks\\): leave it at its default"):
            RunOptions(**{name: value})
        if name not in ("data_files", "response_column"):  # files need a train file; a response column
            RunOptions(dataset="agnews", **{name: value})  # makes a generation task of a classification one
    RunOptions(dataset="files", data_files=["train=mine.jsonl"], response_column="output")
    with pytest.raises(ValueError, match=r"--iid does not read --dirichlet-alpha \(the Dirichlet split's, which "
                                         r"--iid replaces\), --partition-key \(.*\): leave them at their defaults"):
        RunOptions(iid=True, dirichlet_alpha=0.1, partition_key="category")
    RunOptions(iid=True)
    RunOptions(dirichlet_alpha=0.1, partition_key="category")
    # a run recorded before these were refused is read without them (deca-eval, deca-export)
    saved = {"method": "dadam", "variant": "no_bma", "dataset": "synthetic", "label_names": ["a", "b"], "iid": True,
             "dirichlet_alpha": 0.1, "lr": 0.5, "eval_clients": True, "eval_interval": 0}
    assert options_module.read_options(saved) == {"method": "dadam", "dataset": "synthetic", "iid": True, "lr": 0.5,
                                                  "eval_interval": 0}
    assert options_module.read_options({"eval_clients": True, "eval_interval": 3}) == {"eval_clients": True,
                                                                                      "eval_interval": 3}
