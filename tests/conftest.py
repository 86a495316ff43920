"""Fixtures every test gets."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="session", autouse=True)
def token_cache_in_tmp(tmp_path_factory):
    """The token cache (DECA_CACHE, inherited by the ranks a test starts) in a temporary folder:
    tests never write to ~/.cache. Session-scoped so module fixtures (reference runs) get it too."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("DECA_CACHE", str(tmp_path_factory.mktemp("deca_cache")))
        yield


@pytest.fixture
def profiling_runs(monkeypatch):
    """profiling/runs.py, its ranks started as forks of the test's rank server (tests/ranks.py)
    rather than fresh interpreters; the tools that train through it are called in-process."""
    from ranks import start_rank

    monkeypatch.syspath_prepend(str(ROOT / "profiling"))
    import runs

    monkeypatch.setattr(runs, "start_rank",
                        lambda argv, env, stderr: start_rank(argv, env, ROOT, Path(os.devnull), stderr))
    return runs


@pytest.fixture
def judges(monkeypatch):
    """make(script) starts a fake judge (helpers.Judge) on 127.0.0.1, reached without a proxy, with
    its key in JUDGE_KEY; all are stopped after the test."""
    from helpers import JUDGE_KEY, Judge

    for var in ("http_proxy", "HTTP_PROXY", "https_proxy", "HTTPS_PROXY", "all_proxy", "ALL_PROXY"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("no_proxy", "127.0.0.1,localhost")
    monkeypatch.setenv("JUDGE_KEY", JUDGE_KEY)
    made = []

    def make(script=()):
        made.append(Judge(script))
        return made[-1]

    yield make
    for j in made:
        j.close()
