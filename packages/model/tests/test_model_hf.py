"""Hugging Face interop: logits agree with transformers both ways; bad files are refused."""

import json
import struct

import numpy as np
import pytest
import torch
import transformers
from mindloom_model import (
    HFFormatError,
    Llama,
    get_preset,
    load_hf,
    read_safetensors,
    save_hf,
    write_safetensors,
)
from mindspore import Tensor

TOKENS = np.random.default_rng(1).integers(0, 256, (2, 24))


def ours_logits(model, tokens=TOKENS):
    model.set_train(False)
    return model(Tensor(tokens.astype(np.int32))).asnumpy()


def hf_logits(hf, tokens=TOKENS):
    with torch.no_grad():
        return hf(torch.tensor(tokens)).logits.float().numpy()


@pytest.mark.parametrize("tied", [False, True])
def test_save_hf_loads_in_transformers_with_equal_logits(tmp_path, tied):
    model = Llama(get_preset("debug", tie_embeddings=tied, init_seed=3))
    save_hf(model, tmp_path, bos_token_id=1, eos_token_id=2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.json", "model.safetensors"]
    hf = transformers.LlamaForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    assert hf.config.num_key_value_heads == 2 and hf.config.tie_word_embeddings is tied
    np.testing.assert_allclose(ours_logits(model), hf_logits(hf), atol=1e-4, rtol=0)


def test_transformers_model_loads_with_equal_logits(tmp_path):
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=8,
        num_key_value_heads=2,
        max_position_embeddings=64,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
    )
    hf = transformers.LlamaForCausalLM(config).eval()
    with torch.no_grad():  # norms start at 1.0; perturb them so a swapped norm would show
        for name, p in hf.named_parameters():
            if "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
    hf.save_pretrained(tmp_path, safe_serialization=True)
    model = load_hf(tmp_path)
    cfg = model.config
    assert (cfg.num_heads, cfg.num_kv_heads, cfg.ffn_hidden_size, cfg.rms_norm_eps) == (
        8,
        2,
        96,
        1e-6,
    )
    np.testing.assert_allclose(ours_logits(model), hf_logits(hf), atol=1e-4, rtol=0)


def test_bf16_export_round_trips_to_bf16_precision(tmp_path):
    model = Llama(get_preset("debug"))
    save_hf(model, tmp_path, dtype="bfloat16")
    header = json.loads(
        (tmp_path / "model.safetensors").read_bytes()[8:][
            : struct.unpack("<Q", (tmp_path / "model.safetensors").read_bytes()[:8])[0]
        ]
    )
    assert header["model.embed_tokens.weight"]["dtype"] == "BF16"
    back = load_hf(tmp_path)
    w0 = model.embed.weight.asnumpy()
    w1 = back.embed.weight.asnumpy()
    assert np.abs(w1 - w0).max() <= np.abs(w0).max() * 2**-8
    hf = transformers.LlamaForCausalLM.from_pretrained(tmp_path)
    assert hf.model.embed_tokens.weight.dtype == torch.bfloat16
    np.testing.assert_array_equal(hf.model.embed_tokens.weight.detach().float().numpy(), w1)


# ----------------------------------------------------------------------------- bad input


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    d = tmp_path_factory.mktemp("hf")
    save_hf(Llama(get_preset("debug")), d)
    return d


def rewrite(src, dst, edit):
    dst.mkdir()
    (dst / "config.json").write_text((src / "config.json").read_text())
    tensors = read_safetensors(src / "model.safetensors")
    edit(tensors)
    write_safetensors(dst / "model.safetensors", tensors)
    return dst


def one_line_error(path, needle):
    with pytest.raises(HFFormatError) as e:
        load_hf(path)
    msg = str(e.value)
    assert "\n" not in msg
    assert needle in msg, msg
    return msg


