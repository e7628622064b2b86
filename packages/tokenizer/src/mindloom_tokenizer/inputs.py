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
import gzip
import hashlib
import io
import json
import os
import zlib
from collections.abc import Iterable
from dataclasses import dataclass, field

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
CLEAN_MARKER = "clean.done.json"
CLEAN_FORMAT = "mindloom-data clean output"
_TAIL_BYTES = 1 << 16
_GZIP_MAGIC = b"\x1f\x8b"
_ZSTD_MAGIC = b"\x28\xb5\x2f\xfd"


class NoInputError(ValueError):
    """An input does not exist, nothing matched, or a clean output is unfinished (one line)."""


@dataclass
class Discovered:
    """What the inputs name: files to read, in order, and files found but not read."""

    files: list[str] = field(default_factory=list)
    unsupported: list[str] = field(default_factory=list)
    clean_outputs: list[str] = field(default_factory=list)


# -- clean-output markers -----------------------------------------------------------------


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


# -- compressed streams ----------------------------------------------------------------------


class CompressedStreamError(ValueError):
    """A compressed input that is not what its name says, or ends too early.

    `category` is `not_compressed`, `truncated_file` or `corrupt_file`.
    """

    def __init__(self, category: str, message: str):
        super().__init__(message)
        self.category = category


class _Members(io.RawIOBase):
    """Decompresses consecutive gzip members or zstd frames. At the end of the file the
    last one must be complete (the decoder's `eof`): for zstd that includes its checksum
    where it has one, for gzip (zlib, wbits=31) the CRC-32 and length trailer."""

    def __init__(self, path: str, kind: str):
        self._path = path
        self._kind = kind
        if kind == "zstd":
            import zstandard

            self._new = zstandard.ZstdDecompressor().decompressobj
        else:
            self._new = lambda: zlib.decompressobj(wbits=31)
        self._raw = open(path, "rb")  # noqa: SIM115 - closed in close()
        self._obj = None
        self._buf = bytearray()
        self._done = False
        self._members = 0
        self._offset = 0

    def readable(self) -> bool:
        return True

    def readinto(self, b) -> int:
        while not self._buf and not self._done:
            self._fill()
        n = min(len(b), len(self._buf))
        b[:n] = self._buf[:n]
        del self._buf[:n]
        return n

    def _fill(self) -> None:
        chunk = self._raw.read(1 << 17)
        if not chunk:
            self._done = True
            if self._obj is not None:
                what = "frame" if self._kind == "zstd" else "member"
                raise CompressedStreamError(
                    "truncated_file",
                    f"{self._path}: {self._kind} {what} {self._members + 1} ends early at byte "
                    f"{self._offset} (premature end)",
                )
            return
        self._offset += len(chunk)
        data = chunk
        while data:
            if self._obj is None:
                if self._kind == "gzip" and not data.strip(b"\0"):
                    return  # zero padding after the last member, as gzip(1) allows
                self._obj = self._new()
            try:
                self._buf += self._obj.decompress(data)
            except zlib.error as exc:
                raise CompressedStreamError(
                    "corrupt_file", f"{self._path}: bad gzip data near byte {self._offset}: {exc}"
                ) from None
            if self._obj.eof:
                data = self._obj.unused_data
                self._obj = None
                self._members += 1
            else:
                data = b""

    def close(self) -> None:
        if not self.closed:
            self._raw.close()
        super().close()


def open_compressed(path: str | os.PathLike):
    """A buffered binary reader of `path`: `.gz` and `.zst` decompressed and verified
    (see the module docstring), anything else as is."""
    path = os.fspath(path)
    if path.endswith((".gz", ".zst")):
        magic = _GZIP_MAGIC if path.endswith(".gz") else _ZSTD_MAGIC
        with open(path, "rb") as f:
            head = f.read(len(magic))
        if head != magic[: len(head)]:  # a shorter head is a truncated stream
            kind = "gzip" if path.endswith(".gz") else "zstd"
            raise CompressedStreamError(
                "not_compressed", f"{path}: not {kind} data (starts with {head!r})"
            )
        kind = "gzip" if path.endswith(".gz") else "zstd"
        return io.BufferedReader(_Members(path, kind), buffer_size=1 << 20)
    return open(path, "rb", buffering=1 << 20)


def stream_error_category(exc: BaseException) -> str | None:
    """The bad-input category of an error raised while reading a compressed stream, or
    None if it is not one (then it is not ours to count)."""
    if isinstance(exc, CompressedStreamError):
        return exc.category
    if isinstance(exc, EOFError):  # gzip: "ended before the end-of-stream marker"
        return "truncated_file"
    if isinstance(exc, (gzip.BadGzipFile, zlib.error)):  # CRC/length trailer, bad data
        return "corrupt_file"
    if type(exc).__name__ == "ZstdError":  # corrupt data or a checksum mismatch
        return "corrupt_file"
    return None
