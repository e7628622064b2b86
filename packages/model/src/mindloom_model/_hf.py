"""Hugging Face Llama interop: config.json + safetensors, both ways.

Our model uses Hugging Face's rotary layout (`rotate_half`, i paired with i + Dh/2), so
q/k weights map one to one: no permutation either way.

The safetensors reader and writer are ours (the format is an 8-byte little-endian header
length, a JSON header, then raw little-endian tensor bytes) so that bf16 files load
without a bf16 NumPy dtype, the header is validated before anything is allocated, and
nothing in a file is ever executed.
"""

from __future__ import annotations

import json
import math
import os
import struct
from pathlib import Path

import mindspore as ms
import numpy as np

from mindloom_model._llama import Llama, ModelConfig

CONFIG = "config.json"
WEIGHTS = "model.safetensors"
INDEX = "model.safetensors.index.json"
_MAX_HEADER = 100 * 1024 * 1024  # a header is a few KB per tensor; refuse absurd lengths

_NP = {"F32": np.float32, "F16": np.float16, "F64": np.float64, "I32": np.int32, "I64": np.int64}
_ITEMSIZE = {"F32": 4, "F16": 2, "BF16": 2, "F64": 8, "I32": 4, "I64": 8}


class HFFormatError(ValueError):
    """A Hugging Face directory that cannot be loaded; the message is one line."""


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


# ----------------------------------------------------------------------------- safetensors


def _bf16_bytes(a: np.ndarray) -> bytes:
    # fp32 -> bf16 with round-to-nearest-even on the upper 16 bits
    u = np.ascontiguousarray(a, np.float32).view(np.uint32)
    rounded = (u + 0x7FFF + ((u >> 16) & 1)) >> 16
    return rounded.astype("<u2").tobytes()


def write_safetensors(
    path: str | os.PathLike, tensors: dict[str, np.ndarray], dtype: str = "float32", metadata=None
) -> None:
    """Write fp32 arrays as F32/F16/BF16 safetensors, atomically (temp name, fsync, rename)."""
    code = {"float32": "F32", "float16": "F16", "bfloat16": "BF16"}[dtype]
    header, blobs, offset = {}, [], 0
    for name in sorted(tensors):
        a = np.asarray(tensors[name], np.float32)
        if code == "BF16":
            raw = _bf16_bytes(a)
        else:
            raw = np.ascontiguousarray(a.astype("<f4" if code == "F32" else "<f2")).tobytes()
        header[name] = {
            "dtype": code,
            "shape": list(a.shape),
            "data_offsets": [offset, offset + len(raw)],
        }
        blobs.append(raw)
        offset += len(raw)
    if metadata:
        header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
    hb = json.dumps(header, separators=(",", ":")).encode()
    hb += b" " * (-len(hb) % 8)  # the data section starts 8-byte aligned
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        f.write(struct.pack("<Q", len(hb)))
        f.write(hb)
        for raw in blobs:
            f.write(raw)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def read_safetensors_header(path: str | os.PathLike) -> tuple[dict, int]:
    """(header without __metadata__, data start offset); validated before any tensor is read."""
    path = Path(path)
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            first = f.read(8)
            if len(first) < 8:
                raise HFFormatError(
                    f"{path}: not a safetensors file ({size} bytes, no header length)"
                )
            (n,) = struct.unpack("<Q", first)
            if n > min(size - 8, _MAX_HEADER):
                raise HFFormatError(
                    f"{path}: header length {n} at byte 0 exceeds the file ({size} bytes)"
                )
            raw = f.read(n)
    except OSError as e:
        raise HFFormatError(f"{path}: cannot read: {e.strerror or e}") from None
    try:
        header = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise HFFormatError(
            f"{path}: header is not valid JSON at byte {8 + getattr(e, 'pos', 0)}"
        ) from None
    if not isinstance(header, dict):
        raise HFFormatError(f"{path}: header is not a JSON object")
    header.pop("__metadata__", None)
    data_len = size - 8 - n
    for name, info in header.items():
        try:
            dtype, shape, (begin, end) = info["dtype"], info["shape"], info["data_offsets"]
        except (TypeError, KeyError, ValueError):
            raise HFFormatError(f"{path}: tensor {name!r} has a malformed header entry") from None
        if dtype not in _ITEMSIZE:
            raise HFFormatError(f"{path}: tensor {name!r} has unsupported dtype {dtype!r}")
        if not isinstance(shape, list) or not all(isinstance(x, int) and x >= 0 for x in shape):
            raise HFFormatError(f"{path}: tensor {name!r} has a malformed shape {shape!r}")
        want = math.prod(shape) * _ITEMSIZE[dtype]
        if not (
            isinstance(begin, int)
            and isinstance(end, int)
            and 0 <= begin <= end <= data_len
            and end - begin == want
        ):
            raise HFFormatError(
                f"{path}: tensor {name!r} data_offsets [{begin}, {end}] do not fit shape {shape} {dtype} in {data_len} data bytes"
            )
    return header, 8 + n


