"""Interoperability with megatron-core (the real package): files both ways, index arrays.

megatron-core takes ~15 s to import (it pulls in torch and its model-parallel modules),
so every check that needs it lives in this one module, and it is imported when this
module's tests run (`_megatron`), not when the module is collected: under pytest-xdist
every worker collects every file, so a top-level import cost each worker that import
(11.6 CPU-s measured here).
"""

from __future__ import annotations

import numpy as np
import pytest
from mindloom_data import IndexedDataset, IndexedDatasetBuilder
from mindloom_data._blend import blending_indices
from mindloom_data._pack import build_concat_indices


@pytest.fixture(scope="module", autouse=True)
def _megatron():
    """megatron-core and torch for every test here. Required, never skipped: a missing
    package is an error in each of these tests."""
    global mcore_idx, torch, helpers, _build_document_index, _build_shuffle_index
    import megatron.core.datasets.indexed_dataset as mcore_idx
    import torch
    from megatron.core.datasets import helpers
    from megatron.core.datasets.gpt_dataset import _build_document_index, _build_shuffle_index


def _docs(seed=0, n=300, vocab=1000):
    rng = np.random.default_rng(seed)
    return [np.append(rng.integers(3, vocab, int(rng.integers(1, 120))), 2) for _ in range(n)]


@pytest.mark.parametrize("dtype", [np.uint16, np.int32])
def test_mindloom_file_reads_with_megatron(tmp_path, dtype):
    docs = _docs()
    with IndexedDatasetBuilder(tmp_path / "ml", dtype=dtype) as b:
        for d in docs:
            b.add_document(d)
    theirs = mcore_idx.IndexedDataset(str(tmp_path / "ml"))
    assert len(theirs) == len(docs)
    assert theirs.index.dtype == dtype
    for i in (0, 1, 150, len(docs) - 1):
        assert theirs[i].tolist() == docs[i].tolist()
    assert theirs.get(7, offset=1, length=2).tolist() == docs[7][1:3].tolist()
    assert theirs.document_indices.tolist() == list(range(len(docs) + 1))


@pytest.mark.parametrize("dtype", [np.uint16, np.int32])
def test_megatron_file_reads_with_mindloom_byte_identical(tmp_path, dtype):
    docs = _docs(seed=1)
    theirs = mcore_idx.IndexedDatasetBuilder(str(tmp_path / "mc.bin"), dtype=dtype)
    ours = IndexedDatasetBuilder(tmp_path / "ml", dtype=dtype)
    for k, d in enumerate(docs):
        if k == 5:  # a document whose sentences were all dropped: a repeated boundary
            theirs.add_document(torch.tensor([], dtype=torch.int64), [])
            ours.add_document(np.asarray([], dtype=np.int64), lengths=[])
        theirs.add_document(torch.from_numpy(d), [len(d)])
        ours.add_document(d)
    theirs.finalize(str(tmp_path / "mc.idx"))
    ours.finalize()
    ds = IndexedDataset(tmp_path / "mc", vocab_size=1000)
    assert ds.dtype == dtype and ds.num_documents == len(docs) + 1
    assert [ds[i].tolist() for i in range(len(ds))] == [d.tolist() for d in docs]
    for ext in (".bin", ".idx"):
        assert (tmp_path / f"mc{ext}").read_bytes() == (tmp_path / f"ml{ext}").read_bytes()


def test_megatron_merge_matches_mindloom_merge(tmp_path):
    from mindloom_data._indexed import merge_datasets

    parts = []
    for k in range(3):
        with IndexedDatasetBuilder(tmp_path / f"p{k}", dtype=np.uint16) as b:
            for d in _docs(seed=10 + k, n=20):
                b.add_document(d)
        parts.append(str(tmp_path / f"p{k}"))
    mc = mcore_idx.IndexedDatasetBuilder(str(tmp_path / "mc.bin"), dtype=np.uint16)
    for p in parts:
        mc.add_index(p)
    mc.finalize(str(tmp_path / "mc.idx"))
    merge_datasets(parts, tmp_path / "ml")
    for ext in (".bin", ".idx"):
        assert (tmp_path / f"mc{ext}").read_bytes() == (tmp_path / f"ml{ext}").read_bytes()


@pytest.mark.parametrize("num_samples", [None, 100, 550, 700])
def test_concat_indices_equal_megatron_gptdataset(num_samples):
    """document/sample/shuffle index equal megatron's for the same seed (formats.md B4)."""
    lengths = np.asarray([len(d) for d in _docs(seed=2)], dtype=np.int32)
    seq, seed = 64, 1234
    ours = build_concat_indices(lengths, np.arange(len(lengths)), seq, num_samples, seed)
    tokens_per_epoch = int(lengths.sum())
    epochs = len(ours["document_index"]) // len(lengths)
    separate = False
    if epochs > 1:
        sans_final = ((epochs - 1) * tokens_per_epoch - 1) // seq
        separate = num_samples - sans_final < int(0.8 * ((tokens_per_epoch - 1) // seq))
    rs = np.random.RandomState(seed)
    doc_index = _build_document_index(np.arange(len(lengths), dtype=np.int32), epochs, rs, separate)
    sample_index = helpers.build_sample_idx(
        lengths, doc_index, seq, epochs, tokens_per_epoch, True, True
    )
    n = sample_index.shape[0] - 1
    shuffle = _build_shuffle_index(sans_final if separate else n, n, rs)
    assert np.array_equal(ours["document_index"], doc_index)
    assert np.array_equal(ours["sample_index"], sample_index)
    assert np.array_equal(ours["shuffle_index"], shuffle)
    if num_samples == 700:
        assert separate  # the branch with separately shuffled final epoch is covered


def test_blending_indices_equal_megatron_helper():
    weights = np.asarray([0.5, 0.3, 0.15, 0.05])
    size = 5000
    di = np.zeros(size, dtype=np.int16)
    dsi = np.zeros(size, dtype=np.int64)
    helpers.build_blending_indices(di, dsi, weights, len(weights), size, False)
    ours_di, ours_dsi = blending_indices(weights, size)
    assert np.array_equal(ours_di, di) and np.array_equal(ours_dsi, dsi)
