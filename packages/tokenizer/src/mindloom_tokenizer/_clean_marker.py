"""Markers of `mindloom-data clean` outputs: what a marker lists (name, size, a hash of
the last 64 KiB of every shard) and the check that the files still match it. Public
through `mindloom_tokenizer.inputs`."""

from __future__ import annotations

import hashlib
import json
import os

CLEAN_MARKER = "clean.done.json"
CLEAN_FORMAT = "mindloom-data clean output"
_TAIL_BYTES = 1 << 16


class NoInputError(ValueError):
    """An input does not exist, nothing matched, or a clean output is unfinished (one line)."""


def describe_file(path: str | os.PathLike) -> dict:
    """Name, size and a hash of the last 64 KiB: cheap, and a Parquet footer (row group
    offsets and statistics) lives there, so a rewritten shard changes it."""
    path = os.fspath(path)
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        f.seek(max(0, size - _TAIL_BYTES))
        tail = f.read()
    digest = hashlib.blake2b(tail, digest_size=16).hexdigest()
    return {"name": os.path.basename(path), "bytes": size, "tail_blake2b": digest}


def file_matches(directory: str | os.PathLike, entry: dict) -> str | None:
    """None if `directory/entry["name"]` is what `entry` describes, else why not."""
    path = os.path.join(os.fspath(directory), entry["name"])
    try:
        now = describe_file(path)
    except FileNotFoundError:
        return f"{entry['name']} is missing"
    except OSError as exc:
        return f"{entry['name']} is unreadable ({exc.strerror or exc})"
    if now["bytes"] != entry.get("bytes"):
        return f"{entry['name']} has {now['bytes']} bytes, the marker says {entry.get('bytes')}"
    if now["tail_blake2b"] != entry.get("tail_blake2b"):
        return f"{entry['name']} changed since the marker was written"
    return None


def is_clean_output(directory: str | os.PathLike) -> bool:
    d = os.fspath(directory)
    return os.path.isfile(os.path.join(d, CLEAN_MARKER)) or os.path.isfile(
        os.path.join(d, ".work", "run.json")
    )


def read_clean_marker(directory: str | os.PathLike, verify: bool = True) -> dict:
    """The marker of a clean output; with `verify`, every shard it lists is checked.

    Raises `NoInputError` (one line naming the directory and the file) when the marker
    is missing, unreadable or does not match the files.
    """
    d = os.fspath(directory)
    marker = os.path.join(d, CLEAN_MARKER)
    rerun = "rerun the same mindloom-data clean command"
    try:
        with open(marker, encoding="utf-8") as f:
            data = json.load(f)
    except FileNotFoundError:
        raise NoInputError(
            f"{d} is an unfinished mindloom-data clean output (no {CLEAN_MARKER}); {rerun}"
        ) from None
    except (OSError, ValueError) as exc:
        raise NoInputError(f"cannot read clean marker {marker}: {_short(exc)}; {rerun}") from None
    if not isinstance(data, dict) or data.get("format") != CLEAN_FORMAT:
        raise NoInputError(f"{marker} is not a mindloom-data clean marker; {rerun}")
    if verify:
        for entry in [*data.get("shards", []), *data.get("extra", [])]:
            why = file_matches(d, entry)
            if why is not None:
                raise NoInputError(
                    f"clean output {d} does not match {CLEAN_MARKER}: {why}; {rerun}"
                )
    return data


def _short(exc: BaseException, limit: int = 200) -> str:
    text = " ".join(str(exc).split()) or type(exc).__name__
    return text if len(text) <= limit else text[:limit] + "..."
