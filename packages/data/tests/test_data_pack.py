"""Packing: sample contents, position/segment ids, best fit, loss masks, the index cache."""

from __future__ import annotations

import os
import threading

import numpy as np
import pytest
from mindloom_data import IndexedDatasetBuilder, PackedDataset
from mindloom_data._cli import main

EOS = 2
SEQ = 32


@pytest.fixture(scope="module")
def prefix(tmp_path_factory):
    """300 documents of 1..80 tokens (ids 3..99) each ending in EOS; doc k starts with id
    3 + k % 97 so that pieces can be traced back to documents."""
    rng = np.random.default_rng(0)
    out = tmp_path_factory.mktemp("pack") / "ds"
    with IndexedDatasetBuilder(out, dtype=np.uint16) as b:
        for _ in range(300):
            n = int(rng.integers(0, 80))
            b.add_document(np.concatenate([rng.integers(3, 100, n), [EOS]]))
    return str(out)


def _text(sample):
    return np.concatenate([sample["tokens"], sample["labels"][-1:]])


def test_concat_samples_are_windows_of_the_shuffled_stream(prefix, tmp_path):
    p = PackedDataset(prefix, SEQ, cache_dir=tmp_path, eos_id=EOS)
    doc_index = p.index["document_index"]
    assert not np.array_equal(doc_index, np.sort(doc_index))  # shuffled before packing
    stream = np.concatenate([p.dataset[int(d)] for d in doc_index])
    starts = np.cumsum([0] + [len(p.dataset[int(d)]) for d in doc_index])
    assert len(p) == (len(stream) - 1) // SEQ
    for k in range(0, len(p), 7):
        j = int(p.index["shuffle_index"][k])
        s = p[k]
        window = stream[j * SEQ : j * SEQ + SEQ + 1]
        assert np.array_equal(_text(s), window)
        assert np.array_equal(s["labels"][:-1], s["tokens"][1:])
        # positions restart and segments advance exactly at document starts
        lo = j * SEQ
        inside = [b - lo for b in starts if lo < b < lo + SEQ]
        expect_seg = np.searchsorted(inside, np.arange(SEQ), side="right")
        assert np.array_equal(s["segment_ids"], expect_seg)
        last_start = np.maximum.accumulate(
            np.where(np.isin(np.arange(SEQ), inside), np.arange(SEQ), 0)
        )
        assert np.array_equal(s["position_ids"], np.arange(SEQ) - last_start)
        assert s["loss_mask"].sum() == SEQ
        assert {k: v.dtype.name for k, v in s.items()} == {
            "tokens": "int32",
            "labels": "int32",
            "position_ids": "int32",
            "segment_ids": "int32",
            "loss_mask": "float32",
        }


def test_mask_eos_loss(prefix):
    p = PackedDataset(prefix, SEQ, cache_dir=None, eos_id=EOS, mask_eos_loss=True)
    s = p[3]
    assert (s["tokens"] == EOS).any()
    assert np.array_equal(s["loss_mask"] == 0, s["tokens"] == EOS)
    with pytest.raises(ValueError, match="needs eos_id"):
        PackedDataset(prefix, SEQ, mask_eos_loss=True, cache_dir=None)


def test_best_fit_never_splits_short_documents(prefix):
    p = PackedDataset(prefix, SEQ, mode="best_fit", cache_dir=None, eos_id=EOS)
    ds, cap = p.dataset, SEQ + 1
    seen: dict[int, list[tuple[int, int]]] = {}
    pad_positions = 0
    for k in range(len(p)):
        s = p[k]
        j = int(p.index["shuffle_index"][k])
        pieces = p._pieces(j)
        used = sum(n for _, _, n in pieces)
        assert used <= cap
        text = _text(s)
        pos = 0
        for seg, (d, off, n) in enumerate(pieces):
            assert np.array_equal(text[pos : pos + n], ds.get(d, off, n))
            assert (s["segment_ids"][pos : min(pos + n, SEQ)] == seg).all()
            if pos < SEQ:
                assert s["position_ids"][pos] == 0
            seen.setdefault(d, []).append((off, n))
            pos += n
        # padding: its own segment, no loss on it or on the label that is padding
        assert (s["loss_mask"][: used - 1] == 1).all() and (s["loss_mask"][used - 1 :] == 0).all()
        if used < cap:
            assert (s["segment_ids"][used:] == len(pieces)).all()
        pad_positions += SEQ - (used - 1)
    for d in range(len(ds)):
        n = len(ds[d])
        if n <= cap:
            assert seen[d] == [(0, n)]  # exactly once, whole
        else:
            covered = sorted(seen[d])
            assert covered[0][0] == 0 and sum(1 for o, m in covered if m == cap) >= 1
            ends = [o + m for o, m in covered]
            assert max(ends) == n  # nothing lost at the tail
    st = p.stats()
    assert st["padding_ratio"] == pytest.approx(pad_positions / (len(p) * SEQ))
    assert st["padding_ratio"] < 0.05


