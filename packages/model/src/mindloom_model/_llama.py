"""A Llama-family decoder in MindSpore, in one file (in the spirit of nanoGPT's model.py).

Shapes in comments: B batch, S sequence, D model width (hidden), H query heads,
KV key/value heads, Dh head width, F feed-forward width, V vocabulary.

Layout (parameter names are the attribute paths, see docs/contracts.md):

    embed                       Embedding   weight [V, D]
    layers.{i}.attn_norm        RMSNorm     weight [D]
    layers.{i}.attn.wq/wk/wv/wo Linear      weight [out, in], no bias
    layers.{i}.mlp_norm         RMSNorm     weight [D]
    layers.{i}.mlp.w1/w2/w3     Linear      gate / down / up projections
    norm                        RMSNorm     weight [D]
    lm_head                     Linear      weight [V, D]; absent when tied to embed

Every projection is a small `Linear` held as an attribute, and attention reads its head
counts from instance attributes, so tensor/sequence parallelism can be applied from
outside by replacing those attributes (torchtitan-style), without editing this file.

Attention boundaries: token i may attend to token j only if j <= i (causal) AND
segment_ids[i] == segment_ids[j] (same packed document). Position ids drive RoPE, so a
packed document restarts at position 0.
"""

from __future__ import annotations

import logging
import math

import mindspore as ms
import numpy as np
from mindspore import Parameter, Tensor, nn, ops

from mindloom_model._config import ModelConfig, get_preset, preset_names  # noqa: F401
from mindloom_model._dropout import CounterDropout, dropout_site

log = logging.getLogger("mindloom_model")

_DTYPES = {"float32": ms.float32, "float16": ms.float16, "bfloat16": ms.bfloat16}


# ----------------------------------------------------------------------------- precision

_low_precision_ok: dict[str, bool] = {}


def resolve_compute_dtype(name: str):
    """The dtype matmuls actually run in: `name`, or fp32 where the backend lacks the kernel.

    Probed once per dtype with a tiny MatMul (MindSpore's CPU backend has no bf16 MatMul),
    and the fallback is logged once per process.
    """
    if name == "float32":
        return ms.float32
    if name not in _low_precision_ok:
        x = Tensor(np.ones((2, 2), np.float32)).astype(_DTYPES[name])
        try:
            ops.MatMul(transpose_b=True)(x, x).asnumpy()
            _low_precision_ok[name] = True
        except (RuntimeError, TypeError, ValueError):
            _low_precision_ok[name] = False
            log.warning(
                "compute_dtype=%s: the %s backend has no %s MatMul kernel; computing in float32",
                name,
                ms.get_context("device_target"),
                name,
            )
    return _DTYPES[name] if _low_precision_ok[name] else ms.float32


# ----------------------------------------------------------------------------- layers


def _normal(rng: np.random.Generator, shape, std: float) -> np.ndarray:
    return (rng.standard_normal(shape, dtype=np.float32) * np.float32(std)).astype(np.float32)


