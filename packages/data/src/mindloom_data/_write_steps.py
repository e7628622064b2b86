"""The write stage as steps: kept-documents reader -> exact dedup -> MinHash dedup ->
paragraph dedup -> shard writer.

Most documents are untouched by dedup, so the steps pass Arrow batches (`KeptBatch`), not
one object per document: only the documents with a decision (`touched`) become Python
values, and each step counts the untouched rest in bulk. Each dedup step keeps its own
`StepStats` and audit trail and marks the documents it removes in the batch's `keep`.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from mindloom_data._dedup import rows_for_task, split_key
from mindloom_data._report import StepStats
from mindloom_data._scan_steps import Removed
from mindloom_data._web import LanguageRouter
from mindloom_data._writers import JsonlWriter, ParquetShardWriter, load_array

_COLUMNS = ("text", "id", "source", "line", "metadata", "key")


@dataclass
class KeptBatch:
    """A batch of kept documents; `text[pos]` is the current text of a touched one."""

    batch: pa.RecordBatch
    touched: list[int]  # positions in the batch of the documents with a decision
    rows: dict  # column -> values of the touched documents, in `touched` order
    text: dict[int, str]
    keep: np.ndarray
    changed: set[int] = field(default_factory=set)  # positions whose text was rewritten
    plain_docs: int = 0
    plain_bytes: int = 0

    def touched_rows(self) -> Iterator[tuple[int, dict]]:
        """The touched documents still kept: (position, their columns)."""
        for j, pos in enumerate(self.touched):
            if self.keep[pos]:
                yield pos, {c: self.rows[c][j] for c in _COLUMNS}


def read_kept(path: Path, touched_keys: np.ndarray) -> Iterator[KeptBatch]:
    """The reader step: one task's kept documents from the scan stage, in order."""
    for batch in pq.ParquetFile(path).iter_batches(batch_size=2048):
        n = batch.num_rows
        hit = np.flatnonzero(np.isin(batch.column("key").to_numpy(), touched_keys))
        rows = batch.take(pa.array(hit, pa.int64())).to_pydict() if len(hit) else {}
        plain = np.ones(n, bool)
        plain[hit] = False
        lengths = pc.binary_length(batch.column("text")).to_numpy(zero_copy_only=False)
        yield KeptBatch(
            batch=batch,
            touched=hit.tolist(),
            rows=rows,
            text={pos: rows["text"][j] for j, pos in enumerate(hit.tolist())},
            keep=np.ones(n, bool),
            plain_docs=n - len(hit),
            plain_bytes=int(lengths[plain].sum()),
        )


class DedupStep:
    """Removes the documents that a dedup stage decided against (key -> (reason, kept key));
    the removed ones name the document they duplicate."""

    def __init__(self, name: str, drop: dict, files: list[str], removed: Removed):
        self.name, self.drop, self.files, self.removed = name, drop, files, removed
        self.stats = StepStats()

    def __call__(self, batches: Iterable[KeptBatch]) -> Iterator[KeptBatch]:
        st = self.stats
        for kb in batches:
            for pos, r in kb.touched_rows():
                text = kb.text[pos]
                nbytes = len(text.encode("utf-8"))
                st.docs_in += 1
                st.bytes_in += nbytes
                gone = self.drop.get(r["key"])
                if gone is not None:
                    reason, kept = gone
                    kt, kl = split_key(kept)
                    st.drop(reason, r["id"], text)
                    self.removed.add(r["id"], r["source"], r["line"], reason, text,
                                     r["metadata"], duplicate_of=f"{self.files[kt]}:{kl}")  # fmt: skip
                    kb.keep[pos] = False
                    continue
                st.docs_out += 1
                st.bytes_out += nbytes
            _count_plain(st, kb)
            yield kb


