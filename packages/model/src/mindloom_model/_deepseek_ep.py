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
"""

from __future__ import annotations

import mindspore as ms
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
        one = ops.one_hot(ig, self.e, Tensor(1.0, ms.float32), Tensor(0.0, ms.float32))
        mine = one[:, :, self.ep_start : self.ep_start + el]  # [M, k, E_local]
        part = self._dropless_blocks(xg, mine, wg, partial=True)  # [M, D]
        y = self.ep_out(part.astype(ms.float32).expand_dims(0))[0]  # [N, D]
        return y.reshape(n, d).astype(flat.dtype)
