"""The tokenized-training-set cache: keyed by tokenizer, data and settings, written once and
atomically, read by the other ranks, corrupt files rebuilt, and a run's features unchanged."""

from __future__ import annotations

import logging
import os
import threading
from pathlib import Path

import pytest

from deca_ds.data import build_word_tokenizer
from deca_ds.files import current_umask
from deca_ds.runtime import token_cache
from deca_ds.runtime.options import RunOptions
from deca_ds.runtime.task import build_task

FEATURES = [{"input_ids": [1, 5, 6, 2], "labels": [-100, -100, 6, 2], "attention_mask": [1, 1, 1, 1]},
            {"input_ids": [1, 7, 2], "labels": [-100, 7, 2], "attention_mask": [1, 1, 1]},
            {"input_ids": [], "labels": [], "attention_mask": []}]


def counting(features=FEATURES):
    calls = []

    def build():
        calls.append(1)
        return [dict(f) for f in features]

    return build, calls


def test_conftest_points_the_cache_at_a_temporary_folder():
    cache = token_cache.cache_dir(None)
    assert cache is not None and Path.home() / ".cache" not in [cache, *cache.parents]


def test_cache_dir_option_environment_and_default(monkeypatch, tmp_path):
    assert token_cache.cache_dir(str(tmp_path)) == tmp_path
    assert token_cache.cache_dir("none") is None and token_cache.cache_dir("OFF") is None
    monkeypatch.setenv("DECA_CACHE", str(tmp_path / "env"))
    assert token_cache.cache_dir(None) == tmp_path / "env"
    monkeypatch.delenv("DECA_CACHE")
    assert token_cache.cache_dir(None) == Path.home() / ".cache" / "deca_ds"


def test_round_trip_and_second_call_reads_the_file(tmp_path):
    build, calls = counting()
    assert token_cache.cached_features(tmp_path, "k", build, writer=True) == FEATURES
    assert token_cache.cached_features(tmp_path, "k", build, writer=True) == FEATURES
    assert len(calls) == 1 and [p.name for p in tmp_path.iterdir()] == ["k.npz"]  # no temporary file left
    assert (tmp_path / "k.npz").stat().st_mode & 0o777 == 0o666 & ~current_umask()


def test_key_changes_with_tokenizer_data_and_settings():
    tok = build_word_tokenizer(["a", "b", "c"])
    key = token_cache.cache_key(tok, ["a b", "c"], {"max_length": 32})
    assert key == token_cache.cache_key(build_word_tokenizer(["a", "b", "c"]), ["a b", "c"], {"max_length": 32})
    others = [token_cache.cache_key(build_word_tokenizer(["a", "b", "d"]), ["a b", "c"], {"max_length": 32}),
              token_cache.cache_key(build_word_tokenizer(["a", "c", "b"]), ["a b", "c"], {"max_length": 32}),
              token_cache.cache_key(tok, ["a b", "b"], {"max_length": 32}),
              token_cache.cache_key(tok, ["a", "b c"], {"max_length": 32}),  # same characters, other split
              token_cache.cache_key(tok, ["a b", "c"], {"max_length": 16})]
    assert len({key, *others}) == 6


@pytest.mark.parametrize("damage", ["truncate", "flip", "garbage"])
def test_corrupt_file_is_detected_and_rebuilt_with_a_warning(tmp_path, caplog, damage):
    build, calls = counting()
    token_cache.cached_features(tmp_path, "k", build, writer=True)
    path = tmp_path / "k.npz"
    data = bytearray(path.read_bytes())
    if damage == "truncate":
        data = data[:len(data) // 2]
    elif damage == "flip":  # inside the stored (uncompressed) token arrays: only the checksum notices
        at = data.index((6).to_bytes(8, "little") + (2).to_bytes(8, "little"))
        data[at] = 9
    else:
        data = bytearray(b"not a zip file")
    path.write_bytes(bytes(data))
    with pytest.raises(ValueError, match="token cache"):
        token_cache.read(path)
    with caplog.at_level(logging.WARNING):
        assert token_cache.cached_features(tmp_path, "k", build, writer=True) == FEATURES
    assert len(calls) == 2 and "tokenizing again" in caplog.text
    assert token_cache.read(path) == FEATURES  # rebuilt on disk


def test_readers_wait_for_the_writer(tmp_path):
    release = threading.Event()
    build, calls = counting()

    def slow_build():
        release.wait(10)
        return build()

    results = {}
    readers = [threading.Thread(target=lambda i=i: results.__setitem__(
        i, token_cache.cached_features(tmp_path, "k", build, writer=False, wait_s=30, poll_s=0.01)))
        for i in range(3)]
    for r in readers:
        r.start()
    writer = threading.Thread(target=lambda: results.__setitem__(
        "w", token_cache.cached_features(tmp_path, "k", slow_build, writer=True)))
    writer.start()
    release.set()
    for t in (writer, *readers):
        t.join(30)
    assert all(results[k] == FEATURES for k in ("w", 0, 1, 2)) and len(calls) == 1  # tokenized once


def test_a_reader_gives_up_waiting_and_tokenizes_itself(tmp_path, caplog):
    build, calls = counting()
    with caplog.at_level(logging.WARNING):
        assert token_cache.cached_features(tmp_path, "k", build, writer=False, wait_s=0.05, poll_s=0.01) == FEATURES
    assert calls == [1] and "tokenizing here" in caplog.text


def test_a_failed_writer_releases_the_readers(tmp_path):
    def broken():
        raise ValueError("record 3: too long")

    with pytest.raises(ValueError, match="record 3"):
        token_cache.cached_features(tmp_path, "k", broken, writer=True)
    with pytest.raises(ValueError, match="record 3"):  # at once, not after the wait
        token_cache.cached_features(tmp_path, "k", broken, writer=False, wait_s=60)
    build, calls = counting()
    assert token_cache.cached_features(tmp_path, "k", build, writer=True) == FEATURES
    assert not (tmp_path / "k.failed").exists()


def test_build_task_features_equal_with_and_without_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("LOCAL_RANK", "0")
    base = dict(model="tiny", dataset="synthetic", max_seq_len=32, micro_batch=4)
    fresh = build_task(RunOptions(**base, token_cache="none"), 2)
    written = build_task(RunOptions(**base, token_cache=str(tmp_path)), 2)
    files = list(tmp_path.glob("*.npz"))
    assert len(files) == 1
    stamp = files[0].stat().st_mtime_ns
    monkeypatch.setenv("LOCAL_RANK", "1")  # another rank of the machine: reads the file
    read = build_task(RunOptions(**base, token_cache=str(tmp_path)), 2)
    assert fresh.features == written.features == read.features and len(fresh.features) > 100
    assert files[0].stat().st_mtime_ns == stamp
    monkeypatch.setenv("LOCAL_RANK", "0")
    build_task(RunOptions(**{**base, "max_seq_len": 48}, token_cache=str(tmp_path)), 2)
    assert len(list(tmp_path.glob("*.npz"))) == 2  # other settings, other key
    assert not os.environ.get("DECA_CACHE", "").startswith(str(Path.home() / ".cache"))
