"""Checkpoint files: names, atomic writes, JSON and the safetensors codec, and the one
rule that keeps every file a checkpoint names inside its step directory."""

from __future__ import annotations

import hashlib
import json
import os
import re
from pathlib import Path
from typing import Any

import mindloom_model  # the safetensors codec; importing it loads no MindSpore
import numpy as np

from mindloom_train._errors import CheckpointError

FORMAT = "mindloom-checkpoint"
FORMAT_VERSION = 1
TRACKER = "latest"
STEP_RE = re.compile(r"^step_(\d{8,})$")
TRACKER_RE = re.compile(r"^\d+$")
FILE_MODE = 0o640
DIR_MODE = 0o750
_SAFE_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")


def step_dirname(step: int) -> str:
    return f"step_{step:08d}"


def shard_name(kind: str, rank: int, world: int) -> str:
    return f"{kind}-{rank:07d}-{world:07d}.safetensors"


# ---------------------------------------------------------------------------------------
# low-level atomic writes


def fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def write_file(path: Path, data: bytes) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, FILE_MODE)
    try:
        view = memoryview(data)
        while view:
            n = os.write(fd, view)
            view = view[n:]
        os.fsync(fd)
    finally:
        os.close(fd)
    os.chmod(path, FILE_MODE)


def atomic_write(path: Path, data: bytes) -> None:
    """Write `path` so that a crash leaves either the old file or the new one."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        write_file(tmp, data)
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()
    fsync_dir(path.parent)


def json_bytes(obj: Any) -> bytes:
    return (json.dumps(obj, indent=1, sort_keys=True, allow_nan=False) + "\n").encode()


def make_dir(path: Path) -> None:
    path.mkdir(mode=DIR_MODE, parents=True, exist_ok=True)
    os.chmod(path, DIR_MODE)


# ---------------------------------------------------------------------------------------
# safetensors: mindloom_model's one codec (the header checked before any allocation
# depends on it); its refusals become CheckpointError with the same line


def encode_safetensors(tensors: dict[str, np.ndarray]) -> bytes:
    try:
        return mindloom_model.encode_safetensors(tensors, metadata={"format": "np"})
    except mindloom_model.SafetensorsError as exc:
        raise CheckpointError(str(exc)) from None


def read_safetensors_header(path: Path) -> tuple[dict[str, Any], int]:
    """(tensor entries, data start); CheckpointError naming the file on any defect."""
    try:
        return mindloom_model.read_safetensors_header(path)
    except mindloom_model.SafetensorsError as exc:
        raise CheckpointError(str(exc)) from None


def load_safetensors(path: Path) -> dict[str, np.ndarray]:
    try:
        return mindloom_model.read_safetensors(path)
    except mindloom_model.SafetensorsError as exc:
        raise CheckpointError(str(exc)) from None


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def contained(root: Path, name: Any, where: str) -> Path:
    if not isinstance(name, str) or not _SAFE_NAME.match(name) or name in (".", ".."):
        raise CheckpointError(f"{where}: file name {name!r} is not a plain name in {root}")
    path = root / name
    if path.is_symlink():
        raise CheckpointError(f"{where}: {path} is a symlink; refused")
    real = os.path.realpath(path)
    if os.path.dirname(real) != os.path.realpath(root):
        raise CheckpointError(f"{where}: {name!r} resolves outside {root}")
    return path


def read_json(path: Path) -> dict:
    if path.is_symlink():
        raise CheckpointError(f"{path}: is a symlink; refused")
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        raise CheckpointError(f"{path}: missing (incomplete checkpoint)") from None
    except OSError as exc:
        raise CheckpointError(f"{path}: unreadable ({exc.strerror or exc})") from None
    try:
        obj = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"{path}: not valid JSON ({exc})") from None
    if not isinstance(obj, dict):
        raise CheckpointError(f"{path}: expected a JSON object")
    return obj
