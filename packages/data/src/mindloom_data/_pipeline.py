"""The cleaning run: read -> normalize -> filters -> exact / near / paragraph dedup -> write.

Every stage is a function of `(rank, world_size)` over a fixed slice of the work, as in
datatrove, so that an executor only has to run ranks:

| stage     | ranks                 | reads                         | writes (atomically)            |
|-----------|-----------------------|-------------------------------|--------------------------------|
| scan      | one per input file    | the input file                | clean/t.parquet, exch/*/p/t.npy, sigs/t.npy, removed/<filter>/ |
| exact     | one per partition     | exch/exact/p/*                | exact/p.npy                    |
| lsh       | one per partition     | exch/lsh/p/*, sigs/*          | pairs/p.npy                    |
| cluster   | one                   | pairs/*                       | near.npy                       |
| paragraph | one per partition     | exch/para/p/*                 | para/p.npy                     |
| write     | one per input file    | clean/t.parquet, the above    | shard-t.parquet, removed/<dedup step>/ |

A rank leaves `WORK/done/<stage>/<rank>.json` (its counts) as the last thing it does;
a rerun skips ranks that have one. Ranks are independent of the number of workers, so
the output is the same for any `--workers`.
"""

from __future__ import annotations

import copy
import hashlib
import json
import os
import shutil
import sys
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from mindloom_data._dedup import (
    LINE_BITS,
    cluster_stage,
    exact_stage,
    lsh_stage,
    make_key,
    paragraph_stage,
    rows_for_task,
    split_key,
    write_partitioned,
)
from mindloom_data._executors import Executor, check_fault, make_executor
from mindloom_data._filters import TextInfo, build_filters
from mindloom_data._markers import read_rank_marker, reset_outputs, stale_reason, write_clean_marker
from mindloom_data._minhash import MinHasher
from mindloom_data._normalize import Normalizer, check_normalize_config
from mindloom_data._readers import ReadStats, iter_file, resolve_inputs
from mindloom_data._report import StepStats, merge_steps, summary_text
from mindloom_data._safe_yaml import check_finite, load_yaml, shown
from mindloom_data._web import (
    WEB_DEFAULTS,
    LanguageRouter,
    WebSteps,
    check_web_config,
    metadata_fields,
)
from mindloom_data._writers import (
    SCHEMA,
    JsonlWriter,
    NpyAppender,
    ParquetShardWriter,
    atomic_write_bytes,
    atomic_write_json,
    load_array,
    metadata_json,
    remove_temporaries,
    save_array,
)

DEFAULTS: dict = {
    "text_key": "text",
    "id_key": "id",  # the records' own id; without one a document is "source:line"
    "txt_mode": "paragraph",
    "partitions": 4,
    "max_bad_fraction": None,
    "normalize": {
        "enabled": True,
        "nfkc": True,
        "keep_cjk_punctuation": True,
        "ansi": True,
        "control": True,
        "whitespace": True,
        "zh_simplified": False,
    },
    "filters": {},  # name -> params or false; checked by build_filters
    "dedup": {
        "exact": True,
        "minhash": {
            "enabled": True,
            "num_perm": 112,
            "bands": 14,
            "rows": 8,
            "ngram": 5,
            "cjk_ngram": 5,
            "seed": 1,
            "probe_bands": 14,
            "threshold": 0.7,
            "verify": True,
        },
        "paragraph": {"enabled": True, "min_chars": 30},
    },
    "output": {"jsonl": False, "removed": True, "keep_work": False},
    **WEB_DEFAULTS,  # html_key, extract, repair, language, url_filter (see _web)
}

_BATCH = 512  # documents per MinHash batch in the scan stage
_HASHER_KEYS = ("num_perm", "bands", "rows", "ngram", "cjk_ngram", "seed", "probe_bands")


class CleanError(Exception):
    """A problem with the inputs, the output directory or the config (one line)."""