class Linear(nn.Cell):
    """y = x @ weight.T, weight [out, in], no bias. Runs in compute_dtype, returns compute_dtype."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        weight: np.ndarray,
        param_dtype=ms.float32,
        compute_dtype=ms.float32,
    ):
        super().__init__()
        assert weight.shape == (out_features, in_features), (
            weight.shape,
            out_features,
            in_features,
        )
        self.in_features = in_features
        self.out_features = out_features
        self.compute_dtype = compute_dtype
        self.weight = Parameter(Tensor(weight, param_dtype), name="weight")
        self.matmul = ops.MatMul(transpose_b=True)

    def construct(self, x):
        # x [..., in] -> [..., out]; a 2-D MatMul is the fastest kernel on every backend
        lead = x.shape[:-1]
        w = self.weight
        if self.compute_dtype != w.dtype:
            w = w.astype(self.compute_dtype)
        y = self.matmul(x.reshape(-1, self.in_features), w)
        return y.reshape(lead + (self.out_features,))


class Embedding(nn.Cell):
    """tokens [B, S] int -> [B, S, D] compute dtype; weight [V, D]."""

    def __init__(self, weight: np.ndarray, param_dtype=ms.float32, compute_dtype=ms.float32):
        super().__init__()
        self.num_embeddings, self.embedding_dim = weight.shape
        self.compute_dtype = compute_dtype
        self.weight = Parameter(Tensor(weight, param_dtype), name="weight")

    def construct(self, tokens):
        return ops.gather(self.weight, tokens, 0).astype(self.compute_dtype)


class _ScaleRowsCols(nn.Cell):
    """x [N, D] * r [N, 1] * w [D], with every backward reduction written as a matmul.

    Autodiff of the broadcast products would sum the gradients of r and w with
    ReduceSum, which MindSpore's CPU backend runs several times slower than a matmul
    against a ones vector (about a quarter of a small model's step went there).
    """

    def construct(self, x, r, w):
        return x * r * w

    def bprop(self, x, r, w, out, dout):
        gw = dout * w  # [N, D]
        dx = gw * r
        dr = ops.matmul(gw * x, ops.ones((x.shape[1], 1), x.dtype))  # [N, 1]
        dw = ops.matmul(ops.ones((1, x.shape[0]), x.dtype), dout * x * r).reshape(w.shape)
        return dx, dr, dw


class _Softmax(nn.Cell):
    """Softmax over the last axis whose backward row sum is a matmul (see _ScaleRowsCols)."""

    def construct(self, x):
        return ops.softmax(x, -1)

    def bprop(self, x, out, dout):
        t = x.shape[-1]
        row = ops.matmul((dout * out).reshape(-1, t), ops.ones((t, 1), out.dtype))
        return (out * (dout - row.reshape(x.shape[:-1] + (1,))),)


_scale_rows_cols = _ScaleRowsCols()
_softmax = _Softmax()


class RMSNorm(nn.Cell):
    """x / rms(x) * weight, normalized in fp32 (as Hugging Face Llama does)."""

    def __init__(self, dim: int, eps: float, param_dtype=ms.float32):
        super().__init__()
        self.eps = eps
        self.weight = Parameter(Tensor(np.ones(dim, np.float32), param_dtype), name="weight")
        self.kernel = None  # a _kernels.KernelRMSNorm, set by use_cpu_kernels
        self.eps_t = Tensor(np.array([eps], np.float32))

    def construct(self, x):
        # x [..., D] in compute dtype -> same dtype; the mean over D is a matmul (see
        # _ScaleRowsCols for why), the arithmetic is Hugging Face's
        # getattr: tensor parallelism runs this construct on its own wrapper cell
        kernel = getattr(self, "kernel", None)
        if kernel is not None:
            return kernel(x, self.weight, self.eps_t)[0]
        d = x.shape[-1]
        h = x.astype(ms.float32).reshape(-1, d)  # [N, D]
        mean_sq = ops.matmul(h * h, ops.fill(ms.float32, (d, 1), 1.0 / d))  # [N, 1]
        r = ops.rsqrt(mean_sq + self.eps)
        y = _scale_rows_cols(h, r, self.weight.astype(ms.float32))
        return y.reshape(x.shape).astype(x.dtype)


def rope_inv_freq(head_dim: int, theta: float) -> np.ndarray:
    # [Dh/2]: 1 / theta^(2i/Dh), computed like Hugging Face (fp32 from an int64 arange)
    return 1.0 / (
        theta ** (np.arange(0, head_dim, 2, dtype=np.int64).astype(np.float32) / head_dim)
    )


def rope_cos_sin(position_ids, inv_freq):
    """position_ids [B, S] int, inv_freq [Dh/2] fp32 -> cos, sin [B, 1, S, Dh] fp32.

    Hugging Face's layout: the two halves of each head repeat the same frequencies, and
    `rotate_half` pairs element i with i + Dh/2 (HF's checkpoints are permuted for it), so
    HF weights load here unchanged.
    """
    freqs = position_ids.astype(ms.float32).expand_dims(-1) * inv_freq  # [B, S, Dh/2]
    emb = ops.concat((freqs, freqs), -1).expand_dims(1)  # [B, 1, S, Dh]
    # constants of the step: cutting them out of autodiff spares the backward pass from
    # reducing their (unused) gradients over heads in every layer
    return ops.stop_gradient(ops.cos(emb)), ops.stop_gradient(ops.sin(emb))


def apply_rope(x, cos, sin):
    # x [B, h, S, Dh]; rotate_half(x) = [-x2, x1]
    half = x.shape[-1] // 2
    x1 = x[..., :half]
    x2 = x[..., half:]
    rotated = ops.concat((-x2, x1), -1)
    return x * cos.astype(x.dtype) + rotated * sin.astype(x.dtype)


def attention_bias(seq_len: int, segment_ids=None, causal=None):
    """Additive mask [B or 1, 1, S, S] fp32: 0 where allowed, -1e9 where not.

    Allowed: key j <= query i (causal) AND segment_ids[i] == segment_ids[j].
    `causal` is an optional precomputed [S, S] bool lower-triangular tensor.
    """
    if causal is None:
        causal = Tensor(np.tril(np.ones((seq_len, seq_len), np.bool_)))
    allowed = causal.expand_dims(0)  # [1, S, S]
    if segment_ids is not None:
        same = segment_ids.expand_dims(2) == segment_ids.expand_dims(1)  # [B, S, S]
        allowed = ops.logical_and(allowed, same)
    zero = ops.zeros((), ms.float32)
    neg = ops.fill(ms.float32, (), -1e9)
    bias = ops.select(allowed, zero.broadcast_to(allowed.shape), neg.broadcast_to(allowed.shape))
    return ops.stop_gradient(bias.expand_dims(1))


def attention(q, k, v, bias, n_rep: int, dropout=None, scale=None, dropout_key=None):
    """Scaled dot-product attention, softmax in fp32.

    q [B, H, S, Dh], k/v [B, KV, T, Dh] (T = S, or the cache size in generation),
    bias [B|1, 1, S, T] additive fp32 -> [B, H, S, Dh] in q's dtype.
    Grouped-query: query head h reads kv head h // n_rep (Hugging Face's repeat_kv).
    scale: None = 1/sqrt(Dh); pass 1.0 when q is already scaled (Attention does).
    dropout_key: the counter-based dropout's key (see CounterDropout), None = stateful.
    """
    if n_rep > 1:
        b, kv, t, dh = k.shape
        k = k.expand_dims(2).broadcast_to((b, kv, n_rep, t, dh)).reshape(b, kv * n_rep, t, dh)
        v = v.expand_dims(2).broadcast_to((b, kv, n_rep, t, dh)).reshape(b, kv * n_rep, t, dh)
    if scale is None:
        scale = 1.0 / math.sqrt(q.shape[-1])
    scores = ops.BatchMatMul(transpose_b=True)(q, k).astype(ms.float32)  # [B, H, S, T]
    if scale != 1.0:
        scores = scores * scale
    probs = _softmax(scores + bias).astype(q.dtype)
    if dropout is not None:
        # without a key, any dropout cell (DeepSeek's nn.Dropout too) is called as before
        probs = dropout(probs) if dropout_key is None else dropout(probs, dropout_key)
    return ops.BatchMatMul()(probs, v)  # [B, H, S, Dh]


_flash_warned = False


def _use_flash(cfg: ModelConfig) -> bool:
    global _flash_warned
    if cfg.attention_impl != "flash":
        return False
    if ms.get_context("device_target") == "Ascend":
        return True
    if not _flash_warned:
        _flash_warned = True
        log.warning("attention_impl=flash needs Ascend; using the portable eager attention")
    return False


def _dropout(cfg: ModelConfig, site: int) -> CounterDropout | None:
    # dropout 0 builds no cell, so the graph has no extra ops
    return CounterDropout(cfg.dropout, site) if cfg.dropout > 0 else None


class Attention(nn.Cell):
    def __init__(
        self, cfg: ModelConfig, rng: np.random.Generator, param_dtype, compute_dtype, layer_id=0
    ):
        super().__init__()
        d, dh = cfg.hidden_size, cfg.head_dim
        # local head counts: a tensor-parallel wrapper divides these by tp
        self.n_heads = cfg.num_heads
        self.n_kv_heads = cfg.num_kv_heads
        self.head_dim = dh
        self.scale = 1.0 / math.sqrt(dh)
        out_std = cfg.init_std / math.sqrt(2 * cfg.num_layers)
        lin = lambda i, o, std: Linear(i, o, _normal(rng, (o, i), std), param_dtype, compute_dtype)  # noqa: E731
        self.wq = lin(d, cfg.num_heads * dh, cfg.init_std)
        self.wk = lin(d, cfg.num_kv_heads * dh, cfg.init_std)
        self.wv = lin(d, cfg.num_kv_heads * dh, cfg.init_std)
        self.wo = lin(cfg.num_heads * dh, d, out_std)
        self.attn_dropout = _dropout(cfg, dropout_site(layer_id, "attn_probs"))
        self.flash = _use_flash(cfg)
        self.kernel = None  # a _kernels.KernelAttention, set by use_cpu_kernels

    def qkv(self, x, cos, sin, q_scale=1.0):
        # x [B, S, D] -> q [B, H, S, Dh], k/v [B, KV, S, Dh], RoPE applied to q and k.
        # q_scale multiplies q through the small [B, 1, S, Dh] RoPE tables: cheaper than
        # scaling the [B, H, S, S] scores, forward and backward, in every layer.
        b, s, _ = x.shape
        q = self.wq(x).reshape(b, s, self.n_heads, self.head_dim).transpose(0, 2, 1, 3)
        k = self.wk(x).reshape(b, s, self.n_kv_heads, self.head_dim).transpose(0, 2, 1, 3)
        v = self.wv(x).reshape(b, s, self.n_kv_heads, self.head_dim).transpose(0, 2, 1, 3)
        if q_scale != 1.0:
            q = apply_rope(q, cos * q_scale, sin * q_scale)
        else:
            q = apply_rope(q, cos, sin)
        return q, apply_rope(k, cos, sin), v

    def out(self, o):
        # o [B, H, S, Dh] -> [B, S, D]
        b, h, s, dh = o.shape
        return self.wo(o.transpose(0, 2, 1, 3).reshape(b, s, h * dh))

    def construct(self, x, cos, sin, bias, dropout_key=None, kv_cache=None):
        """x [B, S, D] -> [B, S, D]; with `kv_cache` -> (out, k_cache, v_cache).

        kv_cache (decoding, see `_generate`): (k_cache, v_cache, keep, scatter) with the
        caches [B, KV, C, Dh] holding position p in slot p, scatter [C, S] the one-hot
        placement of this call's S keys/values and keep [C, 1] zero on the slots they
        overwrite; bias is then [1, 1, S, C]. The portable eager path runs then.
        """
        if kv_cache is not None:
            k_cache, v_cache, keep, scatter = kv_cache
            q, k, v = self.qkv(x, cos, sin, self.scale)
            # cache[..., slot, :] = k at the written slots (a one-hot matmul: exact)
            k_cache = k_cache * keep + ops.matmul(scatter, k)  # [B, KV, C, Dh]
            v_cache = v_cache * keep + ops.matmul(scatter, v)
            n_rep = self.n_heads // self.n_kv_heads
            o = attention(q, k_cache, v_cache, bias, n_rep, self.attn_dropout, 1.0, dropout_key)
            return self.out(o), k_cache, v_cache
        if self.kernel is not None:
            # bias is segment ids [B|1, S] int32 and cos/sin are [B|1, S, 1, Dh] here:
            # heads stay in the projections' [B, S, H, Dh] layout, no S x S mask exists
            b, s, _ = x.shape
            q = self.wq(x).reshape(b, s, self.n_heads, self.head_dim)
            k = self.wk(x).reshape(b, s, self.n_kv_heads, self.head_dim)
            v = self.wv(x).reshape(b, s, self.n_kv_heads, self.head_dim)
            q = apply_rope(q, cos * self.scale, sin * self.scale)
            o = self.kernel(q, apply_rope(k, cos, sin), v, bias)[0]
            return self.wo(o.reshape(b, s, self.n_heads * self.head_dim))
        if self.flash:
            q, k, v = self.qkv(x, cos, sin)
            o = _flash_attention(q, k, v, bias, self.n_heads)
        else:
            q, k, v = self.qkv(x, cos, sin, self.scale)
            n_rep = self.n_heads // self.n_kv_heads
            o = attention(q, k, v, bias, n_rep, self.attn_dropout, 1.0, dropout_key)
        return self.out(o)


def _flash_attention(q, k, v, bias, n_heads):
    # Ascend's fused kernel takes a keep/drop mask (1 = masked out) and handles GQA itself
    drop = (bias < -1.0).astype(ms.uint8)
    return ops.flash_attention_score(
        q,
        k,
        v,
        n_heads,
        attn_mask=drop,
        scalar_value=1.0 / math.sqrt(q.shape[-1]),
        input_layout="BNSD",
    )


class MLP(nn.Cell):
    """SwiGLU: w2(silu(w1 x) * w3 x)."""

    def __init__(self, cfg: ModelConfig, rng: np.random.Generator, param_dtype, compute_dtype):
        super().__init__()
        d, f = cfg.hidden_size, cfg.ffn_hidden_size
        out_std = cfg.init_std / math.sqrt(2 * cfg.num_layers)
        self.w1 = Linear(d, f, _normal(rng, (f, d), cfg.init_std), param_dtype, compute_dtype)
        self.w2 = Linear(f, d, _normal(rng, (d, f), out_std), param_dtype, compute_dtype)
        self.w3 = Linear(d, f, _normal(rng, (f, d), cfg.init_std), param_dtype, compute_dtype)
        self.kernel = None  # a _kernels.KernelSwiGLU, set by use_cpu_kernels

    def construct(self, x):
        # x [B, S, D] -> [B, S, F] -> [B, S, D]
        if self.kernel is not None:
            return self.w2(self.kernel(self.w1(x), self.w3(x)))
        return self.w2(ops.silu(self.w1(x)) * self.w3(x))


class Block(nn.Cell):
    """Pre-norm transformer block: x + attn(norm(x)); x + mlp(norm(x))."""

    def __init__(
        self, cfg: ModelConfig, rng: np.random.Generator, param_dtype, compute_dtype, layer_id=0
    ):
        super().__init__()
        self.attn_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, param_dtype)
        self.attn = Attention(cfg, rng, param_dtype, compute_dtype, layer_id)
        self.mlp_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, param_dtype)
        self.mlp = MLP(cfg, rng, param_dtype, compute_dtype)
        self.resid_dropout = _dropout(cfg, dropout_site(layer_id, "attn_out"))
        self.mlp_dropout = _dropout(cfg, dropout_site(layer_id, "mlp_out"))

    def construct(self, x, cos, sin, bias, dropout_key=None, kv_cache=None):
        # x [B, S, D] -> [B, S, D]; with kv_cache (see Attention) -> (x, k_cache, v_cache)
        if kv_cache is None:
            h = self.attn(self.attn_norm(x), cos, sin, bias, dropout_key)
            return self.finish(x, h, dropout_key)
        h, k_cache, v_cache = self.attn(self.attn_norm(x), cos, sin, bias, dropout_key, kv_cache)
        return self.finish(x, h, dropout_key), k_cache, v_cache

    def finish(self, x, h, dropout_key=None):
        # the attention output h joins the residual stream, then the MLP branch
        if self.resid_dropout is not None:
            h = self.resid_dropout(h, dropout_key)
        x = x + h
        h = self.mlp(self.mlp_norm(x))
        if self.mlp_dropout is not None:
            h = self.mlp_dropout(h, dropout_key)
        return x + h


class Llama(nn.Cell):
    """tokens [B, S] int32 (+ optional position_ids, segment_ids [B, S]) -> logits [B, S, V] fp32."""

    def __init__(self, cfg: ModelConfig, seed: int | None = None):
        super().__init__()
        cfg.validate()
        self.config = cfg
        param_dtype = _DTYPES[cfg.param_dtype]
        compute_dtype = resolve_compute_dtype(cfg.compute_dtype)
        self.compute_dtype = compute_dtype
        # one generator, consumed in module order, so the same seed gives the same weights
        rng = np.random.default_rng(cfg.init_seed if seed is None else seed)
        embed_std = cfg.init_std if cfg.embed_init_std is None else cfg.embed_init_std
        head_std = cfg.init_std if cfg.head_init_std is None else cfg.head_init_std
        d, v = cfg.hidden_size, cfg.vocab_size

        self.embed = Embedding(_normal(rng, (v, d), embed_std), param_dtype, compute_dtype)
        self.embed_dropout = _dropout(cfg, dropout_site(None))
        self.layers = nn.CellList(
            [Block(cfg, rng, param_dtype, compute_dtype, i) for i in range(cfg.num_layers)]
        )
        self.norm = RMSNorm(d, cfg.rms_norm_eps, param_dtype)
        self.tie_embeddings = cfg.tie_embeddings
        if not cfg.tie_embeddings:
            self.lm_head = Linear(d, v, _normal(rng, (v, d), head_std), param_dtype, compute_dtype)
        self.inv_freq = Tensor(rope_inv_freq(cfg.head_dim, cfg.rope_theta))  # [Dh/2] constant
        # no [S_max, S_max] causal buffer here: at max_seq_len 100000 it alone was 9.3 GiB,
        # allocated before any check; construct builds the [S, S] mask of the actual length
        self.positions = Tensor(np.arange(cfg.max_seq_len, dtype=np.int32)[None])  # [1, S_max]
        self.head_matmul = ops.MatMul(transpose_b=True)
        self.kernel_attention = False
        self.loss_kernel = None
        if use_cpu_kernels(cfg, compute_dtype):
            _install_kernels(self)
        for i in recompute_layer_ids(cfg):
            self.layers[i].recompute()

    def construct(self, tokens, position_ids=None, segment_ids=None, dropout_key=None):
        # dropout_key: uint32[2] from dropout_key(seed, step, micro_batch) -> masks that a
        # resumed run redraws exactly; None -> MindSpore's stateful dropout (training only).
        # A pipeline stage is this model with parts removed (mindloom_parallel): after the
        # first stage `tokens` are hidden states [B, S, D] and are not embedded; without
        # the final norm (every stage but the last) the hidden states are returned.
        s = tokens.shape[1]
        if position_ids is None:
            position_ids = self.positions[:, :s]  # [1, S]
        cos, sin, bias = self.attention_inputs(position_ids, segment_ids)
        if tokens.ndim == 2:
            x = self.embed(tokens)  # [B, S, D]
            if self.embed_dropout is not None:
                x = self.embed_dropout(x, dropout_key)
        else:
            x = tokens
        for layer in self.layers:
            x = layer(x, cos, sin, bias, dropout_key)
        if self.norm is None:
            return x
        x = self.norm(x)
        return self.head(x)

    def attention_inputs(self, position_ids, segment_ids=None):
        """(cos, sin, bias) every layer takes: RoPE tables [B|1, 1, S, Dh] and the additive
        mask [B|1, 1, S, S] fp32; with the fused attention kernel, RoPE tables
        [B|1, S, 1, Dh] and the segment ids [B|1, S] int32 instead (no S x S mask)."""
        s = position_ids.shape[1]
        cos, sin = rope_cos_sin(position_ids, self.inv_freq)  # [B|1, 1, S, Dh]
        if self.kernel_attention:
            # the kernel reads the documents from the segment ids; RoPE in [B, S, H, Dh]
            cos, sin = cos.transpose(0, 2, 1, 3), sin.transpose(0, 2, 1, 3)
            if segment_ids is None:
                return cos, sin, ops.zeros((1, s), ms.int32)
            return cos, sin, segment_ids.astype(ms.int32)
        pos = self.positions[0, :s]
        causal = pos.expand_dims(1) >= pos.expand_dims(0)  # [S, S] lower triangle
        return cos, sin, attention_bias(s, segment_ids, causal)  # [B|1, 1, S, S]

    def head(self, x):
        # x [B, S, D] -> logits [B, S, V] fp32
        if self.tie_embeddings:
            w = self.embed.weight
            if w.dtype != x.dtype:
                w = w.astype(x.dtype)
            b, s, d = x.shape
            logits = self.head_matmul(x.reshape(-1, d), w).reshape(b, s, -1)
        else:
            logits = self.lm_head(x)
        return logits.astype(ms.float32)


def use_cpu_kernels(cfg: ModelConfig, compute_dtype=ms.float32) -> bool:
    """Whether a Llama built now runs mindloom's fused CPU kernels (model.kernels: auto)."""
    if cfg.kernels != "auto" or cfg.family != "llama" or compute_dtype != ms.float32:
        return False
    if cfg.param_dtype != "float32":
        return False
    if ms.get_context("device_target") != "CPU":
        return False  # Ascend keeps its native fused ops
    # the ops carry no sharding strategy for MindSpore's auto-parallel modes
    if ms.get_auto_parallel_context("parallel_mode") not in ("stand_alone", "data_parallel"):
        return False
    from mindloom_model import _kernels

    return _kernels.available()


def _install_kernels(model: Llama) -> None:
    from mindloom_model import _kernels

    for cell in model.cells_and_names():
        obj = cell[1]
        if isinstance(obj, RMSNorm):
            obj.kernel = _kernels.KernelRMSNorm()
        elif isinstance(obj, MLP):
            obj.kernel = _kernels.KernelSwiGLU()
    if model.config.dropout == 0:  # the kernel has no dropout on the probabilities
        model.kernel_attention = True
        for layer in model.layers:
            layer.attn.kernel = _kernels.KernelAttention()
    model.loss_kernel = _kernels.KernelCrossEntropy()


def recompute_layer_ids(cfg: ModelConfig) -> list[int]:
    if cfg.recompute == "full":
        return list(range(cfg.num_layers))
    if cfg.recompute == "selected":
        return sorted(set(cfg.recompute_layers))
    return []


# ----------------------------------------------------------------------------- loss


def causal_lm_loss(logits, labels, loss_mask=None):
    """Mean next-token cross entropy over loss_mask, in fp32.

    logits [B, S, V] fp32, labels [B, S] int32, loss_mask [B, S] float (None = all ones)
    -> scalar. Positions with mask 0 contribute nothing, whatever their label.
    """
    v = logits.shape[-1]
    flat = logits.reshape(-1, v).astype(ms.float32)  # [B*S, V]
    # nll = logsumexp(x) - x[label], written out: MindSpore's CPU LogSoftmaxGrad kernel
    # is slow on [tokens, vocab] (~6% of a 17m step); these elementwise ops are not
    top = ops.stop_gradient(flat.max(-1, keepdims=True))  # [B*S, 1], for stability only
    lse = ops.log(ops.exp(flat - top).sum(-1)) + top.reshape(-1)  # [B*S]
    # negative labels (e.g. -100 padding) are clamped to 0; loss_mask must zero them out
    idx = ops.maximum(labels.reshape(-1, 1).astype(ms.int32), 0)
    nll = lse - ops.gather_elements(flat, 1, idx).reshape(-1)  # [B*S]
    if loss_mask is None:
        return nll.mean()
    m = loss_mask.reshape(-1).astype(ms.float32)
    return (nll * m).sum() / ops.maximum(m.sum(), ops.ones((), ms.float32))


class LlamaWithLoss(nn.Cell):
    """The train-step forward: (tokens, labels, position_ids, segment_ids, loss_mask,
    dropout_key) -> loss."""

    def __init__(self, model: nn.Cell):
        super().__init__(auto_prefix=False)  # keep the model's parameter names
        self.model = model

    def construct(
        self, tokens, labels, position_ids=None, segment_ids=None, loss_mask=None, dropout_key=None
    ):
        logits = self.model(tokens, position_ids, segment_ids, dropout_key)
        return llama_loss(self.model, logits, labels, loss_mask)


def llama_loss(model, logits, labels, loss_mask=None):
    """The loss of `model`'s logits: the fused cross-entropy kernel when the model has one,
    else `causal_lm_loss` (LlamaWithLoss and the MaxLogits stats step share it)."""
    ce = getattr(model, "loss_kernel", None)
    if ce is not None:
        # the fused loss takes per-token weights: the mask over its sum (or 1/N)
        v = logits.shape[-1]
        if loss_mask is None:
            w = ops.fill(ms.float32, labels.reshape(-1).shape, 1.0 / labels.size)
        else:
            m = loss_mask.reshape(-1).astype(ms.float32)
            w = m / ops.maximum(m.sum(), ops.ones((), ms.float32))
        return ce(logits.reshape(-1, v), labels.reshape(-1).astype(ms.int32), w)[0]
    return causal_lm_loss(logits, labels, loss_mask)
