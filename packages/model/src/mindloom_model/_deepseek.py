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

The parts live in their own modules: MLA and its RoPE in _deepseek_mla.py, the router,
experts, dispatch and balancing in _deepseek_moe.py, the cached decoder in
_deepseek_decode.py; this module assembles the layers, the model and its training loss.
"""

from __future__ import annotations

import mindspore as ms
import numpy as np
from mindspore import Tensor, nn, ops

from mindloom_model._deepseek_config import (  # noqa: F401  (re-exported for callers)
    _moe_layer_ids,
    deepseek_flops_per_token,
    deepseek_num_params,
    validate_deepseek,
)
from mindloom_model._deepseek_mla import (  # noqa: F401  (the old import path)
    MLAttention,
    _rope_pairs,
    yarn_inv_freq,
)
from mindloom_model._deepseek_moe import (  # noqa: F401  (the old import path)
    MoE,
    Router,
    moe_route_reference,
    moe_routers,
    update_expert_bias,
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
    attention_bias,
    llama_loss,
    recompute_layer_ids,
    resolve_compute_dtype,
    rope_cos_sin,
    use_cpu_kernels,
)

__all__ = [
    "DeepseekV3",
    "DeepseekV3WithLoss",
    "moe_route_reference",
    "moe_routers",
    "update_expert_bias",
    "yarn_inv_freq",
]


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

    def recompute_parts(self):
        """Recompute this layer's attention and its MLP / experts in the backward: the
        sub-cells, not the whole block. Recomputing the whole block (its norms' custom
        bprop and the router's stop-gradient loads included) made the compiled train step
        fail with "Graph cycle exists" when only some layers were recomputed."""
        self.attn.recompute()
        if self.is_moe:
            self.mlp.experts.recompute()
            if self.mlp.has_shared:
                self.mlp.shared.recompute()
        else:
            self.mlp.recompute()

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
        self.kernel_attention = False
        self.loss_kernel = None
        if use_cpu_kernels(cfg, compute_dtype):
            _install_kernels(self)
        for i in recompute_layer_ids(cfg):
            self.layers[i].recompute_parts()

    def rope(self, position_ids):
        cos, sin = rope_cos_sin(position_ids, self.inv_freq)
        if self.cos_factor != 1.0:
            cos, sin = cos * self.cos_factor, sin * self.cos_factor
        return cos, sin

    def attention_inputs(self, position_ids, segment_ids=None):
        """(cos, sin, bias) every layer takes: RoPE tables [B|1, 1, S, dr] and the additive
        mask [B|1, 1, S, S]; with the fused attention kernel, RoPE tables [B|1, S, 1, dr]
        and the segment ids [B|1, S] int32 instead (no S x S mask)."""
        s = position_ids.shape[1]
        cos, sin = self.rope(position_ids)
        if self.kernel_attention:
            cos, sin = cos.transpose(0, 2, 1, 3), sin.transpose(0, 2, 1, 3)
            if segment_ids is None:
                return cos, sin, ops.zeros((1, s), ms.int32)
            return cos, sin, segment_ids.astype(ms.int32)
        return cos, sin, attention_bias(s, segment_ids)

    def trunk(self, tokens, position_ids=None, segment_ids=None):
        """-> (h [B, S, D] after the last layer, before the final norm; cos; sin; bias;
        loads [n_moe, E]; dropped; aux)."""
        b, s = tokens.shape
        if position_ids is None:
            position_ids = self.positions[:, :s]
        cos, sin, bias = self.attention_inputs(position_ids, segment_ids)
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


def _install_kernels(model: DeepseekV3) -> None:
    """The fused CPU kernels (see use_cpu_kernels): every RMSNorm (MLA's latent norms and
    the MTP norms included), the SwiGLU of dense layers, shared and routed experts, the
    routed experts' grouped products (the dispatch then sorts slots unpadded), the
    cross-entropy of the main and MTP losses, and MLA's attention (dn+dr wide keys, dv
    wide values, the model's softmax scale) unless dropout is on."""
    from mindloom_model import _kernels
    from mindloom_model._deepseek_moe import Experts

    for _, cell in model.cells_and_names():
        if isinstance(cell, RMSNorm):
            cell.kernel = _kernels.KernelRMSNorm()
        elif isinstance(cell, (MLP, Experts)):
            cell.kernel = _kernels.KernelSwiGLU()
            if isinstance(cell, Experts):
                cell.grouped = _kernels.KernelGroupedMatMul()
        elif isinstance(cell, Router):
            cell.select = _kernels.KernelRoute(cell.k, cell.n_group, cell.topk_group)
        elif isinstance(cell, MoE):
            cell.plan = _kernels.KernelMoEPlan()
            cell.gather_rows = _kernels.KernelMoEGather()
            cell.combine_rows = _kernels.KernelMoECombine()
        elif isinstance(cell, MLAttention) and model.config.dropout == 0:
            cell.kernel = _kernels.KernelRopeAttention(cell.scale)
            model.kernel_attention = True
    model.loss_kernel = _kernels.KernelCrossEntropy()


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
        main, mtp, mtp_loads, drop, a = self.head_losses(h, cos, sin, bias, tokens, labels,
                                                         segment_ids, loss_mask)  # fmt: skip
        aux = aux + a
        loss = main + self.mtp_weight * mtp + aux
        if mtp_loads is not None:
            loads = ops.concat((loads, mtp_loads), 0)
        return loss, main, mtp, aux, loads, dropped + drop

    def head_losses(self, h, cos, sin, bias, tokens, labels, segment_ids=None, loss_mask=None):
        """The part after the trunk (a pipeline's last stage runs it on the hidden state it
        receives): h [B, S, D] -> (main CE, MTP loss (mean over depths), MTP loads
        [depths, E] or None without MTP MoE blocks, MTP dropped slots, MTP balance loss)."""
        m = self.model
        # the fused cross-entropy kernel when the model has one (llama_loss picks)
        main = llama_loss(m, m.head(m.norm(h)), labels, loss_mask)
        mask = (
            ops.ones(labels.shape, ms.float32)
            if loss_mask is None
            else loss_mask.astype(ms.float32)
        )
        seg = ops.zeros(labels.shape, ms.int32) if segment_ids is None else segment_ids
        mtp_total = ops.zeros((), ms.float32)
        dropped = ops.zeros((), ms.float32)
        aux = ops.zeros((), ms.float32)
        all_loads = []
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
            mtp_total = mtp_total + llama_loss(m, m.head(mod.norm(hj)), nxt_labels, valid)
            prev = mod.norm(hj)
        mtp = mtp_total / max(self.depths, 1)
        return main, mtp, (ops.concat(all_loads, 0) if all_loads else None), dropped, aux


def __getattr__(name: str):
    # the decoder lives in _deepseek_decode (it imports this module): the old import
    # path `from mindloom_model._deepseek import MLACachedDecoder` still works
    if name in ("MLACachedDecoder", "mla_empty_cache"):
        from mindloom_model import _deepseek_decode

        return getattr(_deepseek_decode, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
