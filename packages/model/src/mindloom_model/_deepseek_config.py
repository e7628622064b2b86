"""The deepseek_v3 rules of ModelConfig and its parameter / FLOP accounting: plain
Python, no MindSpore (ModelConfig validates and counts without importing it)."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from mindloom_model._config import ModelConfig


def validate_deepseek(cfg: ModelConfig, bad) -> None:
    """The deepseek_v3 rules; `bad(msg)` raises (ModelConfig.validate's one-line error)."""
    for key in ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"):
        v = getattr(cfg, key)
        if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
            bad(f"{key} must be a positive integer for family deepseek_v3, found {v!r}")
    if cfg.q_lora_rank is not None and (
        not isinstance(cfg.q_lora_rank, int) or cfg.q_lora_rank <= 0
    ):
        bad(f"q_lora_rank must be a positive integer or null, found {cfg.q_lora_rank!r}")
    if cfg.qk_rope_head_dim % 2:
        bad(f"qk_rope_head_dim={cfg.qk_rope_head_dim} must be even (RoPE rotates pairs)")
    if cfg.qk_nope_head_dim % 2:
        bad(f"qk_nope_head_dim={cfg.qk_nope_head_dim} must be even")
    if cfg.num_kv_heads != cfg.num_heads:
        bad(f"num_kv_heads={cfg.num_kv_heads} must equal num_heads={cfg.num_heads} (MLA)")
    e, k = cfg.n_routed_experts, cfg.num_experts_per_tok
    moe_layers = cfg.num_layers - cfg.first_k_dense_replace
    if not 0 <= cfg.first_k_dense_replace <= cfg.num_layers:
        bad(
            f"first_k_dense_replace={cfg.first_k_dense_replace} is not in [0, num_layers={cfg.num_layers}]"
        )
    if moe_layers > 0 or cfg.num_nextn_predict_layers > 0:
        if e <= 0 or cfg.moe_intermediate_size <= 0:
            bad("n_routed_experts and moe_intermediate_size must be positive for MoE layers, "
                f"found {e} and {cfg.moe_intermediate_size}")  # fmt: skip
        if not 0 < k <= e:
            bad(f"num_experts_per_tok={k} must be in [1, n_routed_experts={e}]")
        if cfg.n_group <= 0 or e % cfg.n_group:
            bad(f"n_routed_experts={e} is not divisible by n_group={cfg.n_group}")
        if not 0 < cfg.topk_group <= cfg.n_group:
            bad(f"topk_group={cfg.topk_group} must be in [1, n_group={cfg.n_group}]")
        if cfg.n_group > 1 and e // cfg.n_group < 2:
            bad(
                f"n_routed_experts / n_group = {e // cfg.n_group} < 2 (a group is scored by its two best experts)"
            )
        if k > cfg.topk_group * (e // cfg.n_group):
            bad(f"num_experts_per_tok={k} exceeds the experts of topk_group={cfg.topk_group} groups "
                f"({cfg.topk_group * (e // cfg.n_group)})")  # fmt: skip
    if cfg.n_shared_experts < 0:
        bad(f"n_shared_experts must be >= 0, found {cfg.n_shared_experts}")
    if cfg.scoring_func != "sigmoid":
        bad(f"scoring_func must be 'sigmoid' (DeepSeek-V3), found {cfg.scoring_func!r}")
    if cfg.moe_capacity_factor is not None and not cfg.moe_capacity_factor > 0:
        bad(f"moe_capacity_factor must be > 0 or null, found {cfg.moe_capacity_factor!r}")
    if cfg.num_nextn_predict_layers < 0:
        bad(f"num_nextn_predict_layers must be >= 0, found {cfg.num_nextn_predict_layers}")
    for key in (
        "routed_scaling_factor",
        "moe_bias_update_speed",
        "moe_aux_loss_weight",
        "mtp_loss_weight",
    ):
        v = getattr(cfg, key)
        if not isinstance(v, (int, float)) or isinstance(v, bool) or not math.isfinite(v) or v < 0:
            bad(f"{key} must be a finite number >= 0, found {v!r}")
    rs = cfg.rope_scaling
    if rs is not None:
        if not isinstance(rs, dict):
            bad(f"rope_scaling must be a mapping or null, found {rs!r}")
        kind = rs.get("type", rs.get("rope_type"))
        if kind not in ("yarn", "default"):
            bad(f"rope_scaling type must be 'yarn', found {kind!r}")
        if kind == "yarn":
            for key in ("factor", "original_max_position_embeddings"):
                if not isinstance(rs.get(key), (int, float)) or rs[key] <= 0:
                    bad(f"rope_scaling.{key} must be a positive number, found {rs.get(key)!r}")
            unknown = set(rs) - {"type", "rope_type", "factor", "original_max_position_embeddings",
                                 "beta_fast", "beta_slow", "mscale", "mscale_all_dim", "rope_theta"}  # fmt: skip
            if unknown:
                bad(f"rope_scaling: unknown key(s) {sorted(unknown)}")


def _moe_layer_ids(cfg: ModelConfig) -> list[int]:
    return list(range(cfg.first_k_dense_replace, cfg.num_layers))


def _param_counts(cfg: ModelConfig) -> dict[str, int]:
    d, h = cfg.hidden_size, cfg.num_heads
    dn, dr, dv, r = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim, cfg.kv_lora_rank
    q = d * h * (dn + dr) if cfg.q_lora_rank is None else (
        d * cfg.q_lora_rank + cfg.q_lora_rank + cfg.q_lora_rank * h * (dn + dr))  # fmt: skip
    attn = q + d * (r + dr) + r + r * h * (dn + dv) + h * dv * d
    expert = 3 * d * cfg.moe_intermediate_size
    return {
        "attn": attn + 2 * d,  # + the two block norms
        "dense_mlp": 3 * d * cfg.ffn_hidden_size,
        "router": cfg.n_routed_experts * d,
        "expert": expert,
        "shared": cfg.n_shared_experts * expert,
        "mtp_extra": 2 * d + 2 * d * d + d,  # enorm, hnorm, eh_proj, its final norm
    }


def deepseek_num_params(cfg: ModelConfig, include_embeddings: bool = True, active: bool = False,
                        include_mtp: bool = True) -> int:  # fmt: skip
    """Exact parameter count of `DeepseekV3(cfg)` (the selection biases are buffers, not
    counted). active=True counts the routed experts a token uses (k of E) instead of all."""
    c = _param_counts(cfg)
    n_exp = cfg.num_experts_per_tok if active else cfg.n_routed_experts
    moe_block = c["attn"] + c["router"] + c["shared"] + n_exp * c["expert"]
    n = cfg.first_k_dense_replace * (c["attn"] + c["dense_mlp"])
    n += (cfg.num_layers - cfg.first_k_dense_replace) * moe_block
    n += cfg.hidden_size  # final norm
    if include_mtp:
        n += cfg.num_nextn_predict_layers * (moe_block + c["mtp_extra"])
    if not cfg.tie_embeddings:
        n += cfg.vocab_size * cfg.hidden_size
    if include_embeddings:
        n += cfg.vocab_size * cfg.hidden_size
    return n


def deepseek_flops_per_token(cfg: ModelConfig, seq_length: int) -> float:
    """Training FLOPs per token counting only active experts, MLA and the MTP modules:
    6 * active matmul parameters (the head once per prediction depth) + attention's
    score and value products over the S x S square (PaLM's convention, as for Llama)."""
    n = deepseek_num_params(cfg, include_embeddings=False, active=True, include_mtp=True)
    depths = 1 + cfg.num_nextn_predict_layers
    if cfg.tie_embeddings:
        n += cfg.vocab_size * cfg.hidden_size
    n += (depths - 1) * cfg.vocab_size * cfg.hidden_size  # every MTP depth runs the head
    layers = cfg.num_layers + cfg.num_nextn_predict_layers
    h = cfg.num_heads
    attn = (
        6.0
        * layers
        * h
        * seq_length
        * (cfg.qk_nope_head_dim + cfg.qk_rope_head_dim + cfg.v_head_dim)
    )
    return 6.0 * n + attn
