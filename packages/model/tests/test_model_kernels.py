"""The fused CPU kernels against NumPy (forward), torch autograd (gradients) and the
portable ops (forward, gradients, and a whole model's losses over 20 training steps)."""

import ctypes
import inspect
import logging
import os
import shutil

import mindspore as ms
import numpy as np
import pytest
import torch
from mindloom_model import Llama, LlamaWithLoss, get_preset
from mindloom_model import _kernels as K
from mindloom_model._llama import RMSNorm, attention, attention_bias, use_cpu_kernels
from mindspore import Tensor, nn, ops

pytestmark = pytest.mark.skipif(
    shutil.which(os.environ.get("CXX", "g++").split()[0] or "g++") is None,
    reason="no C++ compiler: the kernels cannot be built (the portable path is tested elsewhere)",
)

rng = np.random.default_rng(7)


def grads(fn, args, positions):
    return ms.grad(fn, positions)(*[Tensor(a) for a in args])


def packed_segments(b, s):
    """[B, S] int32: each row cut into 1-4 documents of random lengths."""
    seg = np.zeros((b, s), np.int32)
    for i in range(b):
        cuts = np.sort(
            rng.choice(np.arange(1, s), size=min(rng.integers(0, 4), s - 1), replace=False)
        )
        for c in cuts:
            seg[i, c:] += 1
    return seg


# ----------------------------------------------------------------------------- RMSNorm


