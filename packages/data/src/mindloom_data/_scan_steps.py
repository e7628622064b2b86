"""The scan stage as steps, the way datatrove chains a pipeline: reader -> web steps ->
normalizer -> filter step -> signature/key steps -> kept-documents writer.

Every step is called with an iterable of documents and yields the documents it keeps
(possibly rewritten); a step that removes documents counts them in its own `StepStats`
(docs and bytes in and out, reasons with examples) and sends them to the audit trail
(`Removed`). The signature/key steps pass every document through unchanged and collect
the rows of the dedup exchange, which `finish()` writes once the chain is drained.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Iterator
from dataclasses import replace
from pathlib import Path

import numpy as np
import pyarrow as pa

from mindloom_data._atomic import save_array
from mindloom_data._dedup import LINE_BITS, make_key, write_partitioned
from mindloom_data._filters import Filter, TextInfo
from mindloom_data._minhash import MinHasher
from mindloom_data._normalize import Normalizer
from mindloom_data._readers import Document, ReadStats, iter_file
from mindloom_data._report import StepStats
from mindloom_data._web import WebSteps
from mindloom_data._writers import (
    SCHEMA,
    JsonlWriter,
    NpyAppender,
    ParquetShardWriter,
    metadata_json,
)

MINHASH_BATCH = 512  # documents per MinHash batch


def nbytes_of(text: str) -> int:
    return len(text) if text.isascii() else len(text.encode("utf-8"))


def hash64(data: bytes) -> int:
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little")


class Removed:
    """The audit trail: removed documents of one step and rank, as JSON Lines (opened on
    the first removal, so a step that removes nothing leaves no file)."""

    def __init__(self, out: Path, step: str, task: int, enabled: bool):
        self.enabled = enabled
        self.path = out / "removed" / step / f"shard-{task:05d}.jsonl"
        self._w: JsonlWriter | None = None

    def add(self, doc_id, source, line, reason, text, metadata=None, **extra):
        if not self.enabled:
            return
        if self._w is None:
            self._w = JsonlWriter(self.path)
        if isinstance(metadata, str):  # as the clean intermediate stores it
            metadata = json.loads(metadata)
        self._w.write(
            {"id": doc_id, "source": source, "line": line, "reason": reason, **extra,
             "metadata": metadata or {}, "text": text}
        )  # fmt: skip

    def close(self):
        if self._w is not None:
            self._w.close()


def read_documents(path: str, cfg, stats: ReadStats) -> Iterator[Document]:
    """The reader step: one input file's documents; bad records counted in `stats`."""
    return iter_file(path, text_key=cfg.text_key, stats=stats, txt_mode=cfg.txt_mode,
                     id_key=cfg.id_key)  # fmt: skip


class WebStep:
    """URL block list, HTML extraction, encoding repair, language id (see _web); each of
    them keeps its own `StepStats` under its name."""

    def __init__(self, web: WebSteps, stats: dict, removed: dict):
        self.web, self.stats, self.removed = web, stats, removed

    def __call__(self, docs: Iterable[Document]) -> Iterator[Document]:
        for doc in docs:
            doc = self.web.process(doc, self.stats, self.removed)
            if doc is not None:
                yield doc


class NormalizeStep:
    """Rewrites the text (`Normalizer`); a text left empty is removed. Counts every
    document (also with normalization off), so the report always has the step."""

    name = "normalize"

    def __init__(self, normalizer: Normalizer | None, removed: Removed):
        self.normalizer, self.removed = normalizer, removed
        self.stats = StepStats()

    def __call__(self, docs: Iterable[Document]) -> Iterator[Document]:
        st = self.stats
        for doc in docs:
            text = doc.text
            st.docs_in += 1
            st.bytes_in += nbytes_of(text)
            if self.normalizer is not None:
                text = self.normalizer(text)
                if not text:
                    st.drop("empty_after_normalize", doc.id, doc.text)
                    self.removed.add(doc.id, doc.source, doc.line, "empty_after_normalize",
                                     doc.text, doc.metadata)  # fmt: skip
                    continue
                doc = replace(doc, text=text)
            st.docs_out += 1
            st.bytes_out += nbytes_of(text)
            yield doc


class FilterStep:
    """The quality filters in order; the first that gives a reason removes the document.
    Each filter keeps its own `StepStats` (`stats[filter.name]`)."""

    def __init__(self, filters: list[Filter], removed: dict):
        self.filters, self.removed = filters, removed
        self.stats = {f.name: StepStats() for f in filters}

    def __call__(self, docs: Iterable[Document]) -> Iterator[Document]:
        for doc in docs:
            text = doc.text
            nbytes = nbytes_of(text)
            info = TextInfo(text)
            for f in self.filters:
                st = self.stats[f.name]
                st.docs_in += 1
                st.bytes_in += nbytes
                reason = f.check(text, info)
                if reason is not None:
                    st.drop(reason, doc.id, text)
                    self.removed[f.name].add(doc.id, doc.source, doc.line, reason, text,
                                             doc.metadata)  # fmt: skip
                    break
                st.docs_out += 1
                st.bytes_out += nbytes
            else:
                yield doc


