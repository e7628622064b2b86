"""Tokenize documents into a Megatron indexed dataset, in parallel, in input order.

The main thread reads documents (JSON Lines through `_readers`' orjson fast path without
building a `Document` per line; other formats through `_readers.iter_file`), groups
them into tasks of about `task_bytes` of text and keeps at most `2 * workers` tasks in
flight, so memory stays bounded whatever the input size. A document longer than
`chunk_chars` is encoded in chunks cut at a single space (where SentencePiece starts a
new piece anyway) and written as one sequence, so a 50 MB line never becomes one
12-million-element Python list.

`workers` encoding threads share one SentencePiece model: it releases the GIL while it
encodes, so the threads run in parallel while the main thread reads the next tasks, with
no worker start-up, no second model and no pickling of texts and tokens. The `char`
tokenizer (a numpy gather that mostly holds the GIL) gets forked processes instead.
The main thread writes the token arrays in input order through `IndexedDatasetBuilder`,
which renames the files into place only when complete. The same input and settings
therefore give byte-identical files, whatever the number of workers.

Next to the Megatron files (whose bytes these never change), `PREFIX.dataset.json`
records how the documents were made: `append_bos`, `append_eos`, the BOS/EOS ids, the
tokenizer and the counts; training, evaluation and `mindloom generate` read it to feed
the model what the data held. With `metadata_fields`, `PREFIX.docmeta.jsonl` holds one
JSON object per document of the `.bin/.idx`, in dataset order (line i = sequence i):
the document's `id` and each requested field (null when a record has none).
"""

from __future__ import annotations

import hashlib
import json
import multiprocessing as mp
import os
import time
from collections import deque
from concurrent.futures import ProcessPoolExecutor, ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np

from mindloom_data._atomic import atomic_write_bytes, atomic_write_json, named_oserror
from mindloom_data._encode import (
    DOC_METADATA_SUFFIX,
    _DocMetadata,
    _encode_in_worker,
    _Encoder,
    _init_worker,
    _tasks,
    _texts,
    chunking_mode,
)
from mindloom_data._indexed import IndexedDataset, IndexedDatasetBuilder, optimal_dtype
from mindloom_data._readers import (
    ReadStats,
    resolve_inputs,
)

DATASET_METADATA_SUFFIX = ".dataset.json"
DATASET_METADATA_FORMAT = "mindloom-dataset/1"

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


def _fingerprint(inputs, tokenizer_path: str, settings: dict) -> str:
    h = hashlib.sha256()
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
    append_bos: bool = False,
    text_key: str = "text",
    txt_mode: str = "paragraph",
    chunk_chars: int = DEFAULT_CHUNK_CHARS,
    task_bytes: int = DEFAULT_TASK_BYTES,
    force: bool = False,
    overwrite: bool = True,
    allow_empty: bool = False,
    metadata_fields: list[str] | None = None,
    id_key: str = "id",
) -> TokenizeStats:
    """Tokenize `inputs` into `output_prefix.bin/.idx` (see the module docstring).

    `append_bos` / `append_eos` put the tokenizer's BOS before / EOS after every
    document; both are recorded in `output_prefix.dataset.json`. `metadata_fields`
    writes `output_prefix.docmeta.jsonl` (each document's id under `id_key` and these
    fields). A completion marker `output_prefix.done.json` records the inputs, tokenizer
    and settings; a rerun with the same ones finds the files valid and skips the work
    unless `force`. With `overwrite=False` (the CLI's default), existing `.bin`/`.idx`
    files that the marker does not vouch for are refused instead of replaced. Zero
    documents is an error (nothing is written) unless `allow_empty`.
    """
    from mindloom_tokenizer import Tokenizer

    tokenizer_path = os.fspath(tokenizer_path)
    output_prefix = os.fspath(output_prefix)
    tok = Tokenizer.load(tokenizer_path)
    dtype = np.dtype(optimal_dtype(tok.vocab_size))
    if append_eos and tok.eos_id < 0:
        raise ValueError(f"tokenizer {tokenizer_path} has no EOS id; use --no-eos")
    if append_bos and tok.bos_id < 0:
        raise ValueError(f"tokenizer {tokenizer_path} has no BOS id; drop --bos / append_bos")
    settings = _settings(append_eos, append_bos, text_key, txt_mode, chunk_chars, metadata_fields,
                         id_key)  # fmt: skip
    marker = output_prefix + ".done.json"
    fingerprint = _fingerprint(inputs, tokenizer_path, settings)
    if not force:
        done = _still_complete(marker, fingerprint, output_prefix, tok.vocab_size, dtype)
        if done is not None:
            return done
    _clear_outputs(output_prefix, marker, replace=overwrite or force)

    stats = TokenizeStats(dtype=str(dtype))
    t0 = time.perf_counter()
    docmeta = (
        None
        if metadata_fields is None
        else _DocMetadata(output_prefix, list(metadata_fields), id_key)
    )
    texts = _texts(inputs, text_key, stats.read, txt_mode, docmeta)
    tasks = _tasks(texts, stats, chunk_chars, chunking_mode(tok), task_bytes)
    builder = IndexedDatasetBuilder(output_prefix, dtype=dtype)
    sink = _Sink(builder, stats, docmeta)
    eos_id = tok.eos_id if append_eos else None
    bos_id = tok.bos_id if append_bos else None
    pool, encode = _encoder_pool(tok, tokenizer_path, dtype, eos_id, bos_id, workers)
    _encode_all(pool, encode, tasks, sink, stats, builder, docmeta, output_prefix, workers,
                allow_empty)  # fmt: skip
    pool.shutdown(wait=True)
    stats.seconds = time.perf_counter() - t0
    write_dataset_metadata(
        output_prefix,
        dataset_metadata(tok, tokenizer_path, append_bos, append_eos, stats.documents,
                         stats.tokens, metadata_fields, id_key),
    )  # fmt: skip
    done = {"fingerprint": fingerprint, "stats": stats.to_dict()}
    atomic_write_bytes(marker, json.dumps(done, indent=1).encode())
    return stats


