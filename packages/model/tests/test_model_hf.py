"""Hugging Face interop: logits agree with transformers both ways; bad files are refused."""

import json
import struct

import numpy as np
import pytest
import torch
import transformers
from mindloom_model import HFFormatError, Llama, get_preset, load_hf, save_hf
from mindloom_model._hf import read_safetensors, write_safetensors
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


def test_safetensors_writer_is_readable_by_the_reference_library(tmp_path):
    from safetensors.numpy import load_file

    arrays = {"a": np.arange(6, dtype=np.float32).reshape(2, 3), "b": np.ones(5, np.float32)}
    write_safetensors(tmp_path / "x.safetensors", arrays)
    loaded = load_file(tmp_path / "x.safetensors")
    for k, v in arrays.items():
        np.testing.assert_array_equal(loaded[k], v)
    np.testing.assert_array_equal(read_safetensors(tmp_path / "x.safetensors")["a"], arrays["a"])


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
