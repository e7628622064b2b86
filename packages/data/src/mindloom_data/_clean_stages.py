"""The clean job's stages, each a function of `(run, rank)`, and the `Job` executors run.

| stage     | ranks                 | reads                         | writes (atomically)            |
|-----------|-----------------------|-------------------------------|--------------------------------|
| scan      | one per input file    | the input file                | clean/t.parquet, exch/*/p/t.npy, sigs/t.npy, removed/<filter>/ |
| exact     | one per partition     | exch/exact/p/*                | exact/p.npy                    |
| lsh       | one per partition     | exch/lsh/p/*, sigs/*          | pairs/p.npy                    |
| cluster   | one                   | pairs/*                       | near.npy                       |
| paragraph | one per partition     | exch/para/p/*                 | para/p.npy                     |
| write     | one per input file    | clean/t.parquet, the above    | shard-t.parquet, removed/<dedup step>/ |

`scan` and `write` are chains of steps (`_scan_steps`, `_write_steps`). A rank leaves
`WORK/done/<stage>/<rank>.json` (its counts) as the last thing it does; a rerun skips
ranks that have one.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

import numpy as np
import pyarrow as pa

from mindloom_data._atomic import atomic_write_json
from mindloom_data._clean_config import CleanConfig
from mindloom_data._dedup import cluster_stage, exact_stage, lsh_stage, paragraph_stage
from mindloom_data._executors import Job
from mindloom_data._faults import check_fault
from mindloom_data._filters import build_filters
from mindloom_data._normalize import Normalizer
from mindloom_data._readers import ReadStats
from mindloom_data._report import StepStats
from mindloom_data._scan_steps import (
    ExactKeyStep,
    FilterStep,
    KeptWriter,
    NormalizeStep,
    ParagraphKeyStep,
    Removed,
    SignatureStep,
    WebStep,
    read_documents,
)
from mindloom_data._web import WebSteps, metadata_fields
from mindloom_data._write_steps import (
    DedupStep,
    ParagraphDedupStep,
    ShardWriter,
    load_decisions,
    read_kept,
)
from mindloom_data._writers import SCHEMA


@dataclass
class Run:
    """Everything a rank needs; plain data so it can travel to another process."""

    files: list[str]
    output: str
    work: str
    cfg: dict  # CleanConfig.to_dict()

    @property
    def tasks(self) -> int:
        return len(self.files)

    @cached_property
    def config(self) -> CleanConfig:
        return CleanConfig.from_dict(self.cfg)

    @property
    def partitions(self) -> int:
        return self.config.partitions

    def out(self) -> Path:
        return Path(self.output)

    def w(self) -> Path:
        return Path(self.work)


def scan_rank(run: Run, task: int) -> dict:
    """Read one input file, normalize, filter; write kept docs and the dedup exchange files."""
    cfg, work, path = run.config, run.w(), run.files[task]

    def audit(name: str) -> Removed:
        return Removed(run.out(), name, task, cfg.output.removed)

    read = ReadStats()
    web = WebSteps(run.cfg, path)
    normalizer = Normalizer(**cfg.normalize.normalizer_kwargs()) if cfg.normalize.enabled else None
    filters = build_filters(cfg.filters)
    removed = {name: audit(name) for name in [*web.names, "normalize", *(f.name for f in filters)]}
    web_stats = {name: StepStats() for name in web.names}
    normalize = NormalizeStep(normalizer, removed["normalize"])
    filter_step = FilterStep(filters, removed)
    key_steps: list = []
    if cfg.dedup.exact:
        key_steps.append(ExactKeyStep(task))
    if cfg.dedup.paragraph.enabled:
        key_steps.append(ParagraphKeyStep(task, cfg.dedup.paragraph.min_chars))
    m = cfg.dedup.minhash
    if m.enabled:
        verify = bool(m.threshold) and m.verify
        key_steps.append(SignatureStep(m.hasher(), work, task, verify))

    docs = read_documents(path, cfg, read)
    if web.active:
        docs = WebStep(web, web_stats, removed)(docs)
    docs = filter_step(normalize(docs))
    for step in key_steps:
        docs = step(docs)
    KeptWriter(work, task, metadata_fields(run.cfg, run.files)).consume(docs)

    for step in key_steps:
        step.finish(work, task, run.partitions)
    for r in removed.values():
        r.close()
    steps = {**web_stats, "normalize": normalize.stats, **filter_step.stats}
    return {"read": read.to_dict(), "steps": {k: v.to_dict() for k, v in steps.items()}}


def write_rank(run: Run, task: int) -> dict:
    """Apply the dedup decisions to one task's kept documents; write its output shard."""
    cfg, work = run.config, run.w()
    exact, near, paras = load_decisions(work, task, cfg, run.partitions)

    def audit(name: str) -> Removed:
        return Removed(run.out(), name, task, cfg.output.removed)

    steps: list = []
    if cfg.dedup.exact:
        steps.append(DedupStep("exact_dedup", exact, run.files, audit("exact_dedup")))
    if cfg.dedup.minhash.enabled:
        steps.append(DedupStep("minhash_dedup", near, run.files, audit("minhash_dedup")))
    if cfg.dedup.paragraph.enabled:
        steps.append(ParagraphDedupStep(paras, audit("paragraph_dedup")))
    schema = pa.schema([*SCHEMA, *metadata_fields(run.cfg, run.files)])
    writer = ShardWriter(run.out(), task, schema, cfg.output.jsonl, cfg.language["split_output"])

    touched = np.array(sorted({*exact, *near, *paras}), np.uint64)
    batches = read_kept(work / "clean" / f"t{task:05d}.parquet", touched)
    for step in steps:
        batches = step(batches)
    writer.consume(batches)
    for step in steps:
        step.removed.close()
    return {
        "steps": {step.name: step.stats.to_dict() for step in steps},
        "output": {"documents": writer.documents, "bytes": writer.bytes},
    }


