"""Tokenize documents into a Megatron indexed dataset, in parallel, in input order.

The main process reads documents (`_readers.iter_documents`), groups them into tasks of
about `task_bytes` of text and keeps at most `2 * workers` tasks in flight, so memory
stays bounded whatever the input size. A document longer than `chunk_chars` is encoded in
chunks cut at a single space (where SentencePiece starts a new piece anyway) and written
as one sequence, so a 50 MB line never becomes one 12-million-element Python list.
Workers return token arrays; the main process writes them in input order through
`IndexedDatasetBuilder`, which renames the files into place only when complete. The same
input and settings therefore give byte-identical files, whatever the number of workers.
"""

from __future__ import annotations

import hashlib
import json
import multiprocessing as mp
import os
import time
from collections import deque
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from itertools import chain

import numpy as np

from mindloom_data._indexed import IndexedDataset, IndexedDatasetBuilder, optimal_dtype
from mindloom_data._readers import ReadStats, iter_documents

DEFAULT_CHUNK_CHARS = 1 << 20
DEFAULT_TASK_BYTES = 1 << 18  # small enough to keep every worker busy on a few MB


@dataclass
class TokenizeStats:
    documents: int = 0
    empty_documents: int = 0
    chunked_documents: int = 0
    tokens: int = 0
    text_bytes: int = 0
    seconds: float = 0.0
    dtype: str = ""
    read: ReadStats = field(default_factory=ReadStats)
    skipped: bool = False

    def to_dict(self) -> dict:
        return {
            "documents": self.documents,
            "empty_documents": self.empty_documents,
            "chunked_documents": self.chunked_documents,
            "tokens": self.tokens,
            "text_bytes": self.text_bytes,
            "seconds": round(self.seconds, 3),
            "mb_per_s": round(self.text_bytes / 1e6 / self.seconds, 3) if self.seconds else None,
            "dtype": self.dtype,
            "read": self.read.to_dict(),
        }


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


# -- worker side -------------------------------------------------------------------------

_TOK = None
_DTYPE = None
_EOS: list[int] = []


def _init_worker(tokenizer_path: str, dtype: str, eos_id: int | None) -> None:
    global _TOK, _DTYPE, _EOS
    from mindloom_tokenizer import Tokenizer

    _TOK = Tokenizer.load(tokenizer_path)
    _DTYPE = np.dtype(dtype)
    _EOS = [] if eos_id is None else [eos_id]


def _encode_task(texts: list[str], last: list[bool]) -> tuple[bytes, np.ndarray]:
    """Encode a task into its final bytes (EOS after each document's last chunk) and
    the number of tokens each text contributes."""
    ids = _TOK.encode_batch(texts, num_threads=1) if len(texts) > 1 else [_TOK.encode(texts[0])]
    if _EOS:
        for x, is_last in zip(ids, last):
            if is_last:
                x.extend(_EOS)
    lengths = np.fromiter(map(len, ids), dtype=np.int64, count=len(ids))
    total = int(lengths.sum())
    flat = np.fromiter(chain.from_iterable(ids), dtype=np.int64, count=total)
    if flat.size and (flat.min() < 0 or flat.max() > np.iinfo(_DTYPE).max):
        raise ValueError(f"token id {int(flat.max())} does not fit {_DTYPE}")
    return flat.astype(_DTYPE).tobytes(), lengths


# -- main side ---------------------------------------------------------------------------


def _tasks(
    docs: Iterable, stats: TokenizeStats, chunk_chars: int, drop_space: bool | None, task_bytes
) -> Iterator[tuple[list[str], list[tuple[bool, bool]]]]:
    """Group documents into tasks: texts plus (first chunk, last chunk) flags."""
    texts: list[str] = []
    flags: list[tuple[bool, bool]] = []
    size = 0
    for doc in docs:
        text = doc.text
        stats.text_bytes += len(text.encode("utf-8", "surrogatepass"))
        parts = [text] if drop_space is None else chunk_text(text, chunk_chars, drop_space)
        if len(parts) > 1:
            stats.chunked_documents += 1
        for k, part in enumerate(parts):
            texts.append(part)
            flags.append((k == 0, k == len(parts) - 1))
            size += len(part)
            if size >= task_bytes:
                yield texts, flags
                texts, flags, size = [], [], 0
    if texts:
        yield texts, flags


