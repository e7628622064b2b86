"""The building blocks against small NumPy references, and document isolation end to end."""

import numpy as np
import pytest
from mindloom_model import Llama, get_preset
from mindloom_model._llama import (
    RMSNorm,
    apply_rope,
    attention,
    attention_bias,
    rope_cos_sin,
    rope_inv_freq,
)
from mindspore import Tensor

rng = np.random.default_rng(0)


def np_rmsnorm(x, w, eps):
    return w * x / np.sqrt((x * x).mean(-1, keepdims=True) + eps)


def np_rope(x, pos, theta):
    # rotate pairs (i, i + Dh/2) by angle pos * theta^(-2i/Dh): HF's rotate_half layout
    dh = x.shape[-1]
    half = dh // 2
    ang = pos[..., None].astype(np.float64) * theta ** (-np.arange(half) * 2.0 / dh)  # [B, S, half]
    ang = ang[:, None]  # [B, 1, S, half]
    x1, x2 = x[..., :half], x[..., half:]
    c, s = np.cos(ang), np.sin(ang)
    return np.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], -1)


def np_attention(q, k, v, seg):
    # q [B, H, S, Dh], k/v [B, KV, S, Dh]; j visible from i iff j <= i and seg equal
    b, h, s, dh = q.shape
    rep = h // k.shape[1]
    k, v = np.repeat(k, rep, 1), np.repeat(v, rep, 1)
    scores = q @ k.transpose(0, 1, 3, 2) / np.sqrt(dh)
    allowed = np.tril(np.ones((s, s), bool))[None] & (seg[:, :, None] == seg[:, None, :])
    scores = np.where(allowed[:, None], scores, -np.inf)
    p = np.exp(scores - scores.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    return p @ v


def test_rmsnorm_matches_numpy():
    x = rng.standard_normal((2, 5, 16)).astype(np.float32) * 3
    norm = RMSNorm(16, 1e-5)
    w = rng.standard_normal(16).astype(np.float32)
    norm.weight.set_data(Tensor(w))
    np.testing.assert_allclose(
        norm(Tensor(x)).asnumpy(), np_rmsnorm(x, w, 1e-5), rtol=1e-5, atol=1e-5
    )


def test_rope_matches_numpy_with_restarting_positions():
    x = rng.standard_normal((2, 3, 8, 16)).astype(np.float32)
    pos = np.array([[0, 1, 2, 3, 0, 1, 2, 0], [0, 1, 2, 3, 4, 5, 6, 7]], np.int32)
    cos, sin = rope_cos_sin(Tensor(pos), Tensor(rope_inv_freq(16, 10000.0)))
    got = apply_rope(Tensor(x), cos, sin).asnumpy()
    np.testing.assert_allclose(got, np_rope(x, pos, 10000.0), rtol=1e-5, atol=1e-5)
    # position 0 is the identity, and a rotation preserves norms
    np.testing.assert_allclose(got[:, :, 0], x[:, :, 0], atol=1e-6)
    np.testing.assert_allclose(np.linalg.norm(got, axis=-1), np.linalg.norm(x, axis=-1), rtol=1e-5)


@pytest.mark.parametrize("kv_heads", [4, 2, 1])
def test_masked_attention_with_segments_matches_numpy(kv_heads):
    b, h, s, dh = 2, 4, 10, 8
    q = rng.standard_normal((b, h, s, dh)).astype(np.float32)
    k = rng.standard_normal((b, kv_heads, s, dh)).astype(np.float32)
    v = rng.standard_normal((b, kv_heads, s, dh)).astype(np.float32)
    seg = np.array([[0] * 4 + [1] * 3 + [2] * 3, [0] * 10], np.int32)
    bias = attention_bias(s, Tensor(seg))
    got = attention(Tensor(q), Tensor(k), Tensor(v), bias, h // kv_heads).asnumpy()
    np.testing.assert_allclose(got, np_attention(q, k, v, seg), rtol=1e-5, atol=1e-5)


def test_attention_bias_is_causal_and_segmented():
    seg = np.array([[0, 0, 1, 1, 1]], np.int32)
    allowed = attention_bias(5, Tensor(seg)).asnumpy()[0, 0] == 0
    want = np.tril(np.ones((5, 5), bool)) & (seg[0][:, None] == seg[0][None, :])
    np.testing.assert_array_equal(allowed, want)


def test_packed_documents_do_not_see_each_other():
    """A document packed after another gives the same logits as the document alone."""
    cfg = get_preset("debug")
    model = Llama(cfg)
    model.set_train(False)
    doc_a = rng.integers(0, cfg.vocab_size, 12)
    doc_b = rng.integers(0, cfg.vocab_size, 20)
    tokens = np.concatenate([doc_a, doc_b])[None].astype(np.int32)
    pos = np.concatenate([np.arange(12), np.arange(20)])[None].astype(np.int32)
    seg = np.array([[0] * 12 + [1] * 20], np.int32)
    packed = model(Tensor(tokens), Tensor(pos), Tensor(seg)).asnumpy()[0]
    alone_b = model(Tensor(doc_b[None].astype(np.int32))).asnumpy()[0]
    alone_a = model(Tensor(doc_a[None].astype(np.int32))).asnumpy()[0]
    np.testing.assert_allclose(packed[12:], alone_b, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(packed[:12], alone_a, rtol=1e-4, atol=1e-5)
    # without segment ids document b attends to a: the logits change
    unsegmented = model(Tensor(tokens), Tensor(pos)).asnumpy()[0]
    assert np.abs(unsegmented[12:] - alone_b).max() > 1e-3
