"""One reader per format: JSON Lines (plain, gzip, zstd; an orjson fast path for texts
only), plain text (paragraph, file or line documents) and Parquet."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator

import orjson
from mindloom_tokenizer.inputs import (
    NoInputError as NoInputError,  # re-exported: the one input error of both packages
)
from mindloom_tokenizer.inputs import (
    stream_error_category,
)

from mindloom_data._documents import (
    _STREAM_ERRORS,
    Document,
    ReadStats,
    _note,
    _open_binary,
    record_identity,
)


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
