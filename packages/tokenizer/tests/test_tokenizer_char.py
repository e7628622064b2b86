"""The character-level model: exact round trips and nanoGPT's vocabulary."""

from __future__ import annotations

import json

import pytest
from mindloom_tokenizer import Tokenizer, TokenizerError, train_tokenizer

NO_SPECIALS = {"unk_id": -1, "bos_id": -1, "eos_id": -1}
TRICKY = "First line\n\n  two  spaces\tand tab \r\nunicode: café ▁ naïve 中文\n\ntrailing  \n"


def test_round_trips_whitespace_exactly(tmp_path):
    (tmp_path / "c.txt").write_text(TRICKY, encoding="utf-8", newline="")
    tok = train_tokenizer(tmp_path / "c.txt", tmp_path / "t", model_type="char", **NO_SPECIALS)
    ids = tok.encode(TRICKY)
    assert len(ids) == len(TRICKY)
    assert tok.decode(ids) == TRICKY
    assert tok.vocab_size == len(set(TRICKY))
    # Ids follow code-point order, as nanoGPT's sorted(set(text)).
    assert [tok.id_to_piece(i) for i in range(tok.vocab_size)] == sorted(set(TRICKY))
    assert tok.encode_batch([TRICKY, "", "ab"]) == [ids, [], tok.encode("ab")]


def test_tiny_shakespeare_gives_nanogpt_vocabulary(shakespeare, tmp_path):
    text = shakespeare.read_text(encoding="utf-8")
    tok = train_tokenizer(shakespeare, tmp_path / "t", model_type="char", **NO_SPECIALS)
    assert tok.vocab_size == 65
    chars = sorted(set(text))
    stoi = {c: i for i, c in enumerate(chars)}
    ids = tok.encode(text)
    assert ids[:1000] == [stoi[c] for c in text[:1000]]
    assert len(ids) == len(text)
    assert tok.decode(ids) == text
    assert (tok.bos_id, tok.eos_id, tok.pad_id, tok.unk_id) == (-1, -1, -1, -1)
    # Reloaded from disk: the same ids, and the vocabulary is JSON.
    again = Tokenizer.load(tmp_path / "t")
    assert again.encode(text[:5000]) == ids[:5000]
    vocab = json.loads((tmp_path / "t" / "char_vocab.json").read_text(encoding="utf-8"))
    assert vocab["pieces"] == chars


def test_specials_take_their_ids_and_decode_to_nothing(tmp_path):
    (tmp_path / "c.txt").write_text("abc\nab a", encoding="utf-8")
    tok = train_tokenizer(
        tmp_path / "c.txt", tmp_path / "t", model_type="char", control_symbols=["<|im_end|>"]
    )
    assert (tok.unk_id, tok.bos_id, tok.eos_id, tok.pad_id) == (0, 1, 2, -1)
    assert tok.vocab_size == 3 + 1 + 5
    assert tok.id_to_piece(3) == "<|im_end|>"
    ids = tok.encode("ab\nz")
    assert ids[-1] == tok.unk_id  # 'z' was never seen
    assert tok.decode([tok.bos_id, *tok.encode("ab c"), tok.eos_id]) == "ab c"


def test_unknown_character_without_unk_id_is_an_error(tmp_path):
    (tmp_path / "c.txt").write_text("abc", encoding="utf-8")
    tok = train_tokenizer(tmp_path / "c.txt", tmp_path / "t", model_type="char", **NO_SPECIALS)
    with pytest.raises(TokenizerError, match="'z'"):
        tok.encode("abz")


def test_smaller_vocab_keeps_the_most_frequent_characters(tmp_path):
    (tmp_path / "c.txt").write_text("aaaa bbb cc d", encoding="utf-8")
    tok = train_tokenizer(tmp_path / "c.txt", tmp_path / "t", vocab_size=4, model_type="char")
    assert tok.vocab_size == 4
    assert tok.id_to_piece(3) == "a"
    assert tok.encode("ab") == [3, tok.unk_id]
    with pytest.raises(TokenizerError, match="no unknown id"):
        train_tokenizer(
            tmp_path / "c.txt", tmp_path / "u", vocab_size=2, model_type="char", **NO_SPECIALS
        )


def test_corrupt_char_vocab_is_refused(tmp_path):
    (tmp_path / "c.txt").write_text("abc", encoding="utf-8")
    train_tokenizer(tmp_path / "c.txt", tmp_path / "t", model_type="char")
    (tmp_path / "t" / "char_vocab.json").write_text('{"pieces": ["a", "a"]}')
    with pytest.raises(TokenizerError, match="does not match model_sha256"):
        Tokenizer.load(tmp_path / "t")
    # Without the hash to catch it, the content itself is checked.
    meta_path = tmp_path / "t" / "mindloom_tokenizer.json"
    meta = json.loads(meta_path.read_text())
    meta_path.write_text(json.dumps({**meta, "model_sha256": None, "vocab_size": 2}))
    with pytest.raises(TokenizerError, match="appears twice|differ"):
        Tokenizer.load(tmp_path / "t")
    (tmp_path / "t" / "char_vocab.json").write_text("[1, 2")
    with pytest.raises(TokenizerError, match="char_vocab.json: not valid JSON"):
        Tokenizer.load(tmp_path / "t")
    (tmp_path / "t" / "char_vocab.json").unlink()
    with pytest.raises(TokenizerError, match="cannot read"):
        Tokenizer.load(tmp_path / "t")


def test_metadata_hashes_the_char_vocabulary(tmp_path):
    import hashlib

    (tmp_path / "a.txt").write_text("abc", encoding="utf-8")
    (tmp_path / "b.txt").write_text("abd", encoding="utf-8")
    metas = []
    for name in ("a", "b"):
        out = tmp_path / f"t{name}"
        train_tokenizer(tmp_path / f"{name}.txt", out, model_type="char")
        meta = json.loads((out / "mindloom_tokenizer.json").read_text())
        assert (
            meta["model_sha256"]
            == hashlib.sha256((out / "char_vocab.json").read_bytes()).hexdigest()
        )
        metas.append(meta["model_sha256"])
    assert metas[0] != metas[1]
