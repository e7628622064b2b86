"""DeepSeek-V3's multi-head latent attention (MLA) and its RoPE (plain or YaRN).

Shapes: B batch, S sequence, D hidden, H heads, dn / dr per-head query-key widths
without / with RoPE, dv per-head value width, r kv_lora_rank (the KV latent), rq
q_lora_rank. Parameter layout in _deepseek.py.
"""

from __future__ import annotations

import math

import numpy as np
from mindspore import Tensor, nn, ops

from mindloom_model._llama import Linear, ModelConfig, RMSNorm, _normal, attention

__all__ = ["MLAttention", "yarn_inv_freq"]

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


def _rope_pairs(x, cos, sin, perm_a, perm_b):
    """x [B, h, S, dr]; cos/sin [B|1, 1, S, dr] (two equal halves); perm_a/perm_b
    [dr, dr] = _rope_perms(dr, interleave) as fp32 tensors.

    interleave: pairs (x0, x1), (x2, x3), ... rotate by one frequency each and the result
    is laid out as [evens', odds'] (Hugging Face's apply_rotary_pos_emb_interleave);
    otherwise rotate_half pairs i with i + dr/2 (the Llama layout). Both as
    x @ A * cos + x @ B * sin with constant 0/1 (signed) permutations A, B: exact, and
    their backward is matmuls too, where strided slices and concats are slow on the CPU."""
    dr = x.shape[-1]
    lead = x.shape[:-1]
    flat = x.reshape(-1, dr)
    xa = ops.matmul(flat, perm_a.astype(x.dtype)).reshape(lead + (dr,))
    xb = ops.matmul(flat, perm_b.astype(x.dtype)).reshape(lead + (dr,))
    return xa * cos.astype(x.dtype) + xb * sin.astype(x.dtype)


