"""launch/install.sh and requirements/cpu.lock: the torch build is named, bitsandbytes comes only with
--bnb, every install is constrained by the lock, the lock pins every dependency pyproject.toml
declares within its declared range, the Dockerfile installs with the same script, and CI runs the README's
commands. No install runs here: --dry-run prints the commands, and a stub Python stands in for pip."""

import re
import subprocess
import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

ROOT = Path(__file__).resolve().parent.parent


def dry_run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(ROOT / "launch" / "install.sh"), "--dry-run", "--venv", "/nonexistent/v", *args],
                          capture_output=True, text=True, cwd=ROOT)


@pytest.mark.parametrize("args, torch, index, extras", [
    ((), "torch==2.13.0+cpu", "https://download.pytorch.org/whl/cpu", ".[dev]"),
    (("--cpu", "--bnb"), "torch==2.13.0+cpu", "https://download.pytorch.org/whl/cpu", ".[dev,bnb]"),
    (("--cuda", "12.8"), "torch==2.13.0+cu128", "https://download.pytorch.org/whl/cu128", ".[dev]"),
    (("--bnb", "--cuda", "12.6"), "torch==2.13.0+cu126", "https://download.pytorch.org/whl/cu126", ".[dev,bnb]"),
])
def test_install_names_the_torch_build_and_uses_the_lock(args, torch, index, extras):
    done = dry_run(*args)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines == [
        "+ python3 -m venv /nonexistent/v",
        "+ /nonexistent/v/bin/python -m pip install -q --upgrade pip -c requirements/cpu.lock",
        # a wheel pip finds without an index (this machine's CPU build on disk), else the build's own index
        f"+ /nonexistent/v/bin/python -m pip install -q --no-index --no-deps {torch} || "
        f"/nonexistent/v/bin/python -m pip install -q --extra-index-url {index} {torch} -c requirements/cpu.lock",
        f"+ env DS_BUILD_OPS=0 /nonexistent/v/bin/python -m pip install -q -c requirements/cpu.lock -e {extras}",
    ]
    assert "bitsandbytes" not in done.stdout


def test_update_lock_resolves_without_the_lock_and_writes_it():
    done = dry_run("--update-lock")
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert "-c requirements/cpu.lock" not in done.stdout
    assert lines[-2].endswith("-m pip install -q -e .[dev,bnb]")  # the lock covers the bnb extra
    assert lines[-1] == "+ /nonexistent/v/bin/python -m pip freeze --all --exclude-editable > requirements/cpu.lock"


@pytest.mark.parametrize("args, message", [
    (("--cuda", "12"), "--cuda needs a version like 12.8, got '12'"),
    (("--cuda",), "--cuda needs a version like 12.8, got ''"),
    (("--gpu",), "unknown argument '--gpu'"),
    (("--venv", "--bnb"), "--venv needs a path"),
    (("--update-lock", "--cuda", "12.8"), "--update-lock resolves on the CPU build of torch: drop --cuda"),
])
def test_install_refuses_bad_arguments(args, message):
    done = dry_run(*args)
    assert done.returncode == 2 and message in done.stderr and done.stdout == ""


def test_update_lock_refuses_an_existing_venv(tmp_path):
    done = subprocess.run(["bash", str(ROOT / "launch" / "install.sh"), "--dry-run", "--update-lock", "--venv",
                           str(tmp_path)], capture_output=True, text=True, cwd=ROOT)
    assert done.returncode == 2 and f"--update-lock needs a fresh venv, and {tmp_path} exists" in done.stderr


def read_lock() -> dict:
    """requirements/cpu.lock as {canonical name: Version}; every line a comment or an exact `name==version` pin."""
    lock = {}
    for number, line in enumerate((ROOT / "requirements" / "cpu.lock").read_text().splitlines(), 1):
        if not line or line.startswith("#"):
            continue
        pin = re.fullmatch(r"([A-Za-z0-9][A-Za-z0-9_.\-]*)==([0-9][0-9A-Za-z.+!\-]*)", line)
        assert pin, f"requirements/cpu.lock line {number} is not an exact pin: {line!r}"
        name = canonicalize_name(pin[1])
        assert name not in lock, f"requirements/cpu.lock pins {name} twice"
        lock[name] = Version(pin[2])
    return lock