def _settings(append_eos, append_bos, text_key, txt_mode, chunk_chars, metadata_fields, id_key):
    """What of the call goes into the completion marker's fingerprint."""
    settings = {"append_eos": append_eos, "text_key": text_key, "txt_mode": txt_mode}
    settings["chunk_chars"] = chunk_chars
    # only when set, so markers written before these options still match
    if append_bos:
        settings["append_bos"] = True
    if metadata_fields is not None:
        settings["metadata_fields"] = list(metadata_fields)
        settings["id_key"] = id_key
    return settings


def _encode_all(pool, encode, tasks, sink, stats, builder, docmeta, output_prefix, workers,
                allow_empty) -> None:  # fmt: skip
    """Encode every task in input order into the builder; on any failure nothing is left
    that looks complete (the builder and the metadata writer abort)."""
    try:
        _encode_in_order(pool, encode, tasks, sink.write, workers)
        if stats.documents == 0 and not allow_empty:
            bad = ", ".join(f"{k} {v}" for k, v in sorted(stats.read.counts.items()))
            raise ValueError(
                f"no documents to tokenize in {stats.read.files} input files"
                + (f" ({bad})" if bad else "")
                + f"; nothing written to {output_prefix}.bin/.idx"
            )
        builder.finalize()
        if docmeta is not None:
            docmeta.writer.close()
    except BaseException as exc:
        pool.shutdown(wait=True, cancel_futures=True)
        builder.abort()
        if docmeta is not None:
            docmeta.writer.abort()
        if isinstance(exc, OSError) and not exc.filename:  # ENOSPC from write(): name it
            raise named_oserror(exc, output_prefix + ".bin") from None
        raise


def _still_complete(marker: str, fingerprint: str, output_prefix: str, vocab_size: int, dtype):
    """The stats of a finished run of the same inputs and settings, whose files are still
    valid; None when the work must be done (no, a stale or a broken marker)."""
    if not os.path.exists(marker):
        return None
    try:
        with open(marker, encoding="utf-8") as f:
            done = json.load(f)
        if done.get("fingerprint") == fingerprint and os.path.exists(
            output_prefix + DATASET_METADATA_SUFFIX
        ):
            IndexedDataset(output_prefix, vocab_size=vocab_size)
            stats = TokenizeStats(dtype=str(dtype), skipped=True)
            stats.documents = int(done.get("stats", {}).get("documents", 0))
            stats.tokens = int(done.get("stats", {}).get("tokens", 0))
            return stats
    except (OSError, ValueError):
        pass  # a stale or broken marker: redo the work
    return None


def _clear_outputs(output_prefix: str, marker: str, replace: bool) -> None:
    """Refuse to replace `.bin`/`.idx` that the marker does not vouch for unless `replace`;
    drop the old marker before any work."""
    existing = [output_prefix + e for e in (".bin", ".idx") if os.path.exists(output_prefix + e)]
    if existing and not replace:
        raise ValueError(
            f"{existing[0]} already exists and is not the output of this input and settings; "
            "pass --overwrite to replace it"
        )
    if os.path.exists(marker):
        os.unlink(marker)