def test_missing_tensor_is_named(exported, tmp_path):
    d = rewrite(exported, tmp_path / "m", lambda t: t.pop("model.layers.1.mlp.up_proj.weight"))
    one_line_error(
        d, "missing tensor 'model.layers.1.mlp.up_proj.weight' (expected shape [128, 64])"
    )


def test_extra_tensor_is_named(exported, tmp_path):
    d = rewrite(
        exported,
        tmp_path / "e",
        lambda t: t.update({"model.layers.2.bogus.weight": np.zeros((3, 4), np.float32)}),
    )
    one_line_error(d, "unexpected tensor 'model.layers.2.bogus.weight' with shape [3, 4]")


def test_misshaped_tensor_names_expected_and_found(exported, tmp_path):
    d = rewrite(
        exported,
        tmp_path / "s",
        lambda t: t.update(
            {"model.layers.0.self_attn.k_proj.weight": np.zeros((64, 64), np.float32)}
        ),
    )
    one_line_error(
        d, "tensor 'model.layers.0.self_attn.k_proj.weight' has shape [64, 64], expected [32, 64]"
    )


def test_header_length_is_checked_before_allocating(exported, tmp_path):
    d = tmp_path / "h"
    d.mkdir()
    (d / "config.json").write_text((exported / "config.json").read_text())
    # claims a 1 TB header in a 20-byte file
    (d / "model.safetensors").write_bytes(struct.pack("<Q", 1 << 40) + b"{}" + b" " * 10)
    one_line_error(d, "header length 1099511627776 at byte 0 exceeds the file (20 bytes)")


def test_offsets_outside_the_file_are_refused(exported, tmp_path):
    d = tmp_path / "o"
    d.mkdir()
    (d / "config.json").write_text((exported / "config.json").read_text())
    hb = json.dumps({"x": {"dtype": "F32", "shape": [1000], "data_offsets": [0, 4000]}}).encode()
    (d / "model.safetensors").write_bytes(struct.pack("<Q", len(hb)) + hb + b"\0" * 8)
    one_line_error(d, "tensor 'x' data_offsets [0, 4000] do not fit")


def test_pickle_checkpoints_are_not_loaded(exported, tmp_path):
    d = tmp_path / "p"
    d.mkdir()
    (d / "config.json").write_text((exported / "config.json").read_text())
    (d / "pytorch_model.bin").write_bytes(b"\x80\x04not loaded")
    one_line_error(d, "only safetensors weights are loaded")


def test_config_errors_name_the_key(exported, tmp_path):
    d = tmp_path / "c"
    d.mkdir()
    (d / "model.safetensors").write_bytes((exported / "model.safetensors").read_bytes())
    cfg = json.loads((exported / "config.json").read_text())
    del cfg["num_hidden_layers"]
    (d / "config.json").write_text(json.dumps(cfg))
    one_line_error(d, "missing key 'num_hidden_layers'")
    cfg = json.loads((exported / "config.json").read_text())
    cfg["num_key_value_heads"] = 3
    (d / "config.json").write_text(json.dumps(cfg))
    one_line_error(d, "num_kv_heads=3 does not divide num_heads=4")
    (d / "config.json").write_text("{not json")
    one_line_error(d, "config.json: not valid JSON")


# Every config field we write or read, each with a value that differs from both our and
# transformers' defaults, so a field dropped (or read from the wrong key) in either
# direction changes the config or the logits: rope_theta 500 (default 10000) over 40
# positions, eps 1e-3 (defaults 1e-5 / 1e-6) on perturbed norms, 1 kv head of 4, etc.
ODD = dict(vocab_size=200, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=1,
           ffn_hidden_size=96, max_seq_len=48, rms_norm_eps=1e-3, rope_theta=500.0,
           init_std=0.05)  # fmt: skip
LONG = np.random.default_rng(2).integers(0, 200, (2, 40))


def _hf_rope_theta(config) -> float:
    # transformers >= 5 keeps it in rope_parameters, 4.x as an attribute
    params = getattr(config, "rope_parameters", None) or {}
    return float(params.get("rope_theta", getattr(config, "rope_theta", -1.0)))


