"""Expert parallel dispatch and combine of one DeepSeekMoE layer (`MoE` inherits them).

`mindloom_parallel.expert_parallel` splits a layer's routed experts over an ep group: it
keeps this rank's block of experts `[ep_start, ep_start + ep_local)` in `MoE.experts` and
sets the two exchange cells, `ep_in` (an all-gather of [1, N, C] rows over the group, its
backward a reduce-scatter) and `ep_out` (the group's partial outputs [1, ep N, D] summed,
this rank's rows kept; its backward an all-gather). Every rank routes only its own N
tokens (router and bias replicated), so the routing is one process's.

Dropless (the default): the group's token rows come in with their choices and weights,
this rank's experts run on the slots routed to them in the blocks dispatch (the other
ranks' slots go to a trash row), the partial outputs go out.

With `moe_capacity_factor` (training only, as on one process) tokens are dropped at their
own rank before the exchange, Megatron's way: on each rank an expert keeps its first
C = min(N, ceil(cf * N * k / E)) routed tokens of that rank, exactly the one-process rule
on a micro-batch of N tokens, and a dropped slot is sent with expert id -1. An expert
then receives at most ep * C slots, so this rank runs its E/ep experts on a fixed
[E/ep, ep * C, D] buffer (the one-process capacity layout) instead of the dropless
buffer sized for every slot of the group.
"""

from __future__ import annotations

import math

import mindspore as ms
import numpy as np
from mindspore import Tensor, ops

__all__: list[str] = []


class ExpertParallelMoE:
    """The expert-parallel half of `MoE` (a mixin: the methods use MoE's attributes)."""

    def _init_expert_parallel(self) -> None:
        # set by mindloom_parallel's expert_parallel; None / the whole range on one process
        self.ep_in = None
        self.ep_out = None
        self.ep_start, self.ep_local = 0, self.e

    def _expert_parallel(self, flat, idx, w):
        """Dropless: [N, D] tokens, their choices idx [N, k] and weights w [N, k] -> y [N, D]
        (this rank's tokens, every expert's share summed over the group)."""
        n, d = flat.shape
        k, el = self.k, self.ep_local
        rows = ops.concat(
            (flat.astype(ms.float32), w, ops.stop_gradient(idx.astype(ms.float32))), 1
        )  # [N, D + 2k]
        rows = self.ep_in(rows.expand_dims(0))[0]  # [M, D + 2k], M = ep * N
        xg = rows[:, :d].astype(flat.dtype)
        wg = rows[:, d : d + k]
        ig = ops.stop_gradient(rows[:, d + k :]).astype(ms.int32)  # [M, k] global ids
        if self.plan is not None and self.experts.grouped is not None:
            part = self._ep_fused(xg, ig, wg, n)
        else:
            one = ops.one_hot(ig, self.e, Tensor(1.0, ms.float32), Tensor(0.0, ms.float32))
            mine = one[:, :, self.ep_start : self.ep_start + el]  # [M, k, E_local]
            part = self._dropless_blocks(xg, mine, wg, partial=True)  # [M, D]
        y = self.ep_out(part.astype(ms.float32).expand_dims(0))[0]  # [N, D]
        return y.reshape(n, d).astype(flat.dtype)

    def _ep_fused(self, xg, ig, wg, n: int):
        """The kernels' dropless path (MoE._dropless_fused) on the group's rows: xg [M, D],
        global ids ig [M, k], weights wg [M, k] -> this rank's partial outputs [M, D]. The
        plan takes the ids relative to this rank's first expert (others' slots fall
        outside [0, E_local)) and counts each expert's rows per source rank."""
        ranks = xg.shape[0] // n
        spec = ops.zeros((ranks, self.ep_local), ms.int32)
        dest, row_token, counts = self.plan(ig - self.ep_start, spec)
        ys = self.experts(self.gather_rows(xg, row_token, dest), counts=counts)
        return self.combine_rows(ys, wg, dest, ops.zeros_like(xg))

    def _ep_capacity(self, flat, idx, w, assign):
        """With a capacity factor: -> (y [N, D], this rank's dropped slots)."""
        n, d = flat.shape
        rows, dropped = self._ep_capacity_rows(flat, idx, w, assign)
        rows = self.ep_in(rows.expand_dims(0))[0]  # [M, D + 2k], M = ep * N
        part = self._ep_capacity_experts(rows, n, flat.dtype)  # [M, D]
        y = self.ep_out(part.astype(ms.float32).expand_dims(0))[0]  # [N, D]
        return y.reshape(n, d).astype(flat.dtype), dropped

    def _ep_capacity_cap(self, n: int) -> int:
        return min(n, math.ceil(self.capacity_factor * n * self.k / self.e))

    def _ep_capacity_rows(self, flat, idx, w, assign):
        """The rows this rank sends, [N, D + 2k] (token, weights, expert ids with -1 for a
        dropped slot), and its dropped slots: an expert keeps its first `cap` routed tokens
        of this rank (the one-process rule: earlier tokens first)."""
        n = flat.shape[0]
        cap = self._ep_capacity_cap(n)
        before = ops.cumsum(assign, 0) - assign  # [N, E] earlier tokens routed to e
        keep_e = (before < cap).astype(ms.float32) * assign  # [N, E]
        keep = ops.gather_elements(keep_e, 1, idx)  # [N, k] 1 = the slot is kept
        ids = idx.astype(ms.float32) * keep + (keep - 1.0)  # a dropped slot: -1
        rows = ops.concat((flat.astype(ms.float32), w, ops.stop_gradient(ids)), 1)
        return rows, ops.stop_gradient(assign.sum() - keep_e.sum())

    def _ep_capacity_experts(self, rows, n: int, dtype):
        """The group's rows [M, D + 2k] -> this rank's partial outputs [M, D]: each local
        expert takes the slots sent to it (at most ep * cap: each rank sent at most cap)
        into a fixed [E_local, ep * cap, D] buffer, in row order."""
        m = rows.shape[0]
        k, el = self.k, self.ep_local
        d = rows.shape[1] - 2 * k
        xg = rows[:, :d].astype(dtype)
        wg = rows[:, d : d + k]
        ig = ops.stop_gradient(rows[:, d + k :])  # [M, k] global ids, -1 = dropped
        local = Tensor(np.arange(self.ep_start, self.ep_start + el, dtype=np.float32))
        eq = (ig.expand_dims(-1) == local).astype(ms.float32)  # [M, k, E_local]
        assign = eq.sum(1)  # [M, E_local] 0/1 (an expert is chosen once per token)
        combine = (eq * wg.expand_dims(-1)).sum(1)  # [M, E_local]
        c = self._ep_capacity_cap(n) * (m // n)
        order = Tensor(np.arange(m, 0, -1, dtype=np.float32))  # [M], earlier = larger
        top, tok = ops.topk(assign.transpose(1, 0) * order, c)  # [E_local, C]
        keep = (top > 0).astype(ms.float32)
        xs = ops.gather(xg, tok.reshape(-1), 0).reshape(el, c, d)
        ys = self.experts(xs)  # [E_local, C, D]: this rank's expert block
        wt = ops.gather_elements(combine.transpose(1, 0), 1, tok) * keep  # [E_local, C]
        ys = ys * wt.expand_dims(-1).astype(ys.dtype)
        return ops.unsorted_segment_sum(ys.reshape(-1, d), tok.reshape(-1), m)
