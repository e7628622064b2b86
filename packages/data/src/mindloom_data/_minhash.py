"""Vectorized MinHash signatures with datasketch's permutation semantics, and LSH bands.

A document becomes a set of shingles: word n-grams (default 5) of the lowercased text for
Latin script, character n-grams (default 5, whitespace ignored) when the document
contains CJK. Each shingle gets a 32-bit hash; the signature then applies exactly
datasketch's default ("affine32") MinHash: the MurmurHash3 32-bit finalizer, then
`a * h + b mod 2**32` with datasketch's own permutation parameters for the same
`num_perm` and `seed`, and the minimum per permutation. So
`datasketch.MinHash(num_perm, seed, hashfunc=int).update_batch(shingle_hashes(text))`
gives the same hash values (a test checks this); only the shingle hashing differs from
datasketch's sha1 default, because it is done for a whole batch of documents with numpy
instead of one Python call per shingle.

A document with fewer tokens than the n-gram size is one shingle of all its tokens; a
document with no tokens gets the "empty" signature (all 0xFFFFFFFF) and is never
bucketed.

Bands: the `bands` primary bands are consecutive runs of `rows` signature values, as in
datasketch's MinHashLSH. `probe_bands` more bands regroup the same values: each takes
`rows` values from different primary bands (a fixed, seeded regrouping), so a pair that
misses every primary band by one or two values gets more chances from the signature it
already has. More bands mean more false candidates, which the exact check near the
threshold makes cheap; the probability that a pair of Jaccard J shares some band grows
from 1 - (1 - J^rows)^bands towards 1 - (1 - J^rows)^(bands + probe_bands).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import numpy as np

_M64 = (1 << 64) - 1
_P = 0x100000001B3  # odd, so invertible modulo 2**64
_PINV = pow(_P, -1, 1 << 64)
_Q = np.uint64(0x9E3779B97F4A7C15)
_EMPTY = np.uint32(0xFFFFFFFF)
_HAS_CJK = re.compile(
    "[\u2e80-\u2fdf\u3040-\u30ff\u3100-\u312f\u3190-\u31ff\u3400-\u4dbf\u4e00-\u9fff\uac00-\ud7af\uf900-\ufaff]"
)
_WS = np.zeros(256, bool)
_WS[[9, 10, 11, 12, 13, 32]] = True
# Shingles per chunk of the (num_perm, shingles) matrix: small enough to stay in cache,
# which was ~2x faster than larger chunks when measured.
_CHUNK_ROWS = 8192
MAX_PROBE_BANDS = 1024


def probe_groups(bands: int, rows: int, count: int, seed: int) -> np.ndarray:
    """(count, rows) signature positions of the probe bands: a seeded regrouping.

    Each round shuffles the order of the primary bands and of the positions inside each,
    lists slot 0 of every band, then slot 1, ..., and cuts that list into `bands` groups
    of `rows`: consecutive entries come from consecutive bands, so a group takes at most
    ceil(rows / bands) positions from any one primary band (one each when bands >= rows)
    and never equals a primary band. Groups already made (as sets) are skipped.
    """
    grid = np.arange(bands * rows).reshape(bands, rows)
    seen = {frozenset(g.tolist()) for g in grid}
    rng = np.random.default_rng([seed, 0x9E0B])
    out: list[np.ndarray] = []
    for _ in range(64 + 4 * count):
        if len(out) >= count:
            break
        g = grid[rng.permutation(bands)]
        g = np.take_along_axis(g, rng.permuted(np.tile(np.arange(rows), (bands, 1)), axis=1), 1)
        for group in g.T.ravel().reshape(bands, rows):
            key = frozenset(group.tolist())
            if len(out) < count and key not in seen:
                seen.add(key)
                out.append(group)
    if len(out) < count:
        raise ValueError(
            f"dedup.minhash.probe_bands: only {len(out)} distinct probe bands found "
            f"for {bands} bands of {rows} rows, not {count}"
        )
    return np.array(out, np.int64).reshape(count, rows)


def fmix64(h: np.ndarray) -> np.ndarray:
    h = h ^ (h >> np.uint64(33))
    h = h * np.uint64(0xFF51AFD7ED558CCD)
    h = h ^ (h >> np.uint64(33))
    h = h * np.uint64(0xC4CEB9FE1A85EC53)
    return h ^ (h >> np.uint64(33))


def _fmix32(h: np.ndarray) -> np.ndarray:
    # datasketch's _fmix for width 32 (MurmurHash3 fmix32)
    h = h ^ (h >> np.uint32(16))
    h = h * np.uint32(0x85EBCA6B)
    h = h ^ (h >> np.uint32(13))
    h = h * np.uint32(0xC2B2AE35)
    return h ^ (h >> np.uint32(16))


class _Powers:
    """P**i and P**-i modulo 2**64, grown on demand (for position-free substring hashes)."""

    def __init__(self):
        self.pw = np.ones(1, np.uint64)
        self.ipw = np.ones(1, np.uint64)

    def get(self, n: int):
        if len(self.pw) < n:
            m = max(n, 2 * len(self.pw))
            with np.errstate(over="ignore"):
                one = np.ones(1, np.uint64)
                self.pw = np.concatenate([one, np.cumprod(np.full(m - 1, _P, np.uint64))])
                self.ipw = np.concatenate([one, np.cumprod(np.full(m - 1, _PINV, np.uint64))])
        return self.pw[:n], self.ipw[:n]


_POWERS = _Powers()


def _word_tokens(texts: list[str]) -> tuple[np.ndarray, np.ndarray]:
    """Hashes of the whitespace-separated words of every text; returns (hashes, counts)."""
    blobs = [t.lower().encode("utf-8") for t in texts]
    data = np.frombuffer(b" ".join(blobs) + b" ", np.uint8)
    n = len(data)
    ws = _WS[data]
    nonws = ~ws
    starts = np.flatnonzero(nonws & np.concatenate([[True], ws[:-1]]))
    ends = np.flatnonzero(nonws & np.concatenate([ws[1:], [True]])) + 1
    pw, ipw = _POWERS.get(n + 1)
    with np.errstate(over="ignore"):
        pref = np.concatenate(
            [np.zeros(1, np.uint64), np.cumsum(data.astype(np.uint64) * pw[:n], dtype=np.uint64)]
        )
        h = (pref[ends] - pref[starts]) * ipw[starts]
        h = fmix64(h + np.uint64(0x5BD1E995))
    bounds = np.cumsum([len(b) + 1 for b in blobs])
    counts = np.diff(np.searchsorted(starts, np.concatenate([[0], bounds])))
    return h, counts


def _char_tokens(text: str) -> np.ndarray:
    codes = np.frombuffer(text.lower().encode("utf-32-le"), np.uint32)
    codes = codes[(codes > 32) & (codes != 0x3000)]
    with np.errstate(over="ignore"):
        return fmix64(codes.astype(np.uint64) + np.uint64(0x27D4EB2F165667C5))


@dataclass
class MinHasher:
    num_perm: int = 112
    bands: int = 14
    rows: int = 8
    ngram: int = 5
    cjk_ngram: int = 5
    seed: int = 1
    probe_bands: int = 0

    def __post_init__(self):
        if self.bands * self.rows > self.num_perm:
            raise ValueError(
                f"minhash.bands * minhash.rows ({self.bands}*{self.rows}) exceeds minhash.num_perm ({self.num_perm})"
            )
        k = self.probe_bands
        if isinstance(k, bool) or not isinstance(k, int) or not 0 <= k <= MAX_PROBE_BANDS:
            raise ValueError(
                f"dedup.minhash.probe_bands must be an integer from 0 to {MAX_PROBE_BANDS}, got {k!r}"
            )
        if k and (self.bands < 2 or self.rows < 2):
            raise ValueError(
                "dedup.minhash.probe_bands needs minhash.bands >= 2 and minhash.rows >= 2 "
                "(a probe band mixes rows of different primary bands); set it to 0"
            )
        primary = np.arange(self.bands * self.rows, dtype=np.int64).reshape(self.bands, self.rows)
        probes = probe_groups(self.bands, self.rows, k, self.seed) if k else primary[:0]
        # (bands + probe_bands, rows) signature positions of every band, primary first
        self.groups = np.concatenate([primary, probes])
        from datasketch import MinHash

        perms = MinHash(num_perm=self.num_perm, seed=self.seed, scheme="affine32").permutations
        self.a = np.ascontiguousarray(perms[0], np.uint32)
        self.b = np.ascontiguousarray(perms[1], np.uint32)

    def _tokens(self, texts: list[str]) -> tuple[list[np.ndarray], list[int]]:
        cjk = [bool(_HAS_CJK.search(t)) for t in texts]
        latin_idx = [i for i, c in enumerate(cjk) if not c]
        per_doc: list[np.ndarray | None] = [None] * len(texts)
        if latin_idx:
            h, counts = _word_tokens([texts[i] for i in latin_idx])
            offs = np.concatenate([[0], np.cumsum(counts)])
            for j, i in enumerate(latin_idx):
                per_doc[i] = h[offs[j] : offs[j + 1]]
        for i, c in enumerate(cjk):
            if c:
                per_doc[i] = _char_tokens(texts[i])
        return per_doc, [self.cjk_ngram if c else self.ngram for c in cjk]

    def shingle_hashes(self, texts: list[str]) -> list[np.ndarray]:
        """32-bit shingle hashes (uint32) of each text."""
        per_doc, ns = self._tokens(texts)
        out = []
        with np.errstate(over="ignore"):
            for toks, n in zip(per_doc, ns):
                if len(toks) == 0:
                    out.append(np.zeros(0, np.uint32))
                    continue
                k = max(1, len(toks) - n + 1)
                m = min(n, len(toks))
                sh = toks[:k].copy()
                for j in range(1, m):
                    sh = sh * _Q + toks[j : j + k]
                out.append((fmix64(sh) >> np.uint64(32)).astype(np.uint32))
        return out

    def signatures(self, texts: list[str]) -> np.ndarray:
        """(len(texts), num_perm) uint32 MinHash signatures."""
        return self.signatures_of(self.shingle_hashes(texts))

    def signatures_of(self, shingles: list[np.ndarray]) -> np.ndarray:
        """Signatures from `shingle_hashes` output (to keep the shingles, too)."""
        sigs = np.full((len(shingles), self.num_perm), _EMPTY, np.uint32)
        lens = np.array([len(s) for s in shingles], np.int64)
        nonempty = np.flatnonzero(lens)
        if len(nonempty) == 0:
            return sigs
        # Group consecutive documents into chunks of bounded matrix size.
        i = 0
        while i < len(nonempty):
            j, rows = i, 0
            while j < len(nonempty) and (rows == 0 or rows + lens[nonempty[j]] <= _CHUNK_ROWS):
                rows += lens[nonempty[j]]
                j += 1
            docs = nonempty[i:j]
            hv = _fmix32(np.concatenate([shingles[d] for d in docs]))
            with np.errstate(over="ignore"):
                # permutations along rows so the per-document min runs over contiguous memory
                phv = self.a[:, None] * hv[None, :]
                phv += self.b[:, None]
            starts = np.concatenate([[0], np.cumsum(lens[docs])[:-1]])
            sigs[docs] = np.minimum.reduceat(phv, starts, axis=1).T
            i = j
        return sigs

    def band_hashes(self, sigs: np.ndarray) -> np.ndarray:
        """(N, bands + probe_bands) uint64: one hash per LSH band of `rows` signature values.

        The first `bands` columns are the primary bands (datasketch's), the rest the probes.
        """
        used = sigs[:, self.groups].astype(np.uint64)
        with np.errstate(over="ignore"):
            h = np.zeros((len(sigs), len(self.groups)), np.uint64)
            for r in range(self.rows):
                h = h * _Q + used[:, :, r]
            return fmix64(h)


def jaccard(a: set, b: set) -> float:
    return len(a & b) / max(1, len(a | b))


def standard_error(num_perm: int) -> float:
    """The largest standard error of a `num_perm` signature's Jaccard estimate (at J=0.5)."""
    return 0.5 / num_perm**0.5


def exact_jaccard(a: np.ndarray, b: np.ndarray) -> float:
    """Jaccard similarity of two sets given as sorted arrays of unique shingle hashes."""
    inter = len(np.intersect1d(a, b, assume_unique=True))
    union = len(a) + len(b) - inter
    return inter / union if union else 0.0
