"""The Python API of docs/contracts.md on real SentencePiece models."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
from mindloom_tokenizer import Tokenizer, TokenizerError, train_tokenizer

TEXTS = [
    "Hello world, this is the first line.",
    "数字 2024 年 12 月, 价格 3.14159 元。",
    "emoji 😀🚀 and rare ǅ ꙮ characters",
    "  leading and   inner   spaces\tand a tab",
    "",
    "In 1999 there were 12345 items.",
]


def test_loaded_bpe_has_contract_attributes(bpe_dir):
    tok = Tokenizer.load(bpe_dir)
    assert tok.vocab_size == 600
    assert (tok.unk_id, tok.bos_id, tok.eos_id, tok.pad_id) == (0, 1, 2, -1)
    assert tok.model_type == "bpe"
    meta = json.loads((bpe_dir / "mindloom_tokenizer.json").read_text())
    assert meta["vocab_size"] == 600 and meta["model_type"] == "bpe"
    assert meta["bos_id"] == 1 and meta["eos_id"] == 2 and meta["pad_id"] == -1
    assert meta["seed"] == 0 and meta["trained_on"]
    assert meta["options"]["byte_fallback"] is True
    assert meta["options"]["normalization_rule_name"] == "identity"
    assert meta["options"]["character_coverage"] == 0.99995


@pytest.mark.parametrize("which", ["bpe_dir", "unigram_dir"])
def test_encode_decode_round_trips_with_byte_fallback(which, request):
    tok = Tokenizer.load(request.getfixturevalue(which))
    for text in TEXTS:
        ids = tok.encode(text)
        assert all(isinstance(i, int) for i in ids)
        assert tok.bos_id not in ids and tok.eos_id not in ids
        assert tok.decode(ids) == text
    # Emoji are not in a 600-piece vocabulary: byte fallback, not <unk>.
    assert tok.unk_id not in tok.encode("😀🚀")


def test_digits_are_split(bpe_dir):
    tok = Tokenizer.load(bpe_dir)
    pieces = [tok.id_to_piece(i) for i in tok.encode("In 1999 there were 12345 items.")]
    digits = [p.lstrip("\u2581") for p in pieces if any(c.isdigit() for c in p)]
    assert digits == list("199912345")


def test_encode_batch_matches_encode(bpe_dir):
    tok = Tokenizer.load(bpe_dir)
    texts = TEXTS * 50
    expected = [tok.encode(t) for t in texts]
    assert tok.encode_batch(texts) == expected
    assert tok.encode_batch(texts, num_threads=1) == expected
    assert tok.encode_batch(texts, num_threads=2) == expected
    assert tok.encode_batch([]) == []
    with pytest.raises(TypeError):
        tok.encode_batch("not a list")


def test_decode_accepts_numpy_and_rejects_out_of_range(bpe_dir):
    tok = Tokenizer.load(bpe_dir)
    ids = tok.encode("Hello world")
    assert tok.decode(np.asarray(ids, dtype=np.int32)) == "Hello world"
    with pytest.raises(TokenizerError, match="out of range"):
        tok.decode([tok.vocab_size])


def test_load_accepts_model_file_and_metadata_path(bpe_dir):
    a = Tokenizer.load(bpe_dir)
    b = Tokenizer.load(bpe_dir / "tokenizer.model")
    c = Tokenizer.load(str(bpe_dir / "mindloom_tokenizer.json"))
    assert a.encode(TEXTS[1]) == b.encode(TEXTS[1]) == c.encode(TEXTS[1])
    assert b.model_type == "bpe"  # metadata next to tokenizer.model is picked up


def test_same_input_gives_byte_identical_model(corpus_dir, tmp_path):
    for model_type in ("bpe", "unigram"):
        outs = []
        for run in range(2):
            out = tmp_path / f"{model_type}{run}"
            train_tokenizer(corpus_dir, out, 500, model_type=model_type, num_threads=2)
            outs.append(out)
        for name in ("tokenizer.model", "mindloom_tokenizer.json"):
            assert (outs[0] / name).read_bytes() == (outs[1] / name).read_bytes(), name


def test_reservoir_sampling_is_bounded_and_seeded(corpus_dir, tmp_path):
    a = train_tokenizer(corpus_dir, tmp_path / "a", 600, input_sentence_size=500, seed=1)
    train_tokenizer(corpus_dir, tmp_path / "b", 600, input_sentence_size=500, seed=1)
    c = train_tokenizer(corpus_dir, tmp_path / "c", 600, input_sentence_size=500, seed=2)
    stats = a.metadata["stats"]
    assert stats["sentences_seen"] == 3000
    assert stats["sentences_sampled"] == 500
    model = "tokenizer.model"
    assert (tmp_path / "a" / model).read_bytes() == (tmp_path / "b" / model).read_bytes()
    assert (tmp_path / "a" / model).read_bytes() != (tmp_path / "c" / model).read_bytes()
    assert c.metadata["seed"] == 2


def test_special_and_user_defined_symbols(corpus_dir, tmp_path):
    tok = train_tokenizer(
        corpus_dir,
        tmp_path / "t",
        500,
        pad_id=3,
        control_symbols=["<|endoftext|>"],
        user_defined_symbols=["<sep>"],
    )
    assert tok.pad_id == 3 and tok.id_to_piece(3) == "<pad>"
    eot, sep = tok.piece_to_id("<|endoftext|>"), tok.piece_to_id("<sep>")
    assert eot not in (tok.unk_id, sep) and sep != tok.unk_id
    # A user-defined symbol is kept whole when it occurs in text; a control symbol is not.
    assert sep in tok.encode("left<sep>right")
    assert eot not in tok.encode("left<|endoftext|>right")
    kinds = tok.piece_kinds()
    assert kinds[eot] == 2 and kinds[sep] == 4 and kinds[tok.unk_id] == 1
    assert (kinds == 3).sum() == 256  # byte-fallback pieces


def test_over_long_sentences_are_skipped_and_reported(tmp_path):
    lines = [f"short line number {i} here" for i in range(400)] + ["x" * 5000, "y" * 3_000_000]
    (tmp_path / "c.txt").write_text("\n".join(lines), encoding="utf-8")
    messages: list[str] = []
    tok = train_tokenizer(tmp_path / "c.txt", tmp_path / "t", 300, progress=messages.append)
    assert tok.metadata["stats"]["skipped_too_long"] == 2
    assert any("skipped 2 too long sentences" in m for m in messages)


@pytest.mark.parametrize("model_type", ["bpe", "unigram", "char"])
def test_vocab_size_larger_than_corpus_is_a_clear_error(model_type, tmp_path):
    (tmp_path / "c.txt").write_text("abc abd abe\nbcd bce\n" * 20, encoding="utf-8")
    with pytest.raises(TokenizerError, match="larger than this corpus supports") as info:
        train_tokenizer(tmp_path / "c.txt", tmp_path / "t", 5000, model_type=model_type)
    assert "\n" not in str(info.value)
    assert not (tmp_path / "t" / "mindloom_tokenizer.json").exists()


def test_empty_corpus_is_a_clear_error(tmp_path):
    (tmp_path / "empty.txt").write_text("", encoding="utf-8")
    (tmp_path / "blank.jsonl").write_text('{"text": ""}\n{"other": "x"}\n', encoding="utf-8")
    with pytest.raises(TokenizerError, match="empty corpus"):
        train_tokenizer(tmp_path, tmp_path / "t", 100)


def test_bad_options_are_clear_errors(corpus_dir, tmp_path):
    with pytest.raises(TokenizerError, match="model_type"):
        train_tokenizer(corpus_dir, tmp_path / "t", 100, model_type="wordpiece")
    with pytest.raises(TokenizerError, match="vocab_size is required"):
        train_tokenizer(corpus_dir, tmp_path / "t", None)
    with pytest.raises(TokenizerError, match="special ids must differ"):
        train_tokenizer(corpus_dir, tmp_path / "t", 300, pad_id=1)
    with pytest.raises(TokenizerError, match="input not found"):
        train_tokenizer(tmp_path / "missing", tmp_path / "t", 600)


def test_load_errors_are_one_line(bpe_dir, tmp_path):
    with pytest.raises(TokenizerError, match="tokenizer not found"):
        Tokenizer.load(tmp_path / "nope")
    (tmp_path / "empty_dir").mkdir()
    with pytest.raises(TokenizerError, match="no tokenizer.model"):
        Tokenizer.load(tmp_path / "empty_dir")
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "tokenizer.model").write_bytes(b"\x00garbage, not a protobuf" * 10)
    with pytest.raises(TokenizerError, match="not a valid SentencePiece model") as info:
        Tokenizer.load(bad)
    assert "\n" not in str(info.value)
    (bad / "tokenizer.model").write_bytes(b"")
    with pytest.raises(TokenizerError, match="is empty"):
        Tokenizer.load(bad)
    # Metadata from another run: refused instead of silently giving wrong ids.
    other = tmp_path / "other"
    other.mkdir()
    (other / "tokenizer.model").write_bytes((bpe_dir / "tokenizer.model").read_bytes())
    (other / "mindloom_tokenizer.json").write_text('{"vocab_size": 32000}')
    with pytest.raises(TokenizerError, match="different runs"):
        Tokenizer.load(other)
    meta = json.loads((bpe_dir / "mindloom_tokenizer.json").read_text())
    (other / "mindloom_tokenizer.json").write_text(json.dumps({**meta, "model_sha256": "0" * 64}))
    with pytest.raises(TokenizerError, match="does not match model_sha256"):
        Tokenizer.load(other)
    (other / "mindloom_tokenizer.json").write_text("{not json")
    with pytest.raises(TokenizerError, match="not valid JSON"):
        Tokenizer.load(other)


def test_retraining_replaces_a_stale_export(corpus_dir, tmp_path):
    out = tmp_path / "t"
    out.mkdir()
    (out / "tokenizer.json").write_text("{}")
    (out / "tokenizer_config.json").write_text("{}")
    train_tokenizer(corpus_dir, out, 600)
    assert not (out / "tokenizer.json").exists()
    assert sorted(os.listdir(out)) == ["mindloom_tokenizer.json", "tokenizer.model"]


def test_vocab_size_too_small_is_a_clear_error(corpus_dir, tmp_path):
    with pytest.raises(TokenizerError, match="vocab size 300 is too small"):
        train_tokenizer(corpus_dir, tmp_path / "t", 300)


def test_lone_surrogates_do_not_crash(bpe_dir, tmp_path):
    tok = Tokenizer.load(bpe_dir)
    bad = "left\ud800right"  # JSON may carry this as "\ud800"
    ids = tok.encode(bad)
    assert tok.decode(ids) == "left\ufffdright"
    assert tok.encode_batch([bad, "ok"]) == [ids, tok.encode("ok")]
    with pytest.raises(TypeError, match="item 1 is int"):
        tok.encode_batch(["a", 3])
    # In training input it is replaced and counted, not fatal.
    lines = [f'{{"text": "sentence {i} with \\ud800 inside"}}' for i in range(200)]
    (tmp_path / "s.jsonl").write_text("\n".join(lines) + "\n", encoding="utf-8")
    t = train_tokenizer(tmp_path / "s.jsonl", tmp_path / "t", 300)
    assert t.metadata["stats"]["read"]["bad"] == {"lone_surrogate": 200}


def test_metadata_hashes_the_model(bpe_dir):
    import hashlib

    meta = json.loads((bpe_dir / "mindloom_tokenizer.json").read_text())
    model = (bpe_dir / "tokenizer.model").read_bytes()
    assert meta["model_sha256"] == hashlib.sha256(model).hexdigest()


def test_bare_model_file_reports_its_type(unigram_dir, tmp_path):
    (tmp_path / "m.model").write_bytes((unigram_dir / "tokenizer.model").read_bytes())
    tok = Tokenizer.load(tmp_path / "m.model")  # no metadata next to it
    assert tok.model_type == "unigram" and tok.metadata == {}


def test_sentencepiece_needs_an_unknown_id(corpus_dir, tmp_path):
    with pytest.raises(TokenizerError, match="needs an unknown id"):
        train_tokenizer(corpus_dir, tmp_path / "t", 600, unk_id=-1, bos_id=-1, eos_id=-1)


def test_identical_model_across_processes_and_hash_seeds(corpus_dir, tmp_path):
    import subprocess
    import sys

    code = (
        "import sys; from mindloom_tokenizer import train_tokenizer; "
        "train_tokenizer(sys.argv[1], sys.argv[2], 500, model_type='unigram', num_threads=2)"
    )
    outs = []
    for hash_seed in ("1", "2"):
        out = tmp_path / f"p{hash_seed}"
        env = {**os.environ, "PYTHONHASHSEED": hash_seed}
        subprocess.run(
            [sys.executable, "-c", code, str(corpus_dir), str(out)],
            env=env,
            check=True,
            timeout=120,
        )
        outs.append(out)
    for name in ("tokenizer.model", "mindloom_tokenizer.json"):
        assert (outs[0] / name).read_bytes() == (outs[1] / name).read_bytes(), name
