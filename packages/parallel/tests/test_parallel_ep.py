"""Expert parallel: the layout rule (no msrun), the groups, the checkpoint metadata, and the
per-rank expert computation of one process split by hand against the whole layer.

The exchange itself (collectives and their custom backward) runs under real msrun in
packages/train/tests/test_train_expert_parallel.py, against the one-process run."""

from __future__ import annotations

import pytest
from mindloom_parallel import ParallelConfigError, ParallelDims
from mindloom_parallel._ep import ep_group_ranks, ep_traffic, expert_block
from mindloom_parallel._layout import layout_metadata

MOE = {"family": "deepseek_v3", "n_routed_experts": 8, "num_heads": 4, "vocab_size": 512,
       "ffn_hidden_size": 128, "num_layers": 2}  # fmt: skip
LLAMA = {"num_heads": 4, "vocab_size": 512, "ffn_hidden_size": 128, "num_layers": 2}

# (parallelism section, model, message)
BAD_EP = [
    ({"ep": 0}, None, "parallelism.ep = 0: must be an integer >= 1"),
    ({"ep": 2}, MOE,
     "parallelism.ep = 2 does not divide parallelism.dp = 1: expert parallel is carved out "
     "of data parallel (expert-data-parallel size = dp / ep)"),
    ({"dp": 4, "ep": 3}, MOE,
     "parallelism.ep = 3 does not divide parallelism.dp = 4: expert parallel is carved out "
     "of data parallel (expert-data-parallel size = dp / ep)"),
    ({"dp": 2, "ep": 2}, LLAMA,
     "parallelism.ep = 2 needs a MoE model (model.family = deepseek_v3 with routed "
     "experts), found family llama with n_routed_experts = 0"),
    ({"dp": 6, "ep": 6}, MOE, "model.n_routed_experts = 8 is not divisible by parallelism.ep = 6"),
]  # fmt: skip


@pytest.mark.parametrize("section, model, message", BAD_EP)
def test_bad_expert_parallel_layouts_give_one_exact_line(section, model, message):
    dims = ParallelDims.from_section(section)
    with pytest.raises(ParallelConfigError) as e:
        dims.check(model)
    assert str(e.value) == message


def test_ep_is_carved_out_of_dp():
    dims = ParallelDims(dp=4, ep=2).check(MOE, world_size=4, global_batch_size=8,
                                          micro_batch_size=2)  # fmt: skip
    assert dims.world_size == 4 and dims.expert_dp == 2  # ep adds no ranks
    assert not dims.needs_engine
    assert ParallelDims(dp=2, ep=2).expert_dp == 1
    with pytest.raises(ParallelConfigError, match="parallelism.ep: expected an integer"):
        ParallelDims.from_dict({"ep": "2"})
    with pytest.raises(ParallelConfigError, match=r"world size 2 != dp\*tp\*pp = 1\*1\*1"):
        ParallelDims(ep=1).check(MOE, world_size=2)


def test_dp_not_given_is_derived_from_the_world_size():
    """torchtitan's dp_shard = -1: a section without dp, read with a world size, gets
    world / (tp*pp); a given dp keeps its meaning; no world size (one process): dp 1."""
    assert ParallelDims.from_section({"ep": 2}, world_size=2) == ParallelDims(dp=2, ep=2)
    assert ParallelDims.from_section({"tp": 2}, world_size=8).dp == 4
    assert ParallelDims.from_section({"tp": 2, "pp": 2}, world_size=4).dp == 1
    assert ParallelDims.from_section({"dp": 1}, world_size=2).dp == 1  # then check refuses
    assert ParallelDims.from_section({"ep": 2}).dp == 1
    ParallelDims.from_section({"ep": 2}, world_size=4).check(MOE, world_size=4)  # dp 4, edp 2
    with pytest.raises(ParallelConfigError) as e:
        ParallelDims.from_section({"tp": 2, "ep": 2}, world_size=3)
    assert str(e.value) == (
        "world size 3 is not divisible by tp*pp = 2*1 = 2: parallelism.dp is not given, so "
        "it is derived as world / (tp*pp)"
    )
    with pytest.raises(ParallelConfigError, match="ep = 2 does not divide parallelism.dp = 1"):
        ParallelDims.from_section({"tp": 2, "ep": 2}, world_size=2).check(MOE, world_size=2)


def test_ep_groups_are_consecutive_dp_ranks_and_edp_the_same_experts():
    # dp 4, ep 2: ep groups {0,1} {2,3}; ranks 0 and 2 hold experts 0-3 (edp group)
    p = ParallelDims(dp=4, ep=2)
    assert [ep_group_ranks(r, p) for r in range(4)] == [
        {"ep": (0, 1), "edp": (0, 2)}, {"ep": (0, 1), "edp": (1, 3)},
        {"ep": (2, 3), "edp": (0, 2)}, {"ep": (2, 3), "edp": (1, 3)},
    ]  # fmt: skip
    # under tp the data-parallel neighbours are tp apart (rank = dp_rank * tp + tp_rank)
    p = ParallelDims(dp=2, tp=2, ep=2)
    assert ep_group_ranks(1, p) == {"ep": (1, 3), "edp": (1,)}
    assert [expert_block(8, 2, i) for i in range(2)] == [(0, 4), (4, 4)]


