"""Dedup stages over hash-partitioned exchange files.

The scan stage (one rank per input file, "task") writes, for every kept document, rows of
hashes into `WORK/exch/<kind>/p<partition>/t<task>.npy`, the partition chosen by the
hash. Each stage below runs one rank per partition and reads only that partition's
files, so ranks can run in any order, in any process or on any machine that sees the
work directory. A document is known by its key `task << 40 | line`, and keep-first
means: the smallest key wins (input file order, then line order), which does not depend
on how many workers ran.

Order: exact duplicates, then MinHash near-duplicates among the rest (pairs from LSH
buckets, verified on the signatures and, near the threshold, on the exact shingle
sets; clustered with union-find; the smallest key of a cluster is kept), then exact
paragraphs among the documents still kept.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from mindloom_data._atomic import save_array
from mindloom_data._minhash import exact_jaccard, standard_error
from mindloom_data._writers import load_array

LINE_BITS = 40
LINE_MASK = (1 << LINE_BITS) - 1


def make_key(task, line):
    return (np.uint64(task) << np.uint64(LINE_BITS)) | np.asarray(line, np.uint64)


def split_key(key: int) -> tuple[int, int]:
    key = int(key)
    return key >> LINE_BITS, key & LINE_MASK


def partition_of(h: np.ndarray, partitions: int) -> np.ndarray:
    return (h % np.uint64(partitions)).astype(np.int64)


def write_partitioned(
    work: Path, kind: str, task: int, h: np.ndarray, rows: np.ndarray, partitions: int
):
    """Scatter `rows` (first column is the hash `h`) into one file per partition."""
    part = partition_of(h, partitions)
    for p in range(partitions):
        save_array(work / "exch" / kind / f"p{p:04d}" / f"t{task:05d}.npy", rows[part == p])


def _load_partition(work: Path, kind: str, p: int, cols: int, tasks: int) -> np.ndarray:
    arrays = [
        load_array(work / "exch" / kind / f"p{p:04d}" / f"t{t:05d}.npy", cols) for t in range(tasks)
    ]
    return np.concatenate(arrays) if arrays else np.zeros((0, cols), np.uint64)


def exact_stage(work: Path, p: int, tasks: int) -> None:
    """Rows (hash, key) -> WORK/exact/p.npy rows (key, kept_key) for every later copy."""
    rows = _load_partition(work, "exact", p, 2, tasks)
    rows = rows[np.lexsort((rows[:, 1], rows[:, 0]))]
    same = np.concatenate([[False], rows[1:, 0] == rows[:-1, 0]])
    first = np.maximum.accumulate(np.where(~same, np.arange(len(rows)), 0))
    out = np.stack([rows[same, 1], rows[first[same], 1]], axis=1) if len(rows) else rows
    save_array(work / "exact" / f"p{p:04d}.npy", out.astype(np.uint64).reshape(-1, 2))


def removed_keys(work: Path, kinds: list[str], partitions: int) -> np.ndarray:
    """Sorted keys of documents already removed by the given dedup stages."""
    parts = []
    for kind in kinds:
        if kind == "near":
            f = work / "near.npy"
            if f.exists():
                parts.append(load_array(f, 2)[:, 0])
        else:
            for p in range(partitions):
                parts.append(load_array(work / kind / f"p{p:04d}.npy", 2)[:, 0])
    return np.unique(np.concatenate(parts)) if parts else np.zeros(0, np.uint64)


# A pair whose estimate is further than this many standard errors from the threshold is
# decided by the estimate (a wrong call has a probability below 1e-6); the others by
# the exact Jaccard similarity of their shingle sets.
VERIFY_SIGMAS = 5.0


def lsh_stage(
    work: Path,
    p: int,
    tasks: int,
    partitions: int,
    threshold: float,
    exact: bool,
    verify: bool = False,
) -> dict:
    """Rows (band_hash, band, key) -> candidate pairs (first_key, other_key) of each bucket.

    A pair is kept only if the documents' Jaccard similarity is at least `threshold`, which
    removes the LSH false positives: the signatures' estimate decides, except (`verify`)
    when it is within VERIFY_SIGMAS standard errors of the threshold, where the exact
    shingle sets (kept by the scan stage) decide. Without `verify`, the estimate alone
    drops some true pairs near the threshold (its noise at 112 permutations is ~0.04).
    """
    rows = _load_partition(work, "lsh", p, 3, tasks)
    if exact and len(rows):
        gone = removed_keys(work, ["exact"], partitions)
        rows = rows[~np.isin(rows[:, 2], gone)]
    rows = rows[np.lexsort((rows[:, 2], rows[:, 1], rows[:, 0]))]
    same = np.concatenate([[False], (rows[1:, 0] == rows[:-1, 0]) & (rows[1:, 1] == rows[:-1, 1])])
    first = np.maximum.accumulate(np.where(~same, np.arange(len(rows)), 0))
    pairs = (
        np.stack([rows[first[same], 2], rows[same, 2]], axis=1)
        if len(rows)
        else np.zeros((0, 2), np.uint64)
    )
    pairs = np.unique(pairs.astype(np.uint64).reshape(-1, 2), axis=0)
    # a pair can be checked in several partitions (one per band it shares)
    counts = {"candidate_checks": len(pairs), "exact_checks": 0}
    if threshold > 0 and len(pairs):
        sigs = _SignatureStore(work)
        a = sigs.get(pairs[:, 0])
        b = sigs.get(pairs[:, 1])
        est = (a == b).mean(axis=1)
        ok = est >= threshold
        if verify:
            margin = VERIFY_SIGMAS * standard_error(a.shape[1])
            unsure = np.flatnonzero(np.abs(est - threshold) < margin)
            for i in unsure.tolist():
                ok[i] = (
                    exact_jaccard(sigs.shingles(pairs[i, 0]), sigs.shingles(pairs[i, 1]))
                    >= threshold
                )
            counts["exact_checks"] = len(unsure)
        pairs = pairs[ok]
    save_array(work / "pairs" / f"p{p:04d}.npy", pairs.reshape(-1, 2))
    return counts


class _SignatureStore:
    """Random access to the per-task signature and shingle files (memory-mapped, read-only)."""

    def __init__(self, work: Path):
        self.work = work
        self._cache: dict[int, tuple[np.ndarray, np.ndarray]] = {}
        self._shingle_files: dict[int, tuple[np.ndarray, np.ndarray]] = {}
        self._sets: dict[int, np.ndarray] = {}

    def _task(self, t: int):
        if t not in self._cache:
            lines = load_array(self.work / "sigs" / f"t{t:05d}.lines.npy", 1)[:, 0]
            sig = load_array(self.work / "sigs" / f"t{t:05d}.npy", None, np.uint32, mmap=True)
            self._cache[t] = (lines, sig)
        return self._cache[t]

    def get(self, keys: np.ndarray) -> np.ndarray:
        tasks = (keys >> np.uint64(LINE_BITS)).astype(np.int64)
        lines = keys & np.uint64(LINE_MASK)
        out = None
        for t in np.unique(tasks):
            tl, sig = self._task(int(t))
            sel = tasks == t
            idx = np.searchsorted(tl, lines[sel])
            block = np.asarray(sig[idx])
            if out is None:
                out = np.empty((len(keys), sig.shape[1]), np.uint32)
            out[sel] = block
        return out

    def shingles(self, key) -> np.ndarray:
        """The sorted unique shingle hashes of one document."""
        key = int(key)
        if key not in self._sets:
            t, line = split_key(key)
            if t not in self._shingle_files:
                d = self.work / "sigs"
                self._shingle_files[t] = (
                    load_array(d / f"t{t:05d}.shingles.npy", None, np.uint32, mmap=True),
                    load_array(d / f"t{t:05d}.offsets.npy", 1)[:, 0],
                )
            flat, offsets = self._shingle_files[t]
            i = int(np.searchsorted(self._task(t)[0], line))
            self._sets[key] = np.unique(flat[int(offsets[i]) : int(offsets[i + 1])])
        return self._sets[key]


def cluster_stage(work: Path, partitions: int) -> dict:
    """Union-find over all candidate pairs -> WORK/near.npy rows (key, kept_key).

    Only the pairs are in memory (not the corpus); the kept document of a cluster is its
    smallest key.
    """
    pairs = [load_array(work / "pairs" / f"p{p:04d}.npy", 2) for p in range(partitions)]
    pairs = np.concatenate(pairs) if pairs else np.zeros((0, 2), np.uint64)
    if len(pairs) == 0:
        save_array(work / "near.npy", np.zeros((0, 2), np.uint64))
        return {"similar_pairs": 0}
    pairs = np.unique(pairs, axis=0)
    nodes, inv = np.unique(pairs, return_inverse=True)
    inv = inv.reshape(-1, 2)
    parent = np.arange(len(nodes))

    def find(x):
        root = x
        while parent[root] != root:
            root = parent[root]
        while parent[x] != root:
            parent[x], x = root, parent[x]
        return root

    for a, b in inv.tolist():
        ra, rb = find(a), find(b)
        if ra != rb:  # nodes are sorted, so the smaller index is the smaller key
            if ra < rb:
                parent[rb] = ra
            else:
                parent[ra] = rb
    roots = np.array([find(i) for i in range(len(nodes))])
    member = roots != np.arange(len(nodes))
    out = np.stack([nodes[member], nodes[roots[member]]], axis=1)
    save_array(work / "near.npy", out.astype(np.uint64))
    return {"similar_pairs": len(pairs)}


def paragraph_stage(
    work: Path, p: int, tasks: int, partitions: int, removed_kinds: list[str]
) -> None:
    """Rows (para_hash, key, para_no) -> WORK/para/p.npy rows (key, para_no) of later copies."""
    rows = _load_partition(work, "para", p, 3, tasks)
    if removed_kinds and len(rows):
        gone = removed_keys(work, removed_kinds, partitions)
        rows = rows[~np.isin(rows[:, 1], gone)]
    rows = rows[np.lexsort((rows[:, 2], rows[:, 1], rows[:, 0]))]
    same = np.concatenate([[False], rows[1:, 0] == rows[:-1, 0]])
    out = rows[same][:, 1:3] if len(rows) else np.zeros((0, 2), np.uint64)
    save_array(work / "para" / f"p{p:04d}.npy", out.astype(np.uint64).reshape(-1, 2))


def rows_for_task(arr: np.ndarray, task: int) -> np.ndarray:
    return arr[(arr[:, 0] >> np.uint64(LINE_BITS)) == np.uint64(task)]
