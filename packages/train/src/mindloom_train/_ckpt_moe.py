"""What one rank of a DeepSeek-V3 layout (dp, tp, ep, pp, ZeRO-1 under ep) writes into a
distributed checkpoint and what it reads back (`_ckpt_dist`'s `own_shards` / `load_plan`
protocol; Llama's is `_ckpt_own.LayoutState`).

Write: each block once in the world. A tensor every rank of a replica holds whole (norms,
routers, the vocabulary, the biases) by data-parallel rank 0, tensor-parallel rank 0; a
tensor split over tp (`deepseek_tp_plan`) by data-parallel rank 0 of each tp rank, at its
tp offset; a routed-expert block by the first rank of its expert-data-parallel group
(tp rank 0: every tp rank holds the same blocks), at its global expert offset on axis 0.
The AdamW moments go with their weights, or under ZeRO-1 with the rank that owns them.
A pipeline stage skips what an earlier stage writes (the embedding's copy on the last).
Each block is a chunk of metadata.json (file, key, global offset, shape), so the
checkpoint reads back as the one-process tensors (`Checkpoint.load_tensors`) and any
layout, one process included, resumes it.

Read: the global box of every tensor this rank holds, and of the moments it holds.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from mindloom_train._ckpt_files import shard_name

MOMENTS = ("exp_avg.", "exp_avg_sq.")


@dataclass(frozen=True)
class _Spec:
    global_shape: tuple


@dataclass(frozen=True)
class MoESplit:
    """How this rank's tensors sit in the global ones: ``tp_axis`` {name: split axis} with
    this rank's ``tp_index`` of ``tp``; routed experts ``[expert_start, + expert_count)``
    of ``ep`` blocks, ``first_expert_replica`` when this rank writes its blocks; ``zero``:
    the moments are held by their ZeRO-1 owners."""

    tp_axis: dict
    tp_index: int
    tp: int
    expert_start: int
    expert_count: int
    ep: int
    first_expert_replica: bool
    zero: bool = False


class MoELayoutState:
    """``tensors``: (global name, parameter, (exp_avg, exp_avg_sq) or None) for every tensor
    this rank holds (None: a buffer, or moments another rank owns); ``shapes``: every
    tensor of the whole model with its global shape; ``trainable``: the names that have
    moments; ``skip``: names an earlier pipeline stage writes."""

    def __init__(self, groups, tensors: list, shapes: dict, trainable: set, split: MoESplit,
                 skip: frozenset = frozenset()):  # fmt: skip
        from mindloom_parallel import is_expert_param

        self.groups, self.tensors, self.split, self.skip = groups, tensors, split, skip
        self.layout = {n: _Spec(tuple(s)) for n, s in shapes.items()}
        self.trainable = trainable
        self.is_expert = is_expert_param

    def _box(self, name: str) -> tuple[tuple, tuple]:
        s = self.split
        shape = list(self.layout[name].global_shape)
        off = [0] * len(shape)
        if self.is_expert(name):
            off[0], shape[0] = s.expert_start, s.expert_count
        axis = s.tp_axis.get(name)
        if axis is not None:
            shape[axis] //= s.tp
            off[axis] = s.tp_index * shape[axis]
        return tuple(off), tuple(shape)

    def _writes_weight(self, name: str) -> bool:
        s, g = self.split, self.groups
        if name in self.skip:
            return False
        if self.is_expert(name):
            return s.first_expert_replica and s.tp_index == 0
        return g.dp_rank == 0 and (name in s.tp_axis or s.tp_index == 0)

    def _writes_moments(self, name: str) -> bool:
        s = self.split
        if not s.zero:
            return self._writes_weight(name)
        # ZeRO-1: the owner holds them; one copy over tp unless the tensor is split
        return name not in self.skip and (name in s.tp_axis or s.tp_index == 0)

    def _split_entry(self, name: str):
        s = self.split
        if self.is_expert(name):
            return {"ep_axis": 0, "ep": s.ep}
        if name in s.tp_axis:
            return {"tp_axis": s.tp_axis[name], "tp": s.tp}
        return None

    def own_shards(self):
        from mindloom_train._ckpt_own import OwnShards

        g = self.groups
        out = OwnShards()
        mfile = shard_name("model", g.rank, g.world_size)
        ofile = shard_name("optim", g.rank, g.world_size)
        for name, p, moments in self.tensors:
            if self._writes_weight(name):
                self._add(out, mfile, name, name, np.asarray(p.asnumpy(), np.float32))
            if moments is not None and self._writes_moments(name):
                for prefix, m in zip(MOMENTS, moments):
                    self._add(out, ofile, prefix + name, name, m.asnumpy())
        return out

    def _add(self, out, fname: str, key: str, name: str, arr: np.ndarray) -> None:
        off, shape = self._box(name)
        out.add_block(fname, key, arr, self.layout[name].global_shape, off, shape,
                      self._split_entry(name))  # fmt: skip

    def expected_names(self) -> set[str]:
        """Every tensor a checkpoint of this model holds: weights, buffers, moments."""
        return set(self.layout) | {p + n for n in self.trainable for p in MOMENTS}

    def boxes(self, weights_only: bool = False) -> dict[str, tuple]:
        out = {}
        for name, _, moments in self.tensors:
            out[name] = self._box(name)
            if moments is not None and not weights_only:
                out[MOMENTS[0] + name] = out[MOMENTS[1] + name] = out[name]
        return out

    def held_bytes(self, weights_only: bool = False) -> int:
        return sum(4 * int(np.prod(s)) for _, s in self.boxes(weights_only).values())

    def load(self, arrays: dict[str, np.ndarray], weights_only: bool = False) -> None:
        """Assign this rank's blocks in place (the compiled graphs hold these parameters)."""
        import mindspore as ms
        from mindspore import ops

        for name, p, moments in self.tensors:
            ops.assign(p, ms.Tensor(arrays[name], p.dtype))
            if moments is not None and not weights_only:
                for prefix, m in zip(MOMENTS, moments):
                    ops.assign(m, ms.Tensor(np.asarray(arrays[prefix + name], np.float32)))
