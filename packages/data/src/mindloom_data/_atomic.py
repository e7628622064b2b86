"""The package's one atomic-write helper: a reader never sees a half-written file under
its final name.

A file is written to `NAME.tmp-<pid>` in the same directory, fsynced, renamed over the
final name, and the directory fsynced, so a killed run leaves only `*.tmp-*` files (which
`remove_temporaries` and the input discovery skip). On an OSError (ENOSPC, EIO) the
temporary file is dropped, so a full disk stays usable, and the error names the final
path. Streaming writers (`_writers`, `_indexed`) use `writing` and `commit` from here.
"""

from __future__ import annotations

import errno
import json
import os
from contextlib import contextmanager
from pathlib import Path

import numpy as np

__all__ = [
    "WriteOnly", "atomic_write_bytes", "atomic_write_json", "commit", "fsync_dir",
    "named_oserror", "save_array", "tmp_name", "writing",
]  # fmt: skip


def tmp_name(path: Path) -> Path:
    return path.with_name(f"{path.name}.tmp-{os.getpid()}")


def named_oserror(exc: OSError, path: str | Path) -> OSError:
    """`exc` naming `path`: a failed write() (ENOSPC, EIO) carries no file name, and
    pyarrow's errors carry only a message."""
    if exc.filename:
        return exc
    code = exc.errno
    if code is None and "No space left on device" in str(exc):
        code = errno.ENOSPC
    reason = os.strerror(code) if code else " ".join(str(exc).split())
    return OSError(code, reason, str(path))


class WriteOnly:
    """A file seen only through write(): np.save then writes in chunks through Python,
    so a full disk raises ENOSPC instead of numpy's "N requested and M written"."""

    def __init__(self, f):
        self.write = f.write


@contextmanager
def writing(path: str | Path, tmp: str | Path):
    """On an OSError: drop the temporary file (a full disk stays usable) and name `path`."""
    try:
        yield
    except OSError as exc:
        Path(tmp).unlink(missing_ok=True)
        raise named_oserror(exc, path) from None


def fsync_dir(path: str | Path) -> None:
    """Make a rename inside `path`'s directory durable."""
    try:
        fd = os.open(os.path.dirname(os.path.abspath(path)) or ".", os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    except OSError:  # pragma: no cover - some filesystems refuse fsync on directories
        pass


def commit(tmp: str | Path, path: str | Path) -> None:
    """fsync the finished temporary file and rename it over `path`, durably."""
    with open(tmp, "rb+") as f:
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(path)


def atomic_write_bytes(path: str | Path, data: bytes) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = tmp_name(path)
    with writing(path, tmp):
        tmp.write_bytes(data)
        commit(tmp, path)


def atomic_write_json(path: str | Path, obj) -> None:
    atomic_write_bytes(path, (json.dumps(obj, indent=1, ensure_ascii=False) + "\n").encode())


def save_array(path: str | Path, arr: np.ndarray) -> None:
    """A plain .npy (never pickled), written atomically."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = tmp_name(path)
    with writing(path, tmp):
        with open(tmp, "wb") as f:
            np.save(WriteOnly(f), np.ascontiguousarray(arr), allow_pickle=False)
        commit(tmp, path)
