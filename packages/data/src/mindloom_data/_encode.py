"""Encoding for `tokenize`: documents read (JSON Lines on a fast path), cut into chunks
and grouped into tasks of about `task_bytes` of text; each task encoded to one buffer of
token ids by a thread (one shared SentencePiece model, which releases the GIL) or, for the
`char` tokenizer, a forked process. See `_tokenize` for the whole picture.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Iterator
from itertools import chain, repeat

import numpy as np

from mindloom_data._readers import (
    ReadStats,
    _count_file,
    _jsonl_texts,
    iter_file,
    record_identity,
    resolve_inputs,
)
from mindloom_data._writers import JsonlWriter

DOC_METADATA_SUFFIX = ".docmeta.jsonl"


def chunk_text(text: str, chunk_chars: int, drop_space: bool) -> list[str]:
    """Cut `text` into pieces of at most about `chunk_chars` at single spaces.

    With `drop_space` the space itself is dropped (the tokenizer adds a dummy-prefix
    space to every chunk); otherwise it starts the next chunk. Without a space in reach
    the cut is hard, which can change a few tokens at that point.
    """
    if len(text) <= chunk_chars:
        return [text]
    out, start, n = [], 0, len(text)
    while n - start > chunk_chars:
        hi, lo = start + chunk_chars, start + chunk_chars // 2
        cut = text.rfind(" ", lo, hi)
        while cut > lo and (text[cut - 1].isspace() or text[cut + 1].isspace()):
            cut = text.rfind(" ", lo, cut)
        if cut <= lo:
            out.append(text[start:hi])
            start = hi
            continue
        out.append(text[start:cut])
        start = cut + 1 if drop_space else cut
    out.append(text[start:])
    return out


def chunking_mode(tok) -> bool | None:
    """How this tokenizer continues a text cut at a space: drop it (True), keep it
    (False), or neither reproduces the whole-text encoding (None: never chunk)."""
    probes = ["hello world", "The quick brown fox", "ab cd\nef gh", "x y"]
    for drop in (True, False):
        ok = True
        for p in probes:
            i = p.rindex(" ")
            tail = p[i + 1 :] if drop else p[i:]
            if tok.encode(p[:i]) + tok.encode(tail) != tok.encode(p):
                ok = False
                break
        if ok:
            return drop
    return None


# -- reading ---------------------------------------------------------------------------

_JSONL = (".jsonl", ".jsonl.gz", ".jsonl.zst")


def _texts(
    inputs, text_key: str, stats: ReadStats, txt_mode: str, docmeta: _DocMetadata | None = None
) -> Iterator[str]:
    """The texts `iter_documents` yields, with the same counts in `stats`, faster for JSONL.
    With `docmeta`, each document's id and chosen fields are queued there, in order."""
    for path in resolve_inputs(inputs, stats):
        if path.endswith(_JSONL):
            # the reader's own JSONL path and counts, without building a Document per line
            if not _count_file(path, stats):
                continue
            if docmeta is None:
                for _, text in _jsonl_texts(path, text_key, stats):
                    yield text
                continue
            for lineno, text, obj in _jsonl_texts(path, text_key, stats, records=True):
                docmeta.queue(*record_identity(obj, text_key, docmeta.id_key, f"{path}:{lineno}"))
                yield text
        else:
            docs = iter_file(path, text_key=text_key, stats=stats, txt_mode=txt_mode,
                             id_key=None if docmeta is None else docmeta.id_key)  # fmt: skip
            for doc in docs:
                if docmeta is not None:
                    docmeta.queue(doc.id, doc.metadata)
                yield doc.text


class _DocMetadata:
    """PREFIX.docmeta.jsonl: the queued documents' lines, written as the documents are
    (an empty document is dropped from both), so line i is sequence i."""

    def __init__(self, prefix: str, fields: list[str], id_key: str | None) -> None:
        self.fields = fields
        self.id_key = id_key
        self.pending: deque = deque()
        self.writer = JsonlWriter(prefix + DOC_METADATA_SUFFIX)

    def queue(self, doc_id: str, metadata: dict | None) -> None:
        meta = metadata or {}
        line = {"id": doc_id}
        for f in self.fields:
            if f != "id":
                line[f] = meta.get(f)
        self.pending.append(line)

    def done(self, kept: bool) -> None:
        line = self.pending.popleft()
        if kept:
            self.writer.write(line)