def load_config(source: str | os.PathLike | dict | None) -> dict:
    """The run's config: DEFAULTS overlaid with a YAML file or a dict; unknown keys refused."""
    if source is None:
        user = {}
    elif isinstance(source, dict):
        user = source
    else:
        path = Path(source)
        try:  # bounded: no alias bombs, no oversized files (see _safe_yaml)
            user = load_yaml(path) or {}
        except ValueError as exc:
            raise CleanError(str(exc)) from None
        if not isinstance(user, dict):
            raise CleanError(f"config {path} must be a mapping at the top level")
    cfg = copy.deepcopy(DEFAULTS)
    _overlay(cfg, user, "")
    _check_values(cfg)
    try:
        check_normalize_config(cfg["normalize"])
        build_filters(cfg["filters"])
        m = cfg["dedup"]["minhash"]
        if m["enabled"]:
            MinHasher(**{k: m[k] for k in _HASHER_KEYS})
        check_web_config(cfg)
    except (ValueError, TypeError) as exc:
        raise CleanError(shown(str(exc), 300)) from None
    if not isinstance(cfg["partitions"], int) or cfg["partitions"] < 1:
        raise CleanError("partitions must be a positive integer")
    return cfg


def _fraction(cfg: dict, key: str, allow_off: bool) -> None:
    *parents, last = key.split(".")
    d = cfg
    for p in parents:
        d = d[p]
    v = d[last]
    if allow_off and (v is None or v is False):
        return
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 <= v <= 1:
        raise CleanError(f"config key {key} must be a number in [0, 1], got {shown(v)}")


def _check_values(cfg: dict) -> None:
    """Finite numbers everywhere, fractions in [0, 1]: a NaN must never reach report.json."""
    try:
        check_finite(cfg)
    except ValueError as exc:
        raise CleanError(str(exc)) from None
    _fraction(cfg, "max_bad_fraction", allow_off=True)
    _fraction(cfg, "dedup.minhash.threshold", allow_off=True)
    mc = cfg["dedup"]["paragraph"]["min_chars"]
    if isinstance(mc, bool) or not isinstance(mc, int) or mc < 0:
        raise CleanError(
            f"config key dedup.paragraph.min_chars must be an integer >= 0, got {shown(mc)}"
        )


def _overlay(base: dict, user: dict, prefix: str) -> None:
    for k, v in user.items():
        name = f"{prefix}{shown(k)}"
        if k not in base:
            raise CleanError(f"unknown config key {name} (known: {', '.join(base)})")
        if k == "filters":
            if not isinstance(v, dict):
                raise CleanError("filters must be a mapping")
            base[k] = v
        elif isinstance(base[k], dict):
            if isinstance(v, bool) and "enabled" in base[k]:
                base[k]["enabled"] = v
            elif not isinstance(v, dict):
                raise CleanError(f"config key {name} must be a mapping")
            else:
                _overlay(base[k], v, name + ".")
        else:
            base[k] = v


@dataclass
class Run:
    """Everything a rank needs; plain data so it can travel to another process."""

    files: list[str]
    output: str
    work: str
    cfg: dict

    @property
    def tasks(self) -> int:
        return len(self.files)

    @property
    def partitions(self) -> int:
        return self.cfg["partitions"]

    def out(self) -> Path:
        return Path(self.output)

    def w(self) -> Path:
        return Path(self.work)

    def minhasher(self) -> MinHasher:
        m = self.cfg["dedup"]["minhash"]
        return MinHasher(**{k: m[k] for k in _HASHER_KEYS})


def _hash64(data: bytes) -> int:
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little")


class _Removed:
    """The audit trail: removed documents of one step and rank, as JSON Lines."""

    def __init__(self, run: Run, step: str, task: int):
        self.enabled = run.cfg["output"]["removed"]
        self.path = run.out() / "removed" / step / f"shard-{task:05d}.jsonl"
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


