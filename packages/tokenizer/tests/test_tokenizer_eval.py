"""`evaluate`: coverage, compression, unknown characters, fertility, on a seeded sample."""

from __future__ import annotations

import pytest
from mindloom_tokenizer import TokenizerError, train_tokenizer
from mindloom_tokenizer._eval import evaluate


def test_sample_is_reproducible_and_seeded(bpe_dir, corpus_dir):
    a = evaluate(bpe_dir, corpus_dir, num_sentences=200, seed=0)
    b = evaluate(bpe_dir, corpus_dir, num_sentences=200, seed=0)
    c = evaluate(bpe_dir, corpus_dir, num_sentences=200, seed=1)
    assert a == b
    assert a["sentences"] == 200 and a["sentences_seen"] == 3000
    assert (a["characters"], a["tokens"]) != (c["characters"], c["tokens"])


def test_char_model_figures_are_exact(tmp_path):
    text = "ab cd 中文字\nxy 中\n"
    (tmp_path / "c.txt").write_text(text, encoding="utf-8")
    no_specials = {"unk_id": -1, "bos_id": -1, "eos_id": -1}
    tok = train_tokenizer(tmp_path / "c.txt", tmp_path / "t", model_type="char", **no_specials)
    r = evaluate(tok, tmp_path / "c.txt")
    assert r["sentences"] == 2 and r["coverage"] == 1.0
    assert r["chars_per_token"] == 1.0 and r["unknown_characters"] == []
    assert r["fertility"]["cjk"] == {"tokens": 4, "characters": 4, "tokens_per_char": 1.0}
    assert r["fertility"]["latin"] == {"tokens": 6, "words": 3, "tokens_per_word": 2.0}
    # Characters never seen in training count as unknown instead of failing.
    (tmp_path / "other.txt").write_text("abz\n", encoding="utf-8")
    r = evaluate(tok, tmp_path / "other.txt")
    assert r["unk_tokens"] == 1 and r["coverage"] == pytest.approx(2 / 3)
    assert r["unknown_characters"] == [{"char": "z", "codepoint": "U+007A", "count": 1}]


def test_byte_fallback_counts_against_coverage(tmp_path):
    (tmp_path / "train.txt").write_text("hello world\nworld hello there\n" * 40, encoding="utf-8")
    tok = train_tokenizer(tmp_path / "train.txt", tmp_path / "t", 280)
    (tmp_path / "s.txt").write_text("hello 世界\n", encoding="utf-8")
    r = evaluate(tok, tmp_path / "s.txt")
    # Two CJK characters, three UTF-8 bytes each, all byte fallback.
    assert r["byte_fallback_tokens"] == 6 and r["unk_tokens"] == 0
    assert r["fertility"]["cjk"]["tokens"] == 6
    assert r["fertility"]["cjk"]["tokens_per_char"] == 3.0
    assert r["coverage"] == pytest.approx((r["tokens"] - 6) / r["tokens"])
    assert r["ok"] is False
    assert [u["char"] for u in r["unknown_characters"]] == ["世", "界"]


def test_no_sentences_is_an_error(bpe_dir, tmp_path):
    (tmp_path / "blank.txt").write_text("\n\n  \n", encoding="utf-8")
    with pytest.raises(TokenizerError, match="no sentences"):
        evaluate(bpe_dir, tmp_path / "blank.txt")
