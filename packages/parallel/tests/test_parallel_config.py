"""Layout rules, rank mapping, the 1F1B schedule and checkpoint resharding: pure Python."""

from __future__ import annotations

import numpy as np
import pytest
from mindloom_model import get_preset
from mindloom_parallel import (
    ParallelConfig,
    ParallelConfigError,
    assemble_state,
    layout_metadata,
    one_f_one_b,
    rank_coords,
    rank_state,
    tensor_layout,
    validate,
)
from mindloom_parallel._groups import group_ranks, make_groups
from mindloom_parallel._pp import simulate

DEBUG = get_preset("debug")  # 4 heads, 2 kv heads, 2 layers, vocab 256, ffn 128


@pytest.mark.parametrize(
    "pcfg, kwargs, message",
    [
        (ParallelConfig(dp=2, tp=2), dict(world_size=2), "world size 2 != dp*tp*pp = 2*2*1 = 4"),
        (
            ParallelConfig(tp=3),
            dict(world_size=3),
            "model.num_heads = 4 is not divisible by parallelism.tp = 3",
        ),
        (
            ParallelConfig(tp=4),
            dict(world_size=4),
            "model.num_kv_heads = 2 is not divisible by parallelism.tp = 4",
        ),
        (
            ParallelConfig(pp=4),
            dict(world_size=4),
            "model.num_layers = 2 is not divisible by parallelism.pp = 4",
        ),
        (
            ParallelConfig(dp=2),
            dict(world_size=2, global_batch_size=6, micro_batch_size=4),
            "training.global_batch_size = 6 is not divisible by parallelism.dp * "
            "training.micro_batch_size = 2 * 4 = 8",
        ),
        (
            ParallelConfig(dp=2, micro_batch_num=2),
            dict(world_size=2, global_batch_size=8, micro_batch_size=4),
            "training.global_batch_size = 8 != parallelism.dp * training.micro_batch_size * "
            "parallelism.micro_batch_num = 2 * 4 * 2 = 16",
        ),
        (ParallelConfig(sequence_parallel=True), dict(), "needs tp > 1"),
        (ParallelConfig(zero_stage=3), dict(), "zero_stage = 3"),
        (
            ParallelConfig(tp=2, sequence_parallel=True),
            dict(seq_length=33),
            "train_dataset.seq_length = 33 is not divisible",
        ),
    ],
)
def test_validate_names_the_numbers_that_disagree(pcfg, kwargs, message):
    with pytest.raises(ParallelConfigError) as e:
        validate(pcfg, DEBUG, **kwargs)
    assert message in str(e.value)
    assert "\n" not in str(e.value)


def test_valid_layouts_pass_and_dict_configs_are_checked():
    for p in (
        ParallelConfig(dp=2),
        ParallelConfig(tp=2, sequence_parallel=True),
        ParallelConfig(pp=2, micro_batch_num=4),
    ):
        assert validate(p, DEBUG, world_size=p.world_size) is p
    assert ParallelConfig.from_dict({"dp": 2, "tp": 1}).dp == 2
    with pytest.raises(ParallelConfigError, match="parallelism.dpp: unknown key"):
        ParallelConfig.from_dict({"dpp": 2})
    with pytest.raises(ParallelConfigError, match="parallelism.tp: expected an integer"):
        ParallelConfig.from_dict({"tp": "2"})


def test_rank_mapping_is_a_bijection_with_tp_fastest():
    p = ParallelConfig(dp=2, tp=2, pp=2)
    coords = [rank_coords(r, p) for r in range(8)]
    assert len(set(coords)) == 8
    assert coords[:4] == [(0, 0, 0), (0, 1, 0), (1, 0, 0), (1, 1, 0)]
    g = group_ranks(5, p)  # dp 0, tp 1, pp 1
    assert g["tp"] == (4, 5) and g["dp"] == (5, 7) and g["pp"] == (1, 5)
    assert g["pp_prev"] == (1, 5) and g["pp_next"] == (5,)
    assert g["embed"] == (1, 5) and g["mp"] == (0, 1, 4, 5)