def test_layout_metadata_records_the_expert_split():
    meta = layout_metadata({**MOE, "hidden_size": 64, "num_kv_heads": 4,
                            "tie_embeddings": False}, ParallelDims(dp=2, ep=2))  # fmt: skip
    ep = meta["expert_parallel"]
    assert ep["ep"] == 2 and ep["expert_dp"] == 1 and ep["expert_axis"] == 0
    assert ep["ep_rank_experts"] == [[0, 4], [4, 8]]
    assert "expert_parallel" not in layout_metadata(
        {**MOE, "hidden_size": 64, "num_kv_heads": 4, "tie_embeddings": False}, ParallelDims()
    )


def test_ep_traffic_counts_the_slots_an_all_to_all_would_move():
    # 2 routers x 4 experts, ep 2: rank 1 holds experts 2, 3
    local = [[3, 1, 0, 4], [2, 2, 2, 2]]
    glob = [[5, 2, 1, 8], [4, 4, 4, 4]]
    sent, received = ep_traffic(local, glob, 2, 1)
    assert sent == (3 + 1) + (2 + 2)  # its slots on experts 0, 1
    assert received == (1 - 0 + 8 - 4) + (4 - 2 + 4 - 2)  # others' slots on 2, 3


def test_per_rank_expert_blocks_sum_to_the_whole_layer_forward_and_backward():
    """One process, the ep split done by hand: each 'rank' keeps its block of experts and
    computes only the slots routed to them (the rest go to the trash row); the sum of the
    partial outputs is the whole layer's output, and so are the input and weight
    gradients (the combine's all-reduce is this sum)."""
    import mindspore as ms
    import numpy as np
    from mindloom_model import DeepseekV3, get_preset
    from mindspore import Parameter, Tensor, ops

    ms.set_context(mode=ms.PYNATIVE_MODE)
    cfg = get_preset("deepseek-v3-debug", vocab_size=64, num_layers=2, init_std=0.3)
    moe = DeepseekV3(cfg).layers[1].mlp
    rng = np.random.default_rng(0)
    flat = Tensor(rng.standard_normal((24, cfg.hidden_size)).astype(np.float32))
    cot = Tensor(rng.standard_normal((24, cfg.hidden_size)).astype(np.float32))
    idx, w, _ = moe.gate(flat)
    one = ops.one_hot(idx, moe.e, Tensor(1.0, ms.float32), Tensor(0.0, ms.float32))
    full_w = {k: getattr(moe.experts, k).asnumpy() for k in ("w1", "w2", "w3")}

    def run(block):
        def f(x, wt):
            if block is None:
                return moe._dropless_blocks(x, one, wt)
            s, c = block
            return moe._dropless_blocks(x, one[:, :, s : s + c], wt, partial=True)

        y = f(flat, w)
        gx, gw = ms.grad(lambda x, wt: (f(x, wt) * cot).sum(), grad_position=(0, 1))(flat, w)
        return y.asnumpy(), gx.asnumpy(), gw.asnumpy()

    want = run(None)
    got = [np.zeros_like(a) for a in want]
    for r in range(2):
        s, c = expert_block(moe.e, 2, r)
        for k, full in full_w.items():
            setattr(moe.experts, k, Parameter(Tensor(full[s : s + c]), name=k))
        part = run((s, c))
        got = [g + p for g, p in zip(got, part)]
    # each token's k expert outputs are summed in another order: fp32 rounding only
    for name, a, b in zip(("y", "dx", "dw"), got, want):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6, err_msg=name)
    assert np.abs(want[0]).max() > 0.01


