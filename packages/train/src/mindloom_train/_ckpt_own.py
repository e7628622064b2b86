"""What one rank of a tensor / pipeline / ZeRO-1 layout writes into a distributed
checkpoint and what it reads back (issue 16: per-rank writes, balanced loading).

Write: the first data-parallel replica of each (tp, pp) position writes its weights to
`model-RANK-WORLD.safetensors`; the AdamW moments go to `optim-RANK-WORLD.safetensors` of
the rank that holds them (ZeRO-1: the owner of each parameter; otherwise the first
replica). A tensor a pipeline layout holds on several stages (the tied embedding) is
written by its first stage only, one every tensor-parallel rank holds whole (the norms)
by TP rank 0 only. Each written block is a chunk of metadata.json (file,
key, global offset, shape), so the files and offsets are the gathered checkpoint's
(`mindloom_parallel.chunk_metadata`) for the same layout.

Read: the global box of every local tensor this rank holds (its TP slice of the tensors
of its stage, the moments it owns) for `Checkpoint.read_boxes`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from mindloom_train._ckpt_files import shard_name

MOMENTS = ("exp_avg.", "exp_avg_sq.")


@dataclass
class OwnShards:
    """This rank's files ({file: {key: array}}) and their metadata.json entries (the
    chunks this rank writes, per tensor)."""

    files: dict[str, dict[str, np.ndarray]] = field(default_factory=dict)
    tensors: dict[str, dict] = field(default_factory=dict)

    def add(self, fname: str, key: str, spec, tp_rank: int, tp: int, arr: np.ndarray) -> None:
        local = list(spec.local_shape(tp))
        off = [0] * len(local)
        if spec.tp_axis is not None:
            off[spec.tp_axis] = tp_rank * local[spec.tp_axis]
        split = {"tp_axis": spec.tp_axis, "tp": tp, "pp_stages": list(spec.pp_stages)}
        self.add_block(fname, key, arr, spec.global_shape, off, local, split)

    def add_block(self, fname: str, key: str, arr: np.ndarray, global_shape, offset, shape,
                  split) -> None:  # fmt: skip
        """`arr` as the block of `key` at `offset` (its expected `shape`) of a tensor of
        `global_shape`; `split` is metadata.json's description, the same on every rank."""
        if list(arr.shape) != list(shape):
            raise ValueError(f"{key}: local shape {list(arr.shape)} != layout's {list(shape)}")
        self.files.setdefault(fname, {})[key] = arr
        entry = self.tensors.setdefault(key, {
            "file": fname, "dtype": str(arr.dtype), "global_shape": list(global_shape),
            "split": split, "chunks": [],
        })  # fmt: skip
        entry["chunks"].append({"file": fname, "key": key, "offset": list(offset),
                                "shape": list(shape)})  # fmt: skip


def _local_box(spec, tp_rank: int, tp: int):
    local = spec.local_shape(tp)
    off = [0] * len(local)
    if spec.tp_axis is not None:
        off[spec.tp_axis] = tp_rank * local[spec.tp_axis]
    return tuple(off), tuple(local)


class LayoutState:
    """One rank's tensors under a layout: `names[i]` (global names) with `weights[i]`
    (its local parameters) and `moments[i]` ((exp_avg, exp_avg_sq) Parameters, or None
    where another data-parallel rank holds them, ZeRO-1)."""

    def __init__(self, mcfg, pcfg, groups, names, weights, moments):
        from mindloom_parallel import tensor_layout

        self.layout = tensor_layout(mcfg, pcfg)
        self.groups, self.names, self.weights, self.moments = groups, names, weights, moments
        self.tp_rank, self.tp = groups.tp_rank, pcfg.tp

    def _first_holder(self, name: str) -> bool:
        """Whether this rank writes `name`'s block when the first replica does: the first
        stage holding it, and tensor-parallel rank 0 for a tensor every TP rank holds whole."""
        spec, g = self.layout[name], self.groups
        return g.pp_rank == spec.pp_stages[0] and (spec.tp_axis is not None or g.tp_rank == 0)

    def own_shards(self, zero: bool) -> OwnShards:
        """The blocks this rank writes (moments: every holder under ZeRO-1, since each
        holds its own; else the first replica)."""
        g = self.groups
        world, rank = g.world_size, g.rank
        out = OwnShards()
        mfile, ofile = shard_name("model", rank, world), shard_name("optim", rank, world)
        for n, p, mv in zip(self.names, self.weights, self.moments):
            spec = self.layout[n]
            if not self._first_holder(n):
                continue
            if g.dp_rank == 0:
                out.add(mfile, n, spec, self.tp_rank, self.tp, np.asarray(p.asnumpy(), np.float32))
            if mv is not None and (zero or g.dp_rank == 0):
                for prefix, m in zip(MOMENTS, mv):
                    out.add(ofile, prefix + n, spec, self.tp_rank, self.tp, m.asnumpy())
        return out

    def expected_names(self) -> set[str]:
        """Every tensor a checkpoint of this model must hold (any layout)."""
        return set(self.layout) | {p + n for n in self.layout for p in MOMENTS}

    def boxes(self, weights_only: bool = False) -> dict[str, tuple]:
        """{global name: (global offset, local shape)} of every tensor this rank holds."""
        out = {}
        for n, mv in zip(self.names, self.moments):
            box = _local_box(self.layout[n], self.tp_rank, self.tp)
            out[n] = box
            if mv is not None and not weights_only:
                out[MOMENTS[0] + n] = out[MOMENTS[1] + n] = box
        return out

    def held_bytes(self, weights_only: bool = False) -> int:
        """The fp32 bytes of `boxes`: what a balanced load reads."""
        return sum(4 * int(np.prod(s)) for _, s in self.boxes(weights_only).values())

    def load(self, arrays: dict[str, np.ndarray], weights_only: bool = False) -> None:
        """Assign this rank's blocks (from `boxes`) in place: the compiled graphs and the
        optimizer hold these very parameters."""
        import mindspore as ms
        from mindspore import ops

        for n, p, mv in zip(self.names, self.weights, self.moments):
            ops.assign(p, ms.Tensor(arrays[n], p.dtype))
            if mv is not None and not weights_only:
                for prefix, m in zip(MOMENTS, mv):
                    ops.assign(m, ms.Tensor(np.asarray(arrays[prefix + n], np.float32)))
