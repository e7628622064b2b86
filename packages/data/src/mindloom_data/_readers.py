"""Readers: JSON Lines (plain, gzip, zstd), Parquet and plain text, as a stream of documents.

Every stage that reads raw text goes through `iter_documents`. A malformed record never
raises: it is counted by category in a `ReadStats`, with the first few locations, and the
stream goes on with the next record. What counts as a document:

- JSON Lines: one JSON object per line; the text is under `text_key`. `line` is the
  1-based physical line number.
- Parquet: one row; `line` is the 1-based row number within the file.
- Plain text (`.txt`): by default one document per paragraph (a block of lines separated
  by one or more blank lines), `line` being the paragraph's first line. `txt_mode="file"`
  makes the whole file one document (`line` = 1); `txt_mode="line"` makes each non-blank
  line a document.

A document's id is `"{source}:{line}"`, where `source` is the path as found from the
inputs given (not resolved), so ids are stable across runs with the same inputs.
"""

from __future__ import annotations

import glob
import gzip
import io
import json
import os
import zlib
from collections import Counter
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

import orjson

SUFFIXES = (".jsonl.gz", ".jsonl.zst", ".jsonl", ".parquet", ".txt")
SUFFIXES += (".warc.gz", ".warc", ".html", ".htm")  # read by _web
TXT_MODES = ("paragraph", "file", "line")
MAX_EXAMPLES = 5

# Categories of bad input, in report order.
CATEGORIES = (
    "malformed_json",
    "invalid_utf8",
    "missing_text_key",
    "non_object_json",
    "non_string_text",
    "null_text",
    "empty_text",
    "blank_line",
    "empty_file",
    "whitespace_only_file",
    "truncated_file",
    "unreadable_file",
    "truncated_record",  # WARC (see _web)
    "corrupt_record",
    "non_html_record",  # not bad: a WARC response that is no HTML page
)


class NoInputError(ValueError):
    """No input file matched (or an input path does not exist)."""


@dataclass(frozen=True, slots=True)
class Document:
    text: str
    id: str
    source: str
    line: int
    meta: dict | None = None  # e.g. a web page's URL, date and language


@dataclass
class ReadStats:
    """What the readers saw: documents and bytes read, bad records by category."""

    files: int = 0
    documents: int = 0
    bytes: int = 0
    counts: Counter = field(default_factory=Counter)
    examples: dict[str, list[str]] = field(default_factory=dict)

    def bad(self, category: str, source: str, line: int | None, n: int = 1) -> None:
        self.counts[category] += n
        where = source if line is None else f"{source}:{line}"
        ex = self.examples.setdefault(category, [])
        if len(ex) < MAX_EXAMPLES:
            ex.append(where)

    @property
    def bad_records(self) -> int:
        files = ("empty_file", "whitespace_only_file", "truncated_file", "unreadable_file")
        skip = ("blank_line", "non_html_record")
        return sum(v for k, v in self.counts.items() if k not in files and k not in skip)

    def merge(self, other: ReadStats) -> None:
        self.files += other.files
        self.documents += other.documents
        self.bytes += other.bytes
        self.counts.update(other.counts)
        for k, v in other.examples.items():
            ex = self.examples.setdefault(k, [])
            ex.extend(v[: MAX_EXAMPLES - len(ex)])

    def to_dict(self) -> dict:
        return {
            "files": self.files,
            "documents": self.documents,
            "bytes": self.bytes,
            "bad": {k: self.counts[k] for k in CATEGORIES if self.counts.get(k)},
            "examples": {k: list(v) for k, v in self.examples.items()},
        }

    @classmethod
    def from_dict(cls, d: dict) -> ReadStats:
        return cls(
            files=d["files"],
            documents=d["documents"],
            bytes=d["bytes"],
            counts=Counter(d["bad"]),
            examples={k: list(v) for k, v in d["examples"].items()},
        )


def _supported(name: str) -> bool:
    return name.endswith(SUFFIXES)


def resolve_inputs(inputs: str | os.PathLike | Iterable[str | os.PathLike]) -> list[str]:
    """Expand files, directories (recursively) and globs into a sorted, de-duplicated list.

    Raises `NoInputError` (one line) when a path does not exist, a named file has an
    unsupported suffix, or nothing at all matches.
    """
    if isinstance(inputs, (str, os.PathLike)):
        inputs = [inputs]
    found: list[str] = []
    for item in inputs:
        s = os.fspath(item)
        if glob.has_magic(s):
            matches = sorted(glob.glob(s, recursive=True))
            for m in matches:
                if os.path.isdir(m):
                    found.extend(_walk(m))
                elif _supported(m):
                    found.append(m)
        elif os.path.isdir(s):
            found.extend(_walk(s))
        elif os.path.exists(s):
            if not _supported(s):
                raise NoInputError(
                    f"unsupported input file {s} (expected one of {', '.join(SUFFIXES)})"
                )
            found.append(s)
        else:
            raise NoInputError(f"input not found: {s}")
    seen: set[str] = set()
    files = [f for f in found if not (f in seen or seen.add(f))]
    if not files:
        shown = " ".join(os.fspath(i) for i in inputs)
        raise NoInputError(f"no input files matched: {shown}")
    return files