def scan_rank(run: Run, task: int) -> dict:
    """Read one input file, normalize, filter; write kept docs and the dedup exchange files."""
    cfg = run.cfg
    work = run.w()
    path = run.files[task]
    ncfg = cfg["normalize"]
    normalizer = (
        Normalizer(**{k: v for k, v in ncfg.items() if k != "enabled"}) if ncfg["enabled"] else None
    )
    filters = build_filters(cfg["filters"])
    dcfg = cfg["dedup"]
    mcfg = dcfg["minhash"]
    pcfg = dcfg["paragraph"]
    hasher = run.minhasher() if mcfg["enabled"] else None

    rstats = ReadStats()
    web = WebSteps(cfg, path)
    meta_cols = metadata_fields(cfg, run.files)
    steps = {
        **{n: StepStats() for n in web.names},
        "normalize": StepStats(),
        **{f.name: StepStats() for f in filters},
    }
    removed = {name: _Removed(run, name, task) for name in steps}
    # An intermediate that is read once and deleted: not worth compressing.
    clean = ParquetShardWriter(
        work / "clean" / f"t{task:05d}.parquet",
        schema=pa.schema([*SCHEMA, ("key", pa.uint64()), *meta_cols]),
        compression=None,
    )
    exact_rows, para_rows, lines = [], [], []
    sig_blocks, lsh_rows = [], []
    # Shingle hashes of every document, for the exact check of uncertain LSH pairs.
    verify = hasher is not None and bool(mcfg["threshold"]) and mcfg["verify"]
    shingle_file = (
        NpyAppender(work / "sigs" / f"t{task:05d}.shingles.npy", np.uint32) if verify else None
    )
    shingle_counts: list[int] = []
    batch_text, batch_line = [], []

    def flush_minhash():
        if not batch_text:
            return
        shingles = hasher.shingle_hashes(batch_text)
        sig = hasher.signatures_of(shingles)
        if verify:
            for x in shingles:
                shingle_file.append(x)
                shingle_counts.append(len(x))
        bands = hasher.band_hashes(sig)
        keys = make_key(task, np.array(batch_line, np.uint64))
        ok = ~(sig == np.uint32(0xFFFFFFFF)).all(axis=1)  # no shingles: never bucketed
        nb = bands.shape[1]
        rows = np.stack(
            [
                bands[ok].ravel(),
                np.tile(np.arange(nb, dtype=np.uint64), int(ok.sum())),
                np.repeat(keys[ok], nb),
            ],
            axis=1,
        )
        lsh_rows.append(rows)
        sig_blocks.append(sig)
        batch_text.clear()
        batch_line.clear()

    # Per filter, how many documents (and bytes) stopped there; len(filters) = kept. The
    # per-step in/out counts follow from these at the end, which saves the bookkeeping
    # in the loop.
    stopped = [0] * (len(filters) + 1)
    stopped_bytes = [0] * (len(filters) + 1)
    nst = steps["normalize"]
    key_base = task << LINE_BITS
    exact_on, para_on, para_min = dcfg["exact"], pcfg["enabled"], pcfg["min_chars"]
    docs = iter_file(path, text_key=cfg["text_key"], stats=rstats, txt_mode=cfg["txt_mode"],
                     id_key=cfg["id_key"])  # fmt: skip
    for doc in docs:
        if web.active:
            doc = web.process(doc, steps, removed)
            if doc is None:
                continue
        text = doc.text
        nbytes = len(text) if text.isascii() else len(text.encode("utf-8"))
        nst.docs_in += 1
        nst.bytes_in += nbytes
        if normalizer is not None:
            text = normalizer(text)
            if not text:
                nst.drop("empty_after_normalize", doc.id, doc.text)
                removed["normalize"].add(
                    doc.id, doc.source, doc.line, "empty_after_normalize", doc.text, doc.metadata
                )
                continue
            nbytes = len(text) if text.isascii() else len(text.encode("utf-8"))
        nst.docs_out += 1
        nst.bytes_out += nbytes
        info = TextInfo(text)
        reason = None
        for i, f in enumerate(filters):
            reason = f.check(text, info)
            if reason is not None:
                stopped[i] += 1
                stopped_bytes[i] += nbytes
                steps[f.name].drop(reason, doc.id, text)
                removed[f.name].add(doc.id, doc.source, doc.line, reason, text, doc.metadata)
                break
        else:
            stopped[-1] += 1
            stopped_bytes[-1] += nbytes
        if reason is not None:
            continue
        key = key_base | doc.line
        clean.append(text, doc.id, doc.source, doc.line, metadata_json(doc.metadata), key)
        lines.append(doc.line)
        if exact_on:
            exact_rows.append((_hash64(text.encode("utf-8")), key))
        if para_on:
            for pno, para in enumerate(text.split("\n\n")):
                if len(para) >= para_min:
                    para_rows.append((_hash64(para.encode("utf-8")), key, pno))
        if hasher is not None:
            batch_text.append(text)
            batch_line.append(doc.line)
            if len(batch_text) >= _BATCH:
                flush_minhash()
    for i, f in enumerate(filters):
        st = steps[f.name]
        st.docs_in = sum(stopped[i:])
        st.bytes_in = sum(stopped_bytes[i:])
        st.docs_out = st.docs_in - stopped[i]
        st.bytes_out = st.bytes_in - stopped_bytes[i]
    if hasher is not None:
        flush_minhash()
    clean.close()

    P = run.partitions
    if dcfg["exact"]:
        arr = np.array(exact_rows, np.uint64).reshape(-1, 2)
        write_partitioned(work, "exact", task, arr[:, 0], arr, P)
    if pcfg["enabled"]:
        arr = np.array(para_rows, np.uint64).reshape(-1, 3)
        write_partitioned(work, "para", task, arr[:, 0], arr, P)
    if hasher is not None:
        arr = np.concatenate(lsh_rows) if lsh_rows else np.zeros((0, 3), np.uint64)
        write_partitioned(work, "lsh", task, arr[:, 0], arr, P)
        sig = (
            np.concatenate(sig_blocks) if sig_blocks else np.zeros((0, hasher.num_perm), np.uint32)
        )
        save_array(work / "sigs" / f"t{task:05d}.npy", sig)
        save_array(
            work / "sigs" / f"t{task:05d}.lines.npy", np.array(lines, np.uint64).reshape(-1, 1)
        )
        if verify:
            shingle_file.close()
            offsets = np.concatenate([[0], np.cumsum(shingle_counts, dtype=np.uint64)])
            save_array(
                work / "sigs" / f"t{task:05d}.offsets.npy", offsets.astype(np.uint64).reshape(-1, 1)
            )
    for r in removed.values():
        r.close()
    return {"read": rstats.to_dict(), "steps": {k: v.to_dict() for k, v in steps.items()}}


