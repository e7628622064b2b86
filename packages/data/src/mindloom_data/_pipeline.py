"""The cleaning run: read -> normalize -> filters -> exact / near / paragraph dedup -> write.

Every stage is a function of `(rank, world_size)` over a fixed slice of the work, as in
datatrove, so that an executor only has to run ranks (the stages: `_clean_stages`; their
steps: `_scan_steps`, `_write_steps`; the config: `_clean_config`). This module drives a
run: checks the inputs and the output directory, hands each stage's ranks to an executor
by the job's reference, and builds the report. Ranks are independent of the number of
workers, so the output is the same for any `--workers`.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import time
from collections import Counter
from dataclasses import asdict
from pathlib import Path

import numpy as np

from mindloom_data._atomic import atomic_write_bytes, atomic_write_json
from mindloom_data._clean_config import DEFAULTS, CleanConfig, CleanError, load_config
from mindloom_data._clean_stages import JOB_REF, Run, run_rank, stages
from mindloom_data._dedup import split_key
from mindloom_data._executors import Executor, make_executor
from mindloom_data._markers import read_rank_marker, reset_outputs, stale_reason, write_clean_marker
from mindloom_data._readers import ReadStats, resolve_inputs
from mindloom_data._report import merge_steps, summary_text
from mindloom_data._web import check_web_config
from mindloom_data._writers import load_array, remove_temporaries

__all__ = ["DEFAULTS", "CleanConfig", "CleanError", "Run", "build_report", "clean", "load_config",
           "run_rank"]  # fmt: skip


class _Progress:
    def __init__(self, enabled: bool):
        self.enabled = enabled
        self.t0 = time.perf_counter()

    def update(self, stage: str, done: int, total: int, note: str = "") -> None:
        if self.enabled:
            dt = time.perf_counter() - self.t0
            end = "\n" if done == total else ""
            print(
                f"\r{stage:<10} {done}/{total} ranks  {dt:7.1f}s{note}",
                end=end,
                file=sys.stderr,
                flush=True,
            )


def _check_output(output: Path) -> None:
    try:
        output.mkdir(parents=True, exist_ok=True)
        probe = output / f".probe-{os.getpid()}"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as exc:
        raise CleanError(
            f"output directory {output} is not writable: {exc.strerror or exc}"
        ) from None


def clean(
    inputs,
    output: str | os.PathLike,
    config: str | os.PathLike | dict | CleanConfig | None = None,
    workers: int = 1,
    text_key: str | None = None,
    progress: bool | None = None,
    executor: Executor | str | None = None,
    ray_address: str | None = None,
    tasks: int | None = None,
) -> dict:
    """Clean and deduplicate `inputs` into `output`; returns the report (also in report.json).

    Resumable: rerunning with the same inputs and config skips finished ranks.
    `executor` runs the ranks (`"local"` with `workers` processes, the default, or `"ray"`,
    see `_executors`); `tasks` sets the ranks of the hash-partitioned stages (config
    `partitions`). Neither changes the output.
    """
    cfg = load_config(config)
    if text_key is not None:
        cfg.text_key = text_key
    if tasks is not None:
        if tasks < 1:
            raise CleanError(f"tasks must be at least 1, got {tasks}")
        cfg.partitions = tasks
    found = ReadStats()  # files of no known format: not read, but counted and listed
    try:
        files = resolve_inputs(inputs, found)
        check_web_config(cfg.to_dict(), files)
    except ValueError as exc:
        raise CleanError(str(exc)) from None
    if cfg.html_key is not None:
        cfg.text_key = cfg.html_key
    out = Path(output)
    run = Run(files=files, output=str(out), work=str(out / ".work"), cfg=cfg.to_dict())
    _prepare_output(run)

    show = sys.stderr.isatty() if progress is None else progress
    t0 = time.perf_counter()
    ex = make_executor(executor, workers=workers, ray_address=ray_address)
    finished = False
    try:
        _run_stages(run, ex, _Progress(show))
        finished = True
    finally:
        if ex is not executor:
            ex.close()
        if not finished:  # e.g. ENOSPC: no temporary file is left filling the disk
            remove_temporaries(out)
    report = build_report(run)
    if found.counts:
        read = ReadStats.from_dict(report["read"])
        read.merge(found)
        report["read"] = {**read.to_dict(), "bad_fraction": report["read"]["bad_fraction"]}
    report["seconds"] = round(time.perf_counter() - t0, 3)
    atomic_write_json(out / "report.json", report)
    atomic_write_bytes(out / "summary.txt", (summary_text(report) + "\n").encode())
    work = run.w()
    if not cfg.output.keep_work:
        # The bulky intermediates go; markers, counts and decisions stay so a rerun is a no-op.
        for sub in ("clean", "exch", "sigs"):
            shutil.rmtree(work / sub, ignore_errors=True)
    write_clean_marker(out, work, run.tasks, cfg.output.jsonl, cfg.split_output)
    return report


def _prepare_output(run: Run) -> None:
    """A writable output that holds this run or nothing; stale outputs reset; run.json."""
    out, work, cfg = run.out(), run.w(), run.config
    _check_output(out)
    ident = {"files": run.files, "config": run.cfg}
    ident_path = work / "run.json"
    if ident_path.exists():
        try:
            old = json.loads(ident_path.read_text(encoding="utf-8"))
        except ValueError:
            old = None
        if old != json.loads(json.dumps(ident)):
            raise CleanError(
                f"{out} holds a run with other inputs or config; remove it or choose another --output"
            )
    elif out.exists() and any(out.glob("shard-*.parquet")):
        raise CleanError(f"{out} already holds shards from another run; choose another --output")
    stale = stale_reason(out, work, run.tasks, cfg.output.jsonl, cfg.split_output)
    if stale is not None:  # a marker must cover what is there, or nothing is trusted
        print(f"note: {out}: {stale}; regenerating the whole output", file=sys.stderr)
        reset_outputs(out, work)
    remove_temporaries(out)
    atomic_write_json(ident_path, ident)


def _run_stages(run: Run, ex: Executor, prog: _Progress) -> None:
    """Each stage's ranks through the executor, which is handed the job's reference."""
    payload = json.dumps(asdict(run))
    work = run.w()
    for stage, ranks, _ in stages(run):
        done = 0
        counts = Counter()

        def on_done(rank, stage=stage, ranks=ranks, counts=counts):
            nonlocal done
            done += 1
            if prog.enabled and stage in ("scan", "write"):
                # The ranks ran elsewhere; their markers carry the counts.
                res = read_rank_marker(work / "done" / stage / f"{rank:05d}.json")
                if stage == "scan":
                    counts["read"] += res["read"]["documents"]
                for name, st in res["steps"].items():
                    counts[f"{name} removed"] += sum(st["removed"].values())
                if stage == "write":
                    counts["kept"] += res["output"]["documents"]
            note = "".join(f", {k} {v}" for k, v in counts.items() if v)
            prog.update(stage, done, ranks, note)

        ex.map_ranks(JOB_REF, payload, stage, ranks, on_done)


def build_report(run: Run) -> dict:
    work = run.w()

    def markers(stage, n):
        return [read_rank_marker(work / "done" / stage / f"{r:05d}.json") for r in range(n)]

    scans = markers("scan", run.tasks)
    writes = markers("write", run.tasks)
    read = ReadStats()
    for s in scans:
        read.merge(ReadStats.from_dict(s["read"]))
    steps = merge_steps([s["steps"] for s in scans] + [w["steps"] for w in writes])
    report = {
        "inputs": run.files,
        "read": read.to_dict(),
        "steps": {k: v.to_dict() for k, v in steps.items()},
        "output": {
            "documents": sum(w["output"]["documents"] for w in writes),
            "bytes": sum(w["output"]["bytes"] for w in writes),
            "shards": run.tasks,
        },
        "config": run.cfg,
    }
    total = read.documents + read.bad_records
    report["read"]["bad_fraction"] = read.bad_records / total if total else 0.0
    if run.config.dedup.minhash.enabled:
        report["clusters"] = _clusters(run)
        # (the per-partition counts of candidate checks stay in the lsh markers: they
        # depend on the number of partitions, and the report must not)
        report["clusters"]["similar_pairs"] = markers("cluster", 1)[0].get("similar_pairs", 0)
    return report


def _clusters(run: Run, top: int = 10) -> dict:
    near = load_array(run.w() / "near.npy", 2)
    if len(near) == 0:
        return {"count": 0, "documents_removed": 0, "largest": []}
    kept, counts = np.unique(near[:, 1], return_counts=True)
    order = np.lexsort((kept, -counts))[:top]

    def name(key):
        t, line = split_key(key)
        return f"{run.files[t]}:{line}"

    largest = []
    for i in order:
        members = near[near[:, 1] == kept[i], 0][:5]
        largest.append(
            {
                "kept": name(kept[i]),
                "size": int(counts[i]) + 1,
                "members": [name(m) for m in members],
            }
        )
    return {"count": int(len(kept)), "documents_removed": int(len(near)), "largest": largest}
