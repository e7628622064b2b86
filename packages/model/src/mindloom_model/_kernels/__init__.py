"""Fused CPU kernels (kernels.cpp, attention.cpp, experts.cpp, dispatch.cpp, kernels.h) as
MindSpore AOT custom operators, each with its bprop.

The C++ source ships in the package and is compiled on first use into the user's cache,
`$MINDLOOM_CACHE_DIR` or `$XDG_CACHE_HOME/mindloom` or `~/.cache/mindloom`, under
`kernels/<hash of source, compiler and flags>/`: built into a temporary file and renamed
into place, under a file lock, so concurrent msrun workers build it once. The compiler is
`$CXX` (default `g++`). No compiler, a failed build or a non-CPU backend: `available()`
is False, the model keeps its portable ops, and the reason is logged once.
"""

from __future__ import annotations

import logging
import subprocess
from pathlib import Path

import mindspore as ms
import numpy as np
from mindspore import Tensor, nn, ops
from mindspore.ops import signature as sig

from mindloom_model._kernel_build import build_library

log = logging.getLogger("mindloom_model")

__all__ = [
    "available",
    "library_path",
    "KernelRMSNorm",
    "KernelSwiGLU",
    "KernelCrossEntropy",
    "KernelAttention",
    "KernelRopeAttention",
    "KernelSquareSums",
    "KernelAdamW",
    "adamw_kernel",
    "KernelGroupedMatMul",
    "KernelRoute",
    "KernelMoEPlan",
    "KernelMoEGather",
    "KernelMoECombine",
    "square_sums_kernel",
]

_state: dict = {}


def library_path() -> Path | None:
    """The compiled kernel library, or None (the reason is logged once)."""
    if "lib" not in _state:
        try:
            if ms.get_context("device_target") != "CPU":
                raise RuntimeError("not the CPU backend")
            _state["lib"] = build_library()
        except (RuntimeError, OSError, subprocess.SubprocessError) as exc:
            _state["lib"] = None
            log.warning("mindloom CPU kernels unavailable (%s); using the portable ops", exc)
    return _state["lib"]


def available() -> bool:
    return library_path() is not None


def _op(name: str, out_shape, out_dtype):
    return ops.Custom(
        f"{library_path()}:mindloom_{name}",
        out_shape=out_shape,
        out_dtype=out_dtype,
        func_type="aot",
    )


_f32 = ms.float32


class KernelRMSNorm(nn.Cell):
    """(x [..., D] fp32, weight [D] fp32, eps [1] fp32) -> (x / rms(x) * weight, 1 / rms(x))."""

    def __init__(self):
        super().__init__()
        self.fwd = _op("rmsnorm_fwd", lambda x, w, e: (x, x[:-1]), lambda x, w, e: (_f32, _f32))
        self.bwd = _op("rmsnorm_bwd", lambda x, w, r, g: (x, w), lambda x, w, r, g: (_f32, _f32))

    def construct(self, x, weight, eps):
        # (y, rstd): rstd reaches bprop through `out`; callers use [0]
        return self.fwd(x, weight, eps)

    def bprop(self, x, weight, eps, out, dout):
        dx, dw = self.bwd(x, weight, out[1], dout[0])
        return dx, dw, ops.zeros_like(eps)


class KernelSwiGLU(nn.Cell):
    """(a, b) -> silu(a) * b, fp32, any equal shapes."""

    def __init__(self):
        super().__init__()
        self.fwd = _op("swiglu_fwd", lambda a, b: a, lambda a, b: _f32)
        self.bwd = _op("swiglu_bwd", lambda a, b, g: (a, a), lambda a, b, g: (_f32, _f32))

    def construct(self, a, b):
        return self.fwd(a, b)

    def bprop(self, a, b, out, dout):
        return self.bwd(a, b, dout)


class KernelSquareSums(nn.Cell):
    """(t_0, ..., t_{n-1}) fp32 tensors of any shapes -> [n + 1] fp32: each tensor's sum of
    squares, then their total, in one call (float64 accumulation over fixed blocks of
    values, so the result does not depend on the thread count). No gradient."""

    def __init__(self, n: int):
        super().__init__()
        self.op = _op("sumsq_many", lambda *shapes: (n + 1,), lambda *dtypes: _f32)

    def construct(self, *tensors):
        return self.op(*tensors)


