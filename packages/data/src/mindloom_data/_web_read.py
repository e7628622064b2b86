"""Reading web inputs: WARC files (`.warc`, `.warc.gz`; one document per HTML response
record, its URL and date in the metadata, a truncated or corrupt record counted, not fatal)
and single HTML files, decoded by their declared or sniffed charset. The HTML itself is
turned into text later, by the `extract` web step (`_web`)."""

from __future__ import annotations

import mmap
import os
from collections.abc import Iterator

from mindloom_data._documents import Document, ReadStats, _count_file, _note

__all__ = ["HTML_TYPES", "decode_html", "iter_web_file"]

HTML_TYPES = ("text/html", "application/xhtml+xml")


def iter_web_file(path: str, stats: ReadStats) -> Iterator[Document]:
    """The documents of one `.warc[.gz]` or `.html` file (see the module docstring)."""
    if not _count_file(path, stats):
        return
    if path.endswith((".html", ".htm")):
        yield from _iter_html_file(path, stats)
    else:
        yield from _iter_warc(path, stats)


def decode_html(data: bytes, charset: str | None = None) -> str:
    """Bytes of a page -> str: the declared charset if Python knows it, else detected."""
    from resiliparse.parse.encoding import bytes_to_str, detect_encoding

    if charset:
        try:
            return data.decode(charset)
        except (LookupError, UnicodeDecodeError):
            pass
    return bytes_to_str(data, detect_encoding(data))


def _iter_html_file(path: str, stats: ReadStats) -> Iterator[Document]:
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as exc:
        stats.bad("unreadable_file", path, None)
        _note(stats, path, exc)
        return
    stats.bytes += len(data)
    text = decode_html(data)
    if not text.strip():
        stats.bad("empty_text", path, 1)
        return
    stats.documents += 1
    yield Document(text, f"{path}:1", path, 1)


def _next_record_start(path: str, after: int, gz: bool) -> int | None:
    """Offset of the next thing that looks like a record start strictly after `after`."""
    marker = b"\x1f\x8b\x08" if gz else b"WARC/1."
    with open(path, "rb") as f:
        try:
            mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        except ValueError:  # empty file
            return None
        with mm:
            i = mm.find(marker, after + 1)
    return None if i < 0 else i


def _iter_warc(path: str, stats: ReadStats) -> Iterator[Document]:
    from fastwarc.warc import ArchiveIterator, WarcRecordType

    gz = path.endswith(".gz")
    stats.bytes += os.path.getsize(path)
    start = 0
    while True:
        last = None
        try:
            with open(path, "rb") as f:
                f.seek(start)
                records = ArchiveIterator(
                    f,
                    record_types=WarcRecordType.response | WarcRecordType.resource,
                    parse_http=True,
                    fsspec_args=False,
                )
                for rec in records:
                    pos = rec.stream_pos
                    last = pos
                    doc = _record_document(rec, path, pos, stats)
                    if doc is not None:
                        yield doc
            return
        except OSError as exc:
            # FastWARC stops at bytes it cannot parse: count them once, then go on at the
            # next record start after the last good record (or after where we started).
            resume = _next_record_start(path, start if last is None else last, gz)
            where = resume if resume is not None else os.path.getsize(path)
            stats.bad("corrupt_record", path, where)
            _note(stats, f"{path}:{where}", exc)
            if resume is None or resume <= start:
                return
            start = resume


def _record_document(rec, path: str, pos: int, stats: ReadStats) -> Document | None:
    expected = rec.content_length
    try:
        body = rec.reader.read()
    except OSError:
        stats.bad("truncated_record", path, pos)
        return None
    if expected is not None and len(body) < expected:
        stats.bad("truncated_record", path, pos)
        return None
    url = rec.headers.get("WARC-Target-URI")
    if url is None:
        stats.bad("corrupt_record", path, pos)
        return None
    if rec.is_http:
        status = rec.http_headers.status_code if rec.http_headers is not None else None
        ctype = (rec.http_content_type or "").lower()
        charset = rec.http_charset
        if status is None or not 200 <= status < 300 or ctype not in HTML_TYPES:
            stats.bad("non_html_record", path, pos)
            return None
    else:
        ctype = (rec.headers.get("Content-Type") or "").split(";")[0].strip().lower()
        charset = None
        if ctype not in HTML_TYPES:
            stats.bad("non_html_record", path, pos)
            return None
    text = decode_html(body, charset)
    if not text.strip():
        stats.bad("empty_text", path, pos)
        return None
    stats.documents += 1
    meta = {
        "url": url,
        "date": rec.headers.get("WARC-Date"),
        "record_id": rec.headers.get("WARC-Record-ID"),
    }
    return Document(text, f"{path}:{pos}", path, pos, meta)


# --- steps --------------------------------------------------------------------------
