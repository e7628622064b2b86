"""Distributed checkpoints without msrun (issue 16): the files every rank of a
dp2 x tp2 x pp2 layout writes itself (`_ckpt_own.LayoutState` over each rank's blocks,
cut with NumPy), the commit by rank 0, and balanced reads of any block.

The reference for the files: the `safetensors` package's own reader and NumPy assembling
the global tensors from metadata.json's offsets, compared with the full state. The
msrun launches (`test_train_parallel_launch.py`) carry the same code under real ranks.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
from mindloom_train import _checkpoint as ck
from mindloom_train import _ckpt_read
from mindloom_train._ckpt_own import LayoutState


class _Held:
    """A rank's local tensor as the runners hand it over (a MindSpore Parameter has the
    same `asnumpy`); only the write side is exercised here."""

    def __init__(self, a: np.ndarray):
        self.a = a

    def asnumpy(self) -> np.ndarray:
        return self.a


def _shapes(d: int, f: int, v: int, nl: int, nh: int, nkv: int) -> dict[str, tuple[int, ...]]:
    # the Llama tensors by hand (not mindloom_parallel's layout): the independent count
    kv = nkv * (d // nh)
    out = {"embed.weight": (v, d), "norm.weight": (d,)}
    for i in range(nl):
        p = f"layers.{i}."
        out.update({p + "attn_norm.weight": (d,), p + "mlp_norm.weight": (d,),
                    p + "attn.wq.weight": (d, d), p + "attn.wk.weight": (kv, d),
                    p + "attn.wv.weight": (kv, d), p + "attn.wo.weight": (d, d),
                    p + "mlp.w1.weight": (f, d), p + "mlp.w2.weight": (d, f),
                    p + "mlp.w3.weight": (f, d)})  # fmt: skip
    return out


@pytest.fixture(scope="module")
def layout4():
    """dp2 x tp2 x pp2 (8 ranks), tied embeddings, and every rank's own files."""
    from mindloom_model import get_preset
    from mindloom_parallel import ParallelConfig, rank_coords, rank_state, shard_tensor, zero_owners

    mcfg = get_preset("debug", num_layers=4, tie_embeddings=True, vocab_size=66)
    pcfg = ParallelConfig(dp=2, tp=2, pp=2, micro_batch_num=2)
    rng = np.random.default_rng(0)
    shapes = _shapes(
        mcfg.hidden_size,
        mcfg.ffn_hidden_size,
        mcfg.vocab_size,
        4,
        mcfg.num_heads,
        mcfg.num_kv_heads,
    )
    full = {n: rng.standard_normal(s).astype(np.float32) for n, s in shapes.items()}
    full.update({f"{k}.{n}": rng.standard_normal(s).astype(np.float32)
                 for n, s in shapes.items() for k in ("exp_avg", "exp_avg_sq")})  # fmt: skip

    def rank_view(rank: int, zero: bool):
        dp_rank, tp_rank, pp_rank = rank_coords(rank, pcfg)
        local = rank_state(full, mcfg, pcfg, rank)
        names = list(local)
        groups = SimpleNamespace(dp_rank=dp_rank, tp_rank=tp_rank, pp_rank=pp_rank, rank=rank,
                                 world_size=8)  # fmt: skip
        owners = zero_owners([local[n].size for n in names], 2) if zero else [dp_rank] * len(names)
        state = LayoutState(
            mcfg, pcfg, groups, names, [_Held(local[n]) for n in names], [None] * len(names)
        )
        layout = state.layout
        state.moments = [
            tuple(_Held(shard_tensor(full[f"{k}.{n}"], layout[n], tp_rank, 2))
                  for k in ("exp_avg", "exp_avg_sq")) if owners[i] == dp_rank else None
            for i, n in enumerate(names)
        ]  # fmt: skip
        return state

    return SimpleNamespace(mcfg=mcfg, pcfg=pcfg, full=full, rank_view=rank_view, shapes=shapes)


def _save(layout4, save: Path, step: int, zero: bool, ranks=range(8), twice: bool = False):
    for r in ranks:
        own = layout4.rank_view(r, zero).own_shards(zero=zero)
        if twice and r == 2:  # rank 2 (dp 1 of rank 0's block) writes rank 0's files again
            first = layout4.rank_view(0, zero).own_shards(zero=zero)
            own.files = {k.replace("-0000000-", "-0000002-"): v for k, v in first.files.items()}
            own.tensors = json.loads(json.dumps(first.tensors).replace("-0000000-", "-0000002-"))
        ck.write_rank_files(save, step, own.files, own.tensors, r, 8)
    meta = ck.default_metadata({}, 8)
    return ck.commit_rank_files(save, step, 8, meta, {"consumed_samples": 8 * step,
                                                        "global_batch_size": 8})  # fmt: skip