# -- encoding ----------------------------------------------------------------------------


class _Encoder:
    """Encodes a task into its final bytes (BOS before each document's first chunk, EOS
    after its last) and the number of tokens each text contributes.

    Called from several threads at once: SentencePiece releases the GIL while it
    encodes, so threads in one process share the work without a worker start-up, a
    second copy of the model or pickling the texts and tokens between processes.
    """

    def __init__(self, tok, dtype: np.dtype, eos_id: int | None, bos_id: int | None = None):
        self.tok = tok
        self.dtype = np.dtype(dtype)
        self.eos = [] if eos_id is None else [eos_id]
        self.bos = bos_id

    def __call__(
        self, texts: list[str], last: list[bool] | None, first: list[bool] | None = None
    ) -> tuple[bytes, np.ndarray]:
        tok = self.tok
        ids = tok.encode_batch(texts, num_threads=1) if len(texts) > 1 else [tok.encode(texts[0])]
        if self.bos is not None:
            for k, is_first in enumerate(repeat(True) if first is None else first):
                if k >= len(ids):
                    break
                if is_first:
                    ids[k].insert(0, self.bos)
        if self.eos:
            eos = self.eos
            for x, is_last in zip(ids, repeat(True) if last is None else last):
                if is_last:
                    x.extend(eos)
        lengths = np.fromiter(map(len, ids), dtype=np.int64, count=len(ids))
        # int32 holds any SentencePiece id; the range check below covers the narrower dtype
        flat = np.fromiter(chain.from_iterable(ids), dtype=np.int32, count=int(lengths.sum()))
        if flat.size and (flat.min() < 0 or flat.max() > np.iinfo(self.dtype).max):
            raise ValueError(f"token id {int(flat.max())} does not fit {self.dtype}")
        return flat.astype(self.dtype).tobytes(), lengths


_ENCODER: _Encoder | None = None  # in a worker process


def _init_worker(
    tokenizer_path: str, dtype: str, eos_id: int | None, bos_id: int | None, parent: int
) -> None:
    global _ENCODER
    from mindloom_data._lifeline import die_with_parent

    die_with_parent(parent)  # never outlive a killed tokenize
    from mindloom_tokenizer import Tokenizer

    _ENCODER = _Encoder(Tokenizer.load(tokenizer_path), np.dtype(dtype), eos_id, bos_id)


def _encode_in_worker(texts: list[str], last, first=None) -> tuple[bytes, np.ndarray]:
    return _ENCODER(texts, last, first)


# -- main side ---------------------------------------------------------------------------


def _tasks(
    texts: Iterable[str], stats, chunk_chars: int, drop_space, task_bytes: int
) -> Iterator[tuple[list[str], list[tuple[bool, bool]] | None]]:
    """Group texts into tasks: texts plus (first chunk, last chunk) flags, or None for
    flags when every text of the task is a whole document (the common case)."""
    batch: list[str] = []
    flags: list[tuple[bool, bool]] | None = None
    size = 0
    nbytes = 0
    chunk = drop_space is not None
    for text in texts:
        n = len(text)
        nbytes += len(text.encode("utf-8", "surrogatepass"))
        if chunk and n > chunk_chars:
            parts = chunk_text(text, chunk_chars, drop_space)
            stats.chunked_documents += len(parts) > 1
            if flags is None:
                flags = [(True, True)] * len(batch)
            for k, part in enumerate(parts):
                batch.append(part)
                flags.append((k == 0, k == len(parts) - 1))
                size += len(part)
                if size >= task_bytes:
                    stats.text_bytes = nbytes
                    yield batch, flags
                    batch, flags, size = [], [], 0
            if not batch:
                flags = None
            continue
        batch.append(text)
        if flags is not None:
            flags.append((True, True))
        size += n
        if size >= task_bytes:
            stats.text_bytes = nbytes
            yield batch, flags
            batch, flags, size = [], None, 0
    stats.text_bytes = nbytes
    if batch:
        yield batch, flags
