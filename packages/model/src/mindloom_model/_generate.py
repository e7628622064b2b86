"""Autoregressive sampling with a KV cache: greedy, temperature, top-k, top-p.

Generation runs eagerly (PyNative): every step has a new cache length, which would
recompile a graph each time. Sampling happens in NumPy with its own seeded generator.
"""

from __future__ import annotations

import mindspore as ms
import numpy as np
from mindspore import Tensor, ops

from mindloom_model._llama import Llama, attention, rope_cos_sin


def _cached_forward(model: Llama, tokens: np.ndarray, start: int, cache: list):
    """tokens [B, T] at positions start..start+T-1; cache[i] = (k, v) [B, KV, start, Dh] or None.

    Appends this step's keys/values to the cache and returns logits [B, T, V] fp32.
    """
    b, t = tokens.shape
    total = start + t
    pos = Tensor(np.arange(start, total, dtype=np.int32)[None])  # [1, T]
    cos, sin = rope_cos_sin(pos, model.inv_freq)
    # query at position start+i sees keys 0..start+i (one document: no segments here)
    allowed = np.arange(total)[None, :] <= (start + np.arange(t))[:, None]  # [T, total]
    bias = Tensor(np.where(allowed, 0.0, -1e9).astype(np.float32)[None, None])  # [1, 1, T, total]
    x = model.embed(Tensor(tokens.astype(np.int32)))
    for i, layer in enumerate(model.layers):
        attn = layer.attn
        q, k, v = attn.qkv(layer.attn_norm(x), cos, sin)
        if cache[i] is not None:
            k = ops.concat((cache[i][0], k), 2)
            v = ops.concat((cache[i][1], v), 2)
        cache[i] = (k, v)
        x = x + attn.out(attention(q, k, v, bias, attn.n_heads // attn.n_kv_heads))
        x = x + layer.mlp(layer.mlp_norm(x))
    return model.head(model.norm(x))


def sample_next(
    logits: np.ndarray,
    rng: np.random.Generator,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
) -> np.ndarray:
    """logits [B, V] -> token ids [B]. temperature 0 is greedy (argmax)."""
    logits = np.asarray(logits, np.float64)
    if temperature == 0:
        return logits.argmax(-1)
    logits = logits / temperature
    if top_k is not None and top_k < logits.shape[-1]:
        kth = np.sort(logits, -1)[:, -top_k][:, None]
        logits = np.where(logits < kth, -np.inf, logits)
    probs = np.exp(logits - logits.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    if top_p is not None and top_p < 1.0:
        order = np.argsort(-probs, -1)
        sorted_p = np.take_along_axis(probs, order, -1)
        # keep the smallest prefix whose mass reaches top_p (always the most likely token)
        drop_sorted = np.cumsum(sorted_p, -1) - sorted_p >= top_p
        drop = np.zeros_like(drop_sorted)
        np.put_along_axis(drop, order, drop_sorted, -1)
        probs = np.where(drop, 0.0, probs)
        probs /= probs.sum(-1, keepdims=True)
    return np.array([rng.choice(probs.shape[-1], p=p) for p in probs])


def generate(
    model: Llama,
    prompt,
    max_new_tokens: int,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    eos_id: int | None = None,
    seed: int | None = None,
    use_cache: bool = True,
) -> np.ndarray:
    """Continue `prompt` ([T] or [B, T] token ids) by up to max_new_tokens -> int32 [B, T + N].

    temperature=0 is greedy. Rows that emit eos_id are padded with eos_id afterwards and
    generation stops when every row has. The context is the model's max_seq_len: past it,
    the no-cache path crops to the last max_seq_len tokens (as nanoGPT does) and the cache
    path re-reads the last max_seq_len // 2 tokens into a fresh cache.
    """
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0, found {temperature}")
    if top_k is not None and top_k < 1:
        raise ValueError(f"top_k must be >= 1, found {top_k}")
    if top_p is not None and not 0.0 < top_p <= 1.0:
        raise ValueError(f"top_p must be in (0, 1], found {top_p}")
    ids = np.atleast_2d(np.asarray(prompt, np.int64)).astype(np.int32)
    if ids.shape[1] == 0:
        raise ValueError("prompt must hold at least one token")
    rng = np.random.default_rng(seed)
    ctx = model.config.max_seq_len
    mode, training = ms.get_context("mode"), model.training
    ms.set_context(mode=ms.PYNATIVE_MODE)
    model.set_train(False)
    try:
        done = np.zeros(ids.shape[0], bool)
        cache, cached_len = None, 0
        for _ in range(max_new_tokens):
            if use_cache:
                if cache is None or cached_len >= ctx:
                    keep = ids[:, -(ctx // 2 if cache is not None else ctx) :]
                    cache = [None] * len(model.layers)
                    logits = _cached_forward(model, keep, 0, cache)
                    cached_len = keep.shape[1]
                else:
                    logits = _cached_forward(model, ids[:, -1:], cached_len, cache)
                    cached_len += 1
            else:
                logits = model(Tensor(ids[:, -ctx:]))
            nxt = sample_next(logits[:, -1].asnumpy(), rng, temperature, top_k, top_p)
            if eos_id is not None:
                nxt = np.where(done, eos_id, nxt)
                done |= nxt == eos_id
            ids = np.concatenate([ids, nxt[:, None].astype(np.int32)], 1)
            if eos_id is not None and done.all():
                break
    finally:
        model.set_train(training)
        ms.set_context(mode=mode)
    return ids
