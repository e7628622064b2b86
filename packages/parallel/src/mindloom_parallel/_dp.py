"""Data parallel: each rank's slice of the global batch, bucketed gradient all-reduce, and
ZeRO-1 (optimizer state sharded over the data-parallel group).
"""

from __future__ import annotations

import numpy as np
from mindspore import Tensor, nn, ops

from mindloom_parallel._comm import all_gather
from mindloom_parallel._groups import Group

__all__ = ["GradReducer", "ShardedOptimizer", "make_buckets"]


def make_buckets(sizes_bytes: list[int], bucket_bytes: int) -> tuple[tuple[int, ...], ...]:
    """Group parameter indices into buckets of about ``bucket_bytes``, last parameter first
    (backward produces the last layers' gradients first, as in PyTorch DDP)."""
    buckets, cur, cur_bytes = [], [], 0
    for i in reversed(range(len(sizes_bytes))):
        cur.append(i)
        cur_bytes += sizes_bytes[i]
        if cur_bytes >= bucket_bytes:
            buckets.append(tuple(cur))
            cur, cur_bytes = [], 0
    if cur:
        buckets.append(tuple(cur))
    return tuple(buckets)


class GradReducer(nn.Cell):
    """Sum gradients over the data-parallel group, one all-reduce per bucket.

    A Cell: call it on the gradient tuple inside a compiled train step (GRAPH_MODE or
    ``@ms.jit``) as well as in PyNative. The buckets are fixed at construction (static
    shapes), so the compiled graph holds one AllReduce per bucket. ``mean=True`` divides by
    the group size (use it when each rank's loss is its own mean); ``ParallelEngine``
    normalizes the loss by the global token count instead and sums.
    """

    def __init__(self, params, group: Group, bucket_size_mb: float = 25.0, mean: bool = False):
        super().__init__()
        self.group = group
        self.shapes = tuple(tuple(p.shape) for p in params)
        sizes = [int(np.prod(s)) * 4 for s in self.shapes]
        self.buckets = make_buckets(sizes, int(bucket_size_mb * 2**20))
        self.bucket_sizes = tuple(tuple(sizes[i] // 4 for i in b) for b in self.buckets)
        order = [i for b in self.buckets for i in b]
        self.position = tuple(order.index(i) for i in range(len(self.shapes)))
        self.scale = 1.0 / group.size if mean else 1.0
        self.allreduce = (
            ops.AllReduce(ops.ReduceOp.SUM, group=group.name) if group.size > 1 else None
        )

    def construct(self, grads):
        if self.allreduce is None:
            return grads
        # tuples and static indices only: list item assignment is not reliable in graphs
        pieces = ()
        for b in range(len(self.buckets)):
            bucket = self.buckets[b]
            flat = ()
            for i in bucket:
                flat = flat + (grads[i].reshape(-1),)
            reduced = self.allreduce(ops.concat(flat))
            if self.scale != 1.0:
                reduced = reduced * self.scale
            pieces = pieces + ops.split(reduced, self.bucket_sizes[b])
        out = ()
        for i in range(len(self.shapes)):
            out = out + (pieces[self.position[i]].reshape(self.shapes[i]),)
        return out


class ShardedOptimizer:
    """AdamW (decoupled weight decay) or SGD with momentum over a flat fp32 buffer.

    ``zero_stage=1``: each data-parallel rank keeps optimizer state (and updates the
    weights) for 1/dp of the flat buffer only, then the updated slices are all-gathered
    (ZeRO stage 1; the gradients arrive already all-reduced). ``zero_stage=0`` keeps the
    whole state on every rank. Elementwise maths are identical either way, so a ZeRO-1 run
    matches an unsharded one bit for bit.
    """

    def __init__(
        self,
        params,
        dp_group: Group,
        zero_stage: int = 0,
        kind: str = "adamw",
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.95),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        momentum: float = 0.0,
    ):
        if kind not in ("adamw", "sgd"):
            raise ValueError(f"optimizer kind must be 'adamw' or 'sgd', got {kind!r}")
        self.params = list(params)
        self.kind, self.lr, self.betas, self.eps = kind, lr, betas, eps
        self.weight_decay, self.momentum = weight_decay, momentum
        self.group = dp_group if zero_stage == 1 else Group(None, (0,), 0)
        self.sizes = [int(np.prod(p.shape)) for p in self.params]
        total = sum(self.sizes)
        n = self.group.size
        self.padded = -(-total // n) * n
        self.shard = self.padded // n
        self.lo = self.group.index * self.shard
        self.step_count = 0
        z = np.zeros(self.shard, np.float32)
        self.m = Tensor(z)
        self.v = Tensor(z.copy())

    def _flat(self, tensors):
        flat = ops.concat([t.reshape(-1).astype(self.m.dtype) for t in tensors])
        pad = self.padded - flat.shape[0]
        if pad:
            flat = ops.concat([flat, ops.zeros(pad, flat.dtype)])
        return flat

    def step(self, grads, lr: float | None = None) -> None:
        lr = self.lr if lr is None else lr
        self.step_count += 1
        g = self._flat(grads)[self.lo : self.lo + self.shard]
        p = self._flat(self.params)[self.lo : self.lo + self.shard]
        if self.kind == "adamw":
            b1, b2 = self.betas
            self.m = b1 * self.m + (1 - b1) * g
            self.v = b2 * self.v + (1 - b2) * g * g
            mhat = self.m / (1 - b1**self.step_count)
            vhat = self.v / (1 - b2**self.step_count)
            p = p - lr * self.weight_decay * p
            p = p - lr * mhat / (ops.sqrt(vhat) + self.eps)
        else:
            if self.momentum:
                self.m = self.momentum * self.m + g
                g = self.m
            p = p - lr * (g + self.weight_decay * p)
        full = all_gather(p, self.group, 0)
        off = 0
        for prm, n in zip(self.params, self.sizes):
            # assign in place: a compiled graph holding this parameter sees the new value
            ops.assign(prm, full[off : off + n].reshape(prm.shape).astype(prm.dtype))
            off += n

    def state_numpy(self) -> dict[str, np.ndarray]:
        """This rank's optimizer state (its shard when ZeRO-1), for a checkpoint."""
        return {
            "exp_avg": self.m.asnumpy(),
            "exp_avg_sq": self.v.asnumpy(),
            "lo": np.int64(self.lo),
        }

    def gather_state(self, names: list[str]) -> dict[str, np.ndarray]:
        """The FULL optimizer state of this rank's parameters, by name (collective over dp
        when ZeRO-1): ``{"<name>.exp_avg": ..., "<name>.exp_avg_sq": ...}``, layout-free
        like the weights, so it can be saved under one dp size and loaded under another."""
        out = {}
        for key, t in (("exp_avg", self.m), ("exp_avg_sq", self.v)):
            flat = all_gather(t, self.group, 0).asnumpy()
            off = 0
            for name, n, p in zip(names, self.sizes, self.params):
                out[f"{name}.{key}"] = flat[off : off + n].reshape(p.shape)
                off += n
        return out

    def load_state(self, names: list[str], state: dict, step: int) -> None:
        """Inverse of ``gather_state``: keep this rank's shard of the full state."""
        for key, attr in (("exp_avg", "m"), ("exp_avg_sq", "v")):
            parts = [np.asarray(state[f"{name}.{key}"], np.float32).reshape(-1) for name in names]
            flat = np.concatenate(parts + [np.zeros(self.padded - sum(self.sizes), np.float32)])
            setattr(self, attr, Tensor(flat[self.lo : self.lo + self.shard].copy()))
        self.step_count = int(step)
