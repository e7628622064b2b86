"""Hugging Face `DeepseekV3ForCausalLM` directories in and out (config.json + safetensors).

Tensor names are Hugging Face's checkpoint names: routed experts one by one
(`mlp.experts.N.{gate,up,down}_proj.weight`), the selection bias as
`mlp.gate.e_score_correction_bias`, MLA as `self_attn.{q_a_proj, q_a_layernorm, q_b_proj,
kv_a_proj_with_mqa, kv_a_layernorm, kv_b_proj, o_proj}`. Multi-token-prediction depth j
is layer `num_hidden_layers + j` (DeepSeek's release layout: `enorm`, `hnorm`,
`eh_proj`, `shared_head.norm`, plus copies of the embedding and head), read when present
and written only when asked.
"""

from __future__ import annotations

import logging
from pathlib import Path

import mindspore as ms
import numpy as np

from mindloom_model._deepseek import DeepseekV3
from mindloom_model._hf_files import (
    HFFormatError,
    check_tensor_shapes,
    read_fp32_tensor,
    read_headers,
    write_hf_dir,
)
from mindloom_model._llama import ModelConfig

log = logging.getLogger("mindloom_model")

_ATTN = {  # ours (under layers.{i}.attn.) -> Hugging Face (under model.layers.{i}.self_attn.)
    "q_proj": "q_proj",
    "q_a_proj": "q_a_proj",
    "q_a_norm": "q_a_layernorm",
    "q_b_proj": "q_b_proj",
    "kv_a_proj": "kv_a_proj_with_mqa",
    "kv_a_norm": "kv_a_layernorm",
    "kv_b_proj": "kv_b_proj",
    "wo": "o_proj",
}
_SWIGLU = {"w1": "gate_proj", "w2": "down_proj", "w3": "up_proj"}


def deepseek_hf_config(cfg: ModelConfig, dtype: str = "float32", **extra) -> dict:
    d = {
        "architectures": ["DeepseekV3ForCausalLM"],
        "model_type": "deepseek_v3",
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.ffn_hidden_size,
        "moe_intermediate_size": cfg.moe_intermediate_size,
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.num_heads,
        "n_shared_experts": cfg.n_shared_experts,
        "n_routed_experts": cfg.n_routed_experts,
        "routed_scaling_factor": cfg.routed_scaling_factor,
        "kv_lora_rank": cfg.kv_lora_rank,
        "q_lora_rank": cfg.q_lora_rank,
        "qk_rope_head_dim": cfg.qk_rope_head_dim,
        "qk_nope_head_dim": cfg.qk_nope_head_dim,
        "v_head_dim": cfg.v_head_dim,
        "n_group": cfg.n_group,
        "topk_group": cfg.topk_group,
        "num_experts_per_tok": cfg.num_experts_per_tok,
        "first_k_dense_replace": cfg.first_k_dense_replace,
        "norm_topk_prob": cfg.norm_topk_prob,
        "scoring_func": cfg.scoring_func,
        "num_nextn_predict_layers": cfg.num_nextn_predict_layers,
        "hidden_act": "silu",
        "max_position_embeddings": cfg.max_seq_len,
        "rms_norm_eps": cfg.rms_norm_eps,
        "rope_theta": cfg.rope_theta,
        "rope_interleave": cfg.rope_interleave,
        "tie_word_embeddings": cfg.tie_embeddings,
        "initializer_range": cfg.init_std,
        "attention_bias": False,
        "torch_dtype": dtype,
        "dtype": dtype,
    }
    rope = {"rope_type": "default", "rope_theta": cfg.rope_theta}
    if cfg.rope_scaling:
        scaling = {k: v for k, v in cfg.rope_scaling.items() if k not in ("type", "rope_type")}
        rope = {"rope_type": "yarn", "rope_theta": cfg.rope_theta, **scaling}
        d["rope_scaling"] = {"type": "yarn", **scaling}
    d["rope_parameters"] = rope
    d.update(extra)
    return d


