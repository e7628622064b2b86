"""The Llama block's parts that other families reuse: precision, the small layers
(Linear, Embedding, RMSNorm), rotary embeddings and masked attention. Shapes in comments:
B batch, S sequence, D model width, H query heads, KV key/value heads, Dh head width.
"""

from __future__ import annotations

import logging
import math

import mindspore as ms
import numpy as np
from mindspore import Parameter, Tensor, nn, ops

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


def rope_cos_sin(position_ids, inv_freq, heads_axis: bool = True):
    """position_ids [B, S] int, inv_freq [Dh/2] fp32 -> cos, sin [B, 1, S, Dh] fp32
    ([B, S, Dh] with heads_axis False: the fused attention kernel's tables).

    Hugging Face's layout: the two halves of each head repeat the same frequencies, and
    `rotate_half` pairs element i with i + Dh/2 (HF's checkpoints are permuted for it), so
    HF weights load here unchanged.
    """
    freqs = position_ids.astype(ms.float32).expand_dims(-1) * inv_freq  # [B, S, Dh/2]
    emb = ops.concat((freqs, freqs), -1)  # [B, S, Dh]
    if heads_axis:
        emb = emb.expand_dims(1)  # [B, 1, S, Dh]
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


# ----------------------------------------------------------------------------- MoE dispatch
# (the portable blocks dispatch of _deepseek_moe.MoE)


class _RowsByOneHot(nn.Cell):
    """(onehot [nb, E] 0/1 fp32, table [E, ...]) -> table[argmax(onehot)] [nb, ...] as one
    matmul, and its backward (the rows' gradients summed per expert) as one matmul too:
    MindSpore's CPU Gather backward (a scatter-add of [nb, Fm, D] blocks) is slower than a
    [E, nb] @ [nb, Fm*D] product. Exact forward: each row is 1 * its expert's weights."""

    def __init__(self):
        super().__init__()
        self.mm = ops.MatMul()
        self.mm_ta = ops.MatMul(transpose_a=True)

    def construct(self, onehot, table):
        e = table.shape[0]
        flat = table.reshape(e, -1)
        return self.mm(onehot.astype(flat.dtype), flat).reshape(
            (onehot.shape[0],) + table.shape[1:]
        )

    def bprop(self, onehot, table, out, dout):
        nb = onehot.shape[0]
        g = self.mm_ta(onehot.astype(dout.dtype), dout.reshape(nb, -1))  # [E, Fm*D]
        return ops.zeros_like(onehot), g.reshape(table.shape).astype(table.dtype)


class _ScatterRows(nn.Cell):
    """(x [P, D], ids [P] int32 in [0, n), like [n, ...]) -> out [n, D], out[i] = the sum of
    the rows with id i (a segment sum), with the backward written as the gather it is:
    MindSpore's generic UnsortedSegmentSum gradient also masks out-of-range ids
    (LogicalAnd + Select over [P, D]), which these ids never are."""

    def construct(self, x, ids, like):
        return ops.unsorted_segment_sum(x, ids, like.shape[0])

    def bprop(self, x, ids, like, out, dout):
        return ops.gather(dout, ids, 0), ops.zeros_like(ids), ops.zeros_like(like)


class _ScaleRows(nn.Cell):
    """x [P, D] * r [P, 1] with r's gradient (a sum over D) written as a matmul against
    ones: the CPU ReduceSum is several times slower (see _ScaleRowsCols above)."""

    def construct(self, x, r):
        return x * r

    def bprop(self, x, r, out, dout):
        dr = ops.matmul(dout * x, ops.ones((x.shape[1], 1), x.dtype))
        return dout * r, dr.astype(r.dtype)