@pytest.mark.parametrize("shape", [(3, 7, 17), (1, 1, 64), (5, 128)])
def test_rmsnorm_forward_and_gradients(shape):
    d = shape[-1]
    x = rng.standard_normal(shape).astype(np.float32) * 2
    w = rng.standard_normal(d).astype(np.float32)
    g = rng.standard_normal(shape).astype(np.float32)
    eps = np.array([1e-5], np.float32)
    kern = K.KernelRMSNorm()
    y = kern(Tensor(x), Tensor(w), Tensor(eps))[0].asnumpy()
    ref = w * x / np.sqrt((x * x).mean(-1, keepdims=True) + 1e-5)
    np.testing.assert_allclose(y, ref, rtol=1e-5, atol=1e-5)

    gt = Tensor(g)
    dx, dw = grads(lambda a, b: (kern(a, b, Tensor(eps))[0] * gt).sum(), (x, w), (0, 1))
    xt = torch.tensor(x, requires_grad=True)
    wt = torch.tensor(w, requires_grad=True)
    (
        wt * xt * torch.rsqrt((xt * xt).mean(-1, keepdim=True) + 1e-5) * torch.tensor(g)
    ).sum().backward()
    np.testing.assert_allclose(dx.asnumpy(), xt.grad.numpy(), rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(dw.asnumpy(), wt.grad.numpy(), rtol=1e-4, atol=1e-4)

    norm = RMSNorm(d, 1e-5)  # the portable path
    norm.weight.set_data(Tensor(w))
    np.testing.assert_allclose(y, norm(Tensor(x)).asnumpy(), rtol=1e-5, atol=1e-5)


# ----------------------------------------------------------------------------- SwiGLU


@pytest.mark.parametrize("shape", [(2, 9, 33), (4, 384), (1, 1, 1)])
def test_swiglu_forward_and_gradients(shape):
    a = (rng.standard_normal(shape) * 4).astype(np.float32)
    b = rng.standard_normal(shape).astype(np.float32)
    g = rng.standard_normal(shape).astype(np.float32)
    kern = K.KernelSwiGLU()
    y = kern(Tensor(a), Tensor(b)).asnumpy()
    np.testing.assert_allclose(y, a / (1 + np.exp(-a.astype(np.float64))) * b, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(y, (ops.silu(Tensor(a)) * Tensor(b)).asnumpy(), rtol=1e-5, atol=1e-6)

    gt = Tensor(g)
    da, db = grads(lambda p, q: (kern(p, q) * gt).sum(), (a, b), (0, 1))
    at, bt = torch.tensor(a, requires_grad=True), torch.tensor(b, requires_grad=True)
    (torch.nn.functional.silu(at) * bt * torch.tensor(g)).sum().backward()
    np.testing.assert_allclose(da.asnumpy(), at.grad.numpy(), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(db.asnumpy(), bt.grad.numpy(), rtol=1e-5, atol=1e-5)


# ----------------------------------------------------------------------------- cross-entropy


def test_square_sums_of_many_tensors_against_numpy():
    """KernelSquareSums (the train step's global gradient norm in one call): each tensor's
    sum of squares and their total against float64 NumPy, for shapes that leave partial
    8-lane runs, 256-value runs and 32768-value blocks (70001, 65536 + 3), a one-value
    tensor and a zero one, in a compiled graph as TrainStep calls it."""
    rng = np.random.default_rng(3)
    shapes = [(5,), (37, 13), (70001,), (3, 4, 5), (1,), (128, 300), (65539,), (8, 8)]
    xs = [rng.standard_normal(s).astype(np.float32) * (i + 1) for i, s in enumerate(shapes)]
    xs[4][:] = 0.0  # a zero tensor inside the list, the last one not zero

    class Net(nn.Cell):
        def __init__(self):
            super().__init__()
            self.k = K.KernelSquareSums(len(xs))

        def construct(self, *ts):
            return self.k(*ts) * 1.0

    out = ms.jit(Net())(*[Tensor(x) for x in xs]).asnumpy()
    want = np.array([(x.astype(np.float64) ** 2).sum() for x in xs])
    assert out.shape == (len(xs) + 1,)
    np.testing.assert_allclose(out[:-1], want, rtol=1e-6, atol=0)
    np.testing.assert_allclose(out[-1], want.sum(), rtol=1e-6)


def test_adamw_kernel_updates_in_place_as_adamweightdecay_to_the_bit_and_as_numpy():
    """KernelAdamW (the train step's update, in place) against MindSpore's AdamWeightDecay
    on the gradient times the factor (the portable step: every bit of w, exp_avg and
    exp_avg_sq, 4 steps with new gradients, a decayed and a plain tensor) and against
    float64 NumPy AdamW (the same formula: no bias correction, the step folds it into
    lr and eps). Sizes leave partial 16-lane runs and span the pool's 16384-value tasks."""
    rng = np.random.default_rng(11)
    shapes = [(1,), (37, 129), (3 * 16384 + 5,)]
    h = [2e-3, 0.9, 0.95, 1e-8]

    class Step(nn.Cell):
        def __init__(self, w0, kernel):
            super().__init__()
            zeros = np.zeros(w0.shape, np.float32)
            self.w = ms.Parameter(Tensor(w0.copy()), name="w")
            self.m = ms.Parameter(Tensor(zeros), name="m")
            self.v = ms.Parameter(Tensor(zeros.copy()), name="v")
            self.kernel = K.KernelAdamW() if kernel else None
            self.ref = ops.AdamWeightDecay()

        def construct(self, g, scalars):
            if self.kernel is None:
                lr, b1, b2, eps, wd, f = (scalars[i] for i in range(6))
                out = self.ref(self.w, self.m, self.v, lr, b1, b2, eps, wd, g * f)
                return ops.depend(scalars[0] * 0, out)
            return self.kernel(self.w, self.m, self.v, g, scalars)

    for shape in shapes:
        for wd in (0.1, 0.0):
            w0 = rng.standard_normal(shape).astype(np.float32)
            cells = {k: Step(w0, k) for k in (True, False)}
            runs = [ms.jit(c) for c in cells.values()]
            w, m, v = (x.astype(np.float64) for x in (w0, np.zeros(shape), np.zeros(shape)))
            for step in range(4):
                g = (rng.standard_normal(shape) * 3).astype(np.float32)
                f = np.float32(0.5 + 0.25 * step)
                scalars = Tensor(np.array(h + [wd, f], np.float32))
                for run in runs:
                    run(Tensor(g), scalars)
                gf = g.astype(np.float64) * f
                m = 0.9 * m + 0.1 * gf
                v = 0.95 * v + 0.05 * gf * gf
                w = w - 2e-3 * (m / (np.sqrt(v) + 1e-8) + wd * w)
            k_net, r_net = cells[True], cells[False]
            for name in ("w", "m", "v"):
                a, b = (getattr(c, name).asnumpy() for c in (k_net, r_net))
                np.testing.assert_array_equal(a, b, err_msg=f"{shape} wd={wd}: {name}")
            np.testing.assert_allclose(k_net.w.asnumpy(), w, rtol=1e-5, atol=1e-6)
            np.testing.assert_allclose(k_net.m.asnumpy(), m, rtol=1e-5, atol=1e-7)
            np.testing.assert_allclose(k_net.v.asnumpy(), v, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("n,v", [(37, 65), (8, 8000), (5, 3)])
def test_cross_entropy_forward_and_gradients(n, v):
    logits = (rng.standard_normal((n, v)) * 5).astype(np.float32)
    labels = rng.integers(0, v, n).astype(np.int32)
    labels[0] = -100  # padding: clamped, and weighted 0 below
    weight = rng.random(n).astype(np.float32)
    weight[0] = 0.0
    kern = K.KernelCrossEntropy()
    loss = kern(Tensor(logits), Tensor(labels), Tensor(weight))[0].asnumpy()
    x64 = logits.astype(np.float64)
    lse = np.log(np.exp(x64 - x64.max(-1, keepdims=True)).sum(-1)) + x64.max(-1)
    nll = lse - x64[np.arange(n), np.maximum(labels, 0)]
    np.testing.assert_allclose(loss, (nll * weight).sum(), rtol=1e-5)

    dx = grads(lambda x: kern(x, Tensor(labels), Tensor(weight))[0], (logits,), 0)
    xt = torch.tensor(logits, requires_grad=True)
    tl = torch.tensor(np.maximum(labels, 0)).long()
    (
        torch.nn.functional.cross_entropy(xt, tl, reduction="none") * torch.tensor(weight)
    ).sum().backward()
    np.testing.assert_allclose(dx.asnumpy(), xt.grad.numpy(), rtol=1e-4, atol=1e-6)


# ----------------------------------------------------------------------------- attention


def torch_attention(q, k, v, seg):
    # q [B, S, H, Dh] (pre-scaled), k/v [B, S, KV, Dh]: the masked softmax written out
    b, s, h, _ = q.shape
    rep = h // k.shape[2]
    qh, kh, vh = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    kh, vh = kh.repeat_interleave(rep, 1), vh.repeat_interleave(rep, 1)
    allowed = torch.ones(s, s, dtype=torch.bool).tril()[None] & (seg[:, :, None] == seg[:, None, :])
    scores = (qh @ kh.transpose(-1, -2)).masked_fill(~allowed[:, None], float("-inf"))
    return (scores.softmax(-1) @ vh).transpose(1, 2)


@pytest.mark.parametrize(
    "b,s,h,kv,dh,segments",
    [
        (2, 13, 4, 2, 8, True),
        (3, 37, 2, 2, 16, True),
        (1, 64, 4, 4, 32, False),
        (2, 5, 6, 1, 4, True),
    ],
)
def test_attention_forward_and_gradients(b, s, h, kv, dh, segments):
    q = rng.standard_normal((b, s, h, dh)).astype(np.float32) / np.sqrt(dh)
    k = rng.standard_normal((b, s, kv, dh)).astype(np.float32)
    v = rng.standard_normal((b, s, kv, dh)).astype(np.float32)
    seg = packed_segments(b, s) if segments else np.zeros((1, s), np.int32)
    g = rng.standard_normal((b, s, h, dh)).astype(np.float32)
    kern = K.KernelAttention()
    o = kern(Tensor(q), Tensor(k), Tensor(v), Tensor(seg))[0].asnumpy()

    # NumPy: the masked softmax over the full S x S square
    rep = h // kv
    qh, kh, vh = q.transpose(0, 2, 1, 3), k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3)
    kh, vh = np.repeat(kh, rep, 1), np.repeat(vh, rep, 1)
    allowed = np.tril(np.ones((s, s), bool))[None] & (seg[:, :, None] == seg[:, None, :])
    scores = np.where(allowed[:, None], qh @ kh.transpose(0, 1, 3, 2), -np.inf)
    p = np.exp(scores - scores.max(-1, keepdims=True))
    ref = ((p / p.sum(-1, keepdims=True)) @ vh).transpose(0, 2, 1, 3)
    np.testing.assert_allclose(o, ref, rtol=1e-4, atol=1e-5)

    # the portable path: the model's eager attention with its additive mask
    bias = attention_bias(s, Tensor(seg) if segments else None)
    port = attention(Tensor(qh.copy()), Tensor(k.transpose(0, 2, 1, 3).copy()),
                     Tensor(v.transpose(0, 2, 1, 3).copy()), bias, rep, None, 1.0)  # fmt: skip
    np.testing.assert_allclose(o, port.asnumpy().transpose(0, 2, 1, 3), rtol=1e-4, atol=1e-5)

    gt, st = Tensor(g), Tensor(seg)
    dq, dk, dv = grads(lambda x, y, z: (kern(x, y, z, st)[0] * gt).sum(), (q, k, v), (0, 1, 2))
    tq, tk, tv = (torch.tensor(a, requires_grad=True) for a in (q, k, v))
    (torch_attention(tq, tk, tv, torch.tensor(seg)) * torch.tensor(g)).sum().backward()
    for mine, theirs in ((dq, tq), (dk, tk), (dv, tv)):
        np.testing.assert_allclose(mine.asnumpy(), theirs.grad.numpy(), rtol=1e-4, atol=1e-5)


def numpy_attention(q, k, v, seg, scale, g):
    """float64 reference of (o, dq, dk, dv) for o = softmax(scale q k^T, masked) v with
    dq/dk/dv the gradients of sum(o * g); q [B, S, H, Dk], k [B, S, KV, Dk], v [B, S, KV,
    Dv], seg [B|1, S]: the dense masked softmax and its textbook backward."""
    q, k, v, g = (np.asarray(a, np.float64).transpose(0, 2, 1, 3) for a in (q, k, v, g))
    rep = q.shape[1] // k.shape[1]
    kh, vh = np.repeat(k, rep, 1), np.repeat(v, rep, 1)
    s = q.shape[2]
    allowed = (np.tril(np.ones((s, s), bool))[None] & (seg[:, :, None] == seg[:, None, :]))[:, None]
    scores = np.where(allowed, scale * q @ kh.transpose(0, 1, 3, 2), -np.inf)
    p = np.exp(scores - scores.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)  # [B, H, S, S], 0 where masked
    o = p @ vh
    dp = g @ vh.transpose(0, 1, 3, 2)
    ds = p * (dp - (dp * p).sum(-1, keepdims=True))
    dq = scale * ds @ kh
    dkh, dvh = scale * ds.transpose(0, 1, 3, 2) @ q, p.transpose(0, 1, 3, 2) @ g

    def per_kv(x):  # the query heads that share a kv head add up
        b, h, t, d = x.shape
        return x.reshape(b, h // rep, rep, t, d).sum(2)

    back = lambda x: x.transpose(0, 2, 1, 3)  # noqa: E731
    return back(o), back(dq), back(per_kv(dkh)), back(per_kv(dvh))


@pytest.mark.parametrize(
    "b,s,h,kv,dk,dv,scale,segments",
    [
        (2, 13, 4, 4, 24, 16, 0.23, True),  # MLA-like: dn+dr keys wider than the values
        (3, 37, 4, 2, 12, 20, 0.61, True),  # values wider, grouped-query heads
        (1, 5, 3, 3, 10, 6, 1.7, False),
        (2, 1, 2, 1, 6, 3, 0.5, True),
    ],
)
def test_attention_with_value_width_and_scale_against_numpy(b, s, h, kv, dk, dv, scale, segments):
    # MLA's shape: query/key heads dk = qk_nope + qk_rope wide, value heads dv wide, and
    # the model's softmax scale (YaRN mscale included) applied inside the kernel
    q = rng.standard_normal((b, s, h, dk)).astype(np.float32)
    k = rng.standard_normal((b, s, kv, dk)).astype(np.float32)
    v = rng.standard_normal((b, s, kv, dv)).astype(np.float32)
    seg = packed_segments(b, s) if segments else np.zeros((1, s), np.int32)
    g = rng.standard_normal((b, s, h, dv)).astype(np.float32)
    kern = K.KernelAttention(scale)
    st, gt = Tensor(seg), Tensor(g)
    o = kern(Tensor(q), Tensor(k), Tensor(v), st)[0].asnumpy()
    ref_o, ref_dq, ref_dk, ref_dv = numpy_attention(q, k, v, seg, scale, g)
    assert o.shape == (b, s, h, dv)
    np.testing.assert_allclose(o, ref_o, rtol=1e-4, atol=1e-5)
    got = grads(lambda x, y, z: (kern(x, y, z, st)[0] * gt).sum(), (q, k, v), (0, 1, 2))
    for name, mine, ref in zip(("dq", "dk", "dv"), got, (ref_dq, ref_dk, ref_dv)):
        np.testing.assert_allclose(mine.asnumpy(), ref, rtol=1e-4, atol=2e-5, err_msg=name)


@pytest.mark.parametrize(
    "b,s,h,kv,dh,table_b",
    [(2, 13, 4, 2, 8, 2), (3, 37, 2, 2, 16, 1), (1, 5, 3, 1, 6, 1)],
)
def test_rope_attention_forward_and_gradients_against_numpy(b, s, h, kv, dh, table_b):
    # the op Llama runs: RoPE on q and k inside the kernel, Llama's 1/sqrt(Dh) as its
    # scale; the tables per row (positions restart per document) or one for all rows
    q, k, v, g = (rng.standard_normal((b, s, n, dh)).astype(np.float32) for n in (h, kv, kv, h))
    seg = packed_segments(b, s) if table_b == b else np.zeros((1, s), np.int32)
    cos, sin = rope_tables(table_b, s, dh, seg)
    scale = 1.0 / np.sqrt(dh)
    kern = K.KernelRopeAttention(scale)
    st, ct, snt, gt = Tensor(seg), Tensor(cos), Tensor(sin), Tensor(g)
    o = kern(Tensor(q), Tensor(k), Tensor(v), st, ct, snt)[0].asnumpy()
    ref = numpy_rope_attention(q, k, v, seg, scale, g, cos, sin)
    np.testing.assert_allclose(o, ref[0], rtol=1e-4, atol=1e-5)
    got = grads(lambda x, y, z: (kern(x, y, z, st, ct, snt)[0] * gt).sum(), (q, k, v), (0, 1, 2))
    for name, mine, want in zip(("dq", "dk", "dv"), got, ref[1:]):
        np.testing.assert_allclose(mine.asnumpy(), want, rtol=1e-4, atol=2e-5, err_msg=name)


# The attention kernel called through ctypes (MindSpore's AOT signature) in a child
# process with $MINDLOOM_KERNEL_ISA set: the library picks its AVX-512 / AVX2 / baseline
# build once per process, so each build needs a process of its own (NumPy only: fast).
def aot_call(lib, name, arrays):
    """One of the library's entry points called with MindSpore's AOT signature (inputs,
    then outputs) -> its return code."""
    n = len(arrays)
    shapes = [(ctypes.c_int64 * a.ndim)(*a.shape) for a in arrays]
    return getattr(lib, name)(
        n, (ctypes.c_void_p * n)(*[a.ctypes.data for a in arrays]),
        (ctypes.c_int * n)(*[a.ndim for a in arrays]),
        (ctypes.POINTER(ctypes.c_int64) * n)(*shapes), None, None, None)  # fmt: skip


# what every child script starts with: the library (argv[1]), its inputs (argv[2]), aot_call
_CHILD_PRELUDE = (
    "import ctypes, sys\nimport numpy as np\n"
    + inspect.getsource(aot_call)
    + "lib = ctypes.CDLL(sys.argv[1])\nd = np.load(sys.argv[2])\n\n"
    "def call(name, arrays):\n    assert aot_call(lib, name, arrays) == 0, name\n\n"
)

_ISA_CHILD = (
    _CHILD_PRELUDE
    + """
q, k, v, seg, scale, g = (d[x] for x in ("q", "k", "v", "seg", "scale", "g"))
b, s, h, _ = q.shape
o = np.zeros((b, s, h, v.shape[3]), np.float32)
lse = np.zeros((b, h, s), np.float32)
call("mindloom_attn_fwd", [q, k, v, seg, scale, o, lse])
dq, dk, dv = np.zeros_like(q), np.zeros_like(k), np.zeros_like(v)
call("mindloom_attn_bwd", [q, k, v, seg, scale, o, lse, g, dq, dk, dv])
# the same with RoPE inside the kernel (tables for q's width: k's, here)
cos, sin = d["cos"], d["sin"]
ro, rlse = np.zeros_like(o), np.zeros_like(lse)
call("mindloom_attn_rope_fwd", [q, k, v, seg, scale, cos, sin, ro, rlse])
rdq, rdk, rdv = np.zeros_like(q), np.zeros_like(k), np.zeros_like(v)
call("mindloom_attn_rope_bwd", [q, k, v, seg, scale, cos, sin, ro, rlse, g, rdq, rdk, rdv])
np.savez(sys.argv[3], o=o, dq=dq, dk=dk, dv=dv, ro=ro, rdq=rdq, rdk=rdk, rdv=rdv)
"""
)


def numpy_rope(x, cos, sin):
    """float64 RoPE of x [B, S, H, D] with tables [B|1, S, D]: x cos + rotate_half(x) sin."""
    x = np.asarray(x, np.float64)
    half = x.shape[-1] // 2
    rot = np.concatenate((-x[..., half:], x[..., :half]), -1)
    return x * cos[:, :, None] + rot * sin[:, :, None]


def numpy_rope_grad(g, cos, sin):
    """The gradient through numpy_rope: its transpose, g cos - rotate_half(g sin)."""
    gs = g * sin[:, :, None]
    half = g.shape[-1] // 2
    return g * cos[:, :, None] - np.concatenate((-gs[..., half:], gs[..., :half]), -1)


def numpy_rope_attention(q, k, v, seg, scale, g, cos, sin):
    """(o, dq, dk, dv) of attention(rope(q), rope(k), v): numpy_attention on the rotated
    inputs, dq and dk taken back through the rotation."""
    o, dq, dk, dv = numpy_attention(numpy_rope(q, cos, sin), numpy_rope(k, cos, sin), v,
                                    seg, scale, g)  # fmt: skip
    return o, numpy_rope_grad(dq, cos, sin), numpy_rope_grad(dk, cos, sin), dv


def rope_tables(b, s, d, seg, theta=10000.0):
    """cos, sin [b, S, d] float32 at positions that restart at each document."""
    pos = _restarted_positions(np.broadcast_to(seg, (b, s))).astype(np.float32)
    inv = 1.0 / theta ** (np.arange(0, d, 2, dtype=np.float32) / d)
    emb = np.concatenate([pos[..., None] * inv] * 2, -1)
    return np.cos(emb).astype(np.float32), np.sin(emb).astype(np.float32)


def test_attention_tiles_documents_and_every_instruction_set_against_numpy(tmp_path):
    """The tiled kernel (16-query blocks x 16-key tiles, online softmax) at an odd length
    (S = 70: a partial last block and tile) with documents that start at, just after and
    between tile boundaries, a one-token document, documents that are not runs of
    positions, and grouped-query heads with values narrower than the keys: forward and
    all three gradients against the float64 NumPy reference, once per instruction set
    the library builds (baseline SSE2, AVX2 + FMA, AVX-512; one the CPU lacks runs the
    best it has), and the same with RoPE inside the kernel (positions restarting at each
    document; the gradients of q and k before the rotation). Plants: no rescale of the output when a tile raises a row's maximum;
    the segment test dropped in a tile's second half (see the package README)."""
    import subprocess
    import sys

    b, s, h, kv, dk, dv, scale = 4, 70, 4, 2, 20, 12, 0.4
    seg = np.zeros((b, s), np.int32)
    for c in (16, 17, 40):  # a tile boundary, a one-token document, mid-tile
        seg[0, c:] += 1
    seg[2] = (np.arange(s) // 9) % 2  # two documents interleaved in runs of 9
    seg[3, 5:] = 1
    seg[3, 33:] = 2
    data = np.random.default_rng(3)
    arrays = dict(
        q=data.standard_normal((b, s, h, dk)).astype(np.float32),
        k=data.standard_normal((b, s, kv, dk)).astype(np.float32),
        v=data.standard_normal((b, s, kv, dv)).astype(np.float32),
        seg=seg,
        scale=np.array([scale], np.float32),
        g=data.standard_normal((b, s, h, dv)).astype(np.float32),
    )
    arrays["cos"], arrays["sin"] = rope_tables(b, s, dk, seg)
    np.savez(tmp_path / "in.npz", **arrays)
    want = numpy_attention(arrays["q"], arrays["k"], arrays["v"], seg, scale, arrays["g"])
    want_rope = numpy_rope_attention(arrays["q"], arrays["k"], arrays["v"], seg, scale,
                                     arrays["g"], arrays["cos"], arrays["sin"])  # fmt: skip
    for isa in ("base", "avx2", "avx512"):
        out = tmp_path / f"{isa}.npz"
        env = dict(os.environ, MINDLOOM_KERNEL_ISA=isa)
        subprocess.run([sys.executable, "-c", _ISA_CHILD, str(K.library_path()),
                        str(tmp_path / "in.npz"), str(out)], env=env, check=True,
                       timeout=120)  # fmt: skip
        got = np.load(out)
        for name, ref in zip(("o", "dq", "dk", "dv", "ro", "rdq", "rdk", "rdv"),
                             (*want, *want_rope)):  # fmt: skip
            np.testing.assert_allclose(got[name], ref, rtol=1e-4, atol=2e-5,
                                       err_msg=f"{isa}: {name}")  # fmt: skip


# ----------------------------------------------------------------------------- MoE experts

_GMM_CHILD = (
    _CHILD_PRELUDE
    + """
x, w, dy, counts = d["x"], d["w"], d["dy"], d["counts"]
y = np.full((x.shape[0], w.shape[1]), np.nan, np.float32)  # every element must be written
dx = np.full(x.shape, np.nan, np.float32)
dw = np.full(w.shape, np.nan, np.float32)
call("mindloom_gmm_nt", [x, w, counts, y])
call("mindloom_gmm_nn", [dy, w, counts, dx])
call("mindloom_gmm_tn", [dy, x, counts, dw])
bad = counts.copy()
bad[0] += x.shape[0] - counts.sum() + 1  # one row more than x has
refused = aot_call(lib, "mindloom_gmm_nt", [x, w, bad, np.zeros_like(y)]) != 0
np.savez(sys.argv[3], y=y, dx=dx, dw=dw, refused=refused)
"""
)


def numpy_grouped(x, w, counts, dy):
    """float64 reference: (y, dx, dw) of rows grouped by expert, rows past them zero."""
    off = np.concatenate([[0], np.cumsum(counts)])
    x64, w64, g64 = x.astype(np.float64), w.astype(np.float64), dy.astype(np.float64)
    y, dx = np.zeros((x.shape[0], w.shape[1])), np.zeros(x.shape)
    dw = np.zeros(w.shape)
    for e in range(len(counts)):
        rows = slice(off[e], off[e + 1])
        y[rows] = x64[rows] @ w64[e].T
        dx[rows] = g64[rows] @ w64[e]
        dw[e] = g64[rows].T @ x64[rows]
    return y, dx, dw


def test_grouped_expert_products_every_instruction_set_against_numpy(tmp_path):
    """The MoE experts' grouped GEMM's three products (y = x_e w_e^T, dx = dy_e w_e,
    dw_e = dy_e^T x_e) against float64 NumPy, once per instruction set the library builds:
    an idle expert (dw zero), an expert of one row, one of more rows than a task holds
    (400 > 384), rows past the last expert (zero out), a depth over one packed slice
    (K = 300 > 256) and outputs wider than a task (N = 260 > 256) with edge tiles on both
    sides; counts that overrun x are refused. Plants: the second depth slice written
    instead of added; the last expert's rows skipped (see the model README)."""
    import subprocess
    import sys

    data = np.random.default_rng(11)
    counts = np.array([5, 0, 1, 400, 37], np.int32)
    p, k, n = int(counts.sum()) + 9, 300, 260
    arrays = dict(
        x=data.standard_normal((p, k)).astype(np.float32),
        w=data.standard_normal((len(counts), n, k)).astype(np.float32),
        dy=data.standard_normal((p, n)).astype(np.float32),
        counts=counts,
    )
    np.savez(tmp_path / "in.npz", **arrays)
    want = numpy_grouped(arrays["x"], arrays["w"], counts, arrays["dy"])
    for isa in ("base", "avx2", "avx512"):
        out = tmp_path / f"{isa}.npz"
        env = dict(os.environ, MINDLOOM_KERNEL_ISA=isa)
        subprocess.run([sys.executable, "-c", _GMM_CHILD, str(K.library_path()),
                        str(tmp_path / "in.npz"), str(out)], env=env, check=True,
                       timeout=120)  # fmt: skip
        got = np.load(out)
        for name, ref in zip(("y", "dx", "dw"), want):
            np.testing.assert_allclose(got[name], ref, rtol=1e-4, atol=1e-3,
                                       err_msg=f"{isa}: {name}")  # fmt: skip
        assert bool(got["refused"]), isa


def test_grouped_weight_gradient_per_rank_rounds_as_micro_batches_added():
    """Counts [R, E] (expert parallel: each expert's rows per source rank): the weight
    gradient is bit for bit each rank's rows' gradient (a call with [E] counts, as one
    process computes a micro-batch's) added in rank order in fp32, also across a depth
    slice (an expert with 300 rows from rank 0); y and dx are the [E] counts' ones.
    Plant: the breaks ignored (one reduction over both ranks' rows): dw differs in the
    last bits."""
    lib = ctypes.CDLL(str(K.library_path()))
    data = np.random.default_rng(5)
    per_rank = np.array([[3, 0, 300, 20], [0, 7, 41, 20]], np.int32)  # [R, E]
    e, k, n = per_rank.shape[1], 40, 24
    parts = [data.standard_normal((int(c.sum()), k)).astype(np.float32) for c in per_rank]
    grads_ = [data.standard_normal((len(x), n)).astype(np.float32) for x in parts]
    want = np.zeros((e, n, k), np.float32)
    for x, g, c in zip(parts, grads_, per_rank):
        dw = np.zeros((e, n, k), np.float32)
        assert aot_call(lib, "mindloom_gmm_tn", [g, x, c, dw]) == 0
        want = want + dw  # fp32, rank by rank
    # the ranks' rows merged expert by expert, rank order within each expert
    off = [np.concatenate([[0], np.cumsum(c)]) for c in per_rank]
    order = [(r, i) for i in range(e) for r in range(len(per_rank))]
    x = np.concatenate([parts[r][off[r][i] : off[r][i + 1]] for r, i in order])
    g = np.concatenate([grads_[r][off[r][i] : off[r][i + 1]] for r, i in order])
    got = np.zeros((e, n, k), np.float32)
    assert aot_call(lib, "mindloom_gmm_tn", [g, x, per_rank, got]) == 0
    np.testing.assert_array_equal(got, want)
    flat = per_rank.sum(0).astype(np.int32)
    w = data.standard_normal((e, n, k)).astype(np.float32)
    for name, a, out_shape in (
        ("mindloom_gmm_nt", x, (len(x), n)),
        ("mindloom_gmm_nn", g, (len(x), k)),
    ):
        by_rank, by_expert = np.zeros(out_shape, np.float32), np.zeros(out_shape, np.float32)
        assert aot_call(lib, name, [a, w, per_rank, by_rank]) == 0
        assert aot_call(lib, name, [a, w, flat, by_expert]) == 0
        np.testing.assert_array_equal(by_rank, by_expert)


@pytest.mark.parametrize("e,g,tg,k", [(16, 4, 2, 2), (8, 1, 1, 3), (64, 8, 3, 6), (6, 3, 3, 1)])
def test_route_kernel_against_the_numpy_routing(e, g, tg, k):
    """KernelRoute's group-limited top-k against mindloom_model's NumPy routing
    (moe_route_reference, stable sorts): logits from 4 values, so rows are full of exact
    ties (among experts and among group scores), which both break to the lower index;
    plus a random bias. Plant: the group score from the best expert only (see the model
    README)."""
    from types import SimpleNamespace

    from mindloom_model import moe_route_reference

    data = np.random.default_rng(e + k)
    n = 300
    logits = data.integers(-1, 3, (n, e)).astype(np.float32)
    for bias in (np.zeros(e, np.float32), (data.random(e) * 0.3).astype(np.float32)):
        cfg = SimpleNamespace(n_group=g, topk_group=tg, num_experts_per_tok=k,
                              norm_topk_prob=True, routed_scaling_factor=1.0)  # fmt: skip
        want, _, _ = moe_route_reference(logits, np.eye(e, dtype=np.float32), bias, cfg)
        choice = 1.0 / (1.0 + np.exp(-logits.astype(np.float64))) + bias
        got = K.KernelRoute(k, g, tg)(Tensor(choice.astype(np.float32))).asnumpy()
        np.testing.assert_array_equal(np.sort(got, 1), want)
        # descending order of choice within a row (the portable TopK's order)
        picked = np.take_along_axis(choice.astype(np.float32), got, 1)
        assert (np.diff(picked, axis=1) <= 0).all()


def test_grouped_matmul_cell_gradients_against_numpy():
    # the Cell's bprop wiring: MindSpore's gradients of sum(y * g) for x and w
    counts = np.array([3, 0, 6, 2], np.int32)
    x = rng.standard_normal((13, 24)).astype(np.float32)
    w = rng.standard_normal((4, 10, 24)).astype(np.float32)
    g = rng.standard_normal((13, 10)).astype(np.float32)
    kern, gt, ct = K.KernelGroupedMatMul(), Tensor(g), Tensor(counts)
    y = kern(Tensor(x), Tensor(w), ct).asnumpy()
    dx, dw = grads(lambda a, b: (kern(a, b, ct) * gt).sum(), (x, w), (0, 1))
    want = numpy_grouped(x, w, counts, g)
    for got, ref in zip((y, dx.asnumpy(), dw.asnumpy()), want):
        np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-5)


def numpy_dispatch(idx, e, r=1):
    """The dispatch plan by NumPy's stable sort: slots (m, j) with an id in [0, E), in slot
    order, sorted by expert -> (dest [M, k] (-1: another rank's slot), row_token [S] (-1:
    no slot), counts [R, E] (rank of a slot: its token's block of M / R))."""
    flat = idx.reshape(-1)
    here = np.flatnonzero((flat >= 0) & (flat < e))
    order = here[np.argsort(flat[here], kind="stable")]  # row i holds slot order[i]
    dest = np.full(idx.size, -1)
    dest[order] = np.arange(len(order))
    token = np.full(idx.size, -1)
    token[: len(order)] = order // idx.shape[1]
    counts = np.zeros((r, e), np.int64)
    np.add.at(counts, (here // idx.shape[1] // (len(idx) // r), flat[here]), 1)
    return dest.reshape(idx.shape), token, counts


@pytest.mark.parametrize("m,k,e,r", [(37, 2, 6, 1), (50, 3, 8, 1), (9, 1, 4, 1), (40, 2, 3, 2)])
def test_moe_dispatch_kernels_against_numpy(m, k, e, r):
    """The fused dropless dispatch (KernelMoEPlan, KernelMoEGather, KernelMoECombine)
    against NumPy: the plan (slots sorted by expert, slot order within an expert, counts
    per source rank; an idle expert), the gathered rows, y = sum_j w xs[dest] + base and
    every gradient (xs, w, base through the combine; x through the gather: each token's k
    rows summed) in float64. R = 2 is expert parallel: ids relative to this rank's first
    expert, slots outside [0, E) are other ranks' (no row, no weight gradient here), rows
    past this rank's slots are zero. Ids out of range (one process) and rows out of range
    are refused. Plants: the plan's rows not in slot order within an expert; the gather's
    backward keeping only j = 0; w's gradient from the unweighted rows times w (see the
    model README)."""
    data = np.random.default_rng(m + k)
    lo, hi = (0, e - 1) if r == 1 else (-2, e + 2)  # one process: the last expert idle
    idx = np.stack([data.choice(np.arange(lo, hi), k, replace=False) for _ in range(m)])
    idx = idx.astype(np.int32)
    d = 24
    spec = Tensor(np.zeros((r, e), np.int32))
    dest_t, tok_t, counts_t = K.KernelMoEPlan()(Tensor(idx), spec)
    dest, tok, counts = dest_t.asnumpy(), tok_t.asnumpy(), counts_t.asnumpy()
    want = numpy_dispatch(idx, e, r)
    np.testing.assert_array_equal(dest, want[0])
    np.testing.assert_array_equal(tok, want[1])
    np.testing.assert_array_equal(counts, want[2])
    assert counts[:, e - 1].sum() == 0 if r == 1 else (dest == -1).any()

    x = data.standard_normal((m, d)).astype(np.float32)
    g = data.standard_normal((m * k, d)).astype(np.float32)
    gather = K.KernelMoEGather()
    rows_x = np.concatenate([x, np.zeros((1, d), np.float32)])[tok]  # -1: the zero row
    np.testing.assert_array_equal(gather(Tensor(x), tok_t, dest_t).asnumpy(), rows_x)
    dx = grads(lambda a: (gather(a, tok_t, dest_t) * Tensor(g)).sum(), (x,), 0)
    g_pad = np.concatenate([g.astype(np.float64), np.zeros((1, d))])
    np.testing.assert_allclose(dx.asnumpy(), g_pad[dest].sum(1), rtol=1e-6, atol=1e-6)

    xs = data.standard_normal((m * k, d)).astype(np.float32)
    w = data.random((m, k)).astype(np.float32)
    base = data.standard_normal((m, d)).astype(np.float32)
    gy = data.standard_normal((m, d)).astype(np.float32)
    comb = K.KernelMoECombine()
    y = comb(Tensor(xs), Tensor(w), dest_t, Tensor(base)).asnumpy()
    rows = np.concatenate([xs.astype(np.float64), np.zeros((1, d))])[dest]  # [M, k, D]
    np.testing.assert_allclose(y, (w[..., None] * rows).sum(1) + base, rtol=1e-5, atol=1e-5)
    dxs, dw, dbase = grads(lambda a, b, c: (comb(a, b, dest_t, c) * Tensor(gy)).sum(),
                           (xs, w, base), (0, 1, 2))  # fmt: skip
    want_dxs = np.zeros((m * k + 1, d))
    want_dxs[dest.reshape(-1)] = (w[..., None] * gy[:, None, :]).reshape(m * k, d)
    want_dxs[-1] = 0.0  # the slots of other ranks wrote their row "-1": none here
    np.testing.assert_allclose(dxs.asnumpy(), want_dxs[:-1], rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(dw.asnumpy(), (rows * gy[:, None, :]).sum(-1), rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(dbase.asnumpy(), gy)

    lib = ctypes.CDLL(str(K.library_path()))
    if r == 1:
        bad = idx.copy()
        bad[-1, -1] = e  # an expert that does not exist
        out = [np.zeros((m, k), np.int32), np.zeros(m * k, np.int32), np.zeros((1, e), np.int32)]
        assert aot_call(lib, "mindloom_moe_plan", [bad, np.zeros((1, e), np.int32), *out]) != 0
    far = tok.copy()
    far[0] = m  # a token past x
    assert aot_call(lib, "mindloom_moe_gather", [x, far, np.zeros((m * k, d), np.float32)]) != 0
    far = dest.copy()
    far[0, 0] = m * k  # a row past the buffer
    y_out = np.zeros((m, d), np.float32)
    assert aot_call(lib, "mindloom_moe_combine", [xs, w, far, base, y_out]) != 0


# ----------------------------------------------------------------------------- whole model


def _restarted_positions(seg: np.ndarray) -> np.ndarray:
    """Position ids [B, S] that restart at 0 at each document of the segment ids."""
    b, s = seg.shape
    pos = np.zeros((b, s), np.int32)
    for i in range(b):
        for j in range(1, s):
            pos[i, j] = 0 if seg[i, j] != seg[i, j - 1] else pos[i, j - 1] + 1
    return pos


def train_losses(kernels: str, steps: int = 20):
    cfg = get_preset("debug", kernels=kernels)
    net = LlamaWithLoss(Llama(cfg, seed=3))
    assert (net.model.loss_kernel is not None) == (kernels == "auto")
    opt = nn.AdamWeightDecay(net.trainable_params(), learning_rate=1e-3)
    step = nn.TrainOneStepCell(net, opt)
    data = np.random.default_rng(11)
    b, s = 3, cfg.max_seq_len
    # one fixed packed batch, so the losses must fall as the model memorises it
    tokens = data.integers(0, cfg.vocab_size, (b, s + 1)).astype(np.int32)
    seg = np.repeat(np.arange(4, dtype=np.int32), [5, 11, 3, s - 19])[None].repeat(b, 0)
    seg[1] = 0  # one row is a single document
    pos = _restarted_positions(seg)
    mask = (data.random((b, s)) > 0.2).astype(np.float32)
    args = [Tensor(a) for a in (tokens[:, :-1], tokens[:, 1:], pos, seg, mask)]
    return np.array([float(step(*args).asnumpy()) for _ in range(steps)])


def test_whole_model_losses_equal_the_portable_path_over_20_steps():
    ms.set_context(mode=ms.GRAPH_MODE)
    try:
        fused, portable = train_losses("auto"), train_losses("portable")
    finally:
        ms.set_context(mode=ms.PYNATIVE_MODE)
    assert fused[-1] < fused[0]  # it learns
    np.testing.assert_allclose(fused, portable, rtol=0, atol=1e-5)


def test_failing_compiler_falls_back_to_portable_ops_and_says_so_once(
    tmp_path, monkeypatch, caplog
):
    saved = dict(K._state)
    monkeypatch.setenv("CXX", "/bin/false")
    monkeypatch.setenv("MINDLOOM_CACHE_DIR", str(tmp_path))
    K._state.clear()
    try:
        with caplog.at_level(logging.WARNING, logger="mindloom_model"):
            cfg = get_preset("debug", kernels="auto")
            assert not use_cpu_kernels(cfg)
            model = Llama(cfg)
            Llama(cfg)
        assert model.loss_kernel is None and model.layers[0].mlp.kernel is None
        said = [r.message for r in caplog.records if "kernels unavailable" in r.message]
        assert len(said) == 1 and "/bin/false failed" in said[0], said
        out = model(Tensor(np.zeros((1, 8), np.int32)))
        assert out.shape == (1, 8, cfg.vocab_size)
    finally:
        K._state.clear()
        K._state.update(saved)


def test_the_kernel_library_is_built_once_into_the_cache(tmp_path, monkeypatch):
    saved = dict(K._state)
    monkeypatch.setenv("MINDLOOM_CACHE_DIR", str(tmp_path))
    K._state.clear()
    try:
        lib = K.library_path()
        assert lib is not None and lib.is_file() and lib.parent.parent == tmp_path / "kernels"
        assert [p.name for p in lib.parent.iterdir() if p.suffix == ".so"] == [lib.name]
        mtime = lib.stat().st_mtime_ns
        K._state.clear()
        assert K.library_path() == lib and lib.stat().st_mtime_ns == mtime
    finally:
        K._state.clear()
        K._state.update(saved)


def _ctypes_swiglu(lib, a, b):
    """The library's SwiGLU forward called directly (MindSpore's AOT signature)."""
    y = np.empty_like(a)
    assert aot_call(lib, "mindloom_swiglu_fwd", [a, b, y]) == 0
    return y


def test_the_thread_pool_serves_concurrent_callers_and_a_forked_child():
    """The kernels' own thread pool (not OpenMP's): two threads calling kernels at once
    (one gets the pool, the other runs alone) and a child forked after the pool started
    (it has none of the parent's threads: it must start its own, not wait forever) all
    get NumPy's values. Plant: the atfork reset removed -> the child hangs (killed after
    60 s, fails); the try-lock replaced by a plain second caller entering the pool ->
    wrong values or a hang."""
    import threading

    lib = ctypes.CDLL(str(K.library_path()))
    rng = np.random.default_rng(0)
    a, b = (rng.standard_normal(1 << 18).astype(np.float32) for _ in range(2))
    want = a / (1 + np.exp(-a.astype(np.float64))) * b
    np.testing.assert_allclose(_ctypes_swiglu(lib, a, b), want, rtol=1e-5, atol=1e-6)
    errs: list = []

    def hammer():
        for _ in range(200):
            if not np.allclose(_ctypes_swiglu(lib, a, b), want, rtol=1e-5, atol=1e-6):
                errs.append("wrong values")
                return

    threads = [threading.Thread(target=hammer) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errs and not any(t.is_alive() for t in threads)
    pid = os.fork()
    if pid == 0:  # the child: exit 0 only with the right values
        ok = np.allclose(_ctypes_swiglu(lib, a, b), want, rtol=1e-5, atol=1e-6)
        os._exit(0 if ok else 3)
    import time

    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            assert os.waitstatus_to_exitcode(status) == 0
            return
        time.sleep(0.05)
    os.kill(pid, 9)
    os.waitpid(pid, 0)
    pytest.fail("the forked child's kernel call did not return within 60 s")


def test_portable_config_is_validated():
    with pytest.raises(ValueError, match="kernels must be 'auto' or 'portable'"):
        get_preset("debug", kernels="fast")


# ----------------------------------------------------------------------------- DeepSeek-V3


class _LossParts(nn.Cell):
    """DeepseekV3WithLoss's (total, main, MTP) losses; the total is differentiated."""

    def __init__(self, net):
        super().__init__(auto_prefix=False)
        self.net = net

    def construct(self, *args):
        loss, main, mtp = self.net(*args)[:3]
        return loss, main, mtp


class _DeepseekStep(nn.Cell):
    def __init__(self, net, opt):
        super().__init__(auto_prefix=False)
        self.opt = opt
        self.grad = ops.value_and_grad(_LossParts(net), None, opt.parameters, has_aux=True)

    def construct(self, *args):
        (loss, main, mtp), g = self.grad(*args)
        return ops.depend(ops.stack((loss, main, mtp)), self.opt(g))


def deepseek_losses(kernels: str, steps: int = 3):
    from mindloom_model import DeepseekV3, DeepseekV3WithLoss
    from mindloom_model._deepseek_moe import Experts, Router

    # one dense layer and one MTP depth (a MoE block): every kernel site, fewest ops
    cfg = get_preset("deepseek-v3-debug", num_layers=1, kernels=kernels)
    model = DeepseekV3(cfg, seed=5)
    fused = kernels == "auto"
    # every site the kernels apply to, MLA's latent norms and the MTP norms included
    mtp = model.mtp[0]
    assert not model.layers[0].is_moe and mtp.block.is_moe
    sites = [model.loss_kernel, model.layers[0].mlp.kernel, model.layers[0].attn.kernel,
             model.layers[0].attn.q_a_norm.kernel, model.layers[0].attn.kv_a_norm.kernel,
             mtp.block.mlp.shared.kernel, mtp.enorm.kernel, mtp.hnorm.kernel,
             mtp.block.attn.kernel]  # fmt: skip
    sites += [x for _, c in model.cells_and_names() if isinstance(c, Experts)
              for x in (c.kernel, c.grouped)]  # fmt: skip
    sites += [c.select for _, c in model.cells_and_names() if isinstance(c, Router)]
    assert all((x is not None) == fused for x in sites) and model.kernel_attention == fused
    opt = nn.AdamWeightDecay(model.trainable_params(), learning_rate=3e-3)
    step = _DeepseekStep(DeepseekV3WithLoss(model), opt)
    tokens, seg, pos, mask = _packed_batch(cfg, b=2)
    args = [Tensor(a) for a in (tokens[:, :-1], tokens[:, 1:], pos, seg, mask)]
    return np.array([step(*args).asnumpy() for _ in range(steps)])


def _packed_batch(cfg, b):
    # one fixed batch of packed documents (positions restart), a partial loss mask
    data = np.random.default_rng(13)
    s = cfg.max_seq_len
    tokens = data.integers(0, cfg.vocab_size, (b, s + 1)).astype(np.int32)
    seg = np.repeat(np.arange(3, dtype=np.int32), [7, 2, s - 9])[None].repeat(b, 0)
    seg[-1] = 0  # one row is a single document
    pos = _restarted_positions(seg)
    return tokens, seg, pos, (data.random((b, s)) > 0.2).astype(np.float32)


def test_deepseek_losses_with_kernels_equal_the_portable_path():
    # compiled steps: the total, main and MTP losses of every step (so the gradients of
    # every kernel, through AdamW, move the weights the same way)
    ms.set_context(mode=ms.GRAPH_MODE)
    try:
        fused, portable = deepseek_losses("auto"), deepseek_losses("portable")
    finally:
        ms.set_context(mode=ms.PYNATIVE_MODE)
    assert fused[-1, 0] < fused[0, 0] and fused[0, 2] > 0  # it learns; MTP is on
    np.testing.assert_allclose(fused, portable, rtol=0, atol=1e-5)
