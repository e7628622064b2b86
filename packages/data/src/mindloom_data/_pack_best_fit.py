"""`best_fit` packing (see `_pack`): each epoch's shuffled documents placed into bins of
`seq_length + 1` tokens by best-fit decreasing, so a document that fits is never split."""

from __future__ import annotations

import numpy as np

__all__ = ["build_best_fit_indices"]


class _CapacityTree:
    """Bins grouped by remaining capacity; finds the fullest bin that still fits."""

    def __init__(self, capacity: int) -> None:
        self.size = 1
        while self.size < capacity + 1:
            self.size *= 2
        self.count = [0] * (2 * self.size)
        self.bins: list[list[int]] = [[] for _ in range(capacity + 1)]

    def add(self, remaining: int, b: int) -> None:
        self.bins[remaining].append(b)
        i = remaining + self.size
        while i:
            self.count[i] += 1
            i >>= 1

    def pop_fit(self, need: int) -> tuple[int, int]:
        """Remove and return (bin, remaining) with the smallest remaining >= need, or -1."""
        cnt, i = self.count, need + self.size
        if not cnt[i]:
            while True:
                while i & 1:
                    i >>= 1
                if i == 0:
                    return -1, -1
                i += 1
                if cnt[i]:
                    break
            while i < self.size:
                i = 2 * i if cnt[2 * i] else 2 * i + 1
        r = i - self.size
        b = self.bins[r].pop()
        while i:
            cnt[i] -= 1
            i >>= 1
        return b, r


def _best_fit_epoch(lengths: np.ndarray, order: np.ndarray, seq_length: int):
    """Pack one epoch; returns pieces (seq, offset, length) and each bin's piece count."""
    cap = seq_length + 1
    sizes = lengths[order].astype(np.int64)
    full_docs, full_off, tail_docs, tail_off, tail_len = [], [], [], [], []
    for d, n in zip(order[sizes > cap].tolist(), sizes[sizes > cap].tolist()):
        k = (n - 1) // seq_length  # full windows; they overlap by one token like `concat`
        full_docs.extend([d] * k)
        full_off.extend(range(0, k * seq_length, seq_length))
        rest = n - k * seq_length
        if rest > 1:  # a 1-token tail only repeats the last label
            tail_docs.append(d)
            tail_off.append(k * seq_length)
            tail_len.append(rest)
    short = (sizes > 0) & (sizes <= cap)
    item_doc = np.concatenate([order[short], np.asarray(tail_docs, dtype=np.int64)])
    item_off = np.concatenate(
        [np.zeros(int(short.sum()), np.int64), np.asarray(tail_off, np.int64)]
    )
    item_len = np.concatenate([sizes[short], np.asarray(tail_len, dtype=np.int64)])
    by_size = np.argsort(-item_len, kind="stable")  # ties keep the shuffled order

    tree = _CapacityTree(cap)
    bin_items: list[list[int]] = []
    for it, n in zip(by_size.tolist(), item_len[by_size].tolist()):
        b, r = tree.pop_fit(n)
        if b < 0:
            b, r = len(bin_items), cap
            bin_items.append([])
        bin_items[b].append(it)
        tree.add(r - n, b)

    n_full = len(full_docs)
    pieces = np.empty((n_full + len(item_doc), 3), dtype=np.int64)
    pieces[:n_full, 0] = full_docs
    pieces[:n_full, 1] = full_off
    pieces[:n_full, 2] = cap
    flat = np.asarray([it for items in bin_items for it in items], dtype=np.int64)
    pieces[n_full:, 0] = item_doc[flat]
    pieces[n_full:, 1] = item_off[flat]
    pieces[n_full:, 2] = item_len[flat]
    counts = np.concatenate(
        [np.ones(n_full, np.int64), np.asarray([len(x) for x in bin_items], np.int64)]
    )
    return pieces, counts


def build_best_fit_indices(
    lengths: np.ndarray,
    documents: np.ndarray,
    seq_length: int,
    num_samples: int | None,
    seed: int,
) -> dict[str, np.ndarray]:
    """Best-fit-decreasing bins per epoch; epochs are added until `num_samples` is met."""
    if int(lengths[documents].astype(np.int64).sum()) <= 1:
        raise ValueError("the documents hold fewer than 2 tokens: nothing to pack")
    rng = np.random.RandomState(seed)
    all_pieces, all_counts, total = [], [], 0
    while True:
        order = documents.astype(np.int64).copy()
        rng.shuffle(order)  # documents are shuffled before packing, never after
        pieces, counts = _best_fit_epoch(lengths, order, seq_length)
        all_pieces.append(pieces)
        all_counts.append(counts)
        total += len(counts)
        if num_samples is None or total >= num_samples or len(counts) == 0:
            break
    pieces = np.concatenate(all_pieces)
    counts = np.concatenate(all_counts)
    sample_starts = np.zeros(len(counts) + 1, dtype=np.int64)
    np.cumsum(counts, out=sample_starts[1:])
    shuffle_index = np.arange(len(counts), dtype=np.int64)
    rng.shuffle(shuffle_index)
    return {"pieces": pieces, "sample_starts": sample_starts, "shuffle_index": shuffle_index}
