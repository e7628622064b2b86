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

A document's id is the record's own id (JSON Lines and Parquet: the value under `id_key`,
default `id`, when it is a non-empty string or an integer), else `"{source}:{line}"`,
where `source` is the path as found from the inputs given (not resolved), so ids are
stable across runs with the same inputs. A record's other fields become the document's
`metadata`, as datatrove's readers do: every field but the text and the id, with the
fields of a `metadata` object (or of a JSON-object string, as cleaned shards store it)
merged in. `source` and `line` stay the provenance.
"""

from __future__ import annotations

import gzip
import json
import os
import zlib
from collections import Counter
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

import orjson
from mindloom_tokenizer.inputs import (
    CompressedStreamError,
    discover_inputs,
    open_compressed,
    stream_error_category,
)
from mindloom_tokenizer.inputs import (
    NoInputError as NoInputError,  # re-exported: the one input error of both packages
)

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
    "corrupt_file",
    "not_compressed",
    "unreadable_file",
    "unsupported_file",
    "truncated_record",  # WARC (see _web)
    "corrupt_record",
    "non_html_record",  # not bad: a WARC response that is no HTML page
)
# Categories that describe a whole file, not a record (not part of the bad fraction).
FILE_CATEGORIES = frozenset(
    {
        "empty_file",
        "whitespace_only_file",
        "truncated_file",
        "corrupt_file",
        "not_compressed",
        "unreadable_file",
        "unsupported_file",
    }
)


@dataclass(frozen=True, slots=True)
class Document:
    text: str
    id: str
    source: str
    line: int
    metadata: dict | None = None


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
        # a WARC response that is no HTML page is not bad input
        return sum(
            v
            for k, v in self.counts.items()
            if k not in FILE_CATEGORIES and k not in ("blank_line", "non_html_record")
        )

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


def record_identity(
    obj: dict, text_key: str, id_key: str | None, fallback: str
) -> tuple[str, dict]:
    """(id, metadata) of one record, datatrove's adapter: the record's own id (a non-empty
    string or an integer under `id_key`) or `fallback`; the other fields as metadata,
    with a `metadata` object's fields merged in."""
    own = obj.get(id_key) if id_key else None
    if type(own) is int or (type(own) is str and own):
        doc_id = str(own)
    else:
        doc_id, id_key = fallback, None
    meta: dict = {}
    nested = obj.get("metadata")
    if type(nested) is str and nested.startswith("{"):
        try:  # a cleaned shard's metadata column: a JSON object as text
            nested = json.loads(nested)
        except ValueError:
            pass
    if type(nested) is dict:
        meta.update(nested)
    for k, v in obj.items():
        if k != text_key and k != id_key and not (k == "metadata" and type(nested) is dict):
            meta[k] = v
    return doc_id, meta


def _supported(name: str) -> bool:
    return name.endswith(SUFFIXES)


def resolve_inputs(
    inputs: str | os.PathLike | Iterable[str | os.PathLike], stats: ReadStats | None = None
) -> list[str]:
    """The files to read, by the one discovery rule of `mindloom_tokenizer.inputs`.

    Directories are walked recursively for data files; a `clean` output contributes
    exactly its kept shards (never `removed/`, reports or the `--jsonl` copies). Files of
    no known format are counted into `stats` as `unsupported_file` (with their names).
    Raises `NoInputError` (one line) when a path does not exist, a named file has an
    unsupported suffix, a clean output is unfinished, or nothing at all matches.
    """
    found = discover_inputs(inputs, SUFFIXES)
    if stats is not None:
        for path in found.unsupported:
            stats.bad("unsupported_file", path, None)
    return found.files


def iter_documents(
    inputs,
    text_key: str = "text",
    stats: ReadStats | None = None,
    txt_mode: str = "paragraph",
    id_key: str | None = "id",
) -> Iterator[Document]:
    """Stream documents from files, directories and globs (see the module docstring)."""
    stats = ReadStats() if stats is None else stats
    for path in resolve_inputs(inputs, stats):
        yield from iter_file(path, text_key=text_key, stats=stats, txt_mode=txt_mode, id_key=id_key)


def iter_file(
    path: str,
    text_key: str = "text",
    stats: ReadStats | None = None,
    txt_mode: str = "paragraph",
    id_key: str | None = "id",
) -> Iterator[Document]:
    """Stream the documents of one file, counting bad records into `stats`."""
    stats = ReadStats() if stats is None else stats
    if txt_mode not in TXT_MODES:
        raise ValueError(f"txt_mode must be one of {TXT_MODES}, got {txt_mode!r}")
    if path.endswith((".warc.gz", ".warc", ".html", ".htm")):
        from mindloom_data._web_read import iter_web_file

        yield from iter_web_file(path, stats)
        return
    if not _count_file(path, stats):
        return
    if path.endswith(".parquet"):
        yield from _iter_parquet(path, text_key, stats, id_key)
    elif path.endswith(".txt"):
        yield from _iter_txt(path, stats, txt_mode)
    else:
        yield from _iter_jsonl(path, text_key, stats, id_key)


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


_open_binary = open_compressed  # .gz/.zst read to a verified end (mindloom_tokenizer.inputs)

# Errors that mean "the compressed stream broke here"; records before it are kept.
_STREAM_ERRORS: tuple[type[BaseException], ...] = (
    CompressedStreamError,
    EOFError,
    zlib.error,
    gzip.BadGzipFile,
)
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
        category = stream_error_category(exc) or "truncated_file"
        stats.bad(category, path, None if category == "not_compressed" else lineno + 1)
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


def _iter_jsonl(path: str, text_key: str, stats: ReadStats, id_key: str | None = "id"):
    for lineno, text, obj in _jsonl_texts(path, text_key, stats, records=True):
        doc_id, meta = record_identity(obj, text_key, id_key, f"{path}:{lineno}")
        yield Document(text, doc_id, path, lineno, meta)


def _jsonl_texts(path: str, text_key: str, stats: ReadStats, records: bool = False):
    """(line number, text) of every good record, bad ones counted into `stats`; the
    tokenizer reads through this directly, without building `Document`s. With `records`,
    (line number, text, the record's dict)."""
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
                yield (lineno, text, obj) if records else (lineno, text)
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
        yield (lineno, text, obj) if records else (lineno, text)
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


def _iter_parquet(
    path: str, text_key: str, stats: ReadStats, id_key: str | None = "id"
) -> Iterator[Document]:
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
    names = pf.schema_arrow.names
    try:
        # every column: the others are the records' ids and metadata
        for batch in pf.iter_batches(batch_size=4096):
            texts = batch.column(names.index(text_key)).to_pylist()
            others = batch.to_pylist() if len(names) > 1 else None
            for i, text in enumerate(texts):
                row += 1
                if text is None:
                    stats.bad("null_text", path, row)
                elif not isinstance(text, str):
                    stats.bad("non_string_text", path, row)
                elif not text.strip():
                    stats.bad("empty_text", path, row)
                else:
                    stats.documents += 1
                    doc_id, meta = (
                        record_identity(others[i], text_key, id_key, f"{path}:{row}")
                        if others is not None
                        else (f"{path}:{row}", {})
                    )
                    yield Document(text, doc_id, path, row, meta)
    except OSError as exc:  # a truncated or corrupt column chunk
        stats.bad("truncated_file", path, row + 1)
        _note(stats, path, exc)
