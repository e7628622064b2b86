"""Packed training samples: `seq_length + 1` tokens cut from shuffled documents.

Two modes:

- `concat` (Megatron's GPTDataset, formats.md B4): the documents of each epoch are
  shuffled, concatenated (each already ends with EOS) and cut every `seq_length` tokens,
  consecutive samples sharing one token so that no prediction is lost. The three index
  arrays (`document_index`, `sample_index`, `shuffle_index`) are the ones Megatron builds
  from the same seed. No padding, but documents are split across samples.
- `best_fit`: each epoch's shuffled documents are placed into bins of `seq_length + 1`
  tokens by best-fit decreasing, so a document of at most `seq_length + 1` tokens is never
  split; a longer one is cut into full windows and its tail is placed like a short
  document. The rest of a bin is padding with `loss_mask = 0`.

The documents are shuffled before packing, never after; then the samples are shuffled.
All index arrays are built once and cached on disk, keyed by a hash of their parameters
(see `_cache.py`), so every rank and every rerun maps the same files.

A sample is a dict of int32/float32 arrays of length `seq_length`: `tokens`, `labels`,
`position_ids` (restart at 0 at each document start), `segment_ids` (0, 1, 2, ... per
document in the sample; padding gets its own id) and `loss_mask`.
"""

from __future__ import annotations

import hashlib
import os
import re

import numpy as np

from mindloom_data._cache import cached_arrays
from mindloom_data._indexed import IndexedDataset
from mindloom_data._pack_best_fit import build_best_fit_indices

MODES = ("concat", "best_fit")
SPLITS = ("train", "valid", "test")
_CACHE_VERSION = 1


def parse_split(split: str) -> list[float]:
    """`"969,30,1"` -> normalized `[train, valid, test]` ratios (Megatron's rule)."""
    parts = [p for p in re.split(r"[,/\s]+", str(split).strip()) if p]
    try:
        values = [float(p) for p in parts]
    except ValueError:
        raise ValueError(f"split {split!r}: expected up to three numbers like '969,30,1'") from None
    if not 1 <= len(values) <= 3 or any(v < 0 for v in values) or sum(values) <= 0:
        raise ValueError(f"split {split!r}: expected up to three non-negative numbers, sum > 0")
    values += [0.0] * (3 - len(values))
    total = sum(values)
    return [v / total for v in values]


def split_ranges(num_documents: int, split: str) -> dict[str, tuple[int, int]]:
    """Document ranges `[begin, end)` per split, rounded like Megatron's builder."""
    ratios = parse_split(split)
    bounds = [0.0]
    for r in ratios:
        bounds.append(bounds[-1] + r)
    out = {}
    for name, lo, hi in zip(SPLITS, bounds[:-1], bounds[1:]):
        out[name] = (int(round(lo * num_documents)), int(round(hi * num_documents)))
    return out


def _digest(arr: np.ndarray) -> str:
    return hashlib.sha256(np.ascontiguousarray(arr).tobytes()).hexdigest()[:24]