@pytest.mark.parametrize("zero", [False, True])
def test_every_rank_writes_its_own_blocks_once_and_the_reference_reader_reassembles_them(
    layout4, tmp_path, zero
):
    from safetensors.numpy import load_file

    step_dir = _save(layout4, tmp_path, 3, zero)
    assert ck.read_tracker(tmp_path) == 3
    meta = json.loads((step_dir / "metadata.json").read_text())
    # the reference: safetensors' own reader, NumPy placing every chunk at its offsets
    files = {p.name: load_file(p) for p in step_dir.glob("*.safetensors")}
    covered = {}
    for name, entry in meta["tensors"].items():
        out = np.full(entry["global_shape"], np.nan, np.float32)
        for c in entry["chunks"]:
            part = files[c["file"]][c["key"]]
            idx = tuple(slice(o, o + s) for o, s in zip(c["offset"], part.shape))
            assert np.isnan(out[idx]).all(), (name, c)  # no block twice
            out[idx] = part
        covered[name] = out
    assert set(covered) == set(layout4.full)
    for name, ref in layout4.full.items():
        np.testing.assert_array_equal(covered[name], ref, err_msg=name)
    # who wrote: weights only by the first replica; moments by their holders (ZeRO-1:
    # both replicas write optimizer files)
    writers = sorted(p.name for p in step_dir.glob("*.safetensors"))
    assert [w for w in writers if w.startswith("model-")] == [
        ck.shard_name("model", r, 8) for r in (0, 1, 4, 5)
    ]
    optim_ranks = {int(w.split("-")[1]) for w in writers if w.startswith("optim-")}
    assert optim_ranks == ({0, 1, 2, 3, 4, 5, 6, 7} if zero else {0, 1, 4, 5})
    assert not list(step_dir.glob("index-*"))  # merged into metadata.json


def test_a_replica_writing_twice_or_a_rank_missing_is_never_committed(layout4, tmp_path):
    _save(layout4, tmp_path, 2, zero=False)
    with pytest.raises(ck.CheckpointError, match="chunks hold .* elements"):
        _save(layout4, tmp_path, 4, zero=False, twice=True)
    assert ck.read_tracker(tmp_path) == 2 and not (tmp_path / ck.step_dirname(4)).exists()
    with pytest.raises(ck.CheckpointError, match="rank 7 did not finish"):
        _save(layout4, tmp_path, 6, zero=False, ranks=range(7))
    assert ck.read_tracker(tmp_path) == 2 and ck.complete_steps(tmp_path) == [2]


def _owned_bytes(shapes, tp_rank: int, pp_rank: int, pp_layers: dict[int, list[int]]) -> int:
    """fp32 bytes of weights + both moments of the blocks a (tp, pp) rank holds, from the
    shapes: column-parallel linears and the embedding split on axis 0, row-parallel on
    axis 1, norms whole; the tied embedding on the first and the last stage."""
    total = 0
    for name, shape in shapes.items():
        if name.startswith("layers."):
            if int(name.split(".")[1]) not in pp_layers[pp_rank]:
                continue
        elif name == "norm.weight" and pp_rank != 1:
            continue
        n = math.prod(shape)
        if len(shape) == 2:
            n //= 2
        total += 3 * 4 * n
    return total


@pytest.mark.parametrize("target", ["same", "tp1_pp1", "tp2_pp1", "from_one_process"])
def test_a_rank_reads_only_the_bytes_of_the_blocks_it_holds(layout4, tmp_path, target):
    """Balanced loading of the 8-rank checkpoint: the same layout (each rank its blocks),
    one process (everything), tp2 x pp1 (whole stages); and the 8-rank layout from a
    one-process (gathered, one file set) checkpoint: halves of whole tensors, a
    row-parallel tensor's column half being no contiguous byte range."""
    from mindloom_parallel import ParallelConfig, rank_coords, tensor_layout

    if target == "from_one_process":
        full = layout4.full
        weights = {k: v for k, v in full.items() if not k.startswith("exp_avg")}
        shards = {ck.shard_name("model", 0, 1): weights,
                  ck.shard_name("optim", 0, 1): {k: v for k, v in full.items() if k not in weights}}  # fmt: skip
        ck.save_checkpoint(tmp_path, 5, shards, {"consumed_samples": 40})
    else:
        _save(layout4, tmp_path, 5, zero=True)
    step = ck.open_checkpoint(tmp_path)
    shapes = layout4.shapes
    if target in ("same", "from_one_process"):
        pcfg, ranks = layout4.pcfg, range(8)
    elif target == "tp1_pp1":
        pcfg, ranks = ParallelConfig(), [0]
    else:
        pcfg, ranks = ParallelConfig(tp=2), [0, 1]
    layout = tensor_layout(layout4.mcfg, pcfg)
    for r in ranks:
        dp_rank, tp_rank, pp_rank = rank_coords(r, pcfg)
        boxes = {}
        for n, spec in layout.items():
            if pp_rank not in spec.pp_stages:
                continue
            local = spec.local_shape(pcfg.tp)
            off = [0] * len(local)
            if spec.tp_axis is not None:
                off[spec.tp_axis] = tp_rank * local[spec.tp_axis]
            for k in ("", "exp_avg.", "exp_avg_sq."):
                boxes[k + n] = (tuple(off), tuple(local))
        _ckpt_read.reset_counters()
        got = step.read_boxes(boxes)
        for key, (off, shp) in boxes.items():
            idx = tuple(slice(o, o + s) for o, s in zip(off, shp))
            np.testing.assert_array_equal(got[key], layout4.full[key][idx], err_msg=key)
        if target == "tp1_pp1":
            want = 3 * 4 * sum(math.prod(s) for s in shapes.values())
        elif target in ("same", "from_one_process"):
            want = _owned_bytes(shapes, tp_rank, pp_rank, {0: [0, 1], 1: [2, 3]})
        else:
            want = _owned_bytes(shapes, tp_rank, 1, {1: [0, 1, 2, 3]})
        assert _ckpt_read.BYTES_READ["tensor"] == want, (target, r)