def write_rank(run: Run, task: int) -> dict:
    """Apply the dedup decisions to one task's kept documents; write its output shard."""
    cfg = run.cfg
    work = run.w()
    dcfg = cfg["dedup"]
    P = run.partitions
    drop: dict[int, tuple[str, str, int]] = {}  # key -> (step, reason, kept key)
    if dcfg["exact"]:
        for p in range(P):
            for k, kept in rows_for_task(
                load_array(work / "exact" / f"p{p:04d}.npy", 2), task
            ).tolist():
                drop[k] = ("exact_dedup", "exact_duplicate", kept)
    if dcfg["minhash"]["enabled"]:
        for k, kept in rows_for_task(load_array(work / "near.npy", 2), task).tolist():
            drop[k] = ("minhash_dedup", "near_duplicate", kept)
    paras: dict[int, set[int]] = {}
    if dcfg["paragraph"]["enabled"]:
        for p in range(P):
            for k, pno in rows_for_task(
                load_array(work / "para" / f"p{p:04d}.npy", 2), task
            ).tolist():
                paras.setdefault(k, set()).add(pno)

    names = ["exact_dedup", "minhash_dedup", "paragraph_dedup"]
    steps = {n: StepStats() for n in names}
    removed = {n: _Removed(run, n, task) for n in names}
    enabled = {
        "exact_dedup": dcfg["exact"],
        "minhash_dedup": dcfg["minhash"]["enabled"],
        "paragraph_dedup": dcfg["paragraph"]["enabled"],
    }
    shard = run.out() / f"shard-{task:05d}.parquet"
    meta_cols = metadata_fields(cfg, run.files)
    out_schema = pa.schema([*SCHEMA, *meta_cols])
    if cfg["language"]["split_output"]:
        writer, jsonl = LanguageRouter(run.out(), task, out_schema, cfg["output"]["jsonl"]), None
    else:
        writer = ParquetShardWriter(shard, schema=out_schema)
        jsonl = JsonlWriter(shard.with_suffix(".jsonl")) if cfg["output"]["jsonl"] else None
    kept_docs = kept_bytes = 0
    active = [n for n in names if enabled[n]]
    # Most documents are untouched by dedup: they go through as Arrow columns, and only
    # the documents with a decision become Python objects.
    touched = np.array(sorted({*drop, *paras}), np.uint64)
    pf = pq.ParquetFile(work / "clean" / f"t{task:05d}.parquet")
    for batch in pf.iter_batches(batch_size=2048):
        n = batch.num_rows
        hit = np.flatnonzero(np.isin(batch.column("key").to_numpy(), touched))
        keep = np.ones(n, bool)
        new_text: dict[int, str] = {}
        rows = batch.take(pa.array(hit, pa.int64())).to_pydict() if len(hit) else None
        for j, pos in enumerate(hit.tolist()):
            text, doc_id, source, line, meta, key = (
                rows[c][j] for c in ("text", "id", "source", "line", "metadata", "key")
            )
            nbytes = len(text.encode("utf-8"))
            gone = drop.get(key)
            for name in active:
                st = steps[name]
                st.docs_in += 1
                st.bytes_in += nbytes
                if gone is not None and gone[0] == name:
                    kt, kl = split_key(gone[2])
                    kept_id = f"{run.files[kt]}:{kl}"
                    st.drop(gone[1], doc_id, text)
                    removed[name].add(doc_id, source, line, gone[1], text, meta,
                                      duplicate_of=kept_id)  # fmt: skip
                    keep[pos] = False
                    break
                if name == "paragraph_dedup" and key in paras:
                    parts = text.split("\n\n")
                    left = [q for i, q in enumerate(parts) if i not in paras[key]]
                    if not left:
                        st.drop("all_paragraphs_duplicate", doc_id, text)
                        removed[name].add(
                            doc_id, source, line, "all_paragraphs_duplicate", text, meta
                        )
                        keep[pos] = False
                        break
                    st.removed["duplicate_paragraphs"] += len(parts) - len(left)
                    text = "\n\n".join(left)
                    new_text[pos] = text
                    nbytes = len(text.encode("utf-8"))
                st.docs_out += 1
                st.bytes_out += nbytes
            else:
                kept_bytes += nbytes
        plain = np.ones(n, bool)
        plain[hit] = False
        lengths = pc.binary_length(batch.column("text")).to_numpy(zero_copy_only=False)
        plain_bytes = int(lengths[plain].sum())
        plain_docs = n - len(hit)
        for name in active:
            st = steps[name]
            st.docs_in += plain_docs
            st.docs_out += plain_docs
            st.bytes_in += plain_bytes
            st.bytes_out += plain_bytes
        kept_bytes += plain_bytes
        text_col = batch.column("text")
        if new_text:
            mask = np.zeros(n, bool)
            mask[list(new_text)] = True
            text_col = pc.replace_with_mask(
                text_col, pa.array(mask), pa.array([new_text[i] for i in sorted(new_text)])
            )
        out = pa.table(
            [text_col, *(batch.column(n) for n in out_schema.names[1:])],
            names=out_schema.names,
        ).filter(pa.array(keep))
        kept_docs += out.num_rows
        writer.write_table(out)
        if jsonl is not None:
            for rec in out.to_pylist():
                rec["metadata"] = json.loads(rec["metadata"])  # an object, as datatrove's
                jsonl.write(rec)
    writer.close()
    if jsonl is not None:
        jsonl.close()
    for r in removed.values():
        r.close()
    return {
        "steps": {n: s.to_dict() for n, s in steps.items() if enabled[n]},
        "output": {"documents": kept_docs, "bytes": kept_bytes},
    }


