"""Tokenization as ranks: one `.bin/.idx` per slice of the input files, then one merge.

Rank `r` of `tasks` tokenizes the r-th contiguous slice of the sorted input files with
`_tokenize.tokenize` (one process) into `PREFIX.work/rank-r.bin/.idx` and leaves
`PREFIX.work/done/tokenize/r.json`. The merge (`IndexedDatasetBuilder.add_index`, in
rank order) then writes `PREFIX.bin/.idx`: the documents in input order, so the bytes
equal a single-process `tokenize` of all inputs, whatever the executor or `tasks`.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from mindloom_data._atomic import atomic_write_bytes, atomic_write_json
from mindloom_data._executors import Executor, Job, make_executor
from mindloom_data._faults import check_fault
from mindloom_data._markers import read_rank_marker
from mindloom_data._readers import ReadStats, resolve_inputs
from mindloom_data._tokenize import (
    DATASET_METADATA_SUFFIX,
    DEFAULT_CHUNK_CHARS,
    DOC_METADATA_SUFFIX,
    read_dataset_metadata,
    write_dataset_metadata,
)


@dataclass
class TokenizeRun:
    """Everything a rank needs; plain data so it can travel to another process."""

    files: list[str]
    tokenizer: str
    output_prefix: str
    work: str
    tasks: int
    settings: dict

    def slice(self, rank: int) -> list[str]:
        n, k = len(self.files), self.tasks
        return self.files[rank * n // k : (rank + 1) * n // k]

    def prefix(self, rank: int) -> str:
        return os.path.join(self.work, f"rank-{rank:05d}")


def run_rank(run: TokenizeRun, stage: str, rank: int) -> None:
    from mindloom_data._tokenize import tokenize

    marker = Path(run.work) / "done" / stage / f"{rank:05d}.json"
    if marker.exists():
        return
    if stage != "tokenize":
        raise ValueError(f"unknown tokenize stage {stage}")
    stats = tokenize(
        run.slice(rank),
        run.tokenizer,
        run.prefix(rank),
        force=True,
        allow_empty=True,
        **run.settings,
    )
    check_fault(run.work, stage, rank)
    atomic_write_json(marker, stats.to_dict())


def _rank_inputs(run: TokenizeRun, stage: str, rank: int) -> list[str]:
    return run.slice(rank) if stage == "tokenize" else [run.work]


JOB = Job("tokenize", lambda payload: TokenizeRun(**payload), run_rank, _rank_inputs)
JOB_REF = f"{__name__}:JOB"  # what the executors are handed


def tokenize_ranks(
    inputs,
    tokenizer_path: str | os.PathLike,
    output_prefix: str | os.PathLike,
    *,
    executor: Executor | str | None = None,
    workers: int = 1,
    ray_address: str | None = None,
    tasks: int | None = None,
    append_eos: bool = True,
    text_key: str = "text",
    txt_mode: str = "paragraph",
    chunk_chars: int = DEFAULT_CHUNK_CHARS,
    keep_work: bool = False,
    append_bos: bool = False,
    metadata_fields: list[str] | None = None,
    id_key: str = "id",
    progress=None,
) -> dict:
    """Tokenize `inputs` as `tasks` ranks (default: one per input file) and merge them.

    Returns the counts summed over ranks. Resumable: finished ranks are skipped, and a
    completed run with the same inputs and settings is not redone.
    """
    found = ReadStats()  # files of no known format: counted and listed, not read
    files = [os.path.abspath(f) for f in resolve_inputs(inputs, found)]
    tasks = len(files) if tasks is None else tasks
    if tasks < 1:
        raise ValueError(f"tasks must be at least 1, got {tasks}")
    tasks = min(tasks, len(files))
    output_prefix = os.fspath(output_prefix)
    settings = {
        "append_eos": append_eos,
        "text_key": text_key,
        "txt_mode": txt_mode,
        "chunk_chars": chunk_chars,
    }
    if append_bos:  # only when set: a run identity from before the option still matches
        settings["append_bos"] = True
    if metadata_fields is not None:
        settings.update(metadata_fields=list(metadata_fields), id_key=id_key)
    work = output_prefix + ".work"
    run = TokenizeRun(files, os.path.abspath(tokenizer_path), output_prefix, work, tasks, settings)
    ident = asdict(run)
    ident_path = Path(work) / "run.json"
    merged = Path(work) / "done" / "merge.json"
    if ident_path.exists():
        try:
            same = json.loads(ident_path.read_text(encoding="utf-8")) == ident
        except ValueError:
            same = False
        if same and merged.exists() and os.path.exists(output_prefix + ".idx"):
            return json.loads(merged.read_text(encoding="utf-8"))
        if not same or merged.exists():
            shutil.rmtree(work)  # another run's ranks, or ones already merged and removed
    atomic_write_json(ident_path, ident)

    t0 = time.perf_counter()
    _run_ranks(run, ident, executor, workers, ray_address, progress)
    report = _merge(run, found, len(files), keep_work)
    report["seconds"] = time.perf_counter() - t0
    atomic_write_json(merged, report)
    return report


def _run_ranks(run: TokenizeRun, ident: dict, executor, workers, ray_address, progress) -> None:
    """Every rank through the executor, which is handed this job's reference."""
    ex = make_executor(executor, workers=workers, ray_address=ray_address)
    done = 0

    def on_done(_rank: int) -> None:
        nonlocal done
        done += 1
        if progress:
            progress("tokenize", done, run.tasks)

    try:
        ex.map_ranks(JOB_REF, json.dumps(ident), "tokenize", run.tasks, on_done)
    finally:
        if ex is not executor:
            ex.close()