def test_lock_pins_every_package_exactly():
    lock = read_lock()
    for name in ("torch", "deepspeed", "transformers", "bitsandbytes", "ruff", "pytest", "pip", "setuptools"):
        assert name in lock, f"{name} is not in requirements/cpu.lock"
    assert "deca-ds" not in lock  # pip freeze --exclude-editable: the project is installed from the checkout
    assert str(lock["torch"]) == "2.13.0"  # no build label: the lock serves --cpu and --cuda


def test_lock_pins_every_declared_dependency_within_its_range():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    lock = read_lock()
    declared = [*project["dependencies"], *project["optional-dependencies"]["dev"],
                *project["optional-dependencies"]["bnb"]]
    for spec in map(Requirement, declared):
        name = canonicalize_name(spec.name)
        assert name in lock, f"{spec.name} is not in requirements/cpu.lock: regenerate it (docs/install.md)"
        assert spec.specifier.contains(lock[name]), f"lock pins {name}=={lock[name]} outside {spec.specifier}"


def test_pyproject_license_is_an_spdx_expression_the_locked_setuptools_reads():
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert pyproject["project"]["license"] == "Apache-2.0"  # PEP 639: setuptools >= 77
    backend = [Requirement(r) for r in pyproject["build-system"]["requires"]]
    setuptools = next(r for r in backend if r.name == "setuptools")
    assert not setuptools.specifier.contains("76.9") and setuptools.specifier.contains(str(read_lock()["setuptools"]))


def test_dockerfile_installs_with_the_script_ci_runs():
    lines = (ROOT / "Dockerfile").read_text().splitlines()
    runs = [i for i, line in enumerate(lines) if re.match(r"RUN .*\bbash launch/install\.sh --cuda 12\.\d+ ", line)]
    assert len(runs) == 1, "the Dockerfile should install with `bash launch/install.sh --cuda 12.X` once"
    copied_before = " ".join(line for line in lines[:runs[0]] if line.startswith("COPY "))
    for needed in ("pyproject.toml", "requirements/", "launch/install.sh", "deca_ds/"):
        assert needed in copied_before, f"the Dockerfile runs install.sh before copying {needed}"
    flags = [word for word in lines[runs[0]].split("bash launch/install.sh", 1)[1].split() if word != "\\"]
    done = dry_run(*flags)  # the flags are ones the script takes, and name the CUDA build of torch
    assert done.returncode == 0, done.stderr
    assert f"torch==2.13.0+cu{flags[flags.index('--cuda') + 1].replace('.', '')} " in done.stdout
    ignored = (ROOT / ".dockerignore").read_text().split()
    assert ".venv" in ignored and ".git" in ignored


def quick_start() -> list[str]:
    """The commands (not the comments) of the first fenced bash block of README.md."""
    block = re.search(r"```bash\n(.*?)```", (ROOT / "README.md").read_text(), re.S)[1]
    return [line for line in block.splitlines() if line.strip() and not line.startswith("#")]


def test_ci_runs_the_readme_test_command_after_install_and_lint():
    ci = [line for line in (ROOT / ".ci" / "run").read_text().splitlines() if line and not line.startswith("#")]
    demo, test_command = quick_start()
    assert ci[-1] == test_command, f".ci/run ends with {ci[-1]!r}, the README's test command is {test_command!r}"
    install = next(i for i, line in enumerate(ci) if line.startswith("bash launch/install.sh"))
    assert ci.index(".venv/bin/ruff check .") > install


def test_readme_demo_installs_with_this_script():
    assert quick_start()[0] == "bash launch/demo.sh"
    demo = (ROOT / "launch" / "demo.sh").read_text().splitlines()
    assert "bash launch/install.sh" in demo


