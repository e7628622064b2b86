"""A small reader for training input: the formats mindloom-data reads and writes.

mindloom-data depends on this package, not the other way round, so the tokenizer keeps
its own reader: JSON Lines (plain, `.gz`, `.zst`) with the text under a configurable key,
Parquet (a text column) and plain text, from files, directories and globs. A bad record is
counted by category and skipped, never raised; an input path that does not exist, or a
glob that matches nothing, is an error.

Plain-text files are yielded in chunks of whole lines (newlines kept), so a large file
never sits in memory at once and a character-level vocabulary still sees the newlines.
"""

from __future__ import annotations

import json
import os
import re
from collections import Counter
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

from mindloom_tokenizer.inputs import (
    NoInputError,
    discover_inputs,
    open_compressed,
    stream_error_category,
)

__all__ = ["NoInputError", "ReadStats", "iter_texts", "resolve_inputs"]

SUFFIXES = (".jsonl.gz", ".jsonl.zst", ".jsonl", ".parquet", ".txt")
TXT_CHUNK_BYTES = 1 << 20
MAX_EXAMPLES = 5
_SURROGATE = re.compile("[\ud800-\udfff]")


@dataclass
class ReadStats:
    files: int = 0
    documents: int = 0
    bytes: int = 0
    bad: Counter = field(default_factory=Counter)
    examples: dict[str, list[str]] = field(default_factory=dict)

    def count_bad(self, category: str, where: str, n: int = 1) -> None:
        self.bad[category] += n
        ex = self.examples.setdefault(category, [])
        if len(ex) < MAX_EXAMPLES:
            ex.append(where)

    def to_dict(self) -> dict:
        return {
            "files": self.files,
            "documents": self.documents,
            "bytes": self.bytes,
            "bad": dict(sorted(self.bad.items())),
            "examples": {k: list(v) for k, v in sorted(self.examples.items())},
        }


def resolve_inputs(
    inputs: str | os.PathLike | Iterable[str | os.PathLike], stats: ReadStats | None = None
) -> list[str]:
    """The files to read, by the one discovery rule (`mindloom_tokenizer.inputs`);
    files found but of no known format are counted into `stats` as `unsupported_file`."""
    found = discover_inputs(inputs, SUFFIXES)
    if stats is not None:
        for path in found.unsupported:
            stats.count_bad("unsupported_file", path)
    return found.files


def iter_texts(inputs, text_key: str = "text", stats: ReadStats | None = None) -> Iterator[str]:
    """Stream the texts of every input file (see the module docstring)."""
    stats = ReadStats() if stats is None else stats
    for path in resolve_inputs(inputs, stats):
        stats.files += 1
        try:
            if os.path.getsize(path) == 0:
                stats.count_bad("empty_file", path)
                continue
            if path.endswith(".parquet"):
                yield from _iter_parquet(path, text_key, stats)
            elif path.endswith(".txt"):
                yield from _iter_txt(path, stats)
            else:
                yield from _iter_jsonl(path, text_key, stats)
        except OSError as exc:
            stats.count_bad("unreadable_file", f"{path}: {exc.strerror or exc}")


def _iter_jsonl(path: str, text_key: str, stats: ReadStats) -> Iterator[str]:
    lineno = 0
    try:
        with open_compressed(path) as f:
            for raw in f:
                lineno += 1
                stats.bytes += len(raw)
                if not raw.strip():
                    continue
                where = f"{path}:{lineno}"
                try:
                    line = raw.decode("utf-8")
                except UnicodeDecodeError:
                    stats.count_bad("invalid_utf8", where)
                    continue
                try:
                    obj = json.loads(line)
                except ValueError:
                    stats.count_bad("malformed_json", where)
                    continue
                if not isinstance(obj, dict):
                    stats.count_bad("non_object_json", where)
                    continue
                if text_key not in obj:
                    stats.count_bad("missing_text_key", where)
                    continue
                text = obj[text_key]
                if not isinstance(text, str):
                    stats.count_bad("non_string_text", where)
                    continue
                if not text:
                    stats.count_bad("empty_text", where)
                    continue
                if _SURROGATE.search(text):
                    # JSON can escape a lone UTF-16 surrogate; it is not text, and
                    # SentencePiece cannot take it. Replaced, and counted.
                    stats.count_bad("lone_surrogate", where)
                    text = _SURROGATE.sub("\ufffd", text)
                stats.documents += 1
                yield text
    except Exception as exc:
        category = stream_error_category(exc)
        if category is None:
            raise
        where = path if category == "not_compressed" else f"{path}:{lineno + 1}"
        stats.count_bad(category, f"{where}: {exc}")


def _iter_parquet(path: str, text_key: str, stats: ReadStats) -> Iterator[str]:
    import pyarrow.parquet as pq

    try:
        pf = pq.ParquetFile(path)
    except Exception as exc:  # pyarrow raises ArrowInvalid / OSError for a corrupt file
        stats.count_bad("unreadable_file", f"{path}: {' '.join(str(exc).split())}")
        return
    if text_key not in pf.schema_arrow.names:
        stats.count_bad("missing_text_key", f"{path}: no column {text_key!r}", pf.metadata.num_rows)
        return
    stats.bytes += os.path.getsize(path)
    row = 0
    try:
        for batch in pf.iter_batches(columns=[text_key], batch_size=4096):
            for text in batch.column(0).to_pylist():
                row += 1
                if text is None:
                    stats.count_bad("null_text", f"{path}:{row}")
                elif not isinstance(text, str):
                    stats.count_bad("non_string_text", f"{path}:{row}")
                elif not text:
                    stats.count_bad("empty_text", f"{path}:{row}")
                else:
                    stats.documents += 1
                    yield text
    except Exception as exc:
        if type(exc).__module__.startswith("pyarrow") or isinstance(exc, OSError):
            stats.count_bad("truncated_file", f"{path}:{row + 1}: {' '.join(str(exc).split())}")
        else:
            raise


def _iter_txt(path: str, stats: ReadStats) -> Iterator[str]:
    buf: list[str] = []
    size = 0
    with open(path, "rb") as f:
        for lineno, raw in enumerate(f, 1):
            stats.bytes += len(raw)
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError:
                stats.count_bad("invalid_utf8", f"{path}:{lineno}")
                continue
            buf.append(line)
            size += len(raw)
            if size >= TXT_CHUNK_BYTES:
                stats.documents += 1
                yield "".join(buf)
                buf, size = [], 0
    if buf:
        text = "".join(buf)
        if text.strip():
            stats.documents += 1
            yield text
        else:
            stats.count_bad("whitespace_only_file", path)
