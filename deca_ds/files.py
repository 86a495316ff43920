"""How the project writes files: whole or not at all (a temporary name beside the target, then a
rename), with the mode the umask gives. A reader never sees half a file or directory, a killed
writer leaves at most a hidden temporary, and nothing is written over that the writer did not
name."""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Iterable, Iterator

# The temporaries below, named after their target (tempfile's 8 random characters between):
# .<name>.<random>.tmp (a file), .partial (a directory being written), .old (one being replaced).
_TEMPORARY = re.compile(r"\.(.+)\.[a-z0-9_]{8}\.(tmp|partial|old)")


def atomic_write(path: Path, write: Callable[[str], None]) -> None:
    """Call write(tmp) on a temporary file beside `path`, then rename it into place."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.close(fd)
    try:
        write(tmp)
        # mkstemp creates 0600, and so does safetensors (0.8) for the file it puts in tmp's place:
        # the file gets the mode any other file of the run gets (0644 under umask 022)
        os.chmod(tmp, 0o666 & ~current_umask())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def leftovers(directory: Path, names: Iterable[str] | re.Pattern) -> list[Path]:
    """The temporaries in `directory` of writes to `names` (or to the names the pattern matches) that
    were cut off where no cleanup runs (SIGKILL, a rank's exit on SIGTERM): a directory of them can
    hold a whole model."""
    if not directory.is_dir():
        return []
    match = names.fullmatch if isinstance(names, re.Pattern) else set(names).__contains__
    return sorted(p for p in directory.iterdir() if (m := _TEMPORARY.fullmatch(p.name)) and match(m.group(1)))


def remove(path: Path) -> None:
    """A file, a link (not what it points to) or a directory tree; nothing if absent."""
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    else:
        path.unlink(missing_ok=True)


def remove_leftovers(path: Path, say: Callable[[str], None]) -> None:
    """Remove, saying so, what writes of `path` cut off before their end left beside it: as large as
    what they wrote (a model, for a directory)."""
    for left in leftovers(path.parent, [path.name]):
        say(f"removing {left}, left by a write of {path} that was cut off (killed, or a time limit)")
        remove(left)


def vacant(path: Path) -> bool:
    """Absent, or an empty directory (not a link to one): what atomic_directory may write."""
    if path.is_symlink():
        return False
    return not path.exists() or (path.is_dir() and not any(path.iterdir()))


@contextmanager
def atomic_directory(path: Path, *, replace: bool = False) -> Iterator[Path]:
    """A new directory beside `path` to write into, renamed to `path` (absent or an empty directory)
    when the block ends and removed if it fails: `path` ends up whole or as it was. `replace`: a
    directory already at `path` (the run's own, from before a resume) is moved aside only once the
    new one is whole, then removed, so a failed write keeps it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=path.parent, prefix=f".{path.name}.", suffix=".partial"))
    try:
        os.chmod(tmp, 0o777 & ~current_umask())  # mkdtemp's 0700 otherwise
        yield tmp
        umask_modes(tmp)
        old = None
        if replace and path.is_dir() and not path.is_symlink():
            old = Path(tempfile.mkdtemp(dir=path.parent, prefix=f".{path.name}.", suffix=".old"))
            os.replace(path, old)
        try:
            os.replace(tmp, path)  # over an empty directory too; a non-empty one raises and is left alone
        except BaseException:
            if old is not None:
                os.replace(old, path)  # back where it was: the next run would remove it as a leftover
            raise
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if old is not None:
        shutil.rmtree(old)


def umask_modes(directory: Path) -> None:
    """The safetensors files under `directory`, which this process wrote, with the mode the umask
    gives any new file: safetensors 0.8 creates them 0600 whatever the umask (safetensors#782), so a
    model written through save_pretrained would be readable by its owner alone."""
    mode = 0o666 & ~current_umask()
    for path in directory.rglob("*.safetensors"):
        if path.is_file() and not path.is_symlink():
            os.chmod(path, mode)


def current_umask() -> int:
    """The process's umask (reading it means setting it: set back at once)."""
    mask = os.umask(0)
    os.umask(mask)
    return mask


def write_text(path: Path, text: str) -> None:
    """UTF-8, whole or not at all: a reader never sees half a file, a killed writer leaves the old
    one, and two writers of the same file leave one of theirs."""
    atomic_write(path, lambda tmp: Path(tmp).write_text(text, encoding="utf-8"))


def write_json(path: Path, obj) -> None:
    """Atomically, and as valid JSON: a NaN or infinity raises instead of writing a bare NaN."""
    write_text(path, json.dumps(obj, indent=2, allow_nan=False) + "\n")


def sha256(path: Path, chunk: int = 1 << 24) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            digest.update(block)
    return digest.hexdigest()
