"""The compiled data-parallel step agrees on stop and time-limit through the stop slot of its
hyper vector, which the step averages over the ranks (`_step.MeanOver`: a float32 sum times
1/dp). Every combination of ranks stopping and ranks out of time must decode to the OR of
each flag over the ranks, as the engine's all-gather gives."""

from __future__ import annotations

import itertools

import numpy as np
from mindloom_train._runner import _decode_flags, _encode_flags


def test_every_combination_of_rank_flags_decodes_to_their_or():
    for dp in (1, 2, 3, 4, 8, 16, 64):
        combos = [(False, False), (True, False), (False, True), (True, True)]
        # every assignment for small dp; for large dp, a spread of counts
        if dp <= 4:
            worlds = itertools.product(combos, repeat=dp)
        else:
            worlds = [[combos[(i * k) % 4] for i in range(dp)] for k in range(1, 9)]
            worlds += [[(True, True)] * dp, [(False, True)] * dp, [(False, False)] * dp]
        for flags in worlds:
            codes = np.array([_encode_flags(s, t, dp) for s, t in flags], np.float32)
            mean = np.float32(codes.sum(dtype=np.float32) * np.float32(1.0 / dp))
            want = (any(s for s, _ in flags), any(t for _, t in flags))
            assert _decode_flags(float(mean), dp) == want, (dp, flags)


def test_tensor_parallel_compiles_in_graph_mode_and_keeps_the_engine_in_pynative():
    """The one choice of step for tp (issue 16): tp alone, with sequence parallel or with
    ZeRO-1 (session 16) is the compiled tp step in graph mode; pynative keeps the engine
    (ParallelDims.needs_engine), pipeline stages are the compiled stages' (`_pp_step`),
    plain data parallel was compiled before."""
    from mindloom_parallel import ParallelDims
    from mindloom_train._tp_step import compiled_tp

    cases = [
        (dict(tp=2), "graph", True),
        (dict(tp=2, sequence_parallel=True), "graph", True),
        (dict(tp=2), "pynative", False),
        (dict(tp=2, pp=2), "graph", False),
        (dict(tp=2, dp=2, zero_stage=1), "graph", True),
        (dict(tp=2, dp=2, zero_stage=1, sequence_parallel=True), "graph", True),
        (dict(tp=2, dp=2, zero_stage=1), "pynative", False),
        (dict(dp=2), "graph", False),  # the data-parallel compiled step, not this one
    ]
    for kw, mode, want in cases:
        dims = ParallelDims(**kw)
        assert compiled_tp(dims, mode) is want, (kw, mode)
        assert dims.needs_engine == (kw.get("tp", 1) > 1 or "pp" in kw or "zero_stage" in kw)


def test_zero1_compiles_for_plain_data_parallel_in_graph_mode_only():
    """The one choice of step for ZeRO-1 (issue 16): dp > 1 with zero_stage 1 and neither
    tp nor pp is the compiled data-parallel step (_zero_step) in graph mode; with tp it is
    the compiled tp step's (its update `_zero_step.CompiledZero` on the local shards), with
    pp the compiled stages'; pynative or dp = 1 keep the engine; the data-parallel and the
    tp step never both claim a layout."""
    from mindloom_parallel import ParallelDims
    from mindloom_train._tp_step import compiled_tp
    from mindloom_train._zero_step import compiled_zero

    cases = [
        (dict(dp=2, zero_stage=1), "graph", True),
        (dict(dp=4, zero_stage=1), "graph", True),
        (dict(dp=2, zero_stage=1), "pynative", False),
        (dict(dp=2, tp=2, zero_stage=1), "graph", False),
        (dict(dp=2, pp=2, zero_stage=1), "graph", False),
        (dict(zero_stage=1), "graph", False),
        (dict(dp=2), "graph", False),
    ]
    for kw, mode, want in cases:
        dims = ParallelDims(**kw)
        assert compiled_zero(dims, mode) is want, (kw, mode)
        assert not (compiled_zero(dims, mode) and compiled_tp(dims, mode))