def square_sums_kernel(cfg, n: int) -> KernelSquareSums | None:
    """The fused CPU kernel for n fp32 tensors' sums of squares and their total in one call
    (mindloom_train's global gradient norm), or None where `use_cpu_kernels(cfg)` (the
    model's own test: kernels auto, fp32, CPU, built) is False."""
    from mindloom_model._llama import use_cpu_kernels

    return KernelSquareSums(n) if use_cpu_kernels(cfg) else None


class KernelAdamW(ops.Custom):
    """One parameter's AdamW update in place: (w, exp_avg, exp_avg_sq, g, h [6] = lr,
    beta1, beta2, eps, weight decay, gradient factor) -> [1] (0). w and the moments are
    written where they are (`RW_WRITE` inputs and a memory side effect, as MindSpore's
    own `AdamWeightDecay` declares them, so the graph orders the writes after every read
    of the old values); the values equal to the bit `AdamWeightDecay` on `g * factor`,
    in one pass over the memory where the portable step runs a Mul and then the op."""

    __mindspore_signature__ = (
        sig.make_sig("w", sig.sig_rw.RW_WRITE),
        sig.make_sig("exp_avg", sig.sig_rw.RW_WRITE),
        sig.make_sig("exp_avg_sq", sig.sig_rw.RW_WRITE),
        sig.make_sig("g"),
        sig.make_sig("h"),
    )

    def __init__(self):
        super().__init__(
            f"{library_path()}:mindloom_adamw",
            out_shape=lambda *shapes: (1,),
            out_dtype=lambda *dtypes: _f32,
            func_type="aot",
        )
        self.add_prim_attr("side_effect_mem", True)


def adamw_kernel(cfg) -> KernelAdamW | None:
    """The fused in-place AdamW for mindloom_train's step, or None where there is no model
    config or `use_cpu_kernels(cfg)` is False (the step keeps MindSpore's AdamWeightDecay)."""
    from mindloom_model._llama import use_cpu_kernels

    return KernelAdamW() if cfg is not None and use_cpu_kernels(cfg) else None


class KernelCrossEntropy(nn.Cell):
    """(logits [N, V] fp32, labels [N] int32, weight [N] fp32) -> (sum(weight * nll), nll, lse).

    nll = logsumexp(logits) - logits[label], without a softmax in memory; negative labels
    are clamped to 0 (their weight must be 0, as in the portable loss).
    """

    def __init__(self):
        super().__init__()
        self.fwd = _op("ce_fwd", lambda x, y: (x[:1], x[:1]), lambda x, y: (_f32, _f32))
        self.bwd = _op("ce_bwd", lambda x, y, lse, g: x, lambda x, y, lse, g: _f32)

    def construct(self, logits, labels, weight):
        # (loss, nll, lse): nll and lse reach bprop through `out`; callers use [0]
        nll, lse = self.fwd(logits, labels)
        return (nll * weight).sum(), nll, lse

    def bprop(self, logits, labels, weight, out, dout):
        g = dout[0]
        dlogits = self.bwd(logits, labels, out[2], weight * g)
        return dlogits, ops.zeros_like(labels), out[1] * g