def test_epochs_and_determinism(prefix):
    a = PackedDataset(prefix, SEQ, mode="best_fit", num_samples=1000, seed=5, cache_dir=None)
    b = PackedDataset(prefix, SEQ, mode="best_fit", num_samples=1000, seed=5, cache_dir=None)
    c = PackedDataset(prefix, SEQ, mode="best_fit", num_samples=1000, seed=6, cache_dir=None)
    assert len(a) >= 1000
    assert all(np.array_equal(a[k]["tokens"], b[k]["tokens"]) for k in range(0, 1000, 50))
    assert any(not np.array_equal(a[k]["tokens"], c[k]["tokens"]) for k in range(0, 1000, 50))
    d = PackedDataset(prefix, SEQ, num_samples=1000, cache_dir=None)
    assert len(d) >= 1000 and len(d.index["document_index"]) % 300 == 0


def test_index_cache_is_reused_and_pickle_free(prefix, tmp_path):
    first = PackedDataset(prefix, SEQ, mode="best_fit", cache_dir=tmp_path)
    assert not first.cache_hit
    files = sorted(os.listdir(tmp_path))
    npys = [f for f in files if f.endswith(".npy")]
    assert len(npys) == 3 and any(f.endswith("-description.json") for f in files)
    assert not any(".tmp" in f for f in files)
    for f in npys:
        np.load(tmp_path / f, allow_pickle=False)
    again = PackedDataset(prefix, SEQ, mode="best_fit", cache_dir=tmp_path)
    assert again.cache_hit
    fresh = PackedDataset(prefix, SEQ, mode="best_fit", cache_dir=None)
    for name in fresh.index:
        assert np.array_equal(again.index[name], fresh.index[name])
    PackedDataset(prefix, SEQ + 1, mode="best_fit", cache_dir=tmp_path)
    assert len([f for f in os.listdir(tmp_path) if f.endswith(".npy")]) == 6


def test_concurrent_ranks_build_once(prefix, tmp_path):
    results = []

    def rank():
        results.append(PackedDataset(prefix, SEQ, num_samples=500, cache_dir=tmp_path))

    threads = [threading.Thread(target=rank) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sum(not r.cache_hit for r in results) == 1
    ref = results[0].index["shuffle_index"]
    assert all(np.array_equal(r.index["shuffle_index"], ref) for r in results)


def test_default_cache_dir_next_to_the_data(prefix):
    p = PackedDataset(prefix, 16)
    cache = os.path.join(os.path.dirname(prefix), "cache", "mindloom_pack")
    assert os.path.isdir(cache) and any(f.endswith(".npy") for f in os.listdir(cache))
    assert PackedDataset(prefix, 16).cache_hit and len(p) > 0


def test_pack_stats_cli(prefix, capsys, tmp_path):
    assert main(["pack-stats", prefix, "--seq-length", str(SEQ), "--split", "90,10,0"]) == 0
    out = capsys.readouterr().out
    assert "train:" in out and "valid:" in out and "test: empty" in out and "padding" in out
    assert main(["pack-stats", prefix, "--seq-length", str(SEQ), "--mode", "concat"]) == 0
    assert "padding 0.00%" in capsys.readouterr().out
    assert main(["pack-stats", str(tmp_path / "missing"), "--seq-length", "8"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "missing.idx: file not found" in err
