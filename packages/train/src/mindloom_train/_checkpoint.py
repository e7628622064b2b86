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

Under a tensor / pipeline / ZeRO-1 layout every rank writes the files of the blocks it
owns into the same `.tmp-step_XXXXXXXX` (`write_rank_files`, each file fsynced, then the
rank's index); after a barrier over every rank, rank 0 merges the indexes into
metadata.json and commits (`commit_rank_files`): a rank that dies mid-write leaves no
commit, and `latest` on the previous step.

The parts: `_ckpt_files` (names, atomic writes, the codec), `_ckpt_save` (writing a step,
`latest`, retention, stale saves, the per-rank writes), `_ckpt_checks` (what the JSON may
say), `_ckpt_read` (byte-range reads of the blocks a rank needs); this module reads a step
back (`Checkpoint`) and picks the one to resume from.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from pathlib import Path

import numpy as np

from mindloom_train._ckpt_checks import check_common, check_tensor_names, check_tensor_table
from mindloom_train._ckpt_files import (
    DIR_MODE,
    FILE_MODE,
    FORMAT,
    FORMAT_VERSION,
    STEP_RE,
    TRACKER,
    TRACKER_RE,
    atomic_write,
    contained,
    encode_safetensors,
    load_safetensors,
    read_json,
    read_safetensors_header,
    sha256_file,
    shard_name,
    step_dirname,
)
from mindloom_train._ckpt_read import read_boxes
from mindloom_train._ckpt_save import (
    abort_rank_files,
    apply_retention,
    clean_stale_saves,
    commit_rank_files,
    complete_steps,
    default_metadata,
    read_tracker,
    save_checkpoint,
    stale_temp_dirs,
    write_rank_files,
)
from mindloom_train._errors import CheckpointError

# the names this module has always offered (train's modules and the tests import them here)
__all__ = [
    "DIR_MODE",
    "FILE_MODE",
    "FORMAT",
    "FORMAT_VERSION",
    "STEP_RE",
    "TRACKER",
    "TRACKER_RE",
    "Checkpoint",
    "CheckpointError",
    "abort_rank_files",
    "apply_retention",
    "atomic_write",
    "check_tensor_names",
    "clean_stale_saves",
    "commit_rank_files",
    "complete_steps",
    "default_metadata",
    "encode_safetensors",
    "find_resumable",
    "load_safetensors",
    "open_checkpoint",
    "read_safetensors_header",
    "read_tracker",
    "save_checkpoint",
    "shard_name",
    "stale_temp_dirs",
    "step_dirname",
    "write_rank_files",
]


class Checkpoint:
    """A checked step directory: common.json, metadata.json and the shard file list."""

    def __init__(self, path: Path, verify_integrity: bool = False):
        self.path = Path(path)
        if self.path.is_symlink():
            raise CheckpointError(f"{self.path}: is a symlink; refused")
        if not self.path.is_dir():
            raise CheckpointError(f"{self.path}: not a checkpoint directory")
        self.common = read_json(self.path / "common.json")
        self.metadata = read_json(self.path / "metadata.json")
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
        self.files = {f: contained(self.path, f, where) for f in sorted(files, key=str)}
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
        check_tensor_table(tensors, headers, where)
        check_common(self.common, str(self.path / "common.json"))
        manifest = self.path / "manifest.json"
        if verify_integrity or manifest.exists():
            self._verify_manifest(manifest, required=verify_integrity)

    def _verify_manifest(self, manifest: Path, required: bool) -> None:
        if not manifest.exists():
            if required:
                raise CheckpointError(f"{manifest}: missing (checkpoint.verify_integrity is on)")
            return
        sums = read_json(manifest).get("sha256")
        if not isinstance(sums, dict):
            raise CheckpointError(f"{manifest}: no 'sha256' table")
        if not required:
            return  # structure checked; hashing every byte only when asked to
        for fname, digest in sums.items():
            path = contained(self.path, fname, str(manifest))
            if not path.is_file():
                raise CheckpointError(f"{path}: listed in manifest.json but missing")
            if sha256_file(path) != digest:
                raise CheckpointError(f"{path}: SHA-256 does not match manifest.json (corrupt)")

    def load_tensors(self, names: Iterable[str] | None = None) -> dict[str, np.ndarray]:
        """Tensors by name, reassembled to their global shapes from their chunks."""
        wanted = list(self.metadata["tensors"]) if names is None else list(names)
        return self.read_boxes({n: None for n in wanted})

    def read_boxes(self, boxes: dict) -> dict[str, np.ndarray]:
        """name -> its block (global offset, shape; None: the whole tensor), read from the
        shards that hold it, only the bytes of the block (`_ckpt_read`)."""
        return read_boxes(self.metadata["tensors"], self.files, boxes, str(self.path))


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
