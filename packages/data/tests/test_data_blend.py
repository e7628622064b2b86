"""Blending sources by weight, split strings, achieved mixture."""

from __future__ import annotations

import numpy as np
import pytest
from mindloom_data import (
    BlendedDataset,
    IndexedDatasetBuilder,
    build_dataloader,
    build_datasets,
)
from mindloom_data._blend import parse_blend
from mindloom_data._cli import main
from mindloom_data._pack import parse_split, split_ranges

SEQ = 16


def _source(path, lo, hi, n_docs=200, seed=0):
    """Documents whose tokens all lie in [lo, hi): a sample's source is visible in it."""
    rng = np.random.default_rng(seed)
    with IndexedDatasetBuilder(path, dtype=np.uint16) as b:
        for _ in range(n_docs):
            b.add_document(np.append(rng.integers(lo, hi, int(rng.integers(1, 40))), 2))
    return str(path)


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    d = tmp_path_factory.mktemp("blend")
    return _source(d / "a", 100, 200), _source(d / "b", 300, 400, seed=1)


def test_parse_blend_and_split():
    assert parse_blend(["30", "a", "70", "b"]) == (["a", "b"], [0.3, 0.7])
    assert parse_blend("1 a 3 b") == (["a", "b"], [0.25, 0.75])
    assert parse_blend(["a", "b"]) == (["a", "b"], [0.5, 0.5])
    with pytest.raises(ValueError, match="not all 0"):
        parse_blend(["0", "a", "0", "b"])
    assert parse_split("969,30,1") == pytest.approx([0.969, 0.030, 0.001])
    assert parse_split("1") == [1.0, 0.0, 0.0]
    with pytest.raises(ValueError, match="split 'x,y'"):
        parse_split("x,y")
    assert split_ranges(1000, "969,30,1") == {
        "train": (0, 969),
        "valid": (969, 999),
        "test": (999, 1000),
    }


def test_blend_follows_weights_and_is_deterministic(sources, tmp_path):
    a, b = sources
    blend = ["0.7", a, "0.3", b]
    built = build_datasets(blend, SEQ, (400, 20), split="90,10,0", cache_dir=tmp_path)
    train = built["train"]
    assert isinstance(train, BlendedDataset) and len(train) == 400 and built["test"] is None
    mix = {m["source"]: m for m in train.mixture()}
    assert mix[a]["requested"] == pytest.approx(0.7)
    assert abs(mix[a]["achieved"] - 0.7) <= 1 / 400 and mix[a]["samples"] + mix[b]["samples"] == 400
    for k in range(0, 400, 9):
        toks = train[k]["tokens"]
        content = toks[toks != 2]
        from_a = int(train.index["dataset_index"][k]) == 0
        assert ((content >= 100) & (content < 200)).all() if from_a else (content >= 300).all()
    again = build_datasets(blend, SEQ, (400, 20), split="90,10,0", cache_dir=tmp_path)
    assert again["train"].cache_hit
    assert all(
        np.array_equal(train[k]["tokens"], again["train"][k]["tokens"]) for k in (0, 99, 399)
    )
    # the trainer's loader takes a blend like any dataset
    batches = list(build_dataloader(train, global_batch_size=8, micro_batch_size=4, dp_size=2))
    assert len(batches) == 50 and batches[0]["segment_ids"].shape == (4, SEQ)
    # valid uses only the held-out documents of each source
    valid = built["valid"]
    assert valid.datasets[0].documents.tolist() == list(range(180, 200))


def test_blend_errors_are_clear(sources, tmp_path):
    a, _ = sources
    with pytest.raises(ValueError, match="gives train no documents but 10 samples"):
        build_datasets([a], SEQ, (10,), split="0,1,0", cache_dir=None)["train"]
    assert main(["pack-stats", "1", a, "bogus", "--seq-length", "8"]) == 1


def test_pack_stats_reports_mixture(sources, capsys):
    a, b = sources
    assert (
        main(["pack-stats", "2", a, "1", b, "--seq-length", str(SEQ), "--num-samples", "300"]) == 0
    )
    out = capsys.readouterr().out
    assert "requested 0.6667, achieved 0.6667 (200 samples)" in out
    assert "requested 0.3333, achieved 0.3333 (100 samples)" in out
