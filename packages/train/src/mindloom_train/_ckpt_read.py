"""Balanced checkpoint loading: a rank reads only the blocks of the global tensors it
holds, from whichever shard files hold them, byte range by byte range.

A request is a box of a global tensor (offset and shape per axis). Every chunk of the
tensor (metadata.json: file, key, offset, shape) that intersects the box contributes its
intersection, read from the shard with `os.pread` over the file's safetensors offsets:
the intersection's rows are contiguous runs of the chunk's C-order bytes (one run when
the box covers the chunk's trailing axes whole, e.g. a tensor-parallel split on axis 0),
so nothing outside the box is read, and no rank assembles a tensor it does not hold.

`BYTES_READ` counts the tensor bytes this process read (the resume logs it once; the
tests read it); headers are counted apart in `HEADER_BYTES`.
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterable
from pathlib import Path

import numpy as np

from mindloom_train._errors import CheckpointError

__all__ = ["BYTES_READ", "Box", "read_boxes", "reset_counters"]

Box = tuple[tuple[int, ...], tuple[int, ...]]  # (global offset, shape)

# safetensors dtype code -> NumPy dtype (little-endian); BF16 widened to float32 on read
_DTYPES = {"F64": "<f8", "F32": "<f4", "F16": "<f2", "I64": "<i8", "I32": "<i4", "I16": "<i2",
           "I8": "i1", "U8": "u1", "BOOL": "?", "BF16": "<u2"}  # fmt: skip

BYTES_READ = {"tensor": 0, "files": 0}
HEADER_BYTES = {"header": 0}


def reset_counters() -> None:
    BYTES_READ.update(tensor=0, files=0)
    HEADER_BYTES.update(header=0)


def _runs(chunk_shape: list[int], lo: list[int], hi: list[int]) -> tuple[int, list[int]]:
    """(run length in elements, start element of every run) of the box [lo, hi) inside a
    C-ordered array of `chunk_shape`: the trailing axes the box covers whole merge into
    one run with the first axis it does not."""
    nd = len(chunk_shape)
    if nd == 0:
        return 1, [0]
    k = nd - 1
    while k > 0 and lo[k] == 0 and hi[k] == chunk_shape[k]:
        k -= 1
    inner = math.prod(chunk_shape[k + 1 :])
    run = (hi[k] - lo[k]) * inner
    strides = [math.prod(chunk_shape[i + 1 :]) for i in range(nd)]
    starts = np.zeros(1, np.int64) + lo[k] * strides[k]
    for i in range(k - 1, -1, -1):
        idx = np.arange(lo[i], hi[i], dtype=np.int64) * strides[i]
        starts = (idx[:, None] + starts[None, :]).reshape(-1)
    return run, starts.tolist()


class _Shards:
    """Open shard files and their checked headers, read once each."""

    def __init__(self, files: dict[str, Path]):
        self.files, self.fds, self.headers = files, {}, {}

    def entry(self, fname: str, key: str) -> tuple[int, dict, int]:
        from mindloom_train._ckpt_files import read_safetensors_header

        if fname not in self.fds:
            path = self.files[fname]
            header, start = read_safetensors_header(path)
            self.headers[fname] = (header, start)
            self.fds[fname] = os.open(path, os.O_RDONLY)
            HEADER_BYTES["header"] += start
            BYTES_READ["files"] += 1
        header, start = self.headers[fname]
        if key not in header:
            raise CheckpointError(f"{self.files[fname]}: tensor {key!r} is missing")
        return self.fds[fname], header[key], start

    def close(self) -> None:
        for fd in self.fds.values():
            os.close(fd)
        self.fds = {}


def _read_part(fd: int, path: Path, entry: dict, data_start: int, chunk_shape: list[int],
               lo: list[int], hi: list[int]) -> np.ndarray:  # fmt: skip
    code = entry["dtype"]
    if code not in _DTYPES:
        raise CheckpointError(f"{path}: unsupported dtype {code!r}")
    dt = np.dtype(_DTYPES[code])
    run, starts = _runs(chunk_shape, lo, hi)
    base = data_start + entry["data_offsets"][0]
    nbytes = run * dt.itemsize
    buf = bytearray(nbytes * len(starts))
    view = memoryview(buf)
    for j, s in enumerate(starts):
        got = os.preadv(fd, [view[j * nbytes : (j + 1) * nbytes]], base + s * dt.itemsize)
        if got != nbytes:
            raise CheckpointError(f"{path}: truncated at byte {base + s * dt.itemsize + got}")
    BYTES_READ["tensor"] += len(buf)
    a = np.frombuffer(buf, dt)
    if code == "BF16":
        a = (a.astype(np.uint32) << 16).view(np.float32)
    else:
        a = a.astype(dt.newbyteorder("="), copy=False)
    return a.reshape([h - lo_ for lo_, h in zip(lo, hi)])


def read_boxes(
    table: dict, files: dict[str, Path], boxes: dict[str, Box | None], where: str
) -> dict[str, np.ndarray]:
    """name -> the array of its box (None: the whole tensor), read from the chunks of
    metadata.json's `table` (already checked by `check_tensor_table`) in `files`."""
    shards = _Shards(files)
    out = {}
    try:
        for name, box in boxes.items():
            entry = table.get(name)
            if entry is None:
                raise CheckpointError(f"{where}: tensor {name!r} is not in metadata.json")
            gshape = [int(d) for d in entry.get("global_shape", [])]
            off, shape = box if box is not None else ([0] * len(gshape), gshape)
            off, shape = list(off), list(shape)
            if len(off) != len(gshape) or any(
                o < 0 or o + n > g for o, n, g in zip(off, shape, gshape)
            ):
                raise CheckpointError(
                    f"{where}: tensor {name!r} has shape {gshape}, the model expects a block "
                    f"{shape} at {off} of it"
                )
            chunks = entry.get("chunks") or [
                {"file": entry.get("file"), "offset": [0] * len(gshape), "shape": gshape}
            ]
            result, covered = None, 0
            for chunk in chunks:
                c_off = chunk.get("offset") or [0] * len(gshape)
                fd, hentry, start = shards.entry(chunk["file"], chunk.get("key", name))
                c_shape = [int(d) for d in hentry["shape"]]
                lo = [max(o, co) for o, co in zip(off, c_off)]
                hi = [min(o + n, co + cn) for o, n, co, cn in zip(off, shape, c_off, c_shape)]
                if any(h <= low for low, h in zip(lo, hi)) and math.prod(shape) > 0:
                    continue  # this chunk holds nothing of the box
                part = _read_part(fd, files[chunk["file"]], hentry, start, c_shape,
                                  [a - c for a, c in zip(lo, c_off)],
                                  [b - c for b, c in zip(hi, c_off)])  # fmt: skip
                if result is None:
                    if list(part.shape) == shape:  # the box is this one chunk's block
                        result = part
                        covered = part.size
                        continue
                    result = np.zeros(shape, part.dtype)
                idx = tuple(slice(a - o, b - o) for a, b, o in zip(lo, hi, off))
                result[idx] = part
                covered += part.size
            if result is None:
                result = np.zeros(shape, np.float32)
            if covered != math.prod(shape):
                raise CheckpointError(
                    f"{where}: tensor {name!r}: the chunks hold {covered} of the {math.prod(shape)} "
                    f"values at {off} {shape}"
                )
            out[name] = result
    finally:
        shards.close()
    return out


def whole(names: Iterable[str]) -> dict[str, Box | None]:
    return {n: None for n in names}
