"""The trainer's loader: rank slices, union = global batch, resume, prefetch wait time."""

from __future__ import annotations

import time

import numpy as np
import pytest
from mindloom_data import DataLoader, IndexedDatasetBuilder, PackedDataset, build_dataloader

SEQ = 16


@pytest.fixture(scope="module")
def packed(tmp_path_factory):
    rng = np.random.default_rng(0)
    path = tmp_path_factory.mktemp("loader") / "ds"
    with IndexedDatasetBuilder(path, dtype=np.uint16) as b:
        for _ in range(400):
            b.add_document(np.append(rng.integers(3, 1000, int(rng.integers(1, 60))), 2))
    return PackedDataset(path, SEQ, mode="best_fit", cache_dir=None, eos_id=2)


def _all(loader):
    return list(loader)


def test_union_over_ranks_is_the_global_batch(packed):
    gbs, mbs, dp = 12, 2, 3
    single = _all(build_dataloader(packed, global_batch_size=gbs, micro_batch_size=gbs))
    per_rank = [
        _all(
            build_dataloader(
                packed, global_batch_size=gbs, micro_batch_size=mbs, dp_rank=r, dp_size=dp
            )
        )
        for r in range(dp)
    ]
    steps = gbs // (mbs * dp)
    assert len(single) == len(packed) // gbs and all(
        len(x) == len(single) * steps for x in per_rank
    )
    for g, whole in enumerate(single):
        rows = []
        for r in range(dp):
            mine = per_rank[r][g * steps : (g + 1) * steps]
            rows.extend(np.concatenate([m["tokens"] for m in mine]).tolist())
            assert all(m["tokens"].shape == (mbs, SEQ) for m in mine)
        # every rank read a disjoint slice and together they are exactly the global batch
        assert sorted(map(tuple, rows)) == sorted(map(tuple, whole["tokens"].tolist()))
        for key in ("labels", "position_ids", "segment_ids", "loss_mask"):
            assert whole[key].shape == (gbs, SEQ)


def test_resume_from_consumed_samples(packed):
    kw = dict(global_batch_size=8, micro_batch_size=2, dp_rank=1, dp_size=2)
    full = build_dataloader(packed, **kw)
    batches = _all(full)
    assert full.consumed_samples == (len(packed) // 8) * 8
    resumed = build_dataloader(packed, consumed_samples=24, **kw)
    rest = _all(resumed)
    skip = 3 * 2  # 3 global batches of 2 micro-steps each
    assert len(rest) == len(batches) - skip
    for a, b in zip(rest, batches[skip:]):
        for key in a:
            assert np.array_equal(a[key], b[key])


def test_total_samples_and_wait_time(packed):
    loader = build_dataloader(packed, global_batch_size=4, micro_batch_size=4, total_samples=40)
    t0 = time.perf_counter()
    it = iter(loader)
    first = next(it)
    assert first["tokens"].dtype == np.int32
    assert len(list(it)) == 9 and loader.consumed_samples == 40
    # every batch was waited for (the producer thread starts at iter()), never longer than
    # the whole iteration took
    assert 0.0 < loader.wait_s <= time.perf_counter() - t0
    assert loader.state_dict() == {"consumed_samples": 40}


def test_bad_configurations_are_refused(packed):
    with pytest.raises(ValueError, match="not a multiple of micro_batch_size"):
        DataLoader(packed, global_batch_size=10, micro_batch_size=4)
    with pytest.raises(ValueError, match="the run needs"):
        DataLoader(packed, global_batch_size=4, micro_batch_size=4, total_samples=10**9)
    with pytest.raises(ValueError, match="dp_rank 2 out of range"):
        DataLoader(packed, global_batch_size=4, micro_batch_size=2, dp_rank=2, dp_size=2)


def test_errors_in_the_prefetch_thread_reach_the_trainer():
    class Broken:
        def __len__(self):
            return 100

        def get_batch(self, idx):
            raise OSError("disk gone")

    with pytest.raises(OSError, match="disk gone"):
        _all(DataLoader(Broken(), global_batch_size=2, micro_batch_size=2))