def _perturb_norms(model) -> None:
    rng = np.random.default_rng(4)
    for p in model.trainable_params():
        if p.name.endswith("norm.weight"):
            p.set_data(Tensor((1.0 + 0.3 * rng.standard_normal(p.shape)).astype(np.float32)))


@pytest.mark.parametrize("tied", [False, True])
def test_export_writes_every_field_transformers_reads(tmp_path, tied):
    model = Llama(get_preset("debug", tie_embeddings=tied, **ODD))
    _perturb_norms(model)
    save_hf(model, tmp_path, bos_token_id=5, eos_token_id=7)
    c = transformers.AutoConfig.from_pretrained(tmp_path)
    assert isinstance(c, transformers.LlamaConfig)
    got = dict(vocab_size=c.vocab_size, hidden_size=c.hidden_size,
               num_layers=c.num_hidden_layers, num_heads=c.num_attention_heads,
               num_kv_heads=c.num_key_value_heads, ffn_hidden_size=c.intermediate_size,
               max_seq_len=c.max_position_embeddings, rms_norm_eps=c.rms_norm_eps,
               rope_theta=_hf_rope_theta(c), init_std=c.initializer_range)  # fmt: skip
    assert got == ODD
    assert (c.head_dim, c.tie_word_embeddings, c.bos_token_id, c.eos_token_id) == (16, tied, 5, 7)
    assert (c.rope_parameters or {}).get("rope_type", "default") == "default"
    hf = transformers.LlamaForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    np.testing.assert_allclose(ours_logits(model, LONG), hf_logits(hf, LONG), atol=1e-4, rtol=0)


@pytest.mark.parametrize("tied", [False, True])
def test_import_reads_every_field_transformers_writes(tmp_path, tied):
    torch.manual_seed(1)
    config = transformers.LlamaConfig(
        vocab_size=200, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=1, max_position_embeddings=48,
        rms_norm_eps=1e-3, rope_parameters={"rope_type": "default", "rope_theta": 500.0},
        initializer_range=0.05, tie_word_embeddings=tied, bos_token_id=5, eos_token_id=7,
    )  # fmt: skip
    hf = transformers.LlamaForCausalLM(config).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if "norm" in name:
                p.add_(torch.randn_like(p) * 0.3)
    hf.save_pretrained(tmp_path, safe_serialization=True)
    model = load_hf(tmp_path)
    c = model.config
    got = {k: getattr(c, k) for k in ODD}
    assert got == ODD and c.tie_embeddings is tied and c.head_dim == 16
    np.testing.assert_allclose(ours_logits(model, LONG), hf_logits(hf, LONG), atol=1e-4, rtol=0)


def test_transformers_4_style_config_keys_are_read(tmp_path):
    # transformers 4.x wrote rope_theta at the top level and rope_scaling: null
    from mindloom_model._hf import config_from_hf, hf_config

    d = hf_config(get_preset("debug", **ODD))
    d.pop("rope_parameters")
    d["rope_scaling"] = None
    assert d["rope_theta"] == 500.0 and d["rms_norm_eps"] == 1e-3
    c = config_from_hf(d)
    assert {k: getattr(c, k) for k in ODD} == ODD


@pytest.mark.parametrize(
    "rope",
    [
        {"rope_scaling": {"rope_type": "linear", "factor": 2.0}},
        {"rope_scaling": {"type": "dynamic", "factor": 2.0}},
        {"rope_parameters": {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0}},
    ],
)
def test_rope_scaling_we_cannot_reproduce_is_refused(rope):
    from mindloom_model._hf import config_from_hf, hf_config

    d = {**hf_config(get_preset("debug")), **rope}
    with pytest.raises(HFFormatError, match=r"config.json: rope scaling '\w+' is not supported"):
        config_from_hf(d)