def test_make_groups_creates_each_communicator_once():
    created = []
    p = ParallelConfig(dp=2, pp=2)
    groups = make_groups(1, p, lambda name, ranks: created.append((name, tuple(ranks))))
    assert groups.dp.ranks == (0, 1) and groups.dp.index == 1
    assert groups.pp.ranks == (1, 3) and groups.pp_next.ranks == (1, 3)
    assert len(created) == len({c[1] for c in created})  # pp and pp_next share a communicator
    assert groups.tp.size == 1 and groups.tp.name is None


@pytest.mark.parametrize("stages", [1, 2, 3, 4])
@pytest.mark.parametrize("micro", [1, 2, 4, 7])
def test_1f1b_pairs_every_exchange_and_never_deadlocks(stages, micro):
    done = simulate(stages, micro)
    for s in range(stages):
        fwd = [a[1] for a in done[s] if a[0] == "fwd"]
        bwd = [a[1] for a in done[s] if a[0] == "bwd"]
        assert fwd == list(range(micro)) and bwd == list(range(micro))
        # 1F1B bounds the micro-batches in flight by the number of later stages + 1
        in_flight, peak = 0, 0
        for a in done[s]:
            in_flight += {"fwd": 1, "bwd": -1}.get(a[0], 0)
            peak = max(peak, in_flight)
        assert peak <= min(stages - s, micro)


def test_1f1b_schedule_shape_for_two_stages():
    assert one_f_one_b(1, 2, 2) == [
        ("recv_fwd",),
        ("fwd", 0),
        ("bwd", 0),
        ("send_bwd_recv_fwd",),
        ("fwd", 1),
        ("bwd", 1),
        ("send_bwd",),
    ]


def _full_state(cfg, seed=0):
    rng = np.random.default_rng(seed)
    return {
        n: rng.standard_normal(s.global_shape).astype(np.float32)
        for n, s in tensor_layout(cfg, ParallelConfig()).items()
    }


@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize(
    "src, dst",
    [
        (dict(dp=2), dict()),
        (dict(tp=2), dict()),
        (dict(pp=2), dict()),
        (dict(), dict(tp=2, pp=2)),
        (dict(tp=2, pp=2), dict(dp=2, tp=2)),
        (dict(dp=2, tp=2), dict(pp=2)),
    ],
)
def test_checkpoint_reshards_between_layouts(src, dst, tied):
    cfg = get_preset("debug", tie_embeddings=tied)
    full = _full_state(cfg)
    a, b = ParallelConfig(**src), ParallelConfig(**dst)
    saved = {r: rank_state(full, cfg, a, r) for r in range(a.world_size)}
    # every rank holds only its part: shards are smaller than the full tensors under tp
    if a.tp == 2:
        assert saved[1]["layers.0.attn.wk.weight"].shape == (16, 64)
        assert saved[1]["layers.0.mlp.w2.weight"].shape == (64, 64)
        assert np.array_equal(saved[1]["embed.weight"], full["embed.weight"][128:])
    if a.pp == 2:
        assert (
            "layers.1.attn.wq.weight" not in saved[0]
            and "layers.0.attn.wq.weight" not in saved[a.world_size - 1]
        )
        assert ("embed.weight" in saved[a.world_size - 1]) == tied
    back = assemble_state(saved, cfg, a)
    assert back.keys() == full.keys()
    for n in full:
        np.testing.assert_array_equal(back[n], full[n])
    moved = {r: rank_state(back, cfg, b, r) for r in range(b.world_size)}
    again = assemble_state(moved, cfg, b)
    for n in full:
        np.testing.assert_array_equal(again[n], full[n])


def test_layout_metadata_is_json_and_describes_splits():
    import json

    meta = json.loads(json.dumps(layout_metadata(DEBUG, ParallelConfig(tp=2, pp=2))))
    t = meta["tensors"]
    assert t["layers.1.attn.wo.weight"] == {
        "name": "layers.1.attn.wo.weight",
        "global_shape": [64, 64],
        "tp_axis": 1,
        "pp_stages": [1],
    }
    assert t["embed.weight"]["tp_axis"] == 0 and t["norm.weight"]["tp_axis"] is None
    assert meta["parallel"] == {"dp": 1, "tp": 2, "pp": 2}


def test_assemble_refuses_missing_shards():
    full = _full_state(DEBUG)
    p = ParallelConfig(tp=2)
    saved = {0: rank_state(full, DEBUG, p, 0)}
    with pytest.raises(KeyError, match="no shard from rank 1"):
        assemble_state(saved, DEBUG, p)
