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

import os
from collections.abc import Iterable, Iterator

from mindloom_tokenizer.inputs import (
    NoInputError as NoInputError,  # re-exported: the one input error of both packages
)
from mindloom_tokenizer.inputs import (
    discover_inputs,
)

from mindloom_data._documents import (
    _STREAM_ERRORS as _STREAM_ERRORS,
)
from mindloom_data._documents import (
    CATEGORIES as CATEGORIES,
)
from mindloom_data._documents import (
    FILE_CATEGORIES as FILE_CATEGORIES,
)
from mindloom_data._documents import (
    MAX_EXAMPLES as MAX_EXAMPLES,
)
from mindloom_data._documents import (
    SUFFIXES as SUFFIXES,
)
from mindloom_data._documents import (
    TXT_MODES as TXT_MODES,
)
from mindloom_data._documents import (
    Document as Document,
)
from mindloom_data._documents import (
    ReadStats as ReadStats,
)
from mindloom_data._documents import (
    _count_file as _count_file,
)
from mindloom_data._documents import (
    _note as _note,
)
from mindloom_data._documents import (
    _open_binary as _open_binary,
)
from mindloom_data._documents import (
    record_identity as record_identity,
)
from mindloom_data._read_formats import (
    _iter_jsonl as _iter_jsonl,
)
from mindloom_data._read_formats import (
    _iter_parquet as _iter_parquet,
)
from mindloom_data._read_formats import (
    _iter_txt as _iter_txt,
)
from mindloom_data._read_formats import (
    _jsonl_texts as _jsonl_texts,
)
from mindloom_data._read_formats import (
    _lines as _lines,
)


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