class ParagraphDedupStep:
    """Cuts the paragraphs seen earlier in the corpus; a document left empty is removed."""

    name = "paragraph_dedup"

    def __init__(self, paras: dict[int, set[int]], removed: Removed):
        self.paras, self.removed = paras, removed
        self.stats = StepStats()

    def __call__(self, batches: Iterable[KeptBatch]) -> Iterator[KeptBatch]:
        st = self.stats
        for kb in batches:
            for pos, r in kb.touched_rows():
                text = kb.text[pos]
                st.docs_in += 1
                st.bytes_in += len(text.encode("utf-8"))
                cut = self.paras.get(r["key"])
                if cut is not None:
                    parts = text.split("\n\n")
                    left = [q for i, q in enumerate(parts) if i not in cut]
                    if not left:
                        st.drop("all_paragraphs_duplicate", r["id"], text)
                        self.removed.add(r["id"], r["source"], r["line"],
                                         "all_paragraphs_duplicate", text, r["metadata"])  # fmt: skip
                        kb.keep[pos] = False
                        continue
                    st.removed["duplicate_paragraphs"] += len(parts) - len(left)
                    text = "\n\n".join(left)
                    kb.text[pos] = text
                    kb.changed.add(pos)
                st.docs_out += 1
                st.bytes_out += len(text.encode("utf-8"))
            _count_plain(st, kb)
            yield kb


def _count_plain(st: StepStats, kb: KeptBatch) -> None:
    st.docs_in += kb.plain_docs
    st.docs_out += kb.plain_docs
    st.bytes_in += kb.plain_bytes
    st.bytes_out += kb.plain_bytes


class ShardWriter:
    """The last step: kept documents to `shard-NNNNN.parquet` (and `.jsonl`), or to one
    shard per language (`language.split_output`)."""

    def __init__(self, out: Path, task: int, schema: pa.Schema, jsonl: bool, split: bool):
        self.schema = schema
        self.documents = self.bytes = 0
        if split:
            self.writer, self.jsonl = LanguageRouter(out, task, schema, jsonl), None
        else:
            shard = out / f"shard-{task:05d}.parquet"
            self.writer = ParquetShardWriter(shard, schema=schema)
            self.jsonl = JsonlWriter(shard.with_suffix(".jsonl")) if jsonl else None

    def consume(self, batches: Iterable[KeptBatch]) -> None:
        for kb in batches:
            self._write(kb)
        self.writer.close()
        if self.jsonl is not None:
            self.jsonl.close()

    def _write(self, kb: KeptBatch) -> None:
        batch = kb.batch
        text_col = batch.column("text")
        if kb.changed:
            mask = np.zeros(batch.num_rows, bool)
            mask[list(kb.changed)] = True
            text_col = pc.replace_with_mask(
                text_col, pa.array(mask), pa.array([kb.text[i] for i in sorted(kb.changed)])
            )
        names = self.schema.names
        out = pa.table([text_col, *(batch.column(n) for n in names[1:])], names=names).filter(
            pa.array(kb.keep)
        )
        self.documents += out.num_rows
        self.bytes += int(pc.sum(pc.binary_length(out.column("text"))).as_py() or 0)
        self.writer.write_table(out)
        if self.jsonl is not None:
            for rec in out.to_pylist():
                rec["metadata"] = json.loads(rec["metadata"])  # an object, as datatrove's
                self.jsonl.write(rec)


def load_decisions(work: Path, task: int, cfg, partitions: int):
    """This task's dedup decisions: exact and near duplicates (key -> (reason, kept key)),
    duplicate paragraphs (key -> paragraph numbers)."""
    exact: dict[int, tuple[str, int]] = {}
    near: dict[int, tuple[str, int]] = {}
    paras: dict[int, set[int]] = {}
    if cfg.dedup.exact:
        for p in range(partitions):
            arr = load_array(work / "exact" / f"p{p:04d}.npy", 2)
            for k, kept in rows_for_task(arr, task).tolist():
                exact[k] = ("exact_duplicate", kept)
    if cfg.dedup.minhash.enabled:
        for k, kept in rows_for_task(load_array(work / "near.npy", 2), task).tolist():
            near[k] = ("near_duplicate", kept)
    if cfg.dedup.paragraph.enabled:
        for p in range(partitions):
            arr = load_array(work / "para" / f"p{p:04d}.npy", 2)
            for k, pno in rows_for_task(arr, task).tolist():
                paras.setdefault(k, set()).add(pno)
    for k in near:  # a near-duplicate decision wins, as it always has
        exact.pop(k, None)
    return exact, near, paras
