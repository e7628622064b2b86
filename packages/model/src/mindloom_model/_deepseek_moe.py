"""DeepSeekMoE: the router (group-limited top-k with the selection bias), the routed
experts, the dispatch, and the auxiliary-loss-free balancing rule.

Shapes: B batch, S sequence, D hidden, E routed experts, k experts per token, Fm expert
width, N = B*S tokens, S_k = N*k routed (token, expert) slots.

Routing (DeepSeek-V3): s = sigmoid(x @ gate.T) [N, E]; selection ranks s + expert_bias;
experts are split into n_group groups, each scored by the sum of its two best, the
topk_group best groups kept, the k best experts in them chosen; the combine weights
are the unbiased s of the chosen experts, normalised to sum 1 (norm_topk_prob) and
times routed_scaling_factor. The bias is moved after each optimizer step towards even
loads (`update_expert_bias`), so balance costs no gradient.

Dispatch compiles to static shapes. Dropless (the default, `MoE.dropless = "blocks"`):
the slots are sorted by expert into a padded buffer whose blocks of T rows each belong
to one expert, and the experts run as one batched matmul over the blocks;
`MoE.dropless = "dense"` runs every expert over all N tokens and weights the results by
a combine matrix [N, E] (zero for unchosen pairs). With `moe_capacity_factor` each
expert takes its first C = ceil(cf * N * k / E) routed tokens (gathered), later ones are
dropped and counted. Measured trade-off in the model README. Split over an expert-parallel
group (mindloom_parallel's expert_parallel), the dispatch and combine are
`_deepseek_ep.ExpertParallelMoE`'s.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import mindspore as ms
import numpy as np
from mindspore import Parameter, Tensor, nn, ops

from mindloom_model._deepseek_ep import ExpertParallelMoE
from mindloom_model._layers import _RowsByOneHot, _ScaleRows, _ScatterRows
from mindloom_model._llama import MLP, ModelConfig, _normal

if TYPE_CHECKING:
    from mindloom_model._deepseek import DeepseekV3

__all__ = ["MoE", "Router", "moe_route_reference", "moe_routers", "update_expert_bias"]


class Router(nn.Cell):
    """x [N, D] -> (topk ids [N, k] int32, combine weights [N, k] fp32, scores [N, E] fp32)."""

    def __init__(self, cfg: ModelConfig, rng):
        super().__init__()
        e = cfg.n_routed_experts
        self.weight = Parameter(
            Tensor(_normal(rng, (e, cfg.hidden_size), cfg.init_std)), name="weight"
        )
        # the selection bias of auxiliary-loss-free balancing: updated from expert loads
        # after each optimizer step (update_expert_bias), never by a gradient
        self.expert_bias = Parameter(
            Tensor(np.zeros(e, np.float32)), name="expert_bias", requires_grad=False
        )
        self.e, self.k = e, cfg.num_experts_per_tok
        self.n_group, self.topk_group = cfg.n_group, cfg.topk_group
        self.norm_topk = cfg.norm_topk_prob
        self.scaling = float(cfg.routed_scaling_factor)
        self.matmul = ops.MatMul(transpose_b=True)
        self.select = None  # a _kernels.KernelRoute, set by the model's _install_kernels

    def construct(self, x):
        n = x.shape[0]
        scores = ops.sigmoid(self.matmul(x.astype(ms.float32), self.weight))  # [N, E]
        choice = ops.stop_gradient(scores) + self.expert_bias
        if self.select is not None:
            idx = ops.stop_gradient(self.select(choice))  # [N, k]
        else:
            idx = self._select(choice, n)
        w = ops.gather_elements(scores, 1, idx)  # [N, k], the unbiased affinities
        if self.norm_topk:
            w = w / (w.sum(-1, keepdims=True) + 1e-20)
        return idx, w * self.scaling, scores

    def _select(self, choice, n: int):
        # the portable selection: [N, E] -> [N, k] ids (KernelRoute does it in one call)
        if self.n_group > 1:
            per = self.e // self.n_group
            grouped = choice.reshape(n, self.n_group, per)
            top2 = ops.topk(grouped, 2)[0]  # [N, G, 2]
            group_score = top2[..., 0] + top2[..., 1]  # [N, G]
            _, gidx = ops.topk(group_score, self.topk_group)  # [N, tg]
            gmask = ops.one_hot(
                gidx, self.n_group, Tensor(1.0, ms.float32), Tensor(0.0, ms.float32)
            )
            gmask = gmask.sum(1)  # [N, G], 1 for kept groups
            emask = gmask.expand_dims(-1).broadcast_to((n, self.n_group, per)).reshape(n, self.e)
            choice = ops.select(emask > 0, choice, ops.full_like(choice, -1e30))
        return ops.topk(choice, self.k)[1]  # [N, k]


class Experts(nn.Cell):
    """The routed experts' SwiGLU weights as [E, ...] tensors, run as batched matmuls."""

    def __init__(self, cfg: ModelConfig, rng, param_dtype, compute_dtype):
        super().__init__()
        e, d, f = cfg.n_routed_experts, cfg.hidden_size, cfg.moe_intermediate_size
        out_std = cfg.init_std / math.sqrt(2 * cfg.num_layers)
        self.w1 = Parameter(Tensor(_normal(rng, (e, f, d), cfg.init_std), param_dtype), name="w1")
        self.w3 = Parameter(Tensor(_normal(rng, (e, f, d), cfg.init_std), param_dtype), name="w3")
        self.w2 = Parameter(Tensor(_normal(rng, (e, d, f), out_std), param_dtype), name="w2")
        self.compute_dtype = compute_dtype
        self.bmm_t = ops.BatchMatMul(transpose_b=True)
        self.rows = _RowsByOneHot()
        self.kernel = None  # a _kernels.KernelSwiGLU, set by the model's _install_kernels
        # a _kernels.KernelGroupedMatMul (set there too): the dispatch then sorts the slots
        # into [P, D] rows by expert, unpadded, and passes each expert's row count
        self.grouped = None

    # how block b gets expert owner[b]'s weights: "matmul" (a one-hot [nb, E] product, its
    # backward a matmul) or "gather" (ops.gather, its backward a scatter-add); measured in
    # benchmarks/moe_step.py (moe vs moe-gather)
    weights_by = "matmul"

    def construct(self, xs, owner=None, counts=None):
        """xs [E, T, D] (expert e's tokens in row e) -> [E, T, D]; with owner [nb, E] one-hot
        fp32, xs [nb, T, D] is blocks of rows and block b runs expert argmax(owner[b]) ->
        [nb, T, D]; with counts [R, E] int32 (the grouped kernel), xs [P, D] is rows sorted
        by expert, counts[:, e] summed of them expert e's -> [P, D]. One cell call each way, so
        `recompute()` on this cell covers the expert matmuls."""
        cd = self.compute_dtype
        if counts is not None:  # the kernel runs fp32 only (use_cpu_kernels)
            gmm = self.grouped
            hid = self.kernel(gmm(xs, self.w1, counts), gmm(xs, self.w3, counts))  # [P, Fm]
            return gmm(hid, self.w2, counts)  # [P, D]
        if owner is None:
            w1, w2, w3 = self.w1.astype(cd), self.w2.astype(cd), self.w3.astype(cd)
        elif self.weights_by == "matmul":
            w1 = self.rows(owner, self.w1).astype(cd)  # [nb, Fm, D]
            w3 = self.rows(owner, self.w3).astype(cd)
            w2 = self.rows(owner, self.w2).astype(cd)  # [nb, D, Fm]
        else:
            ids = ops.argmax(owner, -1).astype(ms.int32)
            w1 = ops.gather(self.w1, ids, 0).astype(cd)  # [nb, Fm, D]
            w3 = ops.gather(self.w3, ids, 0).astype(cd)
            w2 = ops.gather(self.w2, ids, 0).astype(cd)  # [nb, D, Fm]
        if self.kernel is not None:
            hid = self.kernel(self.bmm_t(xs, w1), self.bmm_t(xs, w3))  # [., T, Fm]
        else:
            hid = ops.silu(self.bmm_t(xs, w1)) * self.bmm_t(xs, w3)
        return self.bmm_t(hid, w2)