def _walk(root: str) -> list[str]:
    out = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames.sort()
        out.extend(os.path.join(dirpath, f) for f in sorted(filenames) if _supported(f))
    return sorted(out)


def iter_documents(
    inputs,
    text_key: str = "text",
    stats: ReadStats | None = None,
    txt_mode: str = "paragraph",
) -> Iterator[Document]:
    """Stream documents from files, directories and globs (see the module docstring)."""
    stats = ReadStats() if stats is None else stats
    for path in resolve_inputs(inputs):
        yield from iter_file(path, text_key=text_key, stats=stats, txt_mode=txt_mode)


def iter_file(
    path: str,
    text_key: str = "text",
    stats: ReadStats | None = None,
    txt_mode: str = "paragraph",
) -> Iterator[Document]:
    """Stream the documents of one file, counting bad records into `stats`."""
    stats = ReadStats() if stats is None else stats
    if txt_mode not in TXT_MODES:
        raise ValueError(f"txt_mode must be one of {TXT_MODES}, got {txt_mode!r}")
    if path.endswith((".warc.gz", ".warc", ".html", ".htm")):
        from mindloom_data._web import iter_web_file

        yield from iter_web_file(path, stats)
        return
    if not _count_file(path, stats):
        return
    if path.endswith(".parquet"):
        yield from _iter_parquet(path, text_key, stats)
    elif path.endswith(".txt"):
        yield from _iter_txt(path, stats, txt_mode)
    else:
        yield from _iter_jsonl(path, text_key, stats)


def _count_file(path: str, stats: ReadStats) -> bool:
    """Count `path` as an input file; False (counted as bad) if it is empty or unreadable."""
    stats.files += 1
    try:
        if os.path.getsize(path) == 0:
            stats.bad("empty_file", path, None)
            return False
    except OSError as exc:
        stats.bad("unreadable_file", path, None)
        _note(stats, path, exc)
        return False
    return True


def _note(stats: ReadStats, path: str, exc: BaseException) -> None:
    # The reason for a skipped file goes into the examples so the report can show it.
    msg = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    stats.examples.setdefault("errors", [])
    if len(stats.examples["errors"]) < MAX_EXAMPLES:
        stats.examples["errors"].append(f"{path}: {msg}")


def _open_binary(path: str):
    if path.endswith(".gz"):
        return gzip.open(path, "rb")
    if path.endswith(".zst"):
        import zstandard

        raw = open(path, "rb")  # noqa: SIM115 - closed through the reader below
        reader = zstandard.ZstdDecompressor().stream_reader(raw, closefd=True)
        return io.BufferedReader(reader, buffer_size=1 << 20)
    return open(path, "rb", buffering=1 << 20)


# Errors that mean "the compressed stream broke here"; records before it are kept.
_STREAM_ERRORS: tuple[type[BaseException], ...] = (EOFError, zlib.error, gzip.BadGzipFile)
try:
    import zstandard as _zstd

    _STREAM_ERRORS = (*_STREAM_ERRORS, _zstd.ZstdError)
except ImportError:  # pragma: no cover - zstandard is a dependency
    pass


def _lines(path: str, stats: ReadStats) -> Iterator[tuple[int, bytes]]:
    lineno = 0
    nonblank = False
    try:
        with _open_binary(path) as f:
            for raw in f:
                lineno += 1
                stats.bytes += len(raw)
                yield lineno, raw
                if not nonblank:
                    nonblank = bool(raw.strip())
    except _STREAM_ERRORS as exc:
        stats.bad("truncated_file", path, lineno + 1)
        _note(stats, path, exc)
        return
    except OSError as exc:
        stats.bad("unreadable_file", path, None)
        _note(stats, path, exc)
        return
    if lineno == 0:
        stats.bad("empty_file", path, None)  # e.g. a compressed file of nothing
    elif not nonblank:
        stats.bad("whitespace_only_file", path, None)


def _iter_jsonl(path: str, text_key: str, stats: ReadStats) -> Iterator[Document]:
    for lineno, text in _jsonl_texts(path, text_key, stats):
        yield Document(text, f"{path}:{lineno}", path, lineno)