def deepseek_config_from_hf(d: dict, where: str, **overrides) -> ModelConfig:
    def need(key):
        if key not in d:
            raise HFFormatError(f"{where}: missing key {key!r}")
        return d[key]

    if d.get("hidden_act", "silu") != "silu":
        raise HFFormatError(
            f"{where}: hidden_act {d['hidden_act']!r} is not supported (only 'silu')"
        )
    if d.get("attention_bias"):
        raise HFFormatError(f"{where}: attention_bias=true is not supported")
    rope = dict(d.get("rope_parameters") or {})
    scaling = dict(d.get("rope_scaling") or {})
    kind = scaling.get("type", scaling.get("rope_type")) or rope.get("rope_type", "default")
    theta = float(rope.get("rope_theta", d.get("rope_theta", 10000.0)))
    rope_scaling = None
    if kind == "yarn":
        src = scaling or rope
        rope_scaling = {"type": "yarn"}
        for key in (
            "factor",
            "original_max_position_embeddings",
            "beta_fast",
            "beta_slow",
            "mscale",
            "mscale_all_dim",
        ):
            if src.get(key) is not None:
                rope_scaling[key] = src[key]
    elif kind != "default":
        raise HFFormatError(f"{where}: rope scaling {kind!r} is not supported (default or yarn)")
    heads = need("num_attention_heads")
    if (d.get("num_key_value_heads") or heads) != heads:
        raise HFFormatError(
            f"{where}: num_key_value_heads {d['num_key_value_heads']} != num_attention_heads {heads}"
        )
    fields = dict(
        family="deepseek_v3",
        vocab_size=need("vocab_size"),
        hidden_size=need("hidden_size"),
        num_layers=need("num_hidden_layers"),
        num_heads=heads,
        ffn_hidden_size=need("intermediate_size"),
        max_seq_len=d.get("max_position_embeddings", 4096),
        rms_norm_eps=d.get("rms_norm_eps", 1e-6),
        rope_theta=theta,
        rope_scaling=rope_scaling,
        tie_embeddings=bool(d.get("tie_word_embeddings", False)),
        init_std=d.get("initializer_range", 0.02),
        q_lora_rank=d.get("q_lora_rank"),
        kv_lora_rank=need("kv_lora_rank"),
        qk_nope_head_dim=need("qk_nope_head_dim"),
        qk_rope_head_dim=need("qk_rope_head_dim"),
        v_head_dim=need("v_head_dim"),
        rope_interleave=bool(d.get("rope_interleave", True)),
        n_routed_experts=need("n_routed_experts"),
        n_shared_experts=d.get("n_shared_experts") or 0,
        num_experts_per_tok=need("num_experts_per_tok"),
        moe_intermediate_size=need("moe_intermediate_size"),
        n_group=d.get("n_group") or 1,
        topk_group=d.get("topk_group") or 1,
        routed_scaling_factor=float(d.get("routed_scaling_factor", 1.0)),
        norm_topk_prob=bool(d.get("norm_topk_prob", True)),
        first_k_dense_replace=d.get("first_k_dense_replace") or 0,
        scoring_func=d.get("scoring_func", "sigmoid"),
        num_nextn_predict_layers=d.get("num_nextn_predict_layers", d.get("num_mtp_layers", 0)) or 0,
    )
    fields.update(overrides)
    try:
        return ModelConfig(**fields)
    except ValueError as e:
        raise HFFormatError(f"{where}: {e}") from None


def _layer_names(cfg: ModelConfig, ours: str, hf: str, moe: bool) -> dict[str, str]:
    """ours-prefix block params -> HF names (experts excluded: they are stacked)."""
    names = {ours + "attn_norm.weight": hf + "input_layernorm.weight",
             ours + "mlp_norm.weight": hf + "post_attention_layernorm.weight"}  # fmt: skip
    attn = ["q_a_proj", "q_a_norm", "q_b_proj"] if cfg.q_lora_rank is not None else ["q_proj"]
    for a in attn + ["kv_a_proj", "kv_a_norm", "kv_b_proj", "wo"]:
        names[f"{ours}attn.{a}.weight"] = f"{hf}self_attn.{_ATTN[a]}.weight"
    if moe:
        names[ours + "mlp.gate.weight"] = hf + "mlp.gate.weight"
        names[ours + "mlp.gate.expert_bias"] = hf + "mlp.gate.e_score_correction_bias"
        if cfg.n_shared_experts:
            for w, h in _SWIGLU.items():
                names[f"{ours}mlp.shared.{w}.weight"] = f"{hf}mlp.shared_experts.{h}.weight"
    else:
        for w, h in _SWIGLU.items():
            names[f"{ours}mlp.{w}.weight"] = f"{hf}mlp.{h}.weight"
    return names


def _expert_prefixes(cfg: ModelConfig, mtp: int) -> dict[str, str]:
    """ours experts-cell prefix -> HF `...mlp.experts.` prefix, for every MoE block."""
    out = {}
    for i in range(cfg.first_k_dense_replace, cfg.num_layers):
        out[f"layers.{i}.mlp.experts."] = f"model.layers.{i}.mlp.experts."
    for j in range(mtp):
        out[f"mtp.{j}.block.mlp.experts."] = f"model.layers.{cfg.num_layers + j}.mlp.experts."
    return out


def deepseek_hf_names(cfg: ModelConfig, mtp: int | None = None) -> dict[str, str]:
    """Our parameter name -> Hugging Face tensor name, experts excluded."""
    mtp = cfg.num_nextn_predict_layers if mtp is None else mtp
    names = {"embed.weight": "model.embed_tokens.weight", "norm.weight": "model.norm.weight"}
    if not cfg.tie_embeddings:
        names["lm_head.weight"] = "lm_head.weight"
    for i in range(cfg.num_layers):
        names.update(
            _layer_names(cfg, f"layers.{i}.", f"model.layers.{i}.", i >= cfg.first_k_dense_replace)
        )
    for j in range(mtp):
        hf = f"model.layers.{cfg.num_layers + j}."
        names.update(_layer_names(cfg, f"mtp.{j}.block.", hf, cfg.n_routed_experts > 0))
        for a, b in (
            ("enorm", "enorm"),
            ("hnorm", "hnorm"),
            ("eh_proj", "eh_proj"),
            ("norm", "shared_head.norm"),
        ):
            names[f"mtp.{j}.{a}.weight"] = f"{hf}{b}.weight"
    return names


