"""Blend several packed datasets by weight (Megatron's BlendedDataset, formats.md B4).

A blend is `[w1, prefix1, w2, prefix2, ...]` (or bare prefixes for equal weights). Each
source is packed with a small surplus (`ceil(ceil(n * w) * 1.005)` samples), then sample
`i` of the blend comes from the source that is furthest behind its share:
`argmax_d(w_d * max(i, 1) - count_d)`, ties to the first source. The result is
deterministic, cached like the pack indices, and reports the achieved mixture next to the
requested one.
"""

from __future__ import annotations

import math
import os

import numpy as np

from mindloom_data._cache import cached_arrays
from mindloom_data._indexed import IndexedDataset
from mindloom_data._pack import SPLITS, PackedDataset, split_ranges

SURPLUS = 0.005


def parse_blend(blend) -> tuple[list[str], list[float]]:
    """`[w1, p1, w2, p2]`, `"w1 p1 w2 p2"` or `[p1, p2]` -> (prefixes, normalized weights)."""
    items = (
        blend.split()
        if isinstance(blend, str)
        else [os.fspath(x) if isinstance(x, os.PathLike) else x for x in blend]
    )
    if not items:
        raise ValueError("blend is empty")

    def number(x) -> float | None:
        try:
            return float(x)
        except (TypeError, ValueError):
            return None

    if len(items) % 2 == 0 and all(number(items[i]) is not None for i in range(0, len(items), 2)):
        weights = [number(items[i]) for i in range(0, len(items), 2)]
        prefixes = [str(items[i]) for i in range(1, len(items), 2)]
    else:
        prefixes = [str(x) for x in items]
        weights = [1.0] * len(prefixes)
    if any(w < 0 or not math.isfinite(w) for w in weights) or sum(weights) <= 0:
        raise ValueError(f"blend weights must be finite, non-negative and not all 0: {weights}")
    total = sum(weights)
    return prefixes, [w / total for w in weights]


def blending_indices(weights, size: int) -> tuple[np.ndarray, np.ndarray]:
    """Megatron's greedy `build_blending_indices`: (dataset_index int16, sample int64)."""
    w = [float(x) for x in weights]
    counts = [0] * len(w)
    dataset_index = np.empty(size, dtype=np.int16)
    sample_index = np.empty(size, dtype=np.int64)
    rng = range(len(w))
    for i in range(size):
        x = max(float(i), 1.0)
        best, best_err = 0, w[0] * x - counts[0]
        for d in rng:
            err = w[d] * x - counts[d]
            if err > best_err:
                best, best_err = d, err
        dataset_index[i] = best
        sample_index[i] = counts[best]
        counts[best] += 1
    return dataset_index, sample_index


class BlendedDataset:
    """Samples drawn from several datasets in the requested proportions."""

    def __init__(self, datasets, weights, size: int, *, cache_dir=None, name="train") -> None:
        if len(datasets) != len(weights):
            raise ValueError(f"{len(datasets)} datasets but {len(weights)} weights")
        self.datasets = list(datasets)
        total = float(sum(weights))
        self.weights = [float(w) / total for w in weights]
        self.size = int(size)
        description = {
            "kind": "BlendedDataset",
            "version": 1,
            "weights": self.weights,
            "size": self.size,
            "split": name,
            "datasets": [getattr(d, "description", repr(d)) for d in self.datasets],
        }

        def build():
            di, si = blending_indices(self.weights, self.size)
            return {"dataset_index": di, "dataset_sample_index": si}

        self.index, self.cache_hit = cached_arrays(
            cache_dir,
            "BlendedDataset",
            description,
            ("dataset_index", "dataset_sample_index"),
            build,
        )
        counts = np.bincount(self.index["dataset_index"], minlength=len(self.datasets))
        for d, (ds, c) in enumerate(zip(self.datasets, counts)):
            if c > len(ds):
                raise ValueError(f"source {d} supplies {len(ds)} samples, the blend needs {c}")

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, k: int) -> dict[str, np.ndarray]:
        if not 0 <= k < self.size:
            raise IndexError(f"sample {k} out of range for {self.size} samples")
        d = int(self.index["dataset_index"][k])
        return self.datasets[d][int(self.index["dataset_sample_index"][k])]

    def get_batch(self, indices) -> dict[str, np.ndarray]:
        samples = [self[int(k)] for k in indices]
        return {key: np.stack([s[key] for s in samples]) for key in samples[0]}

    def mixture(self) -> list[dict]:
        """Requested against achieved share of samples, per source."""
        counts = np.bincount(self.index["dataset_index"], minlength=len(self.datasets))
        return [
            {
                "source": getattr(getattr(ds, "dataset", None), "prefix", str(d)),
                "requested": w,
                "achieved": float(c) / self.size if self.size else 0.0,
                "samples": int(c),
            }
            for d, (ds, w, c) in enumerate(zip(self.datasets, self.weights, counts))
        ]


def build_datasets(
    blend,
    seq_length: int,
    num_samples,
    *,
    split: str = "969,30,1",
    seed: int = 1234,
    mode: str = "concat",
    eos_id: int | None = None,
    mask_eos_loss: bool = False,
    cache_dir: str | os.PathLike | None = "default",
    vocab_size: int | None = None,
) -> dict[str, PackedDataset | BlendedDataset | None]:
    """Train/valid/test datasets from a blend and a split string.

    `num_samples` is `(train, valid, test)` (a missing or `None` entry packs one epoch);
    a split with no documents gives `None`. Every source is split by documents with
    the same ratios, then packed; several sources are blended.
    """
    prefixes, weights = parse_blend(blend)
    if isinstance(num_samples, int) or num_samples is None:
        num_samples = (num_samples,)
    num_samples = list(num_samples) + [None] * (3 - len(num_samples))
    sources = [IndexedDataset(p, vocab_size=vocab_size) for p in prefixes]
    out: dict[str, PackedDataset | BlendedDataset | None] = {}
    for s, name in enumerate(SPLITS):
        n = num_samples[s]
        packed = []
        for src, w in zip(sources, weights):
            lo, hi = split_ranges(len(src), split)[name]
            if hi <= lo:
                if n:
                    raise ValueError(
                        f"{src.prefix}: split {split!r} gives {name} no documents "
                        f"but {n} samples were requested"
                    )
                packed = None
                break
            want = (
                n
                if (n is None or len(sources) == 1)
                else math.ceil(math.ceil(n * w) * (1 + SURPLUS))
            )
            packed.append(
                PackedDataset(
                    src,
                    seq_length,
                    num_samples=want,
                    seed=seed,
                    mode=mode,
                    documents=(lo, hi),
                    eos_id=eos_id,
                    mask_eos_loss=mask_eos_loss,
                    cache_dir=cache_dir,
                    name=name,
                )
            )
        if not packed:
            out[name] = None
        elif len(packed) == 1:
            out[name] = packed[0]
        else:
            size = (
                n
                if n is not None
                else min(int(len(p) / w) for p, w in zip(packed, weights) if w > 0)
            )
            cdir = cache_dir
            if cdir == "default":
                cdir = os.path.join(
                    os.path.dirname(os.path.abspath(prefixes[0])), "cache", "mindloom_pack"
                )
            out[name] = BlendedDataset(packed, weights, size, cache_dir=cdir, name=name)
    return out