def _fingerprint(inputs, tokenizer_path: str, settings: dict) -> str:
    h = hashlib.sha256()
    from mindloom_data._readers import resolve_inputs

    for path in resolve_inputs(inputs):
        st = os.stat(path)
        h.update(f"{os.path.abspath(path)}\0{st.st_size}\0{st.st_mtime_ns}\n".encode())
    tok = tokenizer_path
    model = os.path.join(tok, "tokenizer.model") if os.path.isdir(tok) else tok
    for p in [model, os.path.join(os.path.dirname(model), "mindloom_tokenizer.json")]:
        if os.path.isfile(p):
            with open(p, "rb") as f:
                h.update(hashlib.sha256(f.read()).digest())
    h.update(json.dumps(settings, sort_keys=True).encode())
    return h.hexdigest()


def tokenize(
    inputs,
    tokenizer_path: str | os.PathLike,
    output_prefix: str | os.PathLike,
    *,
    workers: int = 1,
    append_eos: bool = True,
    text_key: str = "text",
    txt_mode: str = "paragraph",
    chunk_chars: int = DEFAULT_CHUNK_CHARS,
    task_bytes: int = DEFAULT_TASK_BYTES,
    force: bool = False,
) -> TokenizeStats:
    """Tokenize `inputs` into `output_prefix.bin/.idx` (see the module docstring).

    A completion marker `output_prefix.done.json` records the inputs, tokenizer and
    settings; a rerun with the same ones finds the files valid and skips the work
    unless `force`.
    """
    from mindloom_tokenizer import Tokenizer

    tokenizer_path = os.fspath(tokenizer_path)
    output_prefix = os.fspath(output_prefix)
    tok = Tokenizer.load(tokenizer_path)
    dtype = np.dtype(optimal_dtype(tok.vocab_size))
    if append_eos and tok.eos_id < 0:
        raise ValueError(f"tokenizer {tokenizer_path} has no EOS id; use --no-eos")
    settings = {"append_eos": append_eos, "text_key": text_key, "txt_mode": txt_mode}
    settings["chunk_chars"] = chunk_chars
    marker = output_prefix + ".done.json"
    fingerprint = _fingerprint(inputs, tokenizer_path, settings)
    if not force and os.path.exists(marker):
        try:
            with open(marker, encoding="utf-8") as f:
                done = json.load(f)
            if done.get("fingerprint") == fingerprint:
                IndexedDataset(output_prefix, vocab_size=tok.vocab_size)
                stats = TokenizeStats(dtype=str(dtype), skipped=True)
                stats.documents = int(done.get("stats", {}).get("documents", 0))
                stats.tokens = int(done.get("stats", {}).get("tokens", 0))
                return stats
        except (OSError, ValueError):
            pass  # a stale or broken marker: redo the work
    if os.path.exists(marker):
        os.unlink(marker)

    stats = TokenizeStats(dtype=str(dtype))
    drop_space = chunking_mode(tok)
    eos_id = tok.eos_id if append_eos else None
    t0 = time.perf_counter()
    docs = iter_documents(inputs, text_key=text_key, stats=stats.read, txt_mode=txt_mode)
    tasks = _tasks(docs, stats, chunk_chars, drop_space, task_bytes)
    builder = IndexedDatasetBuilder(output_prefix, dtype=dtype)
    pending = 0  # tokens of the document being written in chunks

    def write(result, flags) -> None:
        nonlocal pending
        data, lengths = result
        builder.write_raw(data)
        for n, (first, last) in zip(lengths.tolist(), flags):
            pending = n if first else pending + n
            if last:
                if pending == 0:  # nothing to train on: dropped, but counted
                    stats.empty_documents += 1
                    continue
                builder.add_document_length(pending)
                stats.documents += 1
                stats.tokens += pending

    def submit(texts, flags):
        return texts, [last for _, last in flags]

    try:
        if workers <= 1:
            _init_worker(tokenizer_path, dtype.str, eos_id)
            for texts, flags in tasks:
                write(_encode_task(*submit(texts, flags)), flags)
        else:
            ctx = mp.get_context("fork")
            with ctx.Pool(workers, _init_worker, (tokenizer_path, dtype.str, eos_id)) as pool:
                window: deque = deque()
                for texts, flags in tasks:
                    window.append((pool.apply_async(_encode_task, submit(texts, flags)), flags))
                    if len(window) >= 2 * workers:
                        res, fl = window.popleft()
                        write(res.get(), fl)
                while window:
                    res, fl = window.popleft()
                    write(res.get(), fl)
        builder.finalize()
    except BaseException:
        builder.abort()
        raise
    stats.seconds = time.perf_counter() - t0
    tmp = marker + ".partial"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump({"fingerprint": fingerprint, "stats": stats.to_dict()}, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, marker)
    return stats