def _jsonl_texts(path: str, text_key: str, stats: ReadStats) -> Iterator[tuple[int, str]]:
    """(line number, text) of every good record, bad ones counted into `stats`; the
    tokenizer reads through this directly, without building `Document`s."""
    pending_blank: list[int] = []
    seen_record = False
    loads, decode_error = orjson.loads, orjson.JSONDecodeError
    for lineno, raw in _lines(path, stats):
        # The fast path: a good record is one orjson call. orjson accepts no line that
        # json.loads refuses and gives the same strings, so everything else (blank, bad
        # UTF-8, not JSON, NaN, a lone surrogate, ...) takes the checks below, in order.
        try:
            obj = loads(raw)
        except decode_error:
            obj = None
        if type(obj) is dict and not pending_blank:
            text = obj.get(text_key)
            if type(text) is str and text and not text.isspace():
                seen_record = True
                stats.documents += 1
                yield lineno, text
                continue
        if not raw.strip():
            pending_blank.append(lineno)
            continue
        seen_record = True
        # Blank lines are only "bad" inside a file that has records; a file of nothing
        # but whitespace is counted once, as such, by _lines.
        for b in pending_blank:
            stats.bad("blank_line", path, b)
        pending_blank.clear()
        try:
            line = raw.decode("utf-8")
        except UnicodeDecodeError:
            stats.bad("invalid_utf8", path, lineno)
            continue
        try:
            obj = json.loads(line)
        except ValueError:
            stats.bad("malformed_json", path, lineno)
            continue
        if not isinstance(obj, dict):
            stats.bad("non_object_json", path, lineno)
            continue
        if text_key not in obj:
            stats.bad("missing_text_key", path, lineno)
            continue
        text = obj[text_key]
        if text is None:
            stats.bad("null_text", path, lineno)
            continue
        if not isinstance(text, str):
            stats.bad("non_string_text", path, lineno)
            continue
        if not text.strip():
            stats.bad("empty_text", path, lineno)
            continue
        stats.documents += 1
        yield lineno, text
    if seen_record:
        for b in pending_blank:
            stats.bad("blank_line", path, b)


def _iter_txt(path: str, stats: ReadStats, mode: str) -> Iterator[Document]:
    buf: list[str] = []
    start = 0
    had_text = False

    def flush():
        text = "".join(buf).strip("\n")
        buf.clear()
        return text

    for lineno, raw in _lines(path, stats):
        try:
            line = raw.decode("utf-8")
        except UnicodeDecodeError:
            stats.bad("invalid_utf8", path, lineno)
            continue
        if lineno == 1 and line.startswith("\ufeff"):
            line = line[1:]
        blank = not line.strip()
        had_text = had_text or not blank
        if mode == "file":
            if not buf:
                start = 1
            buf.append(line)
        elif mode == "line":
            if not blank:
                stats.documents += 1
                yield Document(line.rstrip("\r\n"), f"{path}:{lineno}", path, lineno)
        elif blank:
            if buf:
                text = flush()
                stats.documents += 1
                yield Document(text, f"{path}:{start}", path, start)
        else:
            if not buf:
                start = lineno
            buf.append(line)
    if buf and had_text:
        text = flush()
        stats.documents += 1
        yield Document(text, f"{path}:{start}", path, start)


def _iter_parquet(path: str, text_key: str, stats: ReadStats) -> Iterator[Document]:
    import pyarrow.parquet as pq

    try:
        pf = pq.ParquetFile(path)
    except Exception as exc:  # pyarrow raises several types for a corrupt footer
        stats.bad("unreadable_file", path, None)
        _note(stats, path, exc)
        return
    stats.bytes += os.path.getsize(path)
    rows = pf.metadata.num_rows
    if rows == 0:
        stats.bad("empty_file", path, None)
        return
    if text_key not in pf.schema_arrow.names:
        stats.bad("missing_text_key", path, None, n=rows)
        return
    row = 0
    try:
        for batch in pf.iter_batches(batch_size=4096, columns=[text_key]):
            for text in batch.column(0).to_pylist():
                row += 1
                if text is None:
                    stats.bad("null_text", path, row)
                elif not isinstance(text, str):
                    stats.bad("non_string_text", path, row)
                elif not text.strip():
                    stats.bad("empty_text", path, row)
                else:
                    stats.documents += 1
                    yield Document(text, f"{path}:{row}", path, row)
    except OSError as exc:  # a truncated or corrupt column chunk
        stats.bad("truncated_file", path, row + 1)
        _note(stats, path, exc)