def _expected_shapes(model: DeepseekV3, mtp: int) -> dict[str, tuple]:
    cfg = model.config
    params = {p.name: p for p in model.get_parameters()}
    shapes = {hf: tuple(params[ours].shape) for ours, hf in deepseek_hf_names(cfg, mtp).items()}
    f, d = cfg.moe_intermediate_size, cfg.hidden_size
    for hf in _expert_prefixes(cfg, mtp).values():
        for e in range(cfg.n_routed_experts):
            shapes.update({f"{hf}{e}.gate_proj.weight": (f, d), f"{hf}{e}.up_proj.weight": (f, d),
                           f"{hf}{e}.down_proj.weight": (d, f)})  # fmt: skip
    return shapes


def save_deepseek_hf(
    model: DeepseekV3, out_dir, dtype: str = "float32", include_mtp: bool = False, **extra
) -> Path:
    """Write a DeepseekV3ForCausalLM directory. MTP modules only with include_mtp (they are
    a training objective; Hugging Face's model ignores them)."""
    cfg = model.config
    mtp = cfg.num_nextn_predict_layers if include_mtp else 0
    params = {p.name: p.astype(ms.float32).asnumpy() for p in model.get_parameters()}
    tensors = {hf: params[ours] for ours, hf in deepseek_hf_names(cfg, mtp).items()}
    for ours, hf in _expert_prefixes(cfg, mtp).items():
        for w, h in _SWIGLU.items():
            stacked = params[ours + w]  # [E, ...]
            for e in range(cfg.n_routed_experts):
                tensors[f"{hf}{e}.{h}.weight"] = stacked[e]
    head = params["embed.weight"] if cfg.tie_embeddings else params["lm_head.weight"]
    for j in range(mtp):  # the release layout keeps its own copies of these two
        tensors[f"model.layers.{cfg.num_layers + j}.embed_tokens.weight"] = params["embed.weight"]
        tensors[f"model.layers.{cfg.num_layers + j}.shared_head.head.weight"] = head
    expected = _expected_shapes(model, mtp)
    for name, shape in expected.items():
        if tensors[name].shape != shape:
            raise ValueError(
                f"save_hf: {name} has shape {list(tensors[name].shape)}, expected {list(shape)}"
            )
    config = deepseek_hf_config(cfg, dtype, **extra)
    config["num_nextn_predict_layers"] = mtp
    return write_hf_dir(out_dir, tensors, config, dtype)


def load_deepseek_hf(root: Path, raw: dict, where: str, **overrides) -> DeepseekV3:
    """Build a DeepseekV3 from a checked config dict and the directory's safetensors.

    MTP depths whose tensors the files hold are loaded; `num_nextn_predict_layers` in
    `overrides` asks for more (fresh initialisation for those). Every tensor is checked
    against the config before any is read."""
    found = read_headers(root)
    probe = deepseek_config_from_hf(raw, where, **{**overrides, "num_nextn_predict_layers": 0})
    present = 0
    while any(n.startswith(f"model.layers.{probe.num_layers + present}.") for n in found):
        present += 1
    want = overrides.get("num_nextn_predict_layers", present)
    cfg = deepseek_config_from_hf(raw, where, **{**overrides, "num_nextn_predict_layers": want})
    load_mtp = min(present, want)
    model = DeepseekV3(cfg)
    expected = _expected_shapes(model, load_mtp)
    skip = {f"model.layers.{cfg.num_layers + j}.{n}" for j in range(present)
            for n in ("embed_tokens.weight", "shared_head.head.weight")}  # fmt: skip
    mtp_left_out = tuple(f"model.layers.{cfg.num_layers + j}." for j in range(load_mtp, present))

    def ignore(name: str) -> bool:  # the release layout's MTP copies; depths left out
        return name in skip or (name not in expected and name.startswith(mtp_left_out))

    check_tensor_shapes(found, expected, root, ignore)
    if want > present:
        log.info(
            "%s: %d MTP depth(s) not in the checkpoint, initialised fresh", root, want - present
        )

    params = {p.name: p for p in model.get_parameters()}
    handles = {}

    def read(hf):
        file, info, start = found[hf]
        if file not in handles:
            handles[file] = open(file, "rb")
        return read_fp32_tensor(handles[file], info, start)

    try:
        for ours, hf in deepseek_hf_names(cfg, load_mtp).items():
            params[ours].set_data(ms.Tensor(read(hf), params[ours].dtype))
        for ours, hf in _expert_prefixes(cfg, load_mtp).items():
            for w, h in _SWIGLU.items():
                stacked = np.stack(
                    [read(f"{hf}{e}.{h}.weight") for e in range(cfg.n_routed_experts)]
                )
                params[ours + w].set_data(ms.Tensor(stacked, params[ours + w].dtype))
    finally:
        for f in handles.values():
            f.close()
    return model