class KernelAttention(nn.Cell):
    """Causal attention within documents, never holding an S x S matrix.

    q [B, S, H, Dk] fp32, k [B, S, KV, Dk], v [B, S, KV, Dv] (Dv may differ from Dk, as
    in MLA), segment_ids [B|1, S] int32 -> (o [B, S, H, Dv], lse [B, H, S]); the scores
    are `scale` * q . k (Llama passes q already scaled and keeps scale 1). Query i sees
    key j iff j <= i and both are in the same document; query head h reads kv head
    h // (H / KV).
    """

    def __init__(self, scale: float = 1.0):
        super().__init__()
        self.scale = float(scale)  # a cell attribute: the compile cache's key sees it
        self.scale_t = Tensor(np.array([scale], np.float32))
        self.fwd = _op(
            "attn_fwd",
            lambda q, k, v, s, c: (q[:3] + [v[3]], [q[0], q[2], q[1]]),
            lambda q, k, v, s, c: (_f32, _f32),
        )
        self.bwd = _op(
            "attn_bwd",
            lambda q, k, v, s, c, o, lse, g: (q, k, v),
            lambda q, k, v, s, c, o, lse, g: (_f32, _f32, _f32),
        )

    def construct(self, q, k, v, segment_ids):
        # (o, lse): the row log-sum-exp reaches bprop through `out`; callers use [0]
        return self.fwd(q, k, v, segment_ids, self.scale_t)

    def bprop(self, q, k, v, segment_ids, out, dout):
        dq, dk, dv = self.bwd(q, k, v, segment_ids, self.scale_t, out[0], out[1], dout[0])
        return dq, dk, dv, ops.zeros_like(segment_ids)


class KernelRopeAttention(nn.Cell):
    """KernelAttention with RoPE applied to q and k inside the kernel, as they are copied
    into its tiles: (q, k, v, segment_ids, cos, sin) -> (o, lse), cos/sin [B|1, S, Dk]
    (Hugging Face's rotate_half layout), o = attention(rope(q), rope(k), v); the
    gradients are those of q and k before the rotation. One op each way where the model
    had run 7 forward ops per rotated tensor and their backward (Llama's path)."""

    def __init__(self, scale: float = 1.0):
        super().__init__()
        self.scale = float(scale)  # a cell attribute: the compile cache's key sees it
        self.scale_t = Tensor(np.array([scale], np.float32))
        self.fwd = _op(
            "attn_rope_fwd",
            lambda q, k, v, s, c, cs, sn: (q[:3] + [v[3]], [q[0], q[2], q[1]]),
            lambda q, k, v, s, c, cs, sn: (_f32, _f32),
        )
        self.bwd = _op(
            "attn_rope_bwd",
            lambda q, k, v, s, c, cs, sn, o, lse, g: (q, k, v),
            lambda q, k, v, s, c, cs, sn, o, lse, g: (_f32, _f32, _f32),
        )

    def construct(self, q, k, v, segment_ids, cos, sin):
        return self.fwd(q, k, v, segment_ids, self.scale_t, cos, sin)

    def bprop(self, q, k, v, segment_ids, cos, sin, out, dout):
        dq, dk, dv = self.bwd(q, k, v, segment_ids, self.scale_t, cos, sin, out[0], out[1], dout[0])
        # the tables are constants of the step (no gradient flows to them)
        return dq, dk, dv, ops.zeros_like(segment_ids), ops.zeros_like(cos), ops.zeros_like(sin)


class KernelGroupedMatMul(nn.Cell):
    """The MoE experts' grouped product: (x [P, K] fp32, w [E, N, K] fp32, counts [E]
    int32) -> y [P, N], where rows [off_e, off_e + counts[e]) of x (off_e = counts[:e]
    summed) belong to expert e and y's rows are x's @ w[e].T; rows past the last expert's
    are zero. Counts [R, E] (expert parallel: expert e's rows per source rank, in rank
    order) make w's gradient sum each rank's rows apart and add the R sums in order, the
    rounding of a one-process run that adds its micro-batches' gradients. One call for
    all experts, each expert's rows an ordinary product with its weight: no row padded per
    expert, no weight copied per block (the portable blocks dispatch's costs). Counts that
    are negative or sum past P make the op raise."""

    def __init__(self):
        super().__init__()
        self.fwd = _op("gmm_nt", lambda x, w, c: [x[0], w[1]], lambda x, w, c: _f32)
        self.bwd_x = _op("gmm_nn", lambda g, w, c: [g[0], w[2]], lambda g, w, c: _f32)
        self.bwd_w = _op("gmm_tn", lambda g, x, c: [c[-1], g[1], x[1]], lambda g, x, c: _f32)

    def construct(self, x, w, counts):
        return self.fwd(x, w, counts)

    def bprop(self, x, w, counts, out, dout):
        return self.bwd_x(dout, w, counts), self.bwd_w(dout, x, counts), ops.zeros_like(counts)


