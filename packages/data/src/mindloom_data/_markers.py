"""The completion marker of a clean output: what it covers, checked before it is trusted.

`OUT/clean.done.json` is written last, after every shard, `report.json` and
`summary.txt`. It lists each kept shard (name, size, a hash of its last 64 KiB, its
document count) and the `--jsonl` copies. A rerun of `clean` checks it (and, without
one, the per-rank markers of the write stage) against the files: a shard that is
missing, resized, rewritten or holds another number of rows means the output is
regenerated from scratch, with one line saying why. Readers
(`mindloom_tokenizer.inputs`) read a clean output only through this marker.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pyarrow.parquet as pq
from mindloom_tokenizer.inputs import (
    CLEAN_FORMAT,
    CLEAN_MARKER,
    NoInputError,
    describe_file,
    read_clean_marker,
)

from mindloom_data._atomic import atomic_write_json

VERSION = 1


def shard_name(task: int, suffix: str = ".parquet") -> str:
    return f"shard-{task:05d}{suffix}"


def read_rank_marker(path: Path) -> dict:
    """A rank's completion marker; a corrupt one is an error naming the file."""
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        why = getattr(exc, "strerror", None) or " ".join(str(exc).split())
        raise ValueError(
            f"cannot read completion marker {path}: {why}; delete it and rerun"
        ) from None


def _split_shards(out: Path) -> list[Path]:
    # language.split_output writes OUT/<language>/shard-NNNNN.parquet, any number per task
    return sorted(out.glob("*/shard-*.parquet"))


def write_clean_marker(out: Path, work: Path, tasks: int, jsonl: bool, split: bool = False) -> dict:
    """Describe the kept shards of a finished run in OUT/clean.done.json (the last write)."""
    shards, extra = [], []
    if split:
        for path in _split_shards(out):
            entry = describe_file(path)
            entry["name"] = path.relative_to(out).as_posix()
            entry["documents"] = int(_rows(path) or 0)
            shards.append(entry)
            if jsonl:
                side = describe_file(path.with_suffix(".jsonl"))
                side["name"] = path.with_suffix(".jsonl").relative_to(out).as_posix()
                extra.append(side)
    for t in range(0 if split else tasks):
        done = read_rank_marker(work / "done" / "write" / f"{t:05d}.json")
        entry = describe_file(out / shard_name(t))
        entry["documents"] = int(done["output"]["documents"])
        shards.append(entry)
        if jsonl:
            extra.append(describe_file(out / shard_name(t, ".jsonl")))
    marker = {
        "format": CLEAN_FORMAT,
        "version": VERSION,
        "documents": sum(s["documents"] for s in shards),
        "shards": shards,
        "extra": extra,
    }
    atomic_write_json(out / CLEAN_MARKER, marker)
    return marker


def _rows(path: Path) -> int | None:
    try:
        return pq.ParquetFile(path).metadata.num_rows
    except Exception:  # noqa: BLE001 - any unreadable footer means "not what was written"
        return None


def stale_reason(out: Path, work: Path, tasks: int, jsonl: bool, split: bool = False) -> str | None:
    """Why the outputs of a previous run here cannot be trusted, or None."""
    if (out / CLEAN_MARKER).exists():
        try:
            marker = read_clean_marker(out, verify=True)
        except NoInputError as exc:
            return str(exc).split("; rerun")[0]
        names = sorted(e["name"] for e in marker["shards"])
        if split:
            if names != [p.relative_to(out).as_posix() for p in _split_shards(out)]:
                return f"{out / CLEAN_MARKER} covers other shards than the folders hold"
        elif len(marker["shards"]) != tasks or bool(marker["extra"]) != (jsonl and tasks > 0):
            return f"{out / CLEAN_MARKER} covers other shards than this run writes"
        for entry in marker["shards"]:
            rows = _rows(out / entry["name"])
            if rows != entry["documents"]:
                return f"{entry['name']} holds {rows} documents, {CLEAN_MARKER} says {entry['documents']}"
        return None
    # No final marker (a run killed before it, or one from before markers existed): every
    # shard that a write rank says it wrote must be there with its rows.
    if split and (work / "done" / "write").is_dir() and any((work / "done" / "write").iterdir()):
        return "a per-language output without its final marker cannot be checked shard by shard"
    for t in range(tasks):
        done = work / "done" / "write" / f"{t:05d}.json"
        if not done.exists():
            continue
        try:
            want = int(read_rank_marker(done)["output"]["documents"])
        except (ValueError, KeyError, TypeError):
            return f"completion marker {done} is corrupt"
        rows = _rows(out / shard_name(t))
        if rows != want:
            shown = "missing" if rows is None else f"{rows} documents"
            return f"{shard_name(t)} is {shown}, its completion marker {done} says {want} documents"
        if jsonl and not (out / shard_name(t, ".jsonl")).exists():
            return f"{shard_name(t, '.jsonl')} is missing"
    return None


def reset_outputs(out: Path, work: Path) -> None:
    """Remove every output and intermediate of a previous run so it is redone whole
    (the dedup decisions of one shard depend on every other)."""
    (out / CLEAN_MARKER).unlink(missing_ok=True)
    shutil.rmtree(work, ignore_errors=True)
    shutil.rmtree(out / "removed", ignore_errors=True)
    for p in [*out.glob("shard-*.parquet"), *out.glob("shard-*.jsonl"),
              *out.glob("*/shard-*.parquet"), *out.glob("*/shard-*.jsonl")]:  # fmt: skip
        if p.parent.name != "removed":
            p.unlink(missing_ok=True)
    for name in ("report.json", "summary.txt"):
        (out / name).unlink(missing_ok=True)


__all__ = [
    "read_rank_marker",
    "reset_outputs",
    "stale_reason",
    "write_clean_marker",
]