class ExactKeyStep:
    """Collects (hash of the whole text, key) for the exact dedup exchange."""

    def __init__(self, task: int):
        self.key_base = task << LINE_BITS
        self.rows: list[tuple[int, int]] = []

    def __call__(self, docs: Iterable[Document]) -> Iterator[Document]:
        for doc in docs:
            self.rows.append((hash64(doc.text.encode("utf-8")), self.key_base | doc.line))
            yield doc

    def finish(self, work: Path, task: int, partitions: int) -> None:
        arr = np.array(self.rows, np.uint64).reshape(-1, 2)
        write_partitioned(work, "exact", task, arr[:, 0], arr, partitions)


class ParagraphKeyStep:
    """Collects (hash, key, paragraph number) of every long enough paragraph."""

    def __init__(self, task: int, min_chars: int):
        self.key_base = task << LINE_BITS
        self.min_chars = min_chars
        self.rows: list[tuple[int, int, int]] = []

    def __call__(self, docs: Iterable[Document]) -> Iterator[Document]:
        for doc in docs:
            key = self.key_base | doc.line
            for pno, para in enumerate(doc.text.split("\n\n")):
                if len(para) >= self.min_chars:
                    self.rows.append((hash64(para.encode("utf-8")), key, pno))
            yield doc

    def finish(self, work: Path, task: int, partitions: int) -> None:
        arr = np.array(self.rows, np.uint64).reshape(-1, 3)
        write_partitioned(work, "para", task, arr[:, 0], arr, partitions)


class SignatureStep:
    """MinHash signatures in batches, their LSH band rows and, for the exact check of
    uncertain pairs (`verify`), every document's shingle hashes appended to a file."""

    def __init__(self, hasher: MinHasher, work: Path, task: int, verify: bool):
        self.hasher, self.task, self.work, self.verify = hasher, task, work, verify
        self.shingle_file = (
            NpyAppender(work / "sigs" / f"t{task:05d}.shingles.npy", np.uint32) if verify else None
        )
        self.shingle_counts: list[int] = []
        self.sig_blocks: list[np.ndarray] = []
        self.lsh_rows: list[np.ndarray] = []
        self.lines: list[int] = []
        self._text: list[str] = []
        self._line: list[int] = []

    def __call__(self, docs: Iterable[Document]) -> Iterator[Document]:
        for doc in docs:
            self.lines.append(doc.line)
            self._text.append(doc.text)
            self._line.append(doc.line)
            if len(self._text) >= MINHASH_BATCH:
                self._flush()
            yield doc
        self._flush()

    def _flush(self) -> None:
        if not self._text:
            return
        hasher = self.hasher
        shingles = hasher.shingle_hashes(self._text)
        sig = hasher.signatures_of(shingles)
        if self.verify:
            for x in shingles:
                self.shingle_file.append(x)
                self.shingle_counts.append(len(x))
        bands = hasher.band_hashes(sig)
        keys = make_key(self.task, np.array(self._line, np.uint64))
        ok = ~(sig == np.uint32(0xFFFFFFFF)).all(axis=1)  # no shingles: never bucketed
        nb = bands.shape[1]
        self.lsh_rows.append(
            np.stack(
                [
                    bands[ok].ravel(),
                    np.tile(np.arange(nb, dtype=np.uint64), int(ok.sum())),
                    np.repeat(keys[ok], nb),
                ],
                axis=1,
            )
        )
        self.sig_blocks.append(sig)
        self._text.clear()
        self._line.clear()

    def finish(self, work: Path, task: int, partitions: int) -> None:
        arr = np.concatenate(self.lsh_rows) if self.lsh_rows else np.zeros((0, 3), np.uint64)
        write_partitioned(work, "lsh", task, arr[:, 0], arr, partitions)
        empty = np.zeros((0, self.hasher.num_perm), np.uint32)
        sig = np.concatenate(self.sig_blocks) if self.sig_blocks else empty
        sigs = work / "sigs"
        save_array(sigs / f"t{task:05d}.npy", sig)
        save_array(sigs / f"t{task:05d}.lines.npy", np.array(self.lines, np.uint64).reshape(-1, 1))
        if self.verify:
            self.shingle_file.close()
            offsets = np.concatenate([[0], np.cumsum(self.shingle_counts, dtype=np.uint64)])
            save_array(sigs / f"t{task:05d}.offsets.npy", offsets.astype(np.uint64).reshape(-1, 1))


class KeptWriter:
    """The last step: the kept documents with their keys, an intermediate that the write
    stage reads once (so not worth compressing)."""

    def __init__(self, work: Path, task: int, meta_cols: list):
        self.key_base = task << LINE_BITS
        self.writer = ParquetShardWriter(
            work / "clean" / f"t{task:05d}.parquet",
            schema=pa.schema([*SCHEMA, ("key", pa.uint64()), *meta_cols]),
            compression=None,
        )

    def consume(self, docs: Iterable[Document]) -> None:
        for doc in docs:
            key = self.key_base | doc.line
            self.writer.append(doc.text, doc.id, doc.source, doc.line,
                               metadata_json(doc.metadata), key)  # fmt: skip
        self.writer.close()