def test_ep_capacity_drops_at_the_source_like_one_process_and_numpy():
    """Capacity factor 1 under ep 2, done by hand in one process: each 'rank' routes its
    own 16 tokens and drops at the source (the rows it sends carry expert id -1 for a
    dropped slot); the gather is both ranks' rows concatenated; each rank's block of
    experts runs on the slots sent to it; the combine is the sum of the partial outputs.
    References: NumPy's drop rule (per rank, an expert keeps its first cap routed tokens),
    NumPy's SwiGLU experts on the kept slots, and the one-process capacity layer on each
    rank's tokens (what one process computes on that micro-batch)."""
    import math

    import mindspore as ms
    import numpy as np
    from mindloom_model import DeepseekV3, get_preset
    from mindspore import Parameter, Tensor, ops

    ms.set_context(mode=ms.PYNATIVE_MODE)
    cfg = get_preset("deepseek-v3-debug", vocab_size=64, num_layers=2, init_std=0.3,
                     moe_capacity_factor=1.0)  # fmt: skip
    moe = DeepseekV3(cfg).layers[1].mlp
    moe.set_train(True)
    n, d, e, k = 16, cfg.hidden_size, moe.e, moe.k
    cap = math.ceil(1.0 * n * k / e)
    rng = np.random.default_rng(1)
    xs = [rng.standard_normal((n, d)).astype(np.float32) for _ in range(2)]
    full = {name: getattr(moe.experts, name).asnumpy() for name in ("w1", "w2", "w3")}
    on, off = Tensor(1.0, ms.float32), Tensor(0.0, ms.float32)
    sent, keeps, routes, one_process = [], [], [], []
    for x in xs:
        y1, _, drop1, _ = moe(Tensor(x).reshape(1, n, d))  # one process, the same capacity
        shared = moe.shared(Tensor(x)).asnumpy()
        one_process.append((y1.asnumpy().reshape(n, d) - shared, float(drop1)))
        idx, w, _ = moe.gate(Tensor(x))
        assign = ops.one_hot(idx, e, on, off).sum(1)
        rows, drop = moe._ep_capacity_rows(Tensor(x), idx, w, assign)
        idx, w, rows = idx.asnumpy(), w.asnumpy(), rows.asnumpy()
        keep, count = np.zeros((n, k), bool), np.zeros(e, int)
        for t in range(n):  # NumPy: earlier tokens first, cap per expert (one per token)
            for j in range(k):
                keep[t, j] = count[idx[t, j]] < cap
                count[idx[t, j]] += 1
        np.testing.assert_array_equal(rows[:, d + k :], np.where(keep, idx, -1))
        assert float(drop) == (~keep).sum() == one_process[-1][1]
        sent.append(rows)
        keeps.append(keep)
        routes.append((idx, w))
    assert sum(int((~kp).sum()) for kp in keeps) > 0  # capacity 1 drops some slots
    gathered = Tensor(np.concatenate(sent))
    part = np.zeros((2 * n, d), np.float32)
    try:
        for r in range(2):
            s, c = expert_block(e, 2, r)
            for name, a in full.items():
                setattr(moe.experts, name, Parameter(Tensor(a[s : s + c]), name=name))
            moe.ep_start, moe.ep_local = s, c
            part += moe._ep_capacity_experts(gathered, n, ms.float32).asnumpy()
    finally:
        for name, a in full.items():
            setattr(moe.experts, name, Parameter(Tensor(a), name=name))
        moe.ep_start, moe.ep_local = 0, e

    def swiglu(x, ex):
        a, b = x @ full["w1"][ex].T, x @ full["w3"][ex].T
        return (a / (1 + np.exp(-a)) * b) @ full["w2"][ex].T

    for r in range(2):
        (idx, w), keep, x = routes[r], keeps[r], xs[r].astype(np.float64)
        want = np.zeros((n, d))
        for t in range(n):
            for j in range(k):
                if keep[t, j]:
                    want[t] += w[t, j] * swiglu(x[t], idx[t, j])
        got = part[r * n : (r + 1) * n]
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-6, err_msg=f"rank {r}")
        # y - shared of the one-process layer: fp32 rounding of outputs up to ~15
        np.testing.assert_allclose(got, one_process[r][0], rtol=1e-5, atol=1e-5)


def test_slice_tp_shards_cuts_each_split_tensor_and_its_moments_by_hand():
    """The load side of a tp x ep checkpoint: every split tensor and its moments cut to
    this rank's block on the plan's axis (NumPy's own split as the reference), the rest
    untouched, and a tensor the axis cannot split named in one line."""
    import numpy as np
    from mindloom_parallel import slice_tp_shards

    rng = np.random.default_rng(0)
    arrays = {"a.weight": rng.normal(size=(4, 6)), "exp_avg.a.weight": rng.normal(size=(4, 6)),
              "exp_avg_sq.b.weight": rng.normal(size=(3, 8)), "b.weight": rng.normal(size=(3, 8)),
              "norm.weight": rng.normal(size=(5,))}  # fmt: skip
    axes = {"a.weight": 0, "b.weight": 1}
    for index in range(2):
        got = slice_tp_shards(arrays, axes, index, 2)
        assert sorted(got) == sorted(arrays)
        for key in ("a.weight", "exp_avg.a.weight"):
            np.testing.assert_array_equal(got[key], np.split(arrays[key], 2, 0)[index])
        for key in ("b.weight", "exp_avg_sq.b.weight"):
            np.testing.assert_array_equal(got[key], np.split(arrays[key], 2, 1)[index])
        assert got["norm.weight"] is arrays["norm.weight"]
    assert slice_tp_shards(arrays, axes, 0, 1)["a.weight"] is arrays["a.weight"]
    with pytest.raises(ValueError, match=r"^tensor 'a.weight' has shape \[4, 6\], which tp = 3 "
                       r"cannot split on axis 0$"):  # fmt: skip
        slice_tp_shards(arrays, axes, 0, 3)
