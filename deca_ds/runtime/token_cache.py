"""Tokenize the training set once: a cache file keyed by what the tokens depend on.

The key hashes the tokenizer (its serialized vocabulary and rules, special tokens, chat
template), the data as read (every record's text) and the encoding settings. The first local
rank (LOCAL_RANK 0) tokenizes and writes the file atomically; the other ranks wait for it
(at most `wait_s`, then tokenize themselves, so a slow or failed writer never stops a run).
Each file carries a SHA-256 of its arrays: a truncated or corrupt file is reported, removed and
rebuilt. Stored as .npz without pickles, read with allow_pickle=False.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import time
import zipfile
from collections.abc import Callable, Iterable
from pathlib import Path

import numpy as np

from ..files import atomic_write

log = logging.getLogger(__name__)

FORMAT = 1  # bump when the encoding (data.encode) or this file's layout changes
FIELDS = ("input_ids", "labels", "attention_mask")
DEFAULT_DIR = Path("~/.cache/deca_ds")
DISABLED = ("none", "off")


def cache_dir(option: str | None) -> Path | None:
    """The cache folder: `--token-cache DIR`, else $DECA_CACHE, else ~/.cache/deca_ds; None
    (no cache) for "none" / "off"."""
    value = option if option is not None else os.environ.get("DECA_CACHE") or str(DEFAULT_DIR)
    return None if value.strip().lower() in DISABLED else Path(value).expanduser()


def tokenizer_fingerprint(tokenizer) -> str:
    """What a tokenizer's ids depend on: a fast tokenizer's full serialization (vocabulary,
    merges, normalizer, pre-tokenizer), else its vocabulary; special tokens and chat template."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    state = {
        "class": type(tokenizer).__name__,
        "backend": backend.to_str() if backend is not None else sorted(tokenizer.get_vocab().items()),
        "special": {k: str(v) for k, v in sorted(tokenizer.special_tokens_map.items())},
        "ids": [tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id],
        "chat_template": getattr(tokenizer, "chat_template", None),
    }
    return hashlib.sha256(json.dumps(state, sort_keys=True, default=str, allow_nan=False).encode()).hexdigest()


def cache_key(tokenizer, texts: Iterable[str], settings: dict) -> str:
    """SHA-256 over the format, the tokenizer's fingerprint, the settings and every text (each
    prefixed by its length, so no two sequences of texts hash alike)."""
    h = hashlib.sha256()
    h.update(json.dumps({"format": FORMAT, "tokenizer": tokenizer_fingerprint(tokenizer), "settings": settings},
                        sort_keys=True, default=str, allow_nan=False).encode())
    for text in texts:
        data = text.encode("utf-8")
        h.update(len(data).to_bytes(8, "little"))
        h.update(data)
    return h.hexdigest()


def _digest(arrays: dict[str, np.ndarray]) -> str:
    h = hashlib.sha256()
    for name in (*FIELDS, "offsets"):
        h.update(name.encode())
        h.update(np.ascontiguousarray(arrays[name]).tobytes())
    return h.hexdigest()


def _pack(features: list[dict[str, list[int]]]) -> dict[str, np.ndarray]:
    lengths = [len(f["input_ids"]) for f in features]
    for i, f in enumerate(features):
        if any(len(f[k]) != lengths[i] for k in FIELDS):
            raise ValueError(f"feature {i}: {FIELDS} differ in length")
    arrays = {k: np.fromiter((t for f in features for t in f[k]), dtype=np.int64, count=sum(lengths))
              for k in FIELDS}
    arrays["offsets"] = np.concatenate([[0], np.cumsum(lengths, dtype=np.int64)])
    return arrays


def _unpack(arrays: dict[str, np.ndarray]) -> list[dict[str, list[int]]]:
    offsets = arrays["offsets"].tolist()
    columns = {k: arrays[k].tolist() for k in FIELDS}
    return [{k: columns[k][a:b] for k in FIELDS} for a, b in zip(offsets[:-1], offsets[1:])]


def write(path: Path, features: list[dict[str, list[int]]]) -> None:
    """Write atomically, synced to disk before the rename: a reader (another rank, a later run)
    sees the whole file or none."""
    arrays = _pack(features)

    def savez(tmp: str) -> None:
        with open(tmp, "wb") as f:
            np.savez(f, digest=np.array(_digest(arrays)), **arrays)
            f.flush()
            os.fsync(f.fileno())

    atomic_write(path, savez)


def read(path: Path) -> list[dict[str, list[int]]]:
    """The features of a cache file; ValueError when it is truncated, corrupt or inconsistent."""
    try:
        with np.load(path, allow_pickle=False) as z:
            arrays = {k: z[k] for k in (*FIELDS, "offsets", "digest")}
    except (OSError, ValueError, KeyError, zipfile.BadZipFile, EOFError) as e:
        raise ValueError(f"token cache {path} is unreadable ({type(e).__name__}: {e})") from None
    offsets = arrays["offsets"]
    lengths_ok = offsets.ndim == 1 and offsets.size >= 1 and offsets[0] == 0 and np.all(np.diff(offsets) >= 0) \
        and all(arrays[k].shape == (offsets[-1],) for k in FIELDS)
    if not lengths_ok or str(arrays["digest"]) != _digest(arrays):
        raise ValueError(f"token cache {path} does not match its checksum")
    return _unpack(arrays)


def cached_features(directory: Path | None, key: str, build: Callable[[], list[dict[str, list[int]]]], *,
                    writer: bool | None = None, wait_s: float = 600.0, poll_s: float = 0.2) -> list[dict]:
    """`build()`'s features through the cache file `<directory>/<key>.npz`.

    `writer`: whether this process tokenizes and writes (default: LOCAL_RANK is 0 or unset). A
    reader waits up to `wait_s` for the writer's file (or its failure note) and then builds the
    features itself. A corrupt file is removed and rebuilt, with a warning."""
    if directory is None:
        return build()
    path = directory / f"{key}.npz"
    failed = directory / f"{key}.failed"
    if writer is None:
        writer = int(os.environ.get("LOCAL_RANK", "0")) == 0
    if not writer:
        deadline = time.monotonic() + wait_s
        while not path.exists() and not failed.exists() and time.monotonic() < deadline:
            time.sleep(poll_s)
        if not path.exists():
            log.warning("token cache: no %s after %.0f s; tokenizing here", path, wait_s)
            return build()
    if path.exists():
        try:
            return read(path)
        except ValueError as e:
            log.warning("%s; tokenizing again", e)
            if not writer:
                return build()
            path.unlink(missing_ok=True)
    failed.unlink(missing_ok=True)  # a note left by an earlier run's failure
    try:
        features = build()
    except BaseException as e:
        directory.mkdir(parents=True, exist_ok=True)
        failed.write_text(f"{type(e).__name__}: {e}\n")  # the readers stop waiting and meet the same error
        raise
    try:
        write(path, features)
    except OSError as e:  # a read-only or full cache folder costs time, not the run
        log.warning("token cache: could not write %s (%s)", path, e)
    return features
