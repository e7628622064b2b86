"""Crash-safe file writes: a reader never sees a half-written file under its final name."""

from __future__ import annotations

import json
import os
import tempfile


def write_bytes_atomic(path: str | os.PathLike, data: bytes) -> None:
    path = os.fspath(path)
    directory = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(prefix=".tmp-", suffix="-" + os.path.basename(path), dir=directory)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise
    _fsync_dir(directory)


def write_json_atomic(path: str | os.PathLike, obj) -> None:
    text = json.dumps(obj, indent=2, ensure_ascii=False, sort_keys=False) + "\n"
    write_bytes_atomic(path, text.encode("utf-8"))


def _fsync_dir(directory: str) -> None:
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