@pytest.mark.parametrize("given", [None, "default"])
def test_the_demo_runs_avx2_kernels_where_the_cpu_has_them_unless_told_otherwise(tmp_path, given):
    """The README's numbers are an AMD EPYC's AVX2 kernels' bits: the demo asks ATen for those where
    the CPU has AVX2 (an AVX-512 CPU would run its own, which round otherwise), never for kernels the
    CPU lacks, and leaves a value the user set. A scratch checkout whose install and launcher are stubs."""
    (tmp_path / "launch").mkdir()
    (tmp_path / "launch" / "demo.sh").write_text((ROOT / "launch" / "demo.sh").read_text())
    (tmp_path / "launch" / "install.sh").write_text("exit 0\n")
    launcher = tmp_path / ".venv" / "bin" / "deepspeed"
    launcher.parent.mkdir(parents=True)
    launcher.write_text('#!/usr/bin/env bash\necho "kernels=${ATEN_CPU_CAPABILITY:-unset} args=$*"\n')
    launcher.chmod(0o755)
    env = {"PATH": "/usr/bin:/bin"} | ({"ATEN_CPU_CAPABILITY": given} if given else {})
    done = subprocess.run(["bash", "launch/demo.sh", "--rounds", "1"], capture_output=True, text=True,
                          cwd=tmp_path, env=env, timeout=60)
    assert done.returncode == 0, done.stderr
    cpuinfo = Path("/proc/cpuinfo")
    has_avx2 = cpuinfo.is_file() and "avx2" in cpuinfo.read_text().split()
    expected = given or ("avx2" if has_avx2 else "unset")
    assert done.stdout.startswith(f"kernels={expected} args=--num_gpus 4 launch/train.py"), done.stdout
    assert done.stdout.rstrip().endswith("--overwrite --rounds 1")


STUB_PYTHON = """#!/usr/bin/env bash
# stands in for python and the venv's python: logs its arguments, creates venvs, answers pip freeze
echo "$*" >> "$STUB_LOG"
case "$*" in
    "-m venv "*) mkdir -p "$3/bin" && cp "$0" "$3/bin/python" ;;
    "-c "*) echo 3.11 ;;
    *"pip freeze"*) printf 'numpy==2.4.6\\ntorch==2.13.0+cpu\\n' ;;
    *"--no-index"*) exit 1 ;;  # no torch wheel on this disk: the script must go to the build's index
esac
"""


def stubbed_install(tmp_path, *args) -> tuple[subprocess.CompletedProcess, list[str], Path]:
    """Runs a copy of install.sh in a scratch checkout whose Python is STUB_PYTHON: the real control flow,
    no pip."""
    (tmp_path / "launch").mkdir()
    (tmp_path / "requirements").mkdir()
    (tmp_path / "launch" / "install.sh").write_text((ROOT / "launch" / "install.sh").read_text())
    stub = tmp_path / "python3"
    stub.write_text(STUB_PYTHON)
    stub.chmod(0o755)
    log = tmp_path / "calls.log"
    done = subprocess.run(["bash", "launch/install.sh", *args], capture_output=True, text=True, cwd=tmp_path,
                          env={"PATH": "/usr/bin:/bin", "PYTHON": str(stub), "STUB_LOG": str(log)}, timeout=60)
    return done, log.read_text().splitlines() if log.exists() else [], tmp_path / "requirements" / "cpu.lock"


def test_update_lock_writes_the_freeze_with_a_header_and_torch_without_its_build_label(tmp_path):
    done, calls, lock = stubbed_install(tmp_path, "--update-lock", "--venv", str(tmp_path / "v"))
    assert done.returncode == 0, done.stderr
    assert lock.read_text().splitlines() == [
        "# deca-ds dependencies pinned for Python 3.11 on Linux",
        "# regenerate: bash launch/install.sh --update-lock (docs/install.md)",
        "numpy==2.4.6",
        "torch==2.13.0",
    ]
    assert not any("cpu.lock" in call for call in calls)  # resolved afresh, not from the old lock
    assert "-m pip install -q -e .[dev,bnb]" in calls  # the lock covers the bnb extra


def test_install_falls_back_to_the_builds_index_when_no_wheel_is_on_disk(tmp_path):
    done, calls, _ = stubbed_install(tmp_path, "--cuda", "12.8", "--venv", str(tmp_path / "v"))
    assert done.returncode == 0, done.stderr
    assert calls == [
        f"-m venv {tmp_path / 'v'}",
        "-m pip install -q --upgrade pip -c requirements/cpu.lock",
        "-m pip install -q --no-index --no-deps torch==2.13.0+cu128",
        "-m pip install -q --extra-index-url https://download.pytorch.org/whl/cu128 torch==2.13.0+cu128 "
        "-c requirements/cpu.lock",
        "-m pip install -q -c requirements/cpu.lock -e .[dev]",
    ]
