"""The safetensors codec of mindloom: one reader and one writer (NumPy only, no MindSpore).

The format: an 8-byte little-endian header length N, N bytes of JSON header
(`{"__metadata__": {str: str}, NAME: {"dtype", "shape", "data_offsets": [begin, end]}}`,
offsets relative to the data section), then the raw little-endian tensor bytes. It is
ours rather than the `safetensors` package's so that bf16 files load without a bf16 NumPy
dtype, every header field is checked before any allocation depends on it, and nothing in
a file is ever executed. The training checkpoints (`mindloom_train`) and the Hugging Face
export/import (`save_hf` / `load_hf`) both use it; the tests check it against the
`safetensors` package's own reader and writer.

A file this reader refuses raises `SafetensorsError`, one line naming the file and, where
the defect has one, its byte offset in the file.
"""

from __future__ import annotations

import json
import math
import os
import struct
from collections.abc import Iterable
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np

__all__ = [
    "SafetensorsError",
    "encode_safetensors",
    "read_safetensors",
    "read_safetensors_header",
    "read_tensor",
    "write_safetensors",
]

MAX_HEADER = 100 * 1024 * 1024  # the reference implementation's limit

# safetensors dtype code -> NumPy dtype; BF16 has no NumPy dtype and is read as float32
_NP_DTYPES = {
    "F64": np.float64,
    "F32": np.float32,
    "F16": np.float16,
    "I64": np.int64,
    "I32": np.int32,
    "I16": np.int16,
    "I8": np.int8,
    "U8": np.uint8,
    "BOOL": np.bool_,
}
_ITEMSIZE = {**{k: np.dtype(v).itemsize for k, v in _NP_DTYPES.items()}, "BF16": 2}
_CODE_OF = {np.dtype(v): k for k, v in _NP_DTYPES.items()}
# write_safetensors(dtype=...): the code float arrays are stored as
_CAST = {"float32": "F32", "float16": "F16", "bfloat16": "BF16"}


class SafetensorsError(ValueError):
    """A safetensors file that cannot be read or a tensor that cannot be written; one line
    naming the file (and the byte offset of the defect where it has one)."""


# ----------------------------------------------------------------------------- write


def _bf16_bytes(a: np.ndarray) -> bytes:
    # fp32 -> bf16 with round-to-nearest-even on the upper 16 bits
    u = np.ascontiguousarray(a, np.float32).view(np.uint32)
    rounded = (u + 0x7FFF + ((u >> 16) & 1)) >> 16
    return rounded.astype("<u2").tobytes()


def _tensor_bytes(name: str, value, dtype: str | None) -> tuple[str, list[int], bytes]:
    arr = np.asarray(value)
    if dtype is not None:
        if dtype not in _CAST:
            raise SafetensorsError(f"dtype must be one of {sorted(_CAST)}, found {dtype!r}")
        code = _CAST[dtype]
        a32 = arr.astype(np.float32)
        if code == "BF16":
            return code, list(arr.shape), _bf16_bytes(a32)
        return code, list(arr.shape), np.ascontiguousarray(a32, _NP_DTYPES[code]).tobytes()
    code = _CODE_OF.get(arr.dtype.newbyteorder("="))
    if code is None:
        raise SafetensorsError(f"tensor {name}: dtype {arr.dtype} cannot be saved")
    little = arr.dtype.newbyteorder("<")
    return code, list(arr.shape), np.ascontiguousarray(arr, little).tobytes()


def encode_safetensors(
    tensors: dict[str, Any], metadata: dict | None = None, dtype: str | None = None
) -> bytes:
    """The bytes of a safetensors file holding `tensors` (name -> array), names sorted.

    dtype None stores each array in its own dtype (F64/F32/F16/I64/I32/I16/I8/U8/BOOL);
    "float32" | "float16" | "bfloat16" stores every tensor as F32/F16/BF16 (bf16 rounded
    to nearest even). `metadata` (str -> str) goes first in the header as `__metadata__`.
    """
    header: dict[str, Any] = {}
    if metadata:
        header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
    blobs, offset = [], 0
    for name in sorted(tensors):
        code, shape, raw = _tensor_bytes(name, tensors[name], dtype)
        header[name] = {"dtype": code, "shape": shape, "data_offsets": [offset, offset + len(raw)]}
        blobs.append(raw)
        offset += len(raw)
    hb = json.dumps(header, separators=(",", ":")).encode()
    hb += b" " * (-len(hb) % 8)  # the data section starts 8-byte aligned
    return b"".join([struct.pack("<Q", len(hb)), hb, *blobs])


def write_safetensors(
    path: str | os.PathLike,
    tensors: dict[str, Any],
    dtype: str | None = None,
    metadata: dict | None = None,
) -> None:
    """`encode_safetensors` written atomically: a temporary name, fsync, rename. A crash
    leaves the old file (or none), never a partial one under `path`."""
    data = encode_safetensors(tensors, metadata, dtype)
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