def _block_size(slots: int, experts: int, fixed: int = 0) -> int:
    if fixed > 0:
        return fixed
    # about half an expert's even share, a power of two in [16, 128]: the padding (at
    # most one block per expert) stays a fraction of the routed slots, blocks stay big
    # enough for the batched matmul
    t = 16
    while t < 128 and 4 * t <= slots // max(experts, 1):
        t *= 2
    return t


class MoE(ExpertParallelMoE, nn.Cell):
    """DeepSeekMoE: shared experts + k of E routed experts. x [B, S, D] -> (y [B, S, D],
    load [E] tokens routed to each expert, dropped tokens, balance loss). Split over an
    ep group, its dispatch and combine are `_deepseek_ep.ExpertParallelMoE`'s."""

    def __init__(self, cfg: ModelConfig, rng, param_dtype, compute_dtype):
        super().__init__()
        self.gate = Router(cfg, rng)
        self.experts = Experts(cfg, rng, param_dtype, compute_dtype)
        self.has_shared = cfg.n_shared_experts > 0
        if self.has_shared:
            shared_cfg = ModelConfig(
                vocab_size=1, hidden_size=cfg.hidden_size, num_layers=cfg.num_layers, num_heads=1,
                ffn_hidden_size=cfg.moe_intermediate_size * cfg.n_shared_experts, init_std=cfg.init_std,
            )  # fmt: skip
            self.shared = MLP(shared_cfg, rng, param_dtype, compute_dtype)
        self.e, self.k = cfg.n_routed_experts, cfg.num_experts_per_tok
        self.capacity_factor = cfg.moe_capacity_factor
        self.aux_weight = float(cfg.moe_aux_loss_weight)
        self.compute_dtype = compute_dtype
        self.scale_rows = _ScaleRows()
        self.scatter_tokens = _ScatterRows()
        # the fused dispatch's kernels (_kernels.KernelMoEPlan, KernelMoEGather,
        # KernelMoECombine), set by the model's _install_kernels; see _dropless_fused
        self.plan = self.gather_rows = self.combine_rows = None
        self.expert_slots = Tensor(np.zeros((1, self.e), np.int32))  # the plan reads [R, E] off it
        self._init_expert_parallel()  # the exchange cells; None on one process

    # dropless dispatch: "blocks" sorts the routed (token, expert) slots by expert into
    # blocks of T rows, each block one expert's (k/E of the dense FLOPs plus at most a
    # block of padding per expert); "dense" runs every expert over every token (E/k times
    # the routed FLOPs, no gathers). Measured in benchmarks/moe_step.py.
    dropless = "blocks"
    block_rows = 0  # T of the blocks dispatch; 0 = _block_size's choice (benchmarks set it)

    def _dropless_dense(self, flat, combine):
        n, d = flat.shape
        # every expert over every token; unchosen pairs weigh 0
        ys = self.experts(flat.expand_dims(0).broadcast_to((self.e, n, d)))  # [E, N, D]
        # y[n] = sum_e combine[n, e] * ys[e, n]: [N, 1, E] @ [N, E, D] -> [N, 1, D]
        y = ops.BatchMatMul()(combine.astype(ys.dtype).reshape(n, 1, self.e), ys.transpose(1, 0, 2))
        return y.reshape(n, d)

    def _dropless_blocks(self, flat, one, w, partial: bool = False):
        """flat [N, D], one [N, k, E] one-hot choices, w [N, k] weights -> y [N, D].

        Slot s = n*k + j goes to row start[e_s] + rank_s of a padded buffer [P, D], where
        each expert's rows start at a multiple of T (counts rounded up to T), so every
        block of T rows belongs to one expert: the experts run as one batched matmul over
        [P/T, T, D] with each block's weights picked by a one-hot matmul. P = T*ceil(N*k/T)
        + E*T is static. Tokens come in by a row gather (its backward the one segment sum
        that also adds a token's k copies) and go out by one segment sum over the rows
        weighted by their slot's weight (its backward a gather): no sum over k, no
        reduction over D outside a matmul.

        `partial` (expert parallel): `one` [N, k, E_local] covers only this rank's experts;
        a slot routed elsewhere has a zero row and goes to one extra trash row past the
        buffer, dropped before the experts run; y is this rank's share of each token."""
        n, d = flat.shape
        e = one.shape[-1]
        slots = n * self.k
        grouped = self.experts.grouped is not None
        # the grouped kernel takes each expert's rows as they come: T = 1, no pad blocks
        t = 1 if grouped else _block_size(slots, self.e, self.block_rows)
        nb = -(-slots // t) + (0 if grouped else e)
        p = nb * t
        oh = one.reshape(slots, e)  # [S, E] fp32 0/1, S = N*k slots
        ones_e = ops.ones((e, 1), ms.float32)
        # rank of a slot among its expert's slots, in slot order (exclusive cumsum)
        rank = ops.matmul((ops.cumsum(oh, 0) - oh) * oh, ones_e).reshape(-1)  # [S]
        counts = ops.matmul(ops.ones((1, slots), ms.float32), oh).reshape(-1)  # [E]
        padded = counts if grouped else ops.ceil(counts / t) * t
        ends = ops.cumsum(padded, 0)  # [E]
        starts = ends - padded
        dest = ops.matmul(oh * starts, ones_e).reshape(-1) + rank
        rows = p
        if partial:  # slots of other ranks' experts: the trash row p
            here = ops.matmul(oh, ones_e).reshape(-1)  # [S] 1 = one of this rank's experts
            dest = dest * here + (1.0 - here) * p
            rows = p + 1
        dest = ops.stop_gradient(dest).astype(ms.int32)  # [S], distinct rows (but trash)
        # the token (1-based; 0 = a pad row) each row holds: exact in fp32 below 2^24
        slot_token = Tensor(np.repeat(np.arange(1, n + 1, dtype=np.float32), self.k))
        row_token = ops.unsorted_segment_sum(slot_token, dest, rows)  # [P (+1)]
        if partial:
            row_token = row_token[:p]
        row_token = ops.stop_gradient(row_token).astype(ms.int32)
        padded_flat = ops.concat((ops.zeros((1, d), flat.dtype), flat), 0)  # row 0: zeros
        xs = ops.gather(padded_flat, row_token, 0)  # [P, D]
        if grouped:
            by = counts.reshape(1, e)
            if partial:  # per source rank (the rows come rank by rank): see KernelGroupedMatMul
                r = self.e // e
                by = ops.BatchMatMul()(ops.ones((r, 1, slots // r), ms.float32),
                                       oh.reshape(r, slots // r, e)).reshape(r, e)  # fmt: skip
            ys = self.experts(xs, counts=ops.stop_gradient(by).astype(ms.int32))
        else:
            ys = self._blocks_experts(xs.reshape(nb, t, d), ends, nb, t).reshape(p, d)
        # each row's slot weight (0 for pad rows); w's gradient comes back by a gather
        row_w = ops.unsorted_segment_sum(w.reshape(slots), dest, rows)  # [P (+1)]
        if partial:
            row_w = row_w[:p]
        ys = self.scale_rows(ys, row_w.astype(ys.dtype).reshape(p, 1))
        like = ops.zeros((n + 1, 1), ms.float32)  # the output's row count, no gradient
        return self.scatter_tokens(ys, row_token, like)[1:]  # [N, D]

    def _dropless_fused(self, flat, idx, w):
        """The kernels' dropless path: flat [N, D], idx [N, k], w [N, k] -> (y [N, D] with
        the shared experts' output added, load [E]). _dropless_blocks' grouped dispatch
        in three kernels: the plan sorts the slots by expert (dest [N, k], row_token [S],
        counts [1, E]), the tokens are gathered into [S, D], the experts run as grouped
        GEMMs, and one combine weighs each token's k rows and adds the shared output."""
        dest, row_token, counts = self.plan(ops.stop_gradient(idx), self.expert_slots)
        xs = self.gather_rows(flat, row_token, dest)  # [S, D] sorted by expert
        ys = self.experts(xs, counts=counts)  # [S, D]
        base = self.shared(flat) if self.has_shared else ops.zeros_like(flat)
        y = self.combine_rows(ys, w, dest, base.astype(ys.dtype))  # [N, D]
        return y, ops.stop_gradient(counts.reshape(-1).astype(ms.float32))

    def _blocks_experts(self, xs, ends, nb: int, t: int):
        """xs [nb, T, D] blocks of rows, ends [E] where each expert's padded rows end ->
        the experts over the blocks [nb, T, D]."""
        # block b belongs to expert owner[b] = #experts whose padded range ends at or
        # before row b*T (blocks past the last range hold only zero rows: the last
        # expert), as a one-hot [nb, E]: 1 where ends[e-1] <= b*T < ends[e]
        bstart = Tensor(np.arange(nb, dtype=np.float32) * t)
        past = (ops.stop_gradient(ends).expand_dims(0) <= bstart.expand_dims(1)).astype(ms.float32)
        past = ops.concat((past[:, :-1], ops.zeros((nb, 1), ms.float32)), 1)  # [nb, E]
        before = ops.concat((ops.ones((nb, 1), ms.float32), past[:, :-1]), 1)
        owner = ops.stop_gradient(before - past)  # [nb, E] one-hot
        return self.experts(xs, owner)

    def construct(self, x):
        b, s, d = x.shape
        n = b * s
        flat = x.reshape(n, d)
        idx, w, scores = self.gate(flat)
        one = ops.one_hot(
            idx, self.e, Tensor(1.0, ms.float32), Tensor(0.0, ms.float32)
        )  # [N, k, E]
        assign = one.sum(1)  # [N, E] 0/1
        combine = (one * w.expand_dims(-1)).sum(1)  # [N, E] fp32
        load = ops.stop_gradient(assign.sum(0))  # [E]
        dropless = self.capacity_factor is None or not self.training
        fused = self.plan is not None and self.experts.grouped is not None and dropless
        fused = fused and self.ep_in is None and self.dropless == "blocks"
        if fused:
            y, load = self._dropless_fused(flat, idx, w)  # the shared output included
            dropped = ops.zeros((), ms.float32)
        elif self.ep_in is not None and dropless:
            y = self._expert_parallel(flat, idx, w)
            dropped = ops.zeros((), ms.float32)
        elif self.ep_in is not None:
            y, dropped = self._ep_capacity(flat, idx, w, assign)
        elif dropless and self.dropless == "dense":
            y = self._dropless_dense(flat, combine)
            dropped = ops.zeros((), ms.float32)
        elif dropless:
            y = self._dropless_blocks(flat, one, w)
            dropped = ops.zeros((), ms.float32)
        else:
            cap = min(n, math.ceil(self.capacity_factor * n * self.k / self.e))
            # an expert keeps its first `cap` routed tokens: rank by (routed, earlier first)
            order = Tensor(np.arange(n, 0, -1, dtype=np.float32))  # [N], earlier = larger
            prio = assign.transpose(1, 0) * order  # [E, N]
            top, tok = ops.topk(prio, cap)  # [E, C]
            keep = (top > 0).astype(ms.float32)  # [E, C]
            xs = ops.gather(flat, tok.reshape(-1), 0).reshape(self.e, cap, d)
            ys = self.experts(xs)  # [E, C, D]
            wt = ops.gather_elements(combine.transpose(1, 0), 1, tok) * keep  # [E, C]
            ys = ys * wt.expand_dims(-1).astype(ys.dtype)
            y = ops.unsorted_segment_sum(ys.reshape(-1, d), tok.reshape(-1), n)
            dropped = ops.stop_gradient(assign.sum() - keep.sum())
        if self.has_shared and not fused:
            y = y + self.shared(flat)
        aux = ops.zeros((), ms.float32)
        if self.aux_weight > 0:
            # sequence-wise balance loss (DeepSeek-V3 eq. 17-20): per sequence,
            # E/(k*S) * sum_e f_e * P_e with P_e the mean normalised affinity
            p = scores / (scores.sum(-1, keepdims=True) + 1e-20)  # [N, E]
            f = assign.reshape(b, s, self.e).sum(1) * (self.e / (self.k * s))  # [B, E]
            pm = p.reshape(b, s, self.e).mean(1)  # [B, E]
            aux = (ops.stop_gradient(f) * pm).sum(-1).mean() * self.aux_weight
        return y.reshape(b, s, d).astype(x.dtype), load, dropped, aux


# ----------------------------------------------------------------------------- balancing


def update_expert_bias(
    model: DeepseekV3, loads: np.ndarray, speed: float | None = None
) -> np.ndarray:
    """Auxiliary-loss-free balancing after an optimizer step: every MoE layer's selection
    bias moves by `speed` towards even load, b_e += speed * sign(mean(load) - load_e).

    loads [n_moe (+ MTP MoE layers), E]: tokens routed to each expert in this step, in
    the order DeepseekV3WithLoss returns them. Returns the new biases [n, E] (fp32)."""
    speed = model.config.moe_bias_update_speed if speed is None else speed
    routers = moe_routers(model)
    loads = np.asarray(loads, np.float32).reshape(len(routers), -1)
    out = []
    for router, load in zip(routers, loads):
        bias = router.expert_bias.asnumpy()
        new = (bias + np.float32(speed) * np.sign(load.mean() - load)).astype(np.float32)
        router.expert_bias.set_data(Tensor(new))
        out.append(new)
    return np.stack(out) if out else np.zeros((0, 0), np.float32)


def moe_routers(model: DeepseekV3) -> list[Router]:
    """The routers in DeepseekV3WithLoss's load order: trunk MoE layers, then MTP blocks."""
    routers = [layer.mlp.gate for layer in model.layers if layer.is_moe]
    routers += [mod.block.mlp.gate for mod in model.mtp if mod.block.is_moe]
    return routers


def moe_route_reference(x: np.ndarray, weight: np.ndarray, bias: np.ndarray, cfg: ModelConfig):
    """NumPy routing of DeepSeek-V3 (for tests and documentation): x [N, D] ->
    (ids [N, k] sorted by expert id, weights [N, k] in the same order, load [E])."""
    x, weight = np.asarray(x, np.float64), np.asarray(weight, np.float64)
    scores = 1.0 / (1.0 + np.exp(-(x @ weight.T)))
    choice = scores + bias
    n, e = scores.shape
    ids, ws = [], []
    per = e // cfg.n_group
    for row, srow in zip(choice, scores):
        if cfg.n_group > 1:
            groups = row.reshape(cfg.n_group, per)
            gscore = np.sort(groups, -1)[:, -2:].sum(-1)
            keep = np.argsort(-gscore, kind="stable")[: cfg.topk_group]
            masked = np.full(e, -np.inf)
            for g in keep:
                masked[g * per : (g + 1) * per] = row[g * per : (g + 1) * per]
            row = masked
        top = np.sort(np.argsort(-row, kind="stable")[: cfg.num_experts_per_tok])
        w = srow[top]
        if cfg.norm_topk_prob:
            w = w / (w.sum() + 1e-20)
        ids.append(top)
        ws.append(w * cfg.routed_scaling_factor)
    ids = np.array(ids)
    return ids, np.array(ws), np.bincount(ids.ravel(), minlength=e).astype(np.float64)
