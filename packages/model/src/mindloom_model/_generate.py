"""Autoregressive sampling with a KV cache: greedy, temperature, top-k, top-p.

Generation is compiled (GRAPH_MODE): the KV cache has a fixed size (max_seq_len), so the
one-token decode step compiles once and the prompt once per prompt length; without the
cache the sequence is right-padded to max_seq_len (causal attention makes padding after
the last token harmless), so that path also compiles once. Sampling happens in NumPy
with its own seeded generator.
"""

from __future__ import annotations

import weakref

import mindspore as ms
import numpy as np
from mindspore import Tensor, nn, ops

from mindloom_model._deepseek import DeepseekV3, MLACachedDecoder, mla_empty_cache
from mindloom_model._llama import Llama, rope_cos_sin


class _CachedDecoder(nn.Cell):
    """tokens [B, T] at positions start..start+T-1 against a fixed-size KV cache.

    The cache is [L, B, KV, C, Dh] with C = max_seq_len, so every decode step has the same
    shapes and compiles once; slot j holds the key/value of position j. Each layer is the
    model's own `Block` forward, given the cache. Returns logits [B, T, V] fp32 and the
    updated caches.
    """

    def __init__(self, model: Llama):
        super().__init__(auto_prefix=False)
        self.model = model
        self.slots = Tensor(np.arange(model.config.max_seq_len, dtype=np.int32))  # [C]

    def construct(self, tokens, start, k_cache, v_cache):
        m = self.model
        t = tokens.shape[1]
        pos = m.positions[:, :t] + start  # [1, T]
        cos, sin = rope_cos_sin(pos, m.inv_freq)
        # query at position p sees slots 0..p (one document: no segments here)
        allowed = self.slots.expand_dims(0) <= pos.reshape(t, 1)  # [T, C]
        bias = ops.select(
            allowed,
            ops.zeros(allowed.shape, ms.float32),
            ops.full(allowed.shape, -1e9, dtype=ms.float32),
        )
        bias = bias.reshape(1, 1, t, -1)  # [1, 1, T, C]
        write = (self.slots.expand_dims(0) == pos.reshape(t, 1)).astype(
            m.compute_dtype
        )  # [T, C] one-hot
        keep = 1 - write.sum(0).reshape(-1, 1)  # [C, 1]: slots not written this step
        scatter = write.transpose(1, 0)  # [C, T]
        x = m.embed(tokens)  # [B, T, D]
        new_k, new_v = [], []
        i = 0
        for layer in m.layers:
            x, kc, vc = layer(x, cos, sin, bias, None, (k_cache[i], v_cache[i], keep, scatter))
            new_k.append(kc)
            new_v.append(vc)
            i += 1
        return m.head(m.norm(x)), ops.stack(new_k), ops.stack(new_v)


_decoders: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _decoder(model: Llama) -> _CachedDecoder:
    # kept outside the model so the decoder never shows up among its cells or parameters
    if model not in _decoders:
        if isinstance(model, DeepseekV3):
            _decoders[model] = MLACachedDecoder(model)
        else:
            _decoders[model] = _CachedDecoder(model)
    return _decoders[model]


def _through(cache, dec, model):
    """The decoder and the model's forward, called through `cache` (CompileCache.run)."""

    def cached_dec(*args):
        return cache.run("generate_decoder", dec, *args)

    def cached_forward(x):
        return cache.run("generate_forward", model, x)

    return (cached_dec if dec is not None else None), cached_forward


def _empty_cache(model: Llama, batch: int):
    if isinstance(model, DeepseekV3):
        return mla_empty_cache(model, batch)
    attn = model.layers[0].attn
    shape = (len(model.layers), batch, attn.n_kv_heads, model.config.max_seq_len, attn.head_dim)
    z = Tensor(np.zeros(shape, np.float32)).astype(model.compute_dtype)
    return z, z


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
    compile_cache=None,
) -> np.ndarray:
    """Continue `prompt` ([T] or [B, T] token ids) by up to max_new_tokens -> int32 [B, T + N].

    temperature=0 is greedy. Rows that emit eos_id are padded with eos_id afterwards and
    generation stops when every row has. The context is the model's max_seq_len: past it,
    the no-cache path crops to the last max_seq_len tokens (as nanoGPT does) and the cache
    path re-reads the last max_seq_len // 2 tokens into a fresh cache.

    `compile_cache` (a `CompileCache` whose context holds the model's config): the
    decoder's graphs (prompt, one token) come from its store when a verified entry exists
    and are published there otherwise, so the next generation from the same architecture
    (another process, another checkpoint) starts without compiling them.
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
    ms.set_context(mode=ms.GRAPH_MODE)
    model.set_train(False)
    try:
        done = np.zeros(ids.shape[0], bool)
        cached_len = None  # tokens in the cache; None = no cache yet
        dec = _decoder(model) if use_cache else None
        forward = model
        if compile_cache is not None:  # through the store only when a call compiles
            dec, forward = _through(compile_cache, dec, model)
        for _ in range(max_new_tokens):
            if use_cache:
                if cached_len is None or cached_len >= ctx:
                    keep = ids[:, -(ctx // 2 if cached_len is not None else ctx) :]
                    kc, vc = _empty_cache(model, ids.shape[0])
                    logits, kc, vc = dec(Tensor(keep), Tensor(0, ms.int32), kc, vc)
                    cached_len = keep.shape[1]
                else:
                    logits, kc, vc = dec(Tensor(ids[:, -1:]), Tensor(cached_len, ms.int32), kc, vc)
                    cached_len += 1
                last = logits[:, -1].asnumpy()
            else:
                window = ids[:, -ctx:]
                n = window.shape[1]
                padded = np.zeros((ids.shape[0], ctx), np.int32)
                padded[:, :n] = window
                last = forward(Tensor(padded))[:, n - 1].asnumpy()
            nxt = sample_next(last, rng, temperature, top_k, top_p)
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