# --- the other stages: hash-partitioned dedup (see _dedup) ---------------------------------


def _exact(run: Run, p: int):
    exact_stage(run.w(), p, run.tasks)


def _lsh(run: Run, p: int):
    m = run.config.dedup.minhash
    return lsh_stage(
        run.w(), p, run.tasks, run.partitions, m.threshold or 0.0, run.config.dedup.exact,
        bool(m.verify),
    )  # fmt: skip


def _cluster(run: Run, _rank: int):
    return cluster_stage(run.w(), run.partitions)


def _paragraph(run: Run, p: int):
    d = run.config.dedup
    kinds = (["exact"] if d.exact else []) + (["near"] if d.minhash.enabled else [])
    paragraph_stage(run.w(), p, run.tasks, run.partitions, kinds)


def stages(run: Run) -> list[tuple[str, int, Callable[[Run, int], dict | None]]]:
    """(stage, number of ranks, rank function) in the order they run."""
    d = run.config.dedup
    out: list = [("scan", run.tasks, scan_rank)]
    if d.exact:
        out.append(("exact", run.partitions, _exact))
    if d.minhash.enabled:
        out.append(("lsh", run.partitions, _lsh))
        out.append(("cluster", 1, _cluster))
    if d.paragraph.enabled:
        out.append(("paragraph", run.partitions, _paragraph))
    out.append(("write", run.tasks, write_rank))
    return out


def run_rank(run: Run, stage: str, rank: int) -> None:
    """Run one rank of one stage unless its completion marker exists (the unit of work)."""
    marker = run.w() / "done" / stage / f"{rank:05d}.json"
    if marker.exists():
        return
    fn = {name: f for name, _, f in stages(run)}[stage]
    result = fn(run, rank)
    check_fault(run.work, stage, rank)
    atomic_write_json(marker, result or {})


def rank_inputs(run: Run, stage: str, rank: int) -> list[str]:
    """What a rank reads, for error messages."""
    if stage in ("scan", "write"):
        return [run.files[rank]]
    if stage == "cluster":
        return [f"{run.work}/pairs/"]
    kind_dir = {"exact": "exact", "lsh": "lsh", "paragraph": "para"}.get(stage, stage)
    return [f"{run.work}/exch/{kind_dir}/p{rank:04d}/"]


JOB = Job("clean", lambda payload: Run(**payload), run_rank, rank_inputs)
JOB_REF = f"{__name__}:JOB"  # what the executors are handed