class KernelRoute(nn.Cell):
    """DeepSeek-V3's selection: choice [N, E] fp32 (the affinities plus the balancing bias,
    no gradient) -> ids [N, k] int32, the k experts of the topk_group best of n_group
    groups (each scored by its two best experts), in descending order of choice, ties to
    the lower index. One call for what the portable router runs as three TopKs and a
    dozen mask ops."""

    def __init__(self, k: int, n_group: int, topk_group: int):
        super().__init__()
        self.k = int(k)
        self.spec = Tensor(np.array([n_group, topk_group], np.int32))
        self.op = _op("moe_route", lambda c, s: [c[0], self.k], lambda c, s: ms.int32)

    def construct(self, choice):
        return self.op(choice, self.spec)

    def bprop(self, choice, out, dout):
        return (ops.zeros_like(choice),)


class KernelMoEPlan(nn.Cell):
    """The dropless dispatch's plan (dispatch.cpp): (idx [M, k] int32 expert ids, experts
    [R, E] int32, only its shape read) -> (dest [M, k] int32: the row of each (token,
    expert) slot in the expert-sorted buffer; row_token [M k] int32: the token each row
    holds; counts [R, E] int32: each expert's rows per source rank, KernelGroupedMatMul's
    counts). One call for the one-hot ranks, cumsums and segment sums the portable
    dispatch runs. R = 1: every id must be in [0, E). R > 1 (expert parallel: the
    group's tokens rank by rank, ids minus this rank's first expert): ids outside [0, E)
    are other ranks' slots (dest -1) and rows past this rank's slots hold no token (-1).
    No gradient."""

    def __init__(self):
        super().__init__()
        self.op = _op(
            "moe_plan",
            lambda i, e: (i, [i[0] * i[1]], e),
            lambda i, e: (ms.int32, ms.int32, ms.int32),
        )

    def construct(self, idx, experts):
        return self.op(idx, experts)

    def bprop(self, idx, experts, out, dout):
        return ops.zeros_like(idx), ops.zeros_like(experts)


class KernelMoEGather(nn.Cell):
    """(x [M, D] fp32, row_token [S] int32, dest [M, k] int32) -> xs [S, D] = x[row_token]
    (a zero row where row_token is -1); its backward sums each token's k rows (dest, -1
    skipped), in slot order: a gather each way where MindSpore's Gather backward is a
    scatter-add (UnsortedSegmentSum) into a zeroed buffer."""

    def __init__(self):
        super().__init__()
        self.fwd = _op("moe_gather", lambda x, t: [t[0], x[1]], lambda x, t: _f32)
        self.bwd = _op("moe_gather_bwd", lambda g, d: [d[0], g[1]], lambda g, d: _f32)

    def construct(self, x, row_token, dest):
        return self.fwd(x, row_token)

    def bprop(self, x, row_token, dest, out, dout):
        return self.bwd(dout, dest), ops.zeros_like(row_token), ops.zeros_like(dest)


class KernelMoECombine(nn.Cell):
    """(xs [S, D] fp32 expert outputs, w [M, k] fp32 weights, dest [M, k] int32, base [M, D]
    fp32) -> y [M, D], y[m] = sum_j w[m, j] xs[dest[m, j]] + base[m] (base: the shared
    experts' output; slots with dest -1 add nothing). Backward: xs's rows scaled by their
    slot's weight (unused rows zero), w's gradient as row dot products (0 for dest -1),
    base's the output's. One op each way for the row scaling, segment sum, slice and add
    (and their backward) of the portable combine."""

    def __init__(self):
        super().__init__()
        self.fwd = _op("moe_combine", lambda x, w, d, b: b, lambda x, w, d, b: _f32)
        self.bwd = _op(
            "moe_combine_bwd", lambda g, x, w, d: (x, w), lambda g, x, w, d: (_f32, _f32)
        )

    def construct(self, xs, w, dest, base):
        return self.fwd(xs, w, dest, base)

    def bprop(self, xs, w, dest, base, out, dout):
        dxs, dw = self.bwd(dout, xs, w, dest)
        return dxs, dw, ops.zeros_like(dest), dout
