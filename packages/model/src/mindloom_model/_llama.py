"""A Llama-family decoder in MindSpore, in the spirit of nanoGPT's model.py (the layers it
shares with DeepSeek-V3 -- Linear, RMSNorm, RoPE, attention -- are in `_layers.py`).

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
from mindspore import Tensor, nn, ops

from mindloom_model._config import ModelConfig, get_preset, preset_names  # noqa: F401
from mindloom_model._dropout import CounterDropout, dropout_site
from mindloom_model._layers import (  # noqa: F401  (the old import path: _llama)
    _DTYPES,
    Embedding,
    Linear,
    RMSNorm,
    _low_precision_ok,
    _normal,
    _ScaleRowsCols,
    _Softmax,
    apply_rope,
    attention,
    attention_bias,
    resolve_compute_dtype,
    rope_cos_sin,
    rope_inv_freq,
)

log = logging.getLogger("mindloom_model")

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
        self.kernel = None  # a _kernels.KernelRopeAttention, set by use_cpu_kernels

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
            # bias is segment ids [B|1, S] int32 and cos/sin are [B|1, S, Dh] here: heads
            # stay in the projections' [B, S, H, Dh] layout, no S x S mask exists, and the
            # kernel (KernelRopeAttention(self.scale)) rotates q and k and scales q itself
            b, s, _ = x.shape
            q = self.wq(x).reshape(b, s, self.n_heads, self.head_dim)
            k = self.wk(x).reshape(b, s, self.n_kv_heads, self.head_dim)
            v = self.wv(x).reshape(b, s, self.n_kv_heads, self.head_dim)
            o = self.kernel(q, k, v, bias, cos, sin)[0]
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
        [B|1, S, Dh] and the segment ids [B|1, S] int32 instead (no S x S mask)."""
        s = position_ids.shape[1]
        if self.kernel_attention:
            # the kernel reads the documents from the segment ids and applies RoPE itself
            cos, sin = rope_cos_sin(position_ids, self.inv_freq, heads_axis=False)
            if segment_ids is None:
                return cos, sin, ops.zeros((1, s), ms.int32)
            return cos, sin, segment_ids.astype(ms.int32)
        cos, sin = rope_cos_sin(position_ids, self.inv_freq)  # [B|1, 1, S, Dh]
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
    """Whether a Llama or DeepSeek-V3 built now runs the fused CPU kernels (kernels: auto)."""
    if cfg.kernels != "auto" or compute_dtype != ms.float32:
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
            layer.attn.kernel = _kernels.KernelRopeAttention(layer.attn.scale)
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