# --- the local executor -------------------------------------------------------------


def _stage_fns(run: Run) -> list[tuple[str, int, Callable[[Run, int], dict | None]]]:
    d = run.cfg["dedup"]
    stages: list = [("scan", run.tasks, scan_rank)]
    if d["exact"]:
        stages.append(("exact", run.partitions, _exact))
    if d["minhash"]["enabled"]:
        stages.append(("lsh", run.partitions, _lsh))
        stages.append(("cluster", 1, _cluster))
    if d["paragraph"]["enabled"]:
        stages.append(("paragraph", run.partitions, _paragraph))
    stages.append(("write", run.tasks, write_rank))
    return stages


def _exact(run: Run, p: int):
    exact_stage(run.w(), p, run.tasks)


def _lsh(run: Run, p: int):
    m = run.cfg["dedup"]["minhash"]
    return lsh_stage(
        run.w(),
        p,
        run.tasks,
        run.partitions,
        m["threshold"] or 0.0,
        run.cfg["dedup"]["exact"],
        bool(m["verify"]),
    )


def _cluster(run: Run, _rank: int):
    return cluster_stage(run.w(), run.partitions)


def _paragraph(run: Run, p: int):
    d = run.cfg["dedup"]
    kinds = (["exact"] if d["exact"] else []) + (["near"] if d["minhash"]["enabled"] else [])
    paragraph_stage(run.w(), p, run.tasks, run.partitions, kinds)