def _num_epochs(tokens_per_epoch: int, num_samples: int | None, seq_length: int) -> int:
    if num_samples is None:
        return 1
    needed = num_samples * seq_length + 1
    return max(1, -(-needed // tokens_per_epoch))


def build_concat_indices(
    lengths: np.ndarray,
    documents: np.ndarray,
    seq_length: int,
    num_samples: int | None,
    seed: int,
) -> dict[str, np.ndarray]:
    """Megatron's document/sample/shuffle indices (formats.md B4), in numpy."""
    tokens_per_epoch = int(lengths[documents].astype(np.int64).sum())
    if tokens_per_epoch <= 1:
        raise ValueError("the documents hold fewer than 2 tokens: nothing to pack")
    epochs = _num_epochs(tokens_per_epoch, num_samples, seq_length)
    separate_final = False
    if epochs > 1:
        sans_final = ((epochs - 1) * tokens_per_epoch - 1) // seq_length
        per_epoch = (tokens_per_epoch - 1) // seq_length
        separate_final = (num_samples - sans_final) < int(0.80 * per_epoch)
    rng = np.random.RandomState(seed)

    def doc_index(n_epochs: int) -> np.ndarray:
        idx = np.tile(documents.astype(np.int32), n_epochs)
        rng.shuffle(idx)
        return idx

    if separate_final:
        document_index = np.concatenate([doc_index(epochs - 1), doc_index(1)])
    else:
        document_index = doc_index(epochs)

    n = (epochs * tokens_per_epoch - 1) // seq_length
    sizes = lengths[document_index].astype(np.int64)
    ends = np.cumsum(sizes)
    starts = np.arange(n + 1, dtype=np.int64) * seq_length
    pos = np.searchsorted(ends, starts, side="right")
    offset = starts - (ends[pos] - sizes[pos])
    pos[0], offset[0] = 0, 0
    sample_index = np.stack([pos, offset], axis=1)
    if sample_index.max() <= np.iinfo(np.int32).max:
        sample_index = sample_index.astype(np.int32)

    sdtype = np.uint32 if n < np.iinfo(np.uint32).max - 1 else np.int64
    if separate_final:
        first = np.arange(sans_final, dtype=sdtype)
        rng.shuffle(first)
        last = np.arange(sans_final, n, dtype=sdtype)
        rng.shuffle(last)
        shuffle_index = np.concatenate([first, last])
    else:
        shuffle_index = np.arange(n, dtype=sdtype)
        rng.shuffle(shuffle_index)
    return {
        "document_index": document_index,
        "sample_index": sample_index,
        "shuffle_index": shuffle_index,
    }


class PackedDataset:
    """Fixed-length training samples over one indexed dataset (see the module docstring).

    `documents` restricts packing to these sequence indices (e.g. one split);
    `num_samples=None` packs exactly one epoch. `mask_eos_loss` zeroes the loss where the
    input token is `eos_id` (Megatron's `eod_mask_loss`: no prediction across documents).
    """

    def __init__(
        self,
        dataset: IndexedDataset | str | os.PathLike,
        seq_length: int,
        *,
        num_samples: int | None = None,
        seed: int = 1234,
        mode: str = "concat",
        documents: np.ndarray | tuple[int, int] | None = None,
        eos_id: int | None = None,
        mask_eos_loss: bool = False,
        pad_id: int | None = None,
        cache_dir: str | os.PathLike | None = "default",
        name: str = "train",
    ) -> None:
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
        if seq_length < 2:
            raise ValueError(f"seq_length must be >= 2, got {seq_length}")
        if mask_eos_loss and eos_id is None:
            raise ValueError("mask_eos_loss needs eos_id")
        if not isinstance(dataset, IndexedDataset):
            dataset = IndexedDataset(dataset)
        self.dataset = dataset
        self.seq_length = int(seq_length)
        self.mode = mode
        self.seed = int(seed)
        self.eos_id = eos_id
        self.mask_eos_loss = mask_eos_loss
        self.pad_id = int(pad_id if pad_id is not None else (eos_id if eos_id is not None else 0))
        if documents is None:
            documents = np.arange(len(dataset), dtype=np.int64)
        elif isinstance(documents, tuple):
            documents = np.arange(documents[0], documents[1], dtype=np.int64)
        self.documents = np.asarray(documents, dtype=np.int64)
        if self.documents.size == 0:
            raise ValueError(f"{dataset.prefix}: no documents to pack for split {name!r}")
        lengths = dataset.sequence_lengths
        if cache_dir == "default":
            cache_dir = os.path.join(
                os.path.dirname(os.path.abspath(dataset.prefix)), "cache", "mindloom_pack"
            )
        description = {
            "kind": "PackedDataset",
            "version": _CACHE_VERSION,
            "dataset": os.path.basename(dataset.prefix),
            "lengths": _digest(lengths),
            "documents": _digest(self.documents),
            "mode": mode,
            "seq_length": self.seq_length,
            "num_samples": num_samples,
            "seed": self.seed,
            "split": name,
        }
        self.description = description
        if mode == "concat":
            names = ("document_index", "sample_index", "shuffle_index")
            builder = build_concat_indices
        else:
            names = ("pieces", "sample_starts", "shuffle_index")
            builder = build_best_fit_indices
        try:
            self.index, self.cache_hit = cached_arrays(
                cache_dir,
                "PackedDataset",
                description,
                names,
                lambda: builder(lengths, self.documents, self.seq_length, num_samples, self.seed),
            )
        except ValueError as exc:  # e.g. nothing to pack: say which dataset and split
            raise ValueError(f"{dataset.prefix} (split {name!r}): {exc}") from None
        self.num_samples = len(self.index["shuffle_index"])

    def __len__(self) -> int:
        return self.num_samples

    def _pieces(self, j: int) -> list[tuple[int, int, int]]:
        """(sequence, offset, length) pieces of unshuffled sample `j`."""
        if self.mode == "best_fit":
            a, b = self.index["sample_starts"][j : j + 2]
            return [tuple(int(x) for x in row) for row in self.index["pieces"][a:b]]
        doc_index, sample_index = self.index["document_index"], self.index["sample_index"]
        (i, o), (i2, o2) = sample_index[j].tolist(), sample_index[j + 1].tolist()
        lengths = self.dataset.sequence_lengths
        if i == i2:
            return [(int(doc_index[i]), o, o2 - o + 1)]
        out = [(int(doc_index[i]), o, int(lengths[doc_index[i]]) - o)]
        for k in range(i + 1, i2):
            out.append((int(doc_index[k]), 0, int(lengths[doc_index[k]])))
        out.append((int(doc_index[i2]), 0, o2 + 1))
        return out

    def __getitem__(self, k: int) -> dict[str, np.ndarray]:
        if not 0 <= k < self.num_samples:
            raise IndexError(f"sample {k} out of range for {self.num_samples} samples")
        return self._sample(int(self.index["shuffle_index"][k]))

    def _sample(self, j: int) -> dict[str, np.ndarray]:
        cap = self.seq_length + 1
        text = np.full(cap, self.pad_id, dtype=np.int64)
        segment = np.empty(cap, dtype=np.int32)
        position = np.empty(cap, dtype=np.int32)
        used = seg = 0
        for seq, off, n in self._pieces(j):
            if n <= 0:
                continue
            text[used : used + n] = self.dataset.get(seq, off, n)
            segment[used : used + n] = seg
            position[used : used + n] = np.arange(n, dtype=np.int32)
            used += n
            seg += 1
        if used < cap:
            segment[used:] = seg  # padding is its own segment: nothing attends to it
            position[used:] = np.arange(cap - used, dtype=np.int32)
        loss_mask = np.zeros(self.seq_length, dtype=np.float32)
        loss_mask[: max(used - 1, 0)] = 1.0
        tokens = text[:-1].astype(np.int32)
        if self.mask_eos_loss:
            loss_mask[tokens == self.eos_id] = 0.0
        return {
            "tokens": tokens,
            "labels": text[1:].astype(np.int32),
            "position_ids": position[:-1],
            "segment_ids": segment[:-1],
            "loss_mask": loss_mask,
        }

    def get_batch(self, indices) -> dict[str, np.ndarray]:
        samples = [self[int(k)] for k in indices]
        return {key: np.stack([s[key] for s in samples]) for key in samples[0]}

    def stats(self) -> dict:
        """Padding ratio, documents split across samples, tokens per sample."""
        lengths = self.dataset.sequence_lengths
        n, seq = self.num_samples, self.seq_length
        if self.mode == "best_fit":
            pieces, starts = self.index["pieces"], self.index["sample_starts"]
            per_sample = np.add.reduceat(pieces[:, 2], starts[:-1]) if n else np.zeros(0)
            real = np.minimum(per_sample - 1, seq).clip(min=0)
            split_docs = int(np.unique(pieces[pieces[:, 2] < lengths[pieces[:, 0]], 0]).size)
            docs_per_sample = float(np.diff(starts).mean()) if n else 0.0
        else:
            sample_index = self.index["sample_index"]
            real = np.full(n, seq, dtype=np.int64)
            cut = sample_index[1:-1]
            split_docs = int(np.unique(cut[cut[:, 1] > 0, 0]).size)
            docs_per_sample = float((np.diff(sample_index[:, 0]) + 1).mean()) if n else 0.0
        total_docs = len(self.documents)
        return {
            "mode": self.mode,
            "seq_length": seq,
            "samples": n,
            "documents": total_docs,
            "tokens_per_sample": float(real.mean()) if n else 0.0,
            "padding_ratio": float(1.0 - real.sum() / (n * seq)) if n else 0.0,
            "documents_split": split_docs,
            "documents_split_frac": split_docs / total_docs if total_docs else 0.0,
            "documents_per_sample": docs_per_sample,
        }