def _rope_perms(dr: int, interleave: bool):
    # y = x @ a is [x0, x2, ...; x1, x3, ...] (interleave) or x; x @ b is rotate_half(y)
    half = dr // 2
    a = np.zeros((dr, dr), np.float32)
    src = np.r_[0:dr:2, 1:dr:2] if interleave else np.arange(dr)
    a[src, np.arange(dr)] = 1.0
    rot = np.zeros((dr, dr), np.float32)  # [y1, y2] @ rot = [-y2, y1]
    rot[np.arange(half) + half, np.arange(half)] = -1.0
    rot[np.arange(half), np.arange(half) + half] = 1.0
    return a, a @ rot


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
        self.rope_a, self.rope_b = (Tensor(m) for m in _rope_perms(self.dr, self.interleave))
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
        # a _kernels.KernelRopeAttention(self.scale), set by _install_kernels
        self.kernel = None
        self.mm_t = ops.MatMul(transpose_b=True)
        self._fused_indices(h)

    def split_heads(self, n: int) -> None:
        """Keep 1/n of the heads (tensor parallel: the projections' weights were cut by
        head), and the fused path's gathers for that many heads."""
        self.n_heads //= n
        self._fused_indices(self.n_heads)

    def _fused_indices(self, h: int) -> None:
        """The fused path's gathers (see `fused`): every head's dn+dr query-key dims in the
        order [nope first half, rope a, nope second half, rope b], where rope a / b are the
        two halves RoPE pairs (the even / odd dims with rope_interleave, else the first /
        second half), so the kernel's rotate_half over a whole head pairs rope a with rope
        b and nope with nope (the tables leave nope as is). Scores are sums over the dims:
        the order does not change them."""
        dn, dr, dv, r = self.dn, self.dr, self.dv, self.r
        qk = dn + dr
        rope = np.r_[0:dr:2, 1:dr:2] if self.interleave else np.arange(dr)
        ra, rb = rope[: dr // 2], rope[dr // 2 :]
        nope = np.arange(dn)
        head = np.concatenate([nope[: dn // 2], dn + ra, nope[dn // 2 :], dn + rb])
        self.q_rows = Tensor((np.arange(h)[:, None] * qk + head).reshape(-1).astype(np.int32))
        # k's rows: from kv_b_proj's key rows (padded with dr zero columns) and, for the rope
        # dims, the rows of a [dr, r + dr] selector appended after them (the shared key)
        base = h * (dn + dv)
        per_head = []
        for i in range(h):
            nope_rows = i * (dn + dv) + nope
            per_head.append(np.concatenate([nope_rows[: dn // 2], base + ra,
                                            nope_rows[dn // 2 :], base + rb]))  # fmt: skip
        self.k_rows = Tensor(np.concatenate(per_head).astype(np.int32))
        self.v_rows = Tensor(
            (np.arange(h)[:, None] * (dn + dv) + dn + np.arange(dv)).reshape(-1).astype(np.int32)
        )
        sel = np.zeros((dr, r + dr), np.float32)
        sel[:, r:] = np.eye(dr, dtype=np.float32)
        self.k_rope_sel = Tensor(sel)
        # [I_r, 0] [r, r + dr]: kv_b_proj's weight times it is the weight with dr zero
        # columns appended. A product, not a concat: a parameter inside a concat made
        # MindSpore load every later kernel's weights twice (forward and backward) and copy
        # them (TensorMove: ~74 copies per deepseek-v3-small step, 16 MB of expert weights)
        pad = np.zeros((r, r + dr), np.float32)
        pad[:, :r] = np.eye(r, dtype=np.float32)
        self.k_pad = Tensor(pad)
        # table columns: 0 = the nope constant (cos 1, sin 0), 1 + j = the rope table's j
        self.table_cols = Tensor(
            np.concatenate([np.zeros(dn // 2), 1 + np.arange(dr // 2),
                            np.zeros(dn // 2), 1 + dr // 2 + np.arange(dr // 2)]).astype(np.int32)
        )  # fmt: skip

    def query(self, x, cos, sin):
        # x [B, S, D] -> q [B, H, S, dn+dr], RoPE on its last dr
        b, s, _ = x.shape
        q = self.q_b_proj(self.q_a_norm(self.q_a_proj(x))) if self.q_lora else self.q_proj(x)
        q = q.reshape(b, s, self.n_heads, self.dn + self.dr).transpose(0, 2, 1, 3)
        return ops.concat(
            (q[..., : self.dn], _rope_pairs(q[..., self.dn :], cos, sin, self.rope_a, self.rope_b)),
            -1,
        )

    def latent(self, x, cos, sin):
        # x [B, S, D] -> c [B, S, r] (normalised latent), k_rope [B, 1, S, dr] (rotated)
        b, s, _ = x.shape
        ckv = self.kv_a_proj(x)  # [B, S, r + dr]
        c = self.kv_a_norm(ckv[..., : self.r])
        k_rope = ckv[..., self.r :].reshape(b, 1, s, self.dr)
        return c, _rope_pairs(k_rope, cos, sin, self.rope_a, self.rope_b)

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

    def fused(self, x, cos, sin, segment_ids):
        """The fused CPU kernel's path: x [B, S, D], cos/sin [B|1, S, 1, dr], segment ids
        [B|1, S] int32 -> [B, S, D]. Heads stay in the projections' [B, S, H, .] layout;
        no [S, S] mask or scores exist; the kernel rotates q and k itself, takes dn+dr wide
        keys and dv wide values, and applies the softmax scale (YaRN's mscale included).

        No activation is sliced, concatenated or rotated per head outside the kernel (on
        the CPU those copies and their backward were ~10% of deepseek-v3-small's step): the
        head dims are reordered (`_fused_indices`) by gathering the projections' weight
        rows, so the kernel's whole-head RoPE rotates only the rope dims; each head's key is
        one product of the latent [c, k_rope] [B, S, r+dr] with kv_b_proj's key rows
        (zero-padded) and selector rows that copy the shared rope key."""
        b, s, _ = x.shape
        h, dn, dr, dv, r = self.n_heads, self.dn, self.dr, self.dv, self.r
        qk = dn + dr
        proj = self.q_b_proj if self.q_lora else self.q_proj
        q_in = self.q_a_norm(self.q_a_proj(x)) if self.q_lora else x
        wq = ops.gather(proj.weight, self.q_rows, 0)  # [H*qk, in], heads' dims reordered
        q = self.mm_t(q_in.reshape(b * s, -1), wq).reshape(b, s, h, qk)
        ckv = self.kv_a_proj(x)  # [B, S, r + dr]
        c = self.kv_a_norm(ckv[..., :r])  # [B, S, r]
        lat = ops.concat((c, ckv[..., r:]), -1).reshape(b * s, r + dr)  # rope key unrotated
        w = self.kv_b_proj.weight  # [H*(dn+dv), r]
        wk = ops.concat((ops.matmul(w, self.k_pad.astype(w.dtype)),
                         self.k_rope_sel.astype(w.dtype)), 0)  # fmt: skip
        k = self.mm_t(lat, ops.gather(wk, self.k_rows, 0)).reshape(b, s, h, qk)
        wv = ops.gather(w, self.v_rows, 0)  # [H*dv, r]
        v = self.mm_t(c.reshape(b * s, r), wv).reshape(b, s, h, dv)
        lead = cos.shape[:-2]  # [B|1, S]
        cos_t = ops.concat((ops.ones(lead + (1,), cos.dtype), cos.reshape(lead + (dr,))), -1)
        sin_t = ops.concat((ops.zeros(lead + (1,), sin.dtype), sin.reshape(lead + (dr,))), -1)
        cos_t, sin_t = ops.gather(cos_t, self.table_cols, 2), ops.gather(sin_t, self.table_cols, 2)
        o = self.kernel(q, k, v, segment_ids, cos_t, sin_t)[0]  # [B, S, H, dv]
        return self.wo(o.reshape(b, s, h * self.dv))

    def construct(self, x, cos, sin, bias):
        # bias: the additive mask [B|1, 1, S, S], or the segment ids [B|1, S] when the
        # model runs the fused kernel (DeepseekV3.attention_inputs); a caller that passes
        # a mask (MaxLogits statistics) gets the portable path either way
        if self.kernel is not None and bias.ndim == 2:
            return self.fused(x, cos, sin, bias)
        q = self.query(x, cos, sin)
        k, v = self.expand(*self.latent(x, cos, sin))
        return self.attend(q, k, v, bias)