def _read_tensor(f, info: dict, data_start: int) -> np.ndarray:
    begin, end = info["data_offsets"]
    f.seek(data_start + begin)
    raw = f.read(end - begin)
    if info["dtype"] == "BF16":
        a = (np.frombuffer(raw, "<u2").astype(np.uint32) << 16).view(np.float32)
    else:
        a = np.frombuffer(raw, np.dtype(_NP[info["dtype"]]).newbyteorder("<"))
    return a.astype(np.float32).reshape(info["shape"])


def read_safetensors(path: str | os.PathLike) -> dict[str, np.ndarray]:
    header, start = read_safetensors_header(path)
    with open(path, "rb") as f:
        return {name: _read_tensor(f, info, start) for name, info in header.items()}


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


def write_hf_dir(out_dir, tensors: dict[str, np.ndarray], config: dict, dtype: str) -> Path:
    """`out_dir/model.safetensors`, then `out_dir/config.json` last (atomically), so a
    directory with a config is complete."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    write_safetensors(out / WEIGHTS, tensors, dtype, metadata={"format": "pt"})
    tmp = out / (CONFIG + ".tmp")
    with open(tmp, "w") as f:
        json.dump(config, f, indent=2)
        f.write("\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, out / CONFIG)
    return out


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


def _weight_files(root: Path) -> list[Path]:
    if (root / INDEX).exists():
        try:
            index = json.loads((root / INDEX).read_text())
            files = sorted(set(index["weight_map"].values()))
        except (json.JSONDecodeError, KeyError, TypeError, AttributeError):
            raise HFFormatError(
                f"{root / INDEX}: not a safetensors index (needs a 'weight_map' object)"
            ) from None
        for name in files:
            if Path(name).name != name:
                raise HFFormatError(f"{root / INDEX}: shard name {name!r} is not a plain file name")
        return [root / name for name in files]
    if (root / WEIGHTS).exists():
        return [root / WEIGHTS]
    raise HFFormatError(f"{root}: no {WEIGHTS} or {INDEX} (only safetensors weights are loaded)")


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
    found: dict[str, tuple[Path, dict, int]] = {}
    for file in _weight_files(root):
        header, start = read_safetensors_header(file)
        for name, info in header.items():
            found[name] = (file, info, start)
    for name, (file, info, _) in found.items():
        if name.endswith("rotary_emb.inv_freq"):
            continue  # a buffer older exports include; we recompute it
        if name not in expected:
            raise HFFormatError(
                f"{file}: unexpected tensor {name!r} with shape {info['shape']} (not in a {cfg.num_layers}-layer Llama)"
            )
        if tuple(info["shape"]) != expected[name]:
            raise HFFormatError(
                f"{file}: tensor {name!r} has shape {info['shape']}, expected {list(expected[name])}"
            )
    for name, shape in expected.items():
        if name not in found:
            raise HFFormatError(f"{root}: missing tensor {name!r} (expected shape {list(shape)})")

    model = Llama(cfg)
    params = {p.name: p for p in model.get_parameters()}
    handles = {}
    try:
        for ours, hf in hf_names(cfg).items():
            file, info, start = found[hf]
            if file not in handles:
                handles[file] = open(file, "rb")
            p = params[ours]
            p.set_data(ms.Tensor(_read_tensor(handles[file], info, start), p.dtype))
    finally:
        for f in handles.values():
            f.close()
    return model
