"""The DeepSeek-V3 family in MindSpore: MLA attention, DeepSeekMoE, multi-token prediction.

Shapes in comments: B batch, S sequence, D hidden, H heads, dn / dr per-head query-key
widths without / with RoPE, dv per-head value width, r kv_lora_rank (the KV latent),
rq q_lora_rank, E routed experts, k experts per token, Fm expert width, N = B*S tokens.

Layout (parameter names are the attribute paths; Hugging Face names in _hf_deepseek.py):

    embed                             Embedding  [V, D]
    layers.{i}.attn_norm              RMSNorm    [D]
    layers.{i}.attn.q_proj            Linear     [H*(dn+dr), D]       (q_lora_rank None)
    layers.{i}.attn.q_a_proj          Linear     [rq, D]              (q_lora_rank set)
    layers.{i}.attn.q_a_norm          RMSNorm    [rq]
    layers.{i}.attn.q_b_proj          Linear     [H*(dn+dr), rq]
    layers.{i}.attn.kv_a_proj         Linear     [r+dr, D]  latent + the shared RoPE key
    layers.{i}.attn.kv_a_norm         RMSNorm    [r]
    layers.{i}.attn.kv_b_proj         Linear     [H*(dn+dv), r]
    layers.{i}.attn.wo                Linear     [D, H*dv]
    layers.{i}.mlp_norm               RMSNorm    [D]
    layers.{i}.mlp.w1/w2/w3           Linear     dense SwiGLU (i < first_k_dense_replace)
    layers.{i}.mlp.gate.weight        [E, D]     router (fp32)
    layers.{i}.mlp.gate.expert_bias   [E]        selection bias: a buffer, never trained
    layers.{i}.mlp.experts.w1/w3      [E, Fm, D] gate / up of every routed expert
    layers.{i}.mlp.experts.w2         [E, D, Fm] down
    layers.{i}.mlp.shared.w1/w2/w3    Linear     the shared experts, one SwiGLU
    norm, lm_head                     as in Llama (lm_head absent when tied)
    mtp.{j}.enorm / hnorm             RMSNorm    [D]
    mtp.{j}.eh_proj                   Linear     [D, 2D]  of concat(enorm(emb), hnorm(h))
    mtp.{j}.block                     a MoE decoder layer
    mtp.{j}.norm                      RMSNorm    [D], then the shared lm_head

Routing (DeepSeek-V3): s = sigmoid(x @ gate.T) [N, E]; selection ranks s + expert_bias;
experts are split into n_group groups, each scored by the sum of its two best, the
topk_group best groups kept, the k best experts in them chosen; the combine weights
are the unbiased s of the chosen experts, normalised to sum 1 (norm_topk_prob) and
times routed_scaling_factor. The bias is moved after each optimizer step towards even
loads (`update_expert_bias`), so balance costs no gradient.

Dispatch compiles to static shapes: without a capacity (dropless, the default) every
expert runs a batched matmul over all N tokens and a combine matrix [N, E] (zero for
unchosen pairs) weights the results; with `moe_capacity_factor` each expert takes its
first C = ceil(cf * N * k / E) routed tokens (gathered), later ones are dropped and
counted. Measured trade-off in the model README.
"""

from __future__ import annotations

import math

import mindspore as ms
import numpy as np
from mindspore import Parameter, Tensor, nn, ops

from mindloom_model._deepseek_config import (  # noqa: F401  (re-exported for callers)
    _moe_layer_ids,
    deepseek_flops_per_token,
    deepseek_num_params,
    validate_deepseek,
)
from mindloom_model._llama import (
    _DTYPES,
    MLP,
    Embedding,
    Linear,
    Llama,
    ModelConfig,
    RMSNorm,
    _normal,
    attention,
    attention_bias,
    causal_lm_loss,
    recompute_layer_ids,
    resolve_compute_dtype,
    rope_cos_sin,
)

__all__ = [
    "DeepseekV3",
    "DeepseekV3WithLoss",
    "moe_route_reference",
    "moe_routers",
    "update_expert_bias",
    "yarn_inv_freq",
]

# the norms inside MLA (q_a_norm, kv_a_norm) use DeepSeek's fixed epsilon, not rms_norm_eps
_LATENT_EPS = 1e-6


