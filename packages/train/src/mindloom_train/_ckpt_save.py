"""A save path on disk: writing a step directory atomically, the `latest` tracker,
retention, and the leftovers of interrupted saves."""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from mindloom_train._ckpt_files import (
    FILE_MODE,
    FORMAT,
    FORMAT_VERSION,
    STEP_RE,
    TRACKER,
    TRACKER_RE,
    atomic_write,
    encode_safetensors,
    fsync_dir,
    json_bytes,
    make_dir,
    sha256_file,
    step_dirname,
    write_file,
)
from mindloom_train._errors import CheckpointError


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
    make_dir(save_path)
    final = save_path / step_dirname(step)
    tmp = save_path / f".tmp-{step_dirname(step)}"
    if tmp.exists():
        shutil.rmtree(tmp)
    make_dir(tmp)
    progress = on_progress or (lambda _s, _n: None)
    try:
        written = 0
        progress(step, written)
        for fname, tensors in shards.items():
            write_file(tmp / fname, encode_safetensors(tensors))
            written += 1
            progress(step, written)
        meta = metadata if metadata is not None else default_metadata(shards)
        write_file(tmp / "metadata.json", json_bytes(meta))
        written += 1
        progress(step, written)
        if verify_integrity:
            names = sorted([*shards, "metadata.json"])
            manifest = {n: sha256_file(tmp / n) for n in names}
            write_file(tmp / "manifest.json", json_bytes({"sha256": manifest}))
            written += 1
            progress(step, written)
        _finish_dir(tmp, final, save_path, step, common, progress, written)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    _commit(save_path, step, keep_last, progress)
    return final


def _finish_dir(tmp: Path, final: Path, save_path: Path, step: int, common: dict,
                progress, written: int) -> None:  # fmt: skip
    """common.json last inside `tmp` (a directory without it is incomplete by definition),
    then `tmp` renamed to `final`."""
    write_file(tmp / "common.json", json_bytes({**common, "step": step}))
    written += 1
    progress(step, written)
    fsync_dir(tmp)
    if final.exists():  # re-saving a step (after going back): swap, then drop the old
        trash = save_path / f".old-{step_dirname(step)}-{os.getpid()}"
        os.replace(final, trash)
        os.replace(tmp, final)
        shutil.rmtree(trash, ignore_errors=True)
    else:
        os.replace(tmp, final)
    fsync_dir(save_path)


def _commit(save_path: Path, step: int, keep_last: int, progress) -> None:
    """`latest` names the step, then retention: only after the step is complete."""
    progress(step, "tracker")
    atomic_write(save_path / TRACKER, f"{step}\n".encode())
    os.chmod(save_path / TRACKER, FILE_MODE)
    apply_retention(save_path, keep_last, protect=step)


# ---------------------------------------------------------------------------------------
# distributed saves: every rank writes its own files into the same temporary directory;
# rank 0 merges the ranks' indexes into metadata.json and commits, after a barrier


def rank_index_name(rank: int, world: int) -> str:
    return f"index-{rank:07d}-{world:07d}.json"


def temp_dir(save_path: Path, step: int) -> Path:
    return Path(os.path.realpath(save_path)) / f".tmp-{step_dirname(step)}"


def write_rank_files(
    save_path: Path,
    step: int,
    files: dict[str, dict[str, np.ndarray]],
    tensors: dict[str, dict],
    rank: int,
    world: int,
    on_progress: Callable[[int, int | str], None] | None = None,
) -> Path:
    """This rank's part of step `step`: its shard files, each fsynced, then its index (the
    metadata.json entries of the chunks it wrote), last. Nothing is committed here."""
    tmp = temp_dir(save_path, step)
    make_dir(tmp.parent)
    make_dir(tmp)
    progress = on_progress or (lambda _s, _n: None)
    written = 0
    progress(step, written)
    for fname, group in files.items():
        write_file(tmp / fname, encode_safetensors(group))
        written += 1
        progress(step, written)
    index = {"rank": rank, "world_size": world, "files": sorted(files), "tensors": tensors}
    write_file(tmp / rank_index_name(rank, world), json_bytes(index))
    fsync_dir(tmp)
    return tmp


def merge_indexes(tmp: Path, world: int) -> dict[str, dict]:
    """metadata.json's tensor table from every rank's index: each tensor's chunks from
    whichever ranks wrote them, checked to tile its global shape exactly against the
    shards' own headers (a rank that did not finish, or a block written twice, is an
    error here, before anything is committed)."""
    from mindloom_train._ckpt_checks import check_tensor_table
    from mindloom_train._ckpt_files import read_json, read_safetensors_header

    tensors: dict[str, dict] = {}
    files: set[str] = set()
    for rank in range(world):
        path = tmp / rank_index_name(rank, world)
        if not path.is_file():
            raise CheckpointError(f"{path}: missing: rank {rank} did not finish its files")
        index = read_json(path)
        files.update(index.get("files", []))
        for name, entry in index.get("tensors", {}).items():
            have = tensors.get(name)
            if have is None:
                tensors[name] = {**entry, "chunks": list(entry["chunks"])}
                continue
            for key in ("global_shape", "dtype", "split"):
                if have.get(key) != entry.get(key):
                    raise CheckpointError(f"{path}: tensor {name!r}: {key} {entry.get(key)} "
                                          f"differs from another rank's {have.get(key)}")  # fmt: skip
            have["chunks"].extend(entry["chunks"])
    for entry in tensors.values():
        entry["chunks"].sort(key=lambda c: c["offset"])
        entry["file"] = entry["chunks"][0]["file"]
    headers = {f: read_safetensors_header(tmp / f)[0] for f in sorted(files)}
    check_tensor_table(tensors, headers, str(tmp / "metadata.json"))
    return tensors


def commit_rank_files(
    save_path: Path,
    step: int,
    world: int,
    metadata: dict,
    common: dict[str, Any],
    *,
    keep_last: int = 2,
    verify_integrity: bool = False,
    on_progress: Callable[[int, int | str], None] | None = None,
) -> Path:
    """Rank 0, after every rank has written its files (the barrier): metadata.json from
    the ranks' indexes, the manifest, common.json, the rename, then `latest`."""
    save_path = Path(os.path.realpath(save_path))
    tmp, final = temp_dir(save_path, step), save_path / step_dirname(step)
    progress = on_progress or (lambda _s, _n: None)
    try:
        meta = {**metadata, "tensors": merge_indexes(tmp, world)}
        write_file(tmp / "metadata.json", json_bytes(meta))
        for rank in range(world):
            (tmp / rank_index_name(rank, world)).unlink()
        if verify_integrity:
            names = sorted({c["file"] for e in meta["tensors"].values() for c in e["chunks"]})
            manifest = {n: sha256_file(tmp / n) for n in [*names, "metadata.json"]}
            write_file(tmp / "manifest.json", json_bytes({"sha256": manifest}))
        _finish_dir(tmp, final, save_path, step, common, progress, 0)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    _commit(save_path, step, keep_last, progress)
    return final


def abort_rank_files(save_path: Path, step: int) -> None:
    """Rank 0, after the barrier, when some rank failed: the partial step is removed."""
    shutil.rmtree(temp_dir(save_path, step), ignore_errors=True)


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
