"""What every reader shares: `Document`, `ReadStats` (bad input counted by category,
with examples), the record identity rule, the input suffixes and the stream errors."""

from __future__ import annotations

import gzip
import json
import os
import zlib
from collections import Counter
from dataclasses import dataclass, field

from mindloom_tokenizer.inputs import (
    CompressedStreamError,
    open_compressed,
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
