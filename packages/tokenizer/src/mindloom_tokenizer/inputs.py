"""Which files an input names, and compressed files read to a verified end.

One rule for every command that takes files, directories or globs: `mindloom-data clean`
and `tokenize`, `mindloom-tokenizer train` and `eval`, and a `mindloom train` config's
`text_input:` (which reads through mindloom-data). It lives here because mindloom-data
depends on this package and mindloom-train on both.

- A file named explicitly must have a data suffix (one line otherwise).
- A directory is walked recursively, in sorted order, for files with a data suffix.
  Hidden names (`.work/`, `.tmp-*`) and our own temporaries (`NAME.tmp-PID`) are never
  read. Every other file is *unsupported*: not read, but counted and listed, so a
  directory of `.json` or `.csv` files is never silently half-used.
- A directory that is a `mindloom-data clean` output (it holds `clean.done.json`, or the
  `.work/run.json` of a run in progress) contributes exactly its kept shards, as listed
  and verified by its marker: never `removed/<step>/`, `report.json`, `summary.txt`,
  or the `--jsonl` copies of the same documents. An unfinished or changed clean output
  is an error (one line), not a partial read. The same holds for a directory or glob
  match inside such an output.
- A glob behaves as if each match were named, except that an unsupported match is
  counted and listed instead of refused.

`open_compressed` reads `.gz` and `.zst` to a verified end: every gzip member's CRC and
length trailer (zlib), every zstd frame completed (its checksum checked where
the frame has one), several frames in a row. A file that does not start with the
format's magic bytes is `not_compressed`; a stream that ends inside a member or frame is
`truncated_file`, even when the cut falls exactly after a newline.
"""

from __future__ import annotations

import glob
import os
from collections.abc import Iterable
from dataclasses import dataclass, field

from mindloom_tokenizer._clean_marker import (
    CLEAN_FORMAT,
    CLEAN_MARKER,
    NoInputError,
    describe_file,
    file_matches,
    is_clean_output,
    read_clean_marker,
)
from mindloom_tokenizer._compressed import (
    CompressedStreamError,
    open_compressed,
    stream_error_category,
)

__all__ = [
    "CLEAN_FORMAT",
    "CLEAN_MARKER",
    "DATA_SUFFIXES",
    "CompressedStreamError",
    "Discovered",
    "NoInputError",
    "describe_file",
    "discover_inputs",
    "file_matches",
    "is_clean_output",
    "open_compressed",
    "read_clean_marker",
    "stream_error_category",
]

DATA_SUFFIXES = (".jsonl.gz", ".jsonl.zst", ".jsonl", ".parquet", ".txt")


@dataclass
class Discovered:
    """What the inputs name: files to read, in order, and files found but not read."""

    files: list[str] = field(default_factory=list)
    unsupported: list[str] = field(default_factory=list)
    clean_outputs: list[str] = field(default_factory=list)


# -- discovery -----------------------------------------------------------------------------


def _ours(name: str) -> bool:
    """Hidden names and our temporaries (`NAME.tmp-PID`, `.tmp-...`): never data."""
    return name.startswith(".") or ".tmp-" in name or name.endswith(".partial")


def _clean_root(path: str) -> str | None:
    """The clean output `path` lies inside (or is), if any: up to three levels up
    (`OUT/removed/<step>/file` is the deepest file a clean writes)."""
    p = os.path.abspath(path)
    for _ in range(4):
        if os.path.isdir(p) and is_clean_output(p):
            return p
        parent = os.path.dirname(p)
        if parent == p:
            break
        p = parent
    return None


class _Walker:
    def __init__(self, suffixes: tuple[str, ...]):
        self.suffixes = suffixes
        self.out = Discovered()
        self._listed: dict[str, list[str]] = {}  # clean root (absolute) -> its shard names

    def _shards(self, root_abs: str) -> list[str]:
        if root_abs not in self._listed:
            data = read_clean_marker(root_abs)
            self._listed[root_abs] = [e["name"] for e in data["shards"]]
            self.out.clean_outputs.append(root_abs)
        return self._listed[root_abs]

    def clean_output(self, shown_root: str) -> None:
        names = self._shards(os.path.abspath(shown_root))
        self.out.files.extend(os.path.join(shown_root, n) for n in names)

    def directory(self, d: str) -> None:
        root = _clean_root(d)
        if root is not None:
            self.inside_clean(d, root)
            return
        for dirpath, dirnames, filenames in os.walk(d):
            dirnames.sort()
            keep = []
            for sub in dirnames:
                full = os.path.join(dirpath, sub)
                if _ours(sub):
                    continue
                if is_clean_output(full):
                    self.clean_output(full)
                else:
                    keep.append(sub)
            dirnames[:] = keep
            for name in sorted(filenames):
                if _ours(name):
                    continue
                full = os.path.join(dirpath, name)
                if name.endswith(self.suffixes):
                    self.out.files.append(full)
                else:
                    self.out.unsupported.append(full)

    def inside_clean(self, path: str, root_abs: str) -> None:
        """`path` is a clean output or lies inside one: only its kept shards count."""
        here = os.path.abspath(path)
        if here == root_abs:
            self.clean_output(path)
            return
        for name in self._shards(root_abs):
            shard = os.path.join(root_abs, name)
            if shard == here:
                self.out.files.append(path)
            elif shard.startswith(here + os.sep):
                self.out.files.append(os.path.join(path, os.path.relpath(shard, here)))

    def match(self, m: str) -> None:
        if os.path.isdir(m):
            self.directory(m)
            return
        root = _clean_root(os.path.dirname(m) or ".")
        if root is not None:
            self.inside_clean(m, root)
        elif _ours(os.path.basename(m)):
            return
        elif m.endswith(self.suffixes):
            self.out.files.append(m)
        else:
            self.out.unsupported.append(m)


def discover_inputs(
    inputs: str | os.PathLike | Iterable[str | os.PathLike],
    suffixes: tuple[str, ...] = DATA_SUFFIXES,
) -> Discovered:
    """Expand files, directories and globs by the rule in the module docstring.

    Files come in the order the inputs name them (each directory sorted), each once.
    Raises `NoInputError` (one line) for a path that does not exist, an explicitly
    named file with another suffix, an unfinished or changed clean output, or when no
    file at all is found.
    """
    if isinstance(inputs, (str, os.PathLike)):
        inputs = [inputs]
    inputs = [os.fspath(i) for i in inputs]
    if not inputs:
        raise NoInputError("no input given")
    w = _Walker(tuple(suffixes))
    for s in inputs:
        if glob.has_magic(s):
            for m in sorted(glob.glob(s, recursive=True)):
                w.match(m)
        elif os.path.isdir(s):
            w.directory(s)
        elif os.path.exists(s):
            if not s.endswith(w.suffixes):
                raise NoInputError(
                    f"unsupported input file {s} (expected one of {', '.join(suffixes)})"
                )
            w.out.files.append(s)
        else:
            raise NoInputError(f"input not found: {s}")
    seen: set[str] = set()
    w.out.files = [f for f in w.out.files if not (f in seen or seen.add(f))]
    if not w.out.files:
        shown = " ".join(inputs)
        extra = f"; {len(w.out.unsupported)} unsupported files" if w.out.unsupported else ""
        raise NoInputError(
            f"no input files matched: {_clip(shown)} (expected {', '.join(suffixes)}{extra})"
        )
    return w.out


def _clip(text: str, limit: int = 300) -> str:
    return text if len(text) <= limit else text[:limit] + "..."