class _Sink:
    """Writes encoded tasks in input order: token bytes to the builder, each document's
    length once its last chunk is in; empty documents dropped but counted."""

    def __init__(self, builder: IndexedDatasetBuilder, stats: TokenizeStats, docmeta):
        self.builder, self.stats, self.docmeta = builder, stats, docmeta
        self.pending = 0  # tokens of the document being written in chunks

    def write(self, data: bytes, lengths: np.ndarray, flags) -> None:
        builder, stats, docmeta = self.builder, self.stats, self.docmeta
        builder.write_raw(data)
        if flags is None:  # whole documents only, so none is pending either
            kept = lengths[lengths > 0]  # nothing to train on: dropped, but counted
            stats.empty_documents += len(lengths) - len(kept)
            if docmeta is not None:
                for n in lengths.tolist():
                    docmeta.done(n > 0)
            builder.add_document_lengths(kept)
            stats.documents += len(kept)
            stats.tokens += int(kept.sum())
            return
        for n, (first, last) in zip(lengths.tolist(), flags):
            self.pending = n if first else self.pending + n
            if last:
                if docmeta is not None:
                    docmeta.done(self.pending > 0)
                if self.pending == 0:
                    stats.empty_documents += 1
                    continue
                builder.add_document_length(self.pending)
                stats.documents += 1
                stats.tokens += self.pending


def _encoder_pool(tok, tokenizer_path: str, dtype, eos_id, bos_id, workers: int):
    """(pool, encode function) for the tokenizer's kind."""
    if tok.model_type == "char":
        # a numpy gather that holds the GIL for most of its time: processes (fork is safe,
        # nothing here has started a thread)
        ctx = mp.get_context("fork")
        initargs = (tokenizer_path, dtype.str, eos_id, bos_id, os.getpid())
        pool = ProcessPoolExecutor(workers, ctx, initializer=_init_worker, initargs=initargs)
        return pool, _encode_in_worker
    pool = ThreadPoolExecutor(workers, thread_name_prefix="tokenize")
    return pool, _Encoder(tok, dtype, eos_id, bos_id)


def _encode_in_order(pool, encode, tasks, write, workers: int) -> None:
    # at most 2 * workers tasks in flight: bounded memory, and every worker has the next
    # task queued while the main thread reads and writes
    window: deque = deque()
    for batch, flags in tasks:
        last = None if flags is None else [is_last for _, is_last in flags]
        first = None if flags is None else [is_first for is_first, _ in flags]
        window.append((pool.submit(encode, batch, last, first), flags))
        if len(window) >= 2 * workers:
            fut, fl = window.popleft()
            write(*fut.result(), fl)
    while window:
        fut, fl = window.popleft()
        write(*fut.result(), fl)


def dataset_metadata(tok, tokenizer_path: str, append_bos: bool, append_eos: bool,
                     documents: int, tokens: int, metadata_fields=None, id_key: str = "id") -> dict:  # fmt: skip
    """What `PREFIX.dataset.json` holds (see the module docstring)."""
    return {
        "format": DATASET_METADATA_FORMAT,
        "append_bos": bool(append_bos),
        "append_eos": bool(append_eos),
        "bos_id": tok.bos_id if tok.bos_id >= 0 else None,
        "eos_id": tok.eos_id if tok.eos_id >= 0 else None,
        "vocab_size": tok.vocab_size,
        "tokenizer": os.path.abspath(tokenizer_path),
        "documents": documents,
        "tokens": tokens,
        "docmeta": None
        if metadata_fields is None
        else {"suffix": DOC_METADATA_SUFFIX, "id_key": id_key,
              "fields": ["id", *(f for f in metadata_fields if f != "id")]},
    }  # fmt: skip


def write_dataset_metadata(prefix: str | os.PathLike, meta: dict) -> None:
    atomic_write_json(os.fspath(prefix) + DATASET_METADATA_SUFFIX, meta)


def read_dataset_metadata(prefix: str | os.PathLike) -> dict | None:
    """`PREFIX.dataset.json` as a dict; None for a dataset written without one (by
    Megatron-LM's tools or an older mindloom-data). ValueError (one line) if unreadable."""
    path = os.fspath(prefix) + DATASET_METADATA_SUFFIX
    try:
        with open(path, encoding="utf-8") as f:
            meta = json.load(f)
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as exc:
        raise ValueError(f"{path}: unreadable dataset metadata: {exc}") from None
    if not isinstance(meta, dict) or not isinstance(meta.get("append_bos"), bool):
        raise ValueError(f"{path}: dataset metadata without a boolean append_bos")
    return meta