# ----------------------------------------------------------------------------- read


def _check_entry(path: Path, name: str, entry: Any, data_start: int, data_len: int):
    try:
        code, shape, (begin, end) = entry["dtype"], entry["shape"], entry["data_offsets"]
    except (TypeError, KeyError, ValueError):
        raise SafetensorsError(f"{path}: tensor {name!r} has a malformed header entry") from None
    if code not in _ITEMSIZE:
        raise SafetensorsError(f"{path}: tensor {name!r} has unsupported dtype {code!r}")
    if not isinstance(shape, list) or not all(
        isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape
    ):
        raise SafetensorsError(f"{path}: tensor {name!r} has a malformed shape {shape!r}")
    want = math.prod(shape) * _ITEMSIZE[code]
    ints = all(isinstance(x, int) and not isinstance(x, bool) for x in (begin, end))
    if not (ints and 0 <= begin <= end and end - begin == want):
        raise SafetensorsError(
            f"{path}: tensor {name!r} data_offsets [{begin}, {end}] do not fit shape {shape} "
            f"{code} ({want} bytes)"
        )
    if end > data_len:
        raise SafetensorsError(
            f"{path}: tensor {name!r} data_offsets [{begin}, {end}] do not fit the data "
            f"section ({data_len} bytes from byte {data_start}): truncated at byte "
            f"{data_start + data_len}"
        )
    return begin, end


def read_safetensors_header(path: str | os.PathLike) -> tuple[dict[str, dict], int]:
    """(tensor entries without `__metadata__`, the data section's byte offset).

    Everything is checked before a tensor is read: the header length against the file,
    the JSON, each entry's dtype, shape and offsets, and that the tensors tile the data
    section exactly (no overlap, no gap, no trailing bytes).
    """
    path = Path(path)
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            first = f.read(8)
            if len(first) < 8:
                raise SafetensorsError(
                    f"{path}: not a safetensors file ({size} bytes, no header length): truncated"
                )
            (n,) = struct.unpack("<Q", first)
            if n > min(size - 8, MAX_HEADER):
                raise SafetensorsError(
                    f"{path}: header length {n} at byte 0 exceeds the file ({size} bytes): "
                    "truncated or corrupt"
                )
            raw = f.read(n)
    except OSError as e:
        raise SafetensorsError(f"{path}: cannot read: {e.strerror or e}") from None
    try:
        header = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        at = 8 + getattr(e, "pos", getattr(e, "start", 0))
        raise SafetensorsError(f"{path}: corrupt header: not valid JSON at byte {at}") from None
    if not isinstance(header, dict):
        raise SafetensorsError(f"{path}: corrupt header: not a JSON object (at byte 8)")
    header.pop("__metadata__", None)
    start, data_len = 8 + n, size - 8 - n
    spans = sorted(
        (*_check_entry(path, name, entry, start, data_len), name) for name, entry in header.items()
    )
    pos = 0
    for begin, end, name in spans:
        if begin != pos:
            raise SafetensorsError(
                f"{path}: tensor {name!r} overlaps or leaves a gap at byte {start + begin}"
            )
        pos = end
    if pos != data_len:
        raise SafetensorsError(
            f"{path}: {data_len - pos} trailing bytes after the last tensor, from byte {start + pos}"
        )
    return header, start


def read_tensor(f: BinaryIO, entry: dict, data_start: int, path: Any = "<file>") -> np.ndarray:
    """One tensor of a header from `read_safetensors_header`, read from the open file `f`:
    its own dtype, except BF16, which comes back as float32 (exactly)."""
    begin, end = entry["data_offsets"]
    f.seek(data_start + begin)
    raw = f.read(end - begin)
    if len(raw) != end - begin:
        raise SafetensorsError(
            f"{path}: truncated at byte {data_start + begin + len(raw)}, inside a tensor"
        )
    if entry["dtype"] == "BF16":
        a = (np.frombuffer(raw, "<u2").astype(np.uint32) << 16).view(np.float32)
    else:
        a = np.frombuffer(raw, np.dtype(_NP_DTYPES[entry["dtype"]]).newbyteorder("<"))
        a = a.astype(a.dtype.newbyteorder("="))  # a native, writable copy
    return a.reshape(entry["shape"])


def read_safetensors(
    path: str | os.PathLike, names: Iterable[str] | None = None
) -> dict[str, np.ndarray]:
    """name -> array for every tensor of the file (or only `names`), checked as
    `read_safetensors_header` says. A name the file lacks is a SafetensorsError."""
    header, start = read_safetensors_header(path)
    wanted = list(header) if names is None else list(names)
    with open(path, "rb") as f:
        out = {}
        for name in wanted:
            if name not in header:
                raise SafetensorsError(f"{path}: no tensor {name!r}")
            out[name] = read_tensor(f, header[name], start, path)
        return out