def run_rank(run: Run, stage: str, rank: int) -> None:
    """Run one rank of one stage unless its completion marker exists (the unit of work)."""
    marker = run.w() / "done" / stage / f"{rank:05d}.json"
    if marker.exists():
        return
    fn = {name: f for name, _, f in _stage_fns(run)}[stage]
    result = fn(run, rank)
    check_fault(run.work, stage, rank)
    atomic_write_json(marker, result or {})


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
    config: str | os.PathLike | dict | None = None,
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
        cfg["text_key"] = text_key
    if tasks is not None:
        if tasks < 1:
            raise CleanError(f"tasks must be at least 1, got {tasks}")
        cfg["partitions"] = tasks
    found = ReadStats()  # files of no known format: not read, but counted and listed
    try:
        files = resolve_inputs(inputs, found)
        check_web_config(cfg, files)
    except ValueError as exc:
        raise CleanError(str(exc)) from None
    if cfg["html_key"] is not None:
        cfg["text_key"] = cfg["html_key"]
    out = Path(output)
    _check_output(out)
    work = out / ".work"
    ident = {"files": files, "config": cfg}
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
    split = bool(cfg["language"]["enabled"] and cfg["language"].get("split_output"))
    stale = stale_reason(out, work, len(files), cfg["output"]["jsonl"], split)
    if stale is not None:  # a marker must cover what is there, or nothing is trusted
        print(f"note: {out}: {stale}; regenerating the whole output", file=sys.stderr)
        reset_outputs(out, work)
    remove_temporaries(out)
    atomic_write_json(ident_path, ident)

    run = Run(files=files, output=str(out), work=str(work), cfg=cfg)
    show = sys.stderr.isatty() if progress is None else progress
    prog = _Progress(show)
    t0 = time.perf_counter()
    ex = make_executor(executor, workers=workers, ray_address=ray_address)
    payload = json.dumps(asdict(run))
    finished = False
    try:
        for stage, ranks, _ in _stage_fns(run):
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

            ex.map_ranks("clean", payload, stage, ranks, on_done)
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
    if not cfg["output"]["keep_work"]:
        # The bulky intermediates go; markers, counts and decisions stay so a rerun is a no-op.
        for sub in ("clean", "exch", "sigs"):
            shutil.rmtree(work / sub, ignore_errors=True)
    write_clean_marker(out, work, run.tasks, cfg["output"]["jsonl"], split)
    return report


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
    if run.cfg["dedup"]["minhash"]["enabled"]:
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
