"""Hugging Face Llama interop: config.json + safetensors, both ways.

Our model uses Hugging Face's rotary layout (`rotate_half`, i paired with i + Dh/2), so
q/k weights map one to one: no permutation either way.

Weights go through mindloom's one safetensors codec (`_safetensors`: bf16 without a bf16
NumPy dtype, every header checked before anything is allocated, nothing in a file ever
executed).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import mindspore as ms

from mindloom_model._config import ModelConfig
from mindloom_model._hf_files import (
    CONFIG,
    HFFormatError,
    check_tensor_shapes,
    read_fp32_tensor,
    read_headers,
    write_hf_dir,
)
from mindloom_model._llama import Llama

# ----------------------------------------------------------------------------- names


def hf_names(cfg: ModelConfig) -> dict[str, str]:
    """Our parameter name -> Hugging Face Llama tensor name."""
    m = {"embed.weight": "model.embed_tokens.weight", "norm.weight": "model.norm.weight"}
    for i in range(cfg.num_layers):
        ours, hf = f"layers.{i}.", f"model.layers.{i}."
        m[ours + "attn_norm.weight"] = hf + "input_layernorm.weight"
        m[ours + "mlp_norm.weight"] = hf + "post_attention_layernorm.weight"
        for a, b in (("wq", "q_proj"), ("wk", "k_proj"), ("wv", "v_proj"), ("wo", "o_proj")):
            m[f"{ours}attn.{a}.weight"] = f"{hf}self_attn.{b}.weight"
        for a, b in (("w1", "gate_proj"), ("w2", "down_proj"), ("w3", "up_proj")):
            m[f"{ours}mlp.{a}.weight"] = f"{hf}mlp.{b}.weight"
    if not cfg.tie_embeddings:
        m["lm_head.weight"] = "lm_head.weight"
    return m


def hf_config(cfg: ModelConfig, dtype: str = "float32", **extra) -> dict:
    d = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.ffn_hidden_size,
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.num_kv_heads,
        "head_dim": cfg.head_dim,
        "max_position_embeddings": cfg.max_seq_len,
        "rms_norm_eps": cfg.rms_norm_eps,
        "rope_theta": cfg.rope_theta,
        # transformers >= 5 reads rope_parameters, older versions rope_theta/rope_scaling
        "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_theta},
        "rope_scaling": None,
        "tie_word_embeddings": cfg.tie_embeddings,
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
        "attention_dropout": 0.0,
        "initializer_range": cfg.init_std,
        "torch_dtype": dtype,
        "dtype": dtype,
    }
    d.update(extra)
    return d


def config_from_hf(d: dict, where: str = CONFIG, **overrides) -> ModelConfig:
    def need(key):
        if key not in d:
            raise HFFormatError(f"{where}: missing key {key!r}")
        return d[key]

    if d.get("model_type", "llama") not in ("llama", "mistral") and "LlamaForCausalLM" not in d.get(
        "architectures", []
    ):
        raise HFFormatError(
            f"{where}: model_type {d.get('model_type')!r} is not one mindloom reads "
            "(llama, mistral, deepseek_v3)"
        )
    if d.get("hidden_act", "silu") != "silu":
        raise HFFormatError(
            f"{where}: hidden_act {d['hidden_act']!r} is not supported (only 'silu')"
        )
    for key in ("attention_bias", "mlp_bias"):
        if d.get(key):
            raise HFFormatError(f"{where}: {key}=true is not supported (Llama has no biases)")
    rope = d.get("rope_parameters") or {}
    scaling = d.get("rope_scaling")
    rope_type = (scaling or {}).get("rope_type", (scaling or {}).get("type")) or rope.get(
        "rope_type", "default"
    )
    if rope_type != "default":
        raise HFFormatError(
            f"{where}: rope scaling {rope_type!r} is not supported (only the default RoPE)"
        )
    hidden, heads = need("hidden_size"), need("num_attention_heads")
    head_dim = d.get("head_dim") or hidden // heads
    if head_dim * heads != hidden:
        raise HFFormatError(
            f"{where}: head_dim {head_dim} * num_attention_heads {heads} != hidden_size {hidden}"
        )
    fields = dict(
        vocab_size=need("vocab_size"),
        hidden_size=hidden,
        num_layers=need("num_hidden_layers"),
        num_heads=heads,
        num_kv_heads=d.get("num_key_value_heads") or heads,
        ffn_hidden_size=need("intermediate_size"),
        max_seq_len=d.get("max_position_embeddings", 2048),
        rms_norm_eps=d.get("rms_norm_eps", 1e-6),
        rope_theta=float(rope.get("rope_theta", d.get("rope_theta", 10000.0))),
        tie_embeddings=bool(d.get("tie_word_embeddings", False)),
        init_std=d.get("initializer_range", 0.02),
    )
    fields.update(overrides)
    try:
        return ModelConfig(**fields)
    except ValueError as e:
        raise HFFormatError(f"{where}: {e}") from None


# ----------------------------------------------------------------------------- save / load


def save_hf(
    model: Llama, out_dir: str | os.PathLike, dtype: str = "float32", **config_extra
) -> Path:
    """Write `out_dir/config.json` and `out_dir/model.safetensors` in Hugging Face Llama layout.

    `dtype` is the file dtype (float32, float16 or bfloat16). `config_extra` adds keys to
    config.json (e.g. bos_token_id, eos_token_id). config.json is written last, so a
    directory with a config is complete.
    """
    cfg = model.config
    if cfg.family == "deepseek_v3":
        from mindloom_model._hf_deepseek import save_deepseek_hf

        return save_deepseek_hf(model, out_dir, dtype, **config_extra)
    names = hf_names(cfg)
    params = {p.name: p for p in model.get_parameters()}
    tensors = {}
    for ours, hf in names.items():
        if ours not in params:
            raise ValueError(f"save_hf: the model has no parameter {ours!r}")
        tensors[hf] = params[ours].astype(ms.float32).asnumpy()
        expected = _expected_shapes(cfg)[hf]
        if tensors[hf].shape != expected:
            # a tensor-parallel shard, not a full model: gather before exporting
            raise ValueError(
                f"save_hf: parameter {ours!r} has shape {list(tensors[hf].shape)}, expected {list(expected)}"
            )
    return write_hf_dir(out_dir, tensors, hf_config(cfg, dtype, **config_extra), dtype)


def _expected_shapes(cfg: ModelConfig) -> dict[str, tuple]:
    d, f, v, dh = cfg.hidden_size, cfg.ffn_hidden_size, cfg.vocab_size, cfg.head_dim
    h, kv = cfg.num_heads * dh, cfg.num_kv_heads * dh
    shapes = {"model.embed_tokens.weight": (v, d), "model.norm.weight": (d,)}
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        shapes.update({
            p + "input_layernorm.weight": (d,),
            p + "post_attention_layernorm.weight": (d,),
            p + "self_attn.q_proj.weight": (h, d),
            p + "self_attn.k_proj.weight": (kv, d),
            p + "self_attn.v_proj.weight": (kv, d),
            p + "self_attn.o_proj.weight": (d, h),
            p + "mlp.gate_proj.weight": (f, d),
            p + "mlp.up_proj.weight": (f, d),
            p + "mlp.down_proj.weight": (d, f),
        })  # fmt: skip
    if not cfg.tie_embeddings:
        shapes["lm_head.weight"] = (v, d)
    return shapes


def load_hf(path: str | os.PathLike, **overrides) -> Llama:
    """Build a `Llama` from a Hugging Face Llama directory (config.json + safetensors).

    `overrides` replace ModelConfig fields (e.g. compute_dtype, recompute, dropout).
    Every tensor is checked against the config before any is loaded: a missing, extra
    or mis-shaped tensor raises `HFFormatError` naming it with expected vs found shape.
    """
    root = Path(path)
    cfg_path = root / CONFIG
    try:
        raw = json.loads(cfg_path.read_text())
    except FileNotFoundError:
        raise HFFormatError(f"{cfg_path}: not found") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise HFFormatError(f"{cfg_path}: not valid JSON ({e})") from None
    if not isinstance(raw, dict):
        raise HFFormatError(f"{cfg_path}: not a JSON object")
    if raw.get("model_type") == "deepseek_v3":
        from mindloom_model._hf_deepseek import load_deepseek_hf

        return load_deepseek_hf(root, raw, str(cfg_path), **overrides)
    cfg = config_from_hf(raw, str(cfg_path), **overrides)

    expected = _expected_shapes(cfg)
    found = read_headers(root)
    check_tensor_shapes(found, expected, root, lambda name: False,
                        f"(not in a {cfg.num_layers}-layer Llama)")  # fmt: skip

    model = Llama(cfg)
    params = {p.name: p for p in model.get_parameters()}
    handles = {}
    try:
        for ours, hf in hf_names(cfg).items():
            file, info, start = found[hf]
            if file not in handles:
                handles[file] = open(file, "rb")
            p = params[ours]
            p.set_data(ms.Tensor(read_fp32_tensor(handles[file], info, start), p.dtype))
    finally:
        for f in handles.values():
            f.close()
    return model
