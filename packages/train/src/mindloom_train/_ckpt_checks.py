"""What a checkpoint's JSON may say: metadata.json's tensor table and common.json's fields
checked for types, ranges and consistency before any tensor is allocated from them."""

from __future__ import annotations

import math
from typing import Any

from mindloom_train._errors import CheckpointError


def check_tensor_names(expected: set[str], found: set[str], where: str) -> None:
    """A partial or padded load is an error, never a silent one: the message names the
    first missing tensor, or else the first unexpected one."""
    missing = sorted(expected - found)
    if missing:
        raise CheckpointError(f"{where}: missing tensor {missing[0]!r} ({len(missing)} missing)")
    extra = sorted(found - expected)
    if extra:
        raise CheckpointError(f"{where}: unexpected tensor {extra[0]!r} ({len(extra)} unexpected)")


def _is_int(v: Any, lo: int = 0, hi: int | None = None) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= lo and (hi is None or v < hi)


def _is_dims(v: Any, ndim: int | None = None) -> bool:
    return isinstance(v, list) and all(_is_int(d) for d in v) and (ndim is None or len(v) == ndim)


def check_tensor_table(tensors: dict, headers: dict[str, dict], where: str) -> None:
    """Every entry of metadata.json's tensor table: types, ranges, chunks inside the
    global shape and tiling it exactly, each chunk's shape the one its shard holds (and
    so bounded by the file size). Nothing is allocated from these numbers before this."""
    for name, entry in tensors.items():
        shape = entry.get("global_shape")
        if not _is_dims(shape):
            raise CheckpointError(f"{where}: tensor {name!r}: global_shape {str(shape)[:100]} "
                                  "is not a list of integers >= 0")  # fmt: skip
        chunks = entry.get("chunks")
        if chunks is None:
            chunks = [{"file": entry.get("file"), "offset": [0] * len(shape), "shape": shape}]
        if not isinstance(chunks, list) or not chunks:
            raise CheckpointError(f"{where}: tensor {name!r}: chunks is not a non-empty list")
        boxes = []
        for i, chunk in enumerate(chunks):
            what = f"{where}: tensor {name!r} chunk {i}"
            if not isinstance(chunk, dict):
                raise CheckpointError(f"{what}: not an object")
            key = chunk.get("key", name)
            off = chunk.get("offset") or [0] * len(shape)
            if not isinstance(key, str):
                raise CheckpointError(f"{what}: key {str(key)[:100]} is not a string")
            if not _is_dims(off, len(shape)):
                raise CheckpointError(
                    f"{what}: offset {str(off)[:100]} is not {len(shape)} integers >= 0"
                )
            header = headers.get(chunk.get("file"), {})
            if key not in header:
                raise CheckpointError(f"{what}: shard {chunk.get('file')} has no tensor {key!r}")
            held = [int(d) for d in header[key]["shape"]]
            size = chunk.get("shape", held)
            if not _is_dims(size, len(shape)) or list(size) != held:
                raise CheckpointError(
                    f"{what}: shape {str(size)[:100]} is not the {held} its shard holds"
                )
            if any(o + n > g for o, n, g in zip(off, size, shape)):
                raise CheckpointError(
                    f"{what}: offset {off} + shape {size} lies outside global_shape {shape}"
                )
            boxes.append((off, size))
        volume = sum(math.prod(n) for _, n in boxes)
        if volume != math.prod(shape):
            raise CheckpointError(
                f"{where}: tensor {name!r}: chunks hold {volume} elements, global_shape "
                f"{shape} needs {math.prod(shape)}"
            )
        for a in range(len(boxes)):  # equal volume + no overlap = exact tiling
            for b in range(a):
                (oa, na), (ob, nb) = boxes[a], boxes[b]
                if all(x < y + m and y < x + n for x, n, y, m in zip(oa, na, ob, nb)):
                    raise CheckpointError(f"{where}: tensor {name!r}: chunks {b} and {a} overlap")


def check_rng(rng: Any, where: str) -> None:
    def bad(what: str) -> CheckpointError:
        return CheckpointError(f"{where}: rng.{what} is not a valid generator state")

    if not isinstance(rng, dict):
        raise CheckpointError(f"{where}: rng is not an object")
    if "numpy" in rng:
        st = rng["numpy"]
        if not (isinstance(st, list) and len(st) == 5 and st[0] == "MT19937"
                and isinstance(st[1], list) and len(st[1]) == 624
                and all(_is_int(k, 0, 2**32) for k in st[1]) and _is_int(st[2], 0, 625)
                and _is_int(st[3], 0, 2) and isinstance(st[4], int | float)):  # fmt: skip
            raise bad("numpy")
    if "python" in rng:
        st = rng["python"]
        if not (isinstance(st, list) and len(st) == 3 and _is_int(st[0])
                and isinstance(st[1], list) and len(st[1]) == 625
                and all(_is_int(k, 0, 2**32) for k in st[1])
                and (st[2] is None or isinstance(st[2], int | float))):  # fmt: skip
            raise bad("python")
    if "mindspore" in rng:
        st = rng["mindspore"]
        if not (isinstance(st, list) and st and all(_is_int(k, -(2**63), 2**64) for k in st)):
            raise bad("mindspore")


def check_common(common: dict, where: str) -> None:
    """common.json's fields the trainer acts on: present, typed, in range, consistent."""
    consumed = common.get("consumed_samples")
    if not _is_int(consumed):
        raise CheckpointError(f"{where}: consumed_samples {str(consumed)[:100]} is not an "
                              "integer >= 0")  # fmt: skip
    gbs = common.get("global_batch_size")
    if gbs is not None:
        if not _is_int(gbs, 1):
            raise CheckpointError(f"{where}: global_batch_size {str(gbs)[:100]} is not >= 1")
        # every update consumes exactly one global batch (a skipped one too)
        if consumed != common["step"] * gbs:
            raise CheckpointError(
                f"{where}: consumed_samples {consumed} != step {common['step']} x "
                f"global_batch_size {gbs}"
            )
    for key in ("adam_step", "skipped_steps", "world_size"):
        if key in common and not _is_int(common[key]):
            raise CheckpointError(f"{where}: {key} {str(common[key])[:100]} is not an integer >= 0")
    for key in ("lr", "loss_smoothed"):
        val = common.get(key)
        if val is not None and (isinstance(val, bool) or not isinstance(val, int | float)):
            raise CheckpointError(f"{where}: {key} {str(val)[:100]} is not a number")
    ls = common.get("loss_scale")
    if ls is not None:
        if not (isinstance(ls, dict) and isinstance(ls.get("scale", 1.0), int | float)
                and ls.get("scale", 1.0) > 0 and _is_int(ls.get("good_steps", 0))):  # fmt: skip
            raise CheckpointError(f"{where}: loss_scale {str(ls)[:100]} is not valid")
    if common.get("rng") is not None:
        check_rng(common["rng"], where)
