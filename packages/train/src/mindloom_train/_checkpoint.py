"""Checkpoints on disk: Safetensors shards + JSON, written atomically, checked on load.

    save_path/
      step_00000100/
        model-0000000-0000001.safetensors   weights (fp32 master copies)
        optim-0000000-0000001.safetensors   AdamW moments: "exp_avg.NAME", "exp_avg_sq.NAME"
        metadata.json   which tensor lives in which shard, global shape, split across ranks
        common.json     step, consumed samples/tokens, scheduler/optimizer scalars, RNG,
                        data position, config hash (written last inside the directory)
        manifest.json   optional SHA-256 of every file (checkpoint.verify_integrity)
      latest            the newest complete step, digits only, updated last

A step directory is written as `.tmp-step_XXXXXXXX`, fsynced, then renamed; `latest` is
replaced (temp + fsync + rename) after that, and only then are old steps deleted. Loading
never unpickles anything: JSON and Safetensors only, every header checked before a byte of
tensor data is trusted, every file name contained in its directory.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
import shutil
from collections.abc import Callable, Iterable
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


def check_tensor_names(expected: set[str], found: set[str], where: str) -> None:
    """A partial or padded load is an error, never a silent one: the message names the
    first missing tensor, or else the first unexpected one."""
    missing = sorted(expected - found)
    if missing:
        raise CheckpointError(f"{where}: missing tensor {missing[0]!r} ({len(missing)} missing)")
    extra = sorted(found - expected)
    if extra:
        raise CheckpointError(f"{where}: unexpected tensor {extra[0]!r} ({len(extra)} unexpected)")


def step_dirname(step: int) -> str:
    return f"step_{step:08d}"


def shard_name(kind: str, rank: int, world: int) -> str:
    return f"{kind}-{rank:07d}-{world:07d}.safetensors"


# ---------------------------------------------------------------------------------------
# low-level atomic writes


def _fsync_dir(path: Path) -> None:
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


def _write_file(path: Path, data: bytes) -> None:
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
        _write_file(tmp, data)
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()
    _fsync_dir(path.parent)


def _json_bytes(obj: Any) -> bytes:
    return (json.dumps(obj, indent=1, sort_keys=True, allow_nan=False) + "\n").encode()


def _mkdir(path: Path) -> None:
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


# ---------------------------------------------------------------------------------------
# save


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def default_metadata(shards: dict[str, dict[str, np.ndarray]], world: int = 1) -> dict:
    """metadata.json for unsplit tensors: every tensor whole in one shard."""
    tensors = {}
    for fname, group in shards.items():
        for name, arr in group.items():
            tensors[name] = {
                "file": fname,
                "dtype": str(np.asarray(arr).dtype),
                "global_shape": list(np.shape(arr)),
                "split": None,
                "chunks": [
                    {"file": fname, "offset": [0] * np.ndim(arr), "shape": list(np.shape(arr))}
                ],
            }
    return {"format": FORMAT, "version": FORMAT_VERSION, "world_size": world, "tensors": tensors}


def save_checkpoint(
    save_path: Path,
    step: int,
    shards: dict[str, dict[str, np.ndarray]],
    common: dict[str, Any],
    *,
    metadata: dict | None = None,
    keep_last: int = 2,
    verify_integrity: bool = False,
    on_progress: Callable[[int, int | str], None] | None = None,
) -> Path:
    """Write step `step` completely, then point `latest` at it, then apply retention."""
    save_path = Path(os.path.realpath(save_path))
    _mkdir(save_path)
    final = save_path / step_dirname(step)
    tmp = save_path / f".tmp-{step_dirname(step)}"
    if tmp.exists():
        shutil.rmtree(tmp)
    _mkdir(tmp)
    progress = on_progress or (lambda _s, _n: None)
    try:
        written = 0
        progress(step, written)
        for fname, tensors in shards.items():
            _write_file(tmp / fname, encode_safetensors(tensors))
            written += 1
            progress(step, written)
        meta = metadata if metadata is not None else default_metadata(shards)
        _write_file(tmp / "metadata.json", _json_bytes(meta))
        written += 1
        progress(step, written)
        if verify_integrity:
            names = sorted([*shards, "metadata.json"])
            manifest = {n: _sha256(tmp / n) for n in names}
            _write_file(tmp / "manifest.json", _json_bytes({"sha256": manifest}))
            written += 1
            progress(step, written)
        # common.json last: a directory without it is incomplete by definition
        _write_file(tmp / "common.json", _json_bytes({**common, "step": step}))
        written += 1
        progress(step, written)
        _fsync_dir(tmp)
        if final.exists():  # re-saving a step (after going back): swap, then drop the old
            trash = save_path / f".old-{step_dirname(step)}-{os.getpid()}"
            os.replace(final, trash)
            os.replace(tmp, final)
            shutil.rmtree(trash, ignore_errors=True)
        else:
            os.replace(tmp, final)
        _fsync_dir(save_path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    progress(step, "tracker")
    atomic_write(save_path / TRACKER, f"{step}\n".encode())
    os.chmod(save_path / TRACKER, FILE_MODE)
    apply_retention(save_path, keep_last, protect=step)
    return final


def complete_steps(save_path: Path) -> list[int]:
    steps = []
    if not save_path.is_dir():
        return steps
    for p in save_path.iterdir():
        m = STEP_RE.match(p.name)
        if m and p.is_dir() and not p.is_symlink() and (p / "common.json").is_file():
            steps.append(int(m.group(1)))
    return sorted(steps)


def apply_retention(save_path: Path, keep_last: int, protect: int) -> list[int]:
    """Delete the oldest complete steps beyond keep_last (never `protect`)."""
    steps = complete_steps(save_path)
    removed = []
    while len(steps) > max(keep_last, 1):
        victim = steps.pop(0)
        if victim == protect:
            continue
        shutil.rmtree(save_path / step_dirname(victim), ignore_errors=True)
        removed.append(victim)
    return removed


def stale_temp_dirs(save_path: Path) -> list[Path]:
    if not save_path.is_dir():
        return []
    return sorted(p for p in save_path.iterdir() if p.name.startswith((".tmp-step_", ".old-step_")))


def clean_stale_saves(save_path: Path, log: Callable[[str], None]) -> list[str]:
    """At the start of a run (rank 0 only, under the run lock): delete interrupted saves,
    `.tmp-step_*` / `.old-step_*` and step directories without `common.json`, but never
    the step `latest` names (nor any step directory while `latest` is unreadable).
    Returns the names deleted; each is logged."""
    save_path = Path(save_path)
    if not save_path.is_dir():
        return []
    try:
        tracked: int | None | str = read_tracker(save_path)
    except CheckpointError:
        tracked = "unreadable"
    victims = stale_temp_dirs(save_path)
    if tracked != "unreadable":
        for p in sorted(save_path.iterdir()):
            m = STEP_RE.match(p.name)
            if (m and int(m.group(1)) != tracked and p.is_dir() and not p.is_symlink()
                    and not (p / "common.json").exists()):  # fmt: skip
                victims.append(p)
    removed = []
    for p in victims:
        if p.is_symlink() or not p.is_dir():
            continue
        shutil.rmtree(p, ignore_errors=True)
        log(f"checkpoint: removed {p.name}, an incomplete save of an earlier run")
        removed.append(p.name)
    return removed


# ---------------------------------------------------------------------------------------
# load


def _contained(root: Path, name: Any, where: str) -> Path:
    if not isinstance(name, str) or not _SAFE_NAME.match(name) or name in (".", ".."):
        raise CheckpointError(f"{where}: file name {name!r} is not a plain name in {root}")
    path = root / name
    if path.is_symlink():
        raise CheckpointError(f"{where}: {path} is a symlink; refused")
    real = os.path.realpath(path)
    if os.path.dirname(real) != os.path.realpath(root):
        raise CheckpointError(f"{where}: {name!r} resolves outside {root}")
    return path


def _read_json(path: Path) -> dict:
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


def read_tracker(save_path: Path) -> int | None:
    """The step `latest` names; None if there is no tracker; CheckpointError if bad."""
    tracker = save_path / TRACKER
    if not tracker.exists() and not tracker.is_symlink():
        return None
    if tracker.is_symlink() or not tracker.is_file():
        raise CheckpointError(f"{tracker}: not a regular file")
    text = tracker.read_text(encoding="utf-8", errors="replace").strip()
    if not TRACKER_RE.match(text):
        raise CheckpointError(f"{tracker}: holds {text!r}, expected a step number")
    step = int(text)
    if not (save_path / step_dirname(step)).is_dir():
        raise CheckpointError(
            f"{tracker}: names step {step} but {save_path / step_dirname(step)} does not exist"
        )
    return step


class Checkpoint:
    """A checked step directory: common.json, metadata.json and the shard file list."""

    def __init__(self, path: Path, verify_integrity: bool = False):
        self.path = Path(path)
        if self.path.is_symlink():
            raise CheckpointError(f"{self.path}: is a symlink; refused")
        if not self.path.is_dir():
            raise CheckpointError(f"{self.path}: not a checkpoint directory")
        self.common = _read_json(self.path / "common.json")
        self.metadata = _read_json(self.path / "metadata.json")
        if self.metadata.get("format") != FORMAT:
            raise CheckpointError(f"{self.path / 'metadata.json'}: not a {FORMAT} file")
        tensors = self.metadata.get("tensors")
        if not isinstance(tensors, dict):
            raise CheckpointError(f"{self.path / 'metadata.json'}: no tensor table")
        files: set[str] = set()
        where = str(self.path / "metadata.json")
        for name, entry in tensors.items():
            if not isinstance(entry, dict):
                raise CheckpointError(f"{where}: tensor {name!r} entry is not an object")
            chunks = entry.get("chunks") or [{"file": entry.get("file")}]
            if not isinstance(chunks, list) or not all(isinstance(c, dict) for c in chunks):
                raise CheckpointError(f"{where}: tensor {name!r}: chunks is not a list of objects")
            for chunk in chunks:
                fname = chunk.get("file")
                if not isinstance(fname, str):
                    raise CheckpointError(
                        f"{where}: tensor {name!r}: file name {repr(fname)[:100]} is not a string"
                    )
                files.add(fname)
        self.files = {f: _contained(self.path, f, where) for f in sorted(files, key=str)}
        step = self.common.get("step")
        if not isinstance(step, int) or isinstance(step, bool) or step < 0:
            raise CheckpointError(f"{self.path / 'common.json'}: no integer 'step' >= 0")
        self.step = step
        headers = {}
        for fname, fpath in self.files.items():
            if not fpath.is_file():
                raise CheckpointError(f"{fpath}: shard named in metadata.json is missing")
            headers[fname] = read_safetensors_header(fpath)[0]
        # semantics, before any tensor is allocated: a bad value here falls back under
        # resume=auto exactly like a corrupt header (find_resumable)
        _check_tensor_table(tensors, headers, where)
        _check_common(self.common, str(self.path / "common.json"))
        manifest = self.path / "manifest.json"
        if verify_integrity or manifest.exists():
            self._verify_manifest(manifest, required=verify_integrity)

    def _verify_manifest(self, manifest: Path, required: bool) -> None:
        if not manifest.exists():
            if required:
                raise CheckpointError(f"{manifest}: missing (checkpoint.verify_integrity is on)")
            return
        sums = _read_json(manifest).get("sha256")
        if not isinstance(sums, dict):
            raise CheckpointError(f"{manifest}: no 'sha256' table")
        if not required:
            return  # structure checked; hashing every byte only when asked to
        for fname, digest in sums.items():
            path = _contained(self.path, fname, str(manifest))
            if not path.is_file():
                raise CheckpointError(f"{path}: listed in manifest.json but missing")
            if _sha256(path) != digest:
                raise CheckpointError(f"{path}: SHA-256 does not match manifest.json (corrupt)")

    def load_tensors(self, names: Iterable[str] | None = None) -> dict[str, np.ndarray]:
        """Tensors by name, reassembled to their global shapes from their chunks."""
        table = self.metadata["tensors"]
        wanted = list(table) if names is None else list(names)
        cache: dict[str, dict[str, np.ndarray]] = {}
        out = {}
        for name in wanted:
            entry = table.get(name)
            if entry is None:
                raise CheckpointError(f"{self.path}: tensor {name!r} is not in metadata.json")
            chunks = entry.get("chunks") or [{"file": entry["file"], "offset": None}]
            shape = [int(d) for d in entry.get("global_shape", [])]
            full = None
            for chunk in chunks:
                fname = chunk["file"]
                if fname not in cache:
                    cache[fname] = load_safetensors(self.files[fname])
                key = chunk.get("key", name)
                if key not in cache[fname]:
                    raise CheckpointError(f"{self.files[fname]}: tensor {key!r} is missing")
                part = cache[fname][key]
                if len(chunks) == 1 and list(part.shape) == shape:
                    full = part
                    break
                if full is None:
                    full = np.zeros(shape, dtype=part.dtype)
                off = chunk.get("offset") or [0] * part.ndim
                idx = tuple(slice(o, o + s) for o, s in zip(off, part.shape))
                full[idx] = part
            if full is None or list(full.shape) != shape:
                raise CheckpointError(
                    f"{self.path}: tensor {name!r} has shape {None if full is None else list(full.shape)}, "
                    f"metadata.json says {shape}"
                )
            out[name] = full
        return out


def _is_int(v: Any, lo: int = 0, hi: int | None = None) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= lo and (hi is None or v < hi)


def _is_dims(v: Any, ndim: int | None = None) -> bool:
    return isinstance(v, list) and all(_is_int(d) for d in v) and (ndim is None or len(v) == ndim)


def _check_tensor_table(tensors: dict, headers: dict[str, dict], where: str) -> None:
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


def _check_rng(rng: Any, where: str) -> None:
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


def _check_common(common: dict, where: str) -> None:
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
        _check_rng(common["rng"], where)


def find_resumable(
    save_path: Path, log: Callable[[str], None], verify_integrity: bool = False
) -> Checkpoint | None:
    """The newest usable checkpoint under save_path (falls back past corrupt ones).

    None when there is nothing at all to resume from. CheckpointError when the tracker is
    unusable, or when checkpoints exist but none of them loads.
    """
    save_path = Path(save_path)
    for p in stale_temp_dirs(save_path):
        log(f"checkpoint: {p.name} is an incomplete save (interrupted); ignoring it")
    tracked = read_tracker(save_path)
    steps = complete_steps(save_path)
    if tracked is None and not steps:
        return None
    candidates = sorted({*steps, *([tracked] if tracked is not None else [])}, reverse=True)
    if tracked is not None:
        # never resume from a step newer than the tracker: it was not committed
        candidates = [s for s in candidates if s <= tracked]
    errors = []
    for step in candidates:
        try:
            ckpt = Checkpoint(save_path / step_dirname(step), verify_integrity)
        except CheckpointError as exc:
            log(f"checkpoint: step {step} is unusable: {exc}")
            errors.append(str(exc))
            continue
        if step != (tracked if tracked is not None else step):
            log(f"checkpoint: falling back to the previous complete checkpoint, step {step}")
        return ckpt
    raise CheckpointError(
        f"{save_path}: no usable checkpoint ({len(errors)} found, all unusable; last error: "
        f"{errors[-1] if errors else 'none'})"
    )


def open_checkpoint(path: Path, verify_integrity: bool = False) -> Checkpoint:
    """A step directory, or a save_path (its `latest`), for weights-only starts and tools."""
    path = Path(path)
    if (path / "common.json").exists() or STEP_RE.match(path.name):
        return Checkpoint(path, verify_integrity)
    step = read_tracker(path)
    if step is None:
        raise CheckpointError(f"{path}: neither a step directory nor a save path with '{TRACKER}'")
    return Checkpoint(path / step_dirname(step), verify_integrity)