def _merge(run: TokenizeRun, found: ReadStats, nfiles: int, keep_work: bool) -> dict:
    """The ranks' files merged into the output in rank order; their counts summed."""
    from mindloom_data._indexed import merge_datasets

    tasks, output_prefix, work = run.tasks, run.output_prefix, run.work
    rank_stats = [
        read_rank_marker(Path(work) / "done" / "tokenize" / f"{r:05d}.json") for r in range(tasks)
    ]
    if sum(s["documents"] for s in rank_stats) == 0:
        raise ValueError(
            f"no documents to tokenize in {nfiles} input files; "
            f"nothing written to {output_prefix}.bin/.idx"
        )
    ds = merge_datasets([run.prefix(r) for r in range(tasks)], output_prefix)
    _merge_side_files(run, output_prefix, tasks)

    read = ReadStats()
    read.merge(found)
    report = {"documents": 0, "empty_documents": 0, "chunked_documents": 0, "tokens": 0}
    report["text_bytes"] = 0
    for s in rank_stats:
        for k in list(report):
            report[k] += s[k]
        read.merge(ReadStats.from_dict(s["read"]))
    report.update(dtype=str(ds.dtype), ranks=tasks, read=read.to_dict())
    for r in range(tasks):
        for ext in (".bin", ".idx", ".done.json", DATASET_METADATA_SUFFIX, DOC_METADATA_SUFFIX):
            if not keep_work and os.path.exists(run.prefix(r) + ext):
                os.unlink(run.prefix(r) + ext)
    return report


def _merge_side_files(run: TokenizeRun, output_prefix: str, tasks: int) -> None:
    """PREFIX.dataset.json (counts summed) and PREFIX.docmeta.jsonl (ranks in order), as
    one `tokenize` of all inputs writes them."""
    metas = [read_dataset_metadata(run.prefix(r)) for r in range(tasks)]
    merged = dict(metas[0])
    merged["documents"] = sum(m["documents"] for m in metas)
    merged["tokens"] = sum(m["tokens"] for m in metas)
    if merged.get("docmeta") is not None:
        parts = [Path(run.prefix(r) + DOC_METADATA_SUFFIX).read_bytes() for r in range(tasks)]
        atomic_write_bytes(output_prefix + DOC_METADATA_SUFFIX, b"".join(parts))
    write_dataset_metadata(output_prefix, merged)