# ----------------------------------------------------------------------------- RoPE (YaRN)


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def yarn_inv_freq(cfg: ModelConfig) -> tuple[np.ndarray, float, float]:
    """(inv_freq [dr/2] fp32, cos/sin factor, softmax-scale factor) for cfg's RoPE.

    Plain RoPE without rope_scaling. YaRN as Hugging Face computes it: frequencies
    between the beta_fast and beta_slow rotation counts blend from extrapolated to
    interpolated (divided by factor); cos/sin scale by mscale(factor, mscale) /
    mscale(factor, mscale_all_dim), and the softmax scale by mscale(factor,
    mscale_all_dim)^2 (DeepSeek's "mscale" attention correction).
    """
    dim, base = cfg.qk_rope_head_dim, float(cfg.rope_theta)
    pos = base ** (np.arange(0, dim, 2, dtype=np.int64).astype(np.float32) / dim)
    rs = cfg.rope_scaling
    if not rs or rs.get("type", rs.get("rope_type")) != "yarn":
        return (1.0 / pos).astype(np.float32), 1.0, 1.0
    factor = float(rs["factor"])
    orig = float(rs["original_max_position_embeddings"])
    beta_fast, beta_slow = float(rs.get("beta_fast") or 32), float(rs.get("beta_slow") or 1)
    mscale, mscale_all = rs.get("mscale"), rs.get("mscale_all_dim")
    if mscale and mscale_all:
        cos_factor = _yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all)
    else:
        cos_factor = _yarn_mscale(factor)

    def corr_dim(rot):
        return dim * math.log(orig / (rot * 2 * math.pi)) / (2 * math.log(base))

    low, high = (
        max(math.floor(corr_dim(beta_fast)), 0),
        min(math.ceil(corr_dim(beta_slow)), dim - 1),
    )
    if low == high:
        high += 0.001
    ramp = np.clip((np.arange(dim // 2, dtype=np.float32) - low) / (high - low), 0, 1)
    extra = 1.0 - ramp  # share of the extrapolated (original) frequency
    inv = (1.0 / (factor * pos)) * (1 - extra) + (1.0 / pos) * extra
    score_factor = _yarn_mscale(factor, mscale_all) ** 2 if mscale_all else 1.0
    return inv.astype(np.float32), float(cos_factor), float(score_factor)


def _rope_pairs(x, cos, sin, interleave: bool):
    """x [B, h, S, dr]; cos/sin [B|1, 1, S, dr] (two equal halves).

    interleave: pairs (x0, x1), (x2, x3), ... rotate by one frequency each and the result
    is laid out as [evens', odds'] (Hugging Face's apply_rotary_pos_emb_interleave);
    otherwise rotate_half pairs i with i + dr/2 (the Llama layout)."""
    half = x.shape[-1] // 2
    if interleave:
        c, s = cos[..., :half].astype(x.dtype), sin[..., :half].astype(x.dtype)
        x1, x2 = x[..., 0::2], x[..., 1::2]
        return ops.concat((x1 * c - x2 * s, x2 * c + x1 * s), -1)
    rotated = ops.concat((-x[..., half:], x[..., :half]), -1)
    return x * cos.astype(x.dtype) + rotated * sin.astype(x.dtype)


# ----------------------------------------------------------------------------- MLA


class MLAttention(nn.Cell):
    """Multi-head latent attention. x [B, S, D] -> [B, S, D].

    Keys and values come from one compressed latent c = kv_a_norm(x W_kv_a)[:r] [B, S, r]
    and one RoPE key shared by all heads [B, 1, S, dr]; the cache keeps only those two,
    (r + dr) numbers per token instead of 2 * H * dh.
    """

    def __init__(self, cfg: ModelConfig, rng, param_dtype, compute_dtype):
        super().__init__()
        d, h = cfg.hidden_size, cfg.num_heads
        self.n_heads = h
        self.dn, self.dr, self.dv = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
        self.r = cfg.kv_lora_rank
        self.interleave = cfg.rope_interleave
        qk = self.dn + self.dr
        std, out_std = cfg.init_std, cfg.init_std / math.sqrt(2 * cfg.num_layers)

        def lin(i, o, s=std):
            return Linear(i, o, _normal(rng, (o, i), s), param_dtype, compute_dtype)

        self.q_lora = cfg.q_lora_rank is not None
        if self.q_lora:
            self.q_a_proj = lin(d, cfg.q_lora_rank)
            self.q_a_norm = RMSNorm(cfg.q_lora_rank, _LATENT_EPS, param_dtype)
            self.q_b_proj = lin(cfg.q_lora_rank, h * qk)
        else:
            self.q_proj = lin(d, h * qk)
        self.kv_a_proj = lin(d, self.r + self.dr)
        self.kv_a_norm = RMSNorm(self.r, _LATENT_EPS, param_dtype)
        self.kv_b_proj = lin(self.r, h * (self.dn + self.dv))
        self.wo = lin(h * self.dv, d, out_std)
        _, _, score_factor = yarn_inv_freq(cfg)
        self.scale = qk**-0.5 * score_factor
        self.attn_dropout = nn.Dropout(p=cfg.dropout) if cfg.dropout > 0 else None

    def query(self, x, cos, sin):
        # x [B, S, D] -> q [B, H, S, dn+dr], RoPE on its last dr
        b, s, _ = x.shape
        q = self.q_b_proj(self.q_a_norm(self.q_a_proj(x))) if self.q_lora else self.q_proj(x)
        q = q.reshape(b, s, self.n_heads, self.dn + self.dr).transpose(0, 2, 1, 3)
        return ops.concat(
            (q[..., : self.dn], _rope_pairs(q[..., self.dn :], cos, sin, self.interleave)), -1
        )

    def latent(self, x, cos, sin):
        # x [B, S, D] -> c [B, S, r] (normalised latent), k_rope [B, 1, S, dr] (rotated)
        b, s, _ = x.shape
        ckv = self.kv_a_proj(x)  # [B, S, r + dr]
        c = self.kv_a_norm(ckv[..., : self.r])
        k_rope = ckv[..., self.r :].reshape(b, 1, s, self.dr)
        return c, _rope_pairs(k_rope, cos, sin, self.interleave)

    def expand(self, c, k_rope):
        # c [B, T, r], k_rope [B, 1, T, dr] -> k [B, H, T, dn+dr], v [B, H, T, dv]
        b, t, _ = c.shape
        kv = self.kv_b_proj(c).reshape(b, t, self.n_heads, self.dn + self.dv).transpose(0, 2, 1, 3)
        k_rope = k_rope.broadcast_to((b, self.n_heads, t, self.dr))
        return ops.concat((kv[..., : self.dn], k_rope), -1), kv[..., self.dn :]

    def attend(self, q, k, v, bias):
        # -> [B, S, D]
        o = attention(q, k, v, bias, 1, self.attn_dropout, self.scale)  # [B, H, S, dv]
        b, h, s, dv = o.shape
        return self.wo(o.transpose(0, 2, 1, 3).reshape(b, s, h * dv))

    def construct(self, x, cos, sin, bias):
        q = self.query(x, cos, sin)
        k, v = self.expand(*self.latent(x, cos, sin))
        return self.attend(q, k, v, bias)


# ----------------------------------------------------------------------------- MoE


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

    def construct(self, x):
        n = x.shape[0]
        scores = ops.sigmoid(self.matmul(x.astype(ms.float32), self.weight))  # [N, E]
        choice = ops.stop_gradient(scores) + self.expert_bias
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
        _, idx = ops.topk(choice, self.k)  # [N, k]
        w = ops.gather_elements(scores, 1, idx)  # [N, k], the unbiased affinities
        if self.norm_topk:
            w = w / (w.sum(-1, keepdims=True) + 1e-20)
        return idx, w * self.scaling, scores


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

    def run_blocks(self, xs, owner):
        # xs [nb, T, D], owner [nb] int32: block b runs expert owner[b] -> [nb, T, D]
        cd = self.compute_dtype
        w1 = ops.gather(self.w1, owner, 0).astype(cd)  # [nb, Fm, D]
        w3 = ops.gather(self.w3, owner, 0).astype(cd)
        w2 = ops.gather(self.w2, owner, 0).astype(cd)  # [nb, D, Fm]
        hid = ops.silu(self.bmm_t(xs, w1)) * self.bmm_t(xs, w3)  # [nb, T, Fm]
        return self.bmm_t(hid, w2)

    def construct(self, xs):
        # xs [E, T, D] (each expert's tokens) -> [E, T, D]
        cd = self.compute_dtype
        w1, w2, w3 = self.w1.astype(cd), self.w2.astype(cd), self.w3.astype(cd)
        hid = ops.silu(self.bmm_t(xs, w1)) * self.bmm_t(xs, w3)  # [E, T, Fm]
        return self.bmm_t(hid, w2)


def _block_size(slots: int, experts: int) -> int:
    # about half an expert's even share, a power of two in [16, 128]: the padding (at
    # most one block per expert) stays a fraction of the routed slots, blocks stay big
    # enough for the batched matmul
    t = 16
    while t < 128 and 4 * t <= slots // max(experts, 1):
        t *= 2
    return t


class MoE(nn.Cell):
    """DeepSeekMoE: shared experts + k of E routed experts. x [B, S, D] -> (y [B, S, D],
    load [E] tokens routed to each expert, dropped tokens, balance loss)."""

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

    # dropless dispatch: "blocks" sorts the routed (token, expert) slots by expert into
    # blocks of T rows, each block one expert's (k/E of the dense FLOPs plus at most a
    # block of padding per expert); "dense" runs every expert over every token (E/k times
    # the routed FLOPs, no gathers). Measured in benchmarks/moe_step.py.
    dropless = "blocks"

    def _dropless_dense(self, flat, combine):
        n, d = flat.shape
        # every expert over every token; unchosen pairs weigh 0
        ys = self.experts(flat.expand_dims(0).broadcast_to((self.e, n, d)))  # [E, N, D]
        # y[n] = sum_e combine[n, e] * ys[e, n]: [N, 1, E] @ [N, E, D] -> [N, 1, D]
        y = ops.BatchMatMul()(combine.astype(ys.dtype).reshape(n, 1, self.e), ys.transpose(1, 0, 2))
        return y.reshape(n, d)

    def _dropless_blocks(self, flat, one, w):
        """flat [N, D], one [N, k, E] one-hot choices, w [N, k] weights -> y [N, D].

        Slot s = n*k + j goes to row start[e_s] + rank_s of a padded buffer [P, D], where
        each expert's rows start at a multiple of T (counts rounded up to T), so every
        block of T rows belongs to one expert: the experts run as one batched matmul over
        [P/T, T, D] with each block's weights gathered. P = T*ceil(N*k/T) + E*T is static.
        Gather-free forward scatter: a segment sum (its backward is the gather)."""
        n, d = flat.shape
        slots = n * self.k
        t = _block_size(slots, self.e)
        nb = -(-slots // t) + self.e
        p = nb * t
        oh = one.reshape(slots, self.e)  # [S, E] fp32 0/1, S = N*k slots
        # rank of a slot among its expert's slots, in slot order (exclusive cumsum)
        rank = ((ops.cumsum(oh, 0) - oh) * oh).sum(-1)  # [S]
        counts = oh.sum(0)  # [E]
        padded = ops.ceil(counts / t) * t
        ends = ops.cumsum(padded, 0)  # [E]
        starts = ends - padded
        dest = ops.stop_gradient((oh * starts).sum(-1) + rank).astype(ms.int32)  # [S]
        xs = flat.expand_dims(1).broadcast_to((n, self.k, d)).reshape(slots, d)
        xs = ops.unsorted_segment_sum(xs, dest, p).reshape(nb, t, d)  # pad rows are 0
        # block b belongs to the expert whose padded range holds row b*T; blocks past the
        # last expert's range hold only zero rows (any expert will do: the last)
        bstart = Tensor(np.arange(nb, dtype=np.float32) * t)
        owner = (ops.stop_gradient(ends).expand_dims(0) <= bstart.expand_dims(1)).astype(ms.float32)
        owner = ops.minimum(owner.sum(-1), self.e - 1).astype(ms.int32)  # [nb]
        ys = self.experts.run_blocks(xs, owner)  # [nb, T, D]
        ys = ops.gather(ys.reshape(p, d), dest, 0)  # [S, D]
        y = (ys.reshape(n, self.k, d) * w.astype(ys.dtype).expand_dims(-1)).sum(1)
        return y

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
        if (self.capacity_factor is None or not self.training) and self.dropless == "dense":
            y = self._dropless_dense(flat, combine)
            dropped = ops.zeros((), ms.float32)
        elif self.capacity_factor is None or not self.training:
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
        if self.has_shared:
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


class DecoderLayer(nn.Cell):
    """Pre-norm block: x + MLA(norm(x)); x + (dense MLP | MoE)(norm(x)).
    Returns (x, load [E], dropped, aux); a dense layer returns zeros for the MoE parts."""

    def __init__(self, cfg: ModelConfig, rng, param_dtype, compute_dtype, moe: bool):
        super().__init__()
        self.attn_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, param_dtype)
        self.attn = MLAttention(cfg, rng, param_dtype, compute_dtype)
        self.mlp_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, param_dtype)
        self.is_moe = moe
        self.mlp = (
            MoE(cfg, rng, param_dtype, compute_dtype)
            if moe
            else MLP(cfg, rng, param_dtype, compute_dtype)
        )
        self.resid_dropout = nn.Dropout(p=cfg.dropout) if cfg.dropout > 0 else None
        self.e = max(cfg.n_routed_experts, 1)

    def ffn(self, x):
        h = self.mlp_norm(x)
        if self.is_moe:
            return self.mlp(h)
        z = ops.zeros((), ms.float32)
        return self.mlp(h), ops.zeros((self.e,), ms.float32), z, z

    def construct(self, x, cos, sin, bias):
        h = self.attn(self.attn_norm(x), cos, sin, bias)
        if self.resid_dropout is not None:
            h = self.resid_dropout(h)
        x = x + h
        h, load, dropped, aux = self.ffn(x)
        if self.resid_dropout is not None:
            h = self.resid_dropout(h)
        return x + h, load, dropped, aux


class MTPModule(nn.Cell):
    """One multi-token-prediction depth: h' = block(eh_proj([enorm(emb(t_{i+j})); hnorm(h_i)]))."""

    def __init__(self, cfg: ModelConfig, rng, param_dtype, compute_dtype):
        super().__init__()
        d = cfg.hidden_size
        self.enorm = RMSNorm(d, cfg.rms_norm_eps, param_dtype)
        self.hnorm = RMSNorm(d, cfg.rms_norm_eps, param_dtype)
        self.eh_proj = Linear(
            2 * d, d, _normal(rng, (d, 2 * d), cfg.init_std), param_dtype, compute_dtype
        )
        self.block = DecoderLayer(
            cfg, rng, param_dtype, compute_dtype, moe=cfg.n_routed_experts > 0
        )
        self.norm = RMSNorm(d, cfg.rms_norm_eps, param_dtype)

    def construct(self, emb, h, cos, sin, bias):
        # emb, h [B, S, D] -> (h' [B, S, D] before the final norm, load, dropped, aux)
        x = self.eh_proj(ops.concat((self.enorm(emb), self.hnorm(h)), -1))
        return self.block(x, cos, sin, bias)


# ----------------------------------------------------------------------------- model


class DeepseekV3(nn.Cell):
    """tokens [B, S] int32 (+ optional position_ids, segment_ids [B, S]) -> logits [B, S, V] fp32.

    `construct` is the inference forward (what generate, evaluation and export use);
    `forward_train` also returns the MTP hidden states and the MoE statistics.
    """

    def __init__(self, cfg: ModelConfig, seed: int | None = None):
        super().__init__()
        cfg.validate()
        if cfg.family != "deepseek_v3":
            raise ValueError(
                f"model config: DeepseekV3 needs family 'deepseek_v3', found {cfg.family!r}"
            )
        self.config = cfg
        param_dtype = _DTYPES[cfg.param_dtype]
        compute_dtype = resolve_compute_dtype(cfg.compute_dtype)
        self.compute_dtype = compute_dtype
        rng = np.random.default_rng(cfg.init_seed if seed is None else seed)
        embed_std = cfg.init_std if cfg.embed_init_std is None else cfg.embed_init_std
        head_std = cfg.init_std if cfg.head_init_std is None else cfg.head_init_std
        d, v = cfg.hidden_size, cfg.vocab_size
        self.embed = Embedding(_normal(rng, (v, d), embed_std), param_dtype, compute_dtype)
        self.embed_dropout = nn.Dropout(p=cfg.dropout) if cfg.dropout > 0 else None
        moe_ids = set(_moe_layer_ids(cfg))
        self.layers = nn.CellList(
            [
                DecoderLayer(cfg, rng, param_dtype, compute_dtype, i in moe_ids)
                for i in range(cfg.num_layers)
            ]
        )
        self.norm = RMSNorm(d, cfg.rms_norm_eps, param_dtype)
        self.tie_embeddings = cfg.tie_embeddings
        if not cfg.tie_embeddings:
            self.lm_head = Linear(d, v, _normal(rng, (v, d), head_std), param_dtype, compute_dtype)
        self.mtp = nn.CellList(
            [
                MTPModule(cfg, rng, param_dtype, compute_dtype)
                for _ in range(cfg.num_nextn_predict_layers)
            ]
        )
        inv_freq, cos_factor, _ = yarn_inv_freq(cfg)
        self.inv_freq = Tensor(inv_freq)  # [dr/2]
        self.cos_factor = cos_factor
        self.positions = Tensor(np.arange(cfg.max_seq_len, dtype=np.int32)[None])  # [1, S_max]
        self.head_matmul = ops.MatMul(transpose_b=True)
        self.n_moe = len(moe_ids)
        self.moe_index = [i for i in range(cfg.num_layers) if i in moe_ids]
        for i in recompute_layer_ids(cfg):
            self.layers[i].recompute()

    def rope(self, position_ids):
        cos, sin = rope_cos_sin(position_ids, self.inv_freq)
        if self.cos_factor != 1.0:
            cos, sin = cos * self.cos_factor, sin * self.cos_factor
        return cos, sin

    def trunk(self, tokens, position_ids=None, segment_ids=None):
        """-> (h [B, S, D] after the last layer, before the final norm; cos; sin; bias;
        loads [n_moe, E]; dropped; aux)."""
        b, s = tokens.shape
        if position_ids is None:
            position_ids = self.positions[:, :s]
        cos, sin = self.rope(position_ids)
        bias = attention_bias(s, segment_ids)
        x = self.embed(tokens)
        if self.embed_dropout is not None:
            x = self.embed_dropout(x)
        loads = []
        dropped = ops.zeros((), ms.float32)
        aux = ops.zeros((), ms.float32)
        for layer in self.layers:
            x, load, drop, a = layer(x, cos, sin, bias)
            if layer.is_moe:
                loads.append(load)
                dropped = dropped + drop
                aux = aux + a
        stacked = (
            ops.stack(loads)
            if loads
            else ops.zeros((1, max(self.config.n_routed_experts, 1)), ms.float32)
        )
        return x, cos, sin, bias, stacked, dropped, aux

    def construct(self, tokens, position_ids=None, segment_ids=None):
        x = self.trunk(tokens, position_ids, segment_ids)[0]
        return self.head(self.norm(x))

    # the output head reads the same attributes as Llama's (tie_embeddings, embed,
    # head_matmul, lm_head): one implementation for both families
    head = Llama.head


def _shift_left(x, j: int, fill):
    # x [B, S] -> x[:, j:] padded with `fill` on the right (static shapes for the graph)
    if j == 0:
        return x
    pad = ops.full((x.shape[0], j), fill, dtype=x.dtype)
    return ops.concat((x[:, j:], pad), 1)


class DeepseekV3WithLoss(nn.Cell):
    """The train-step forward: (tokens, labels, position_ids, segment_ids, loss_mask) ->
    (loss, main loss, MTP loss, balance loss, loads [n_moe + mtp moe, E], dropped tokens).

    loss = main + mtp_loss_weight * mean over depths of the MTP losses + balance loss.
    MTP depth j (1-based) at position i reads token i+j and predicts label i+j (token
    i+j+1); positions whose target lies past the row or in another document are masked.
    """

    def __init__(self, model: DeepseekV3):
        super().__init__(auto_prefix=False)
        self.model = model
        self.mtp_weight = float(model.config.mtp_loss_weight)
        self.depths = model.config.num_nextn_predict_layers

    def construct(self, tokens, labels, position_ids=None, segment_ids=None, loss_mask=None):
        m = self.model
        h, cos, sin, bias, loads, dropped, aux = m.trunk(tokens, position_ids, segment_ids)
        main = causal_lm_loss(m.head(m.norm(h)), labels, loss_mask)
        mask = (
            ops.ones(labels.shape, ms.float32)
            if loss_mask is None
            else loss_mask.astype(ms.float32)
        )
        seg = ops.zeros(labels.shape, ms.int32) if segment_ids is None else segment_ids
        mtp_total = ops.zeros((), ms.float32)
        all_loads = [loads]
        prev = m.norm(h)  # the main model's output hidden state (vLLM's MTP reads it normed)
        j = 0
        for mod in m.mtp:
            j += 1
            nxt_tokens = _shift_left(tokens, j, 0)  # token i+j (= labels[i+j-1])
            nxt_labels = _shift_left(labels, j, 0)
            valid = _shift_left(mask, j, 0.0) * (_shift_left(seg, j, -1) == seg).astype(ms.float32)
            hj, load, drop, a = mod(m.embed(nxt_tokens), prev, cos, sin, bias)
            all_loads.append(load.expand_dims(0))
            dropped = dropped + drop
            aux = aux + a
            mtp_total = mtp_total + causal_lm_loss(m.head(mod.norm(hj)), nxt_labels, valid)
            prev = mod.norm(hj)
        mtp = mtp_total / max(self.depths, 1)
        loss = main + self.mtp_weight * mtp + aux
        return loss, main, mtp, aux, ops.concat(all_loads, 0), dropped


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


# ----------------------------------------------------------------------------- decoding


class MLACachedDecoder(nn.Cell):
    """tokens [B, T] at positions start..start+T-1 against fixed-size MLA caches.

    The caches hold what MLA exists to keep small: the normalised latent [L, B, C, r]
    and the rotated shared RoPE key [L, B, C, dr] (C = max_seq_len), not per-head keys
    and values; keys and values are expanded from them at each step. Returns logits
    [B, T, V] fp32 and the updated caches. Only the main model decodes (MTP is a
    training objective here).
    """

    def __init__(self, model: DeepseekV3):
        super().__init__(auto_prefix=False)
        self.model = model
        self.slots = Tensor(np.arange(model.config.max_seq_len, dtype=np.int32))  # [C]

    def construct(self, tokens, start, c_cache, r_cache):
        m = self.model
        b, t = tokens.shape
        pos = m.positions[:, :t] + start  # [1, T]
        cos, sin = m.rope(pos)
        allowed = self.slots.expand_dims(0) <= pos.reshape(t, 1)  # [T, C]
        bias = ops.select(
            allowed,
            ops.zeros(allowed.shape, ms.float32),
            ops.full(allowed.shape, -1e9, dtype=ms.float32),
        ).reshape(1, 1, t, -1)
        write = (self.slots.expand_dims(0) == pos.reshape(t, 1)).astype(m.compute_dtype)  # [T, C]
        keep = 1 - write.sum(0).reshape(-1, 1)  # [C, 1]
        scatter = write.transpose(1, 0)  # [C, T]
        x = m.embed(tokens)
        new_c, new_r = [], []
        i = 0
        for layer in m.layers:
            attn = layer.attn
            hn = layer.attn_norm(x)
            q = attn.query(hn, cos, sin)
            c, kr = attn.latent(hn, cos, sin)  # [B, T, r], [B, 1, T, dr]
            cc = c_cache[i] * keep + ops.matmul(scatter, c)  # [B, C, r]; one-hot: exact
            rc = r_cache[i] * keep + ops.matmul(scatter, kr.reshape(b, t, -1))  # [B, C, dr]
            new_c.append(cc)
            new_r.append(rc)
            k, v = attn.expand(cc, rc.expand_dims(1))
            x = x + attn.attend(q, k, v, bias)
            x = x + layer.ffn(x)[0]
            i += 1
        return m.head(m.norm(x)), ops.stack(new_c), ops.stack(new_r)


def mla_empty_cache(model: DeepseekV3, batch: int):
    cfg = model.config
    c = np.zeros((cfg.num_layers, batch, cfg.max_seq_len, cfg.kv_lora_rank), np.float32)
    r = np.zeros((cfg.num_layers, batch, cfg.max_seq_len, cfg.qk_rope_head_dim), np.float32)
    return Tensor(c).astype(model.compute_dtype), Tensor(r).astype(model.compute_dtype)
