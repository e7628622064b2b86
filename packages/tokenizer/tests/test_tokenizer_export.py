"""Export to Hugging Face: the same ids from tokenizers and transformers as from SentencePiece."""

from __future__ import annotations

import json

import pytest
from mindloom_tokenizer import Tokenizer, train_tokenizer
from mindloom_tokenizer._export import export_hf
from tokenizers import Tokenizer as HFTokenizer

TEXTS = [
    "Hello world, this is the first line.",
    "The quick brown fox jumps over the lazy dog.",
    "中文测试：我们在这里说中文。混合 English 和 中文。",
    "In 1999 there were 12345 items; pi is 3.14159.",
    "emoji 😀🚀 and rare ǅ ꙮ 𝔘 characters",
    "  two leading spaces, inner   runs\tand\ttabs",
    " one leading space",
    "trailing spaces   ",
    "line one\nline two\n\nline four\n",
    "\u2581 a literal meta-space",
    "",
    " ",
]


def _check_same_ids(tok: Tokenizer, hf: HFTokenizer, texts) -> None:
    for text in texts:
        ids = tok.encode(text)
        assert hf.encode(text, add_special_tokens=False).ids == ids, text
        assert hf.decode(ids) == tok.decode(ids), text


@pytest.mark.parametrize("which", ["bpe_dir", "unigram_dir"])
def test_tokenizers_gives_identical_ids(which, request, corpus_dir):
    tok = Tokenizer.load(request.getfixturevalue(which))
    path = export_hf(tok)
    assert path.endswith("tokenizer.json")
    hf = HFTokenizer.from_file(path)
    assert hf.get_vocab_size() == tok.vocab_size
    corpus = (corpus_dir / "a.txt").read_text(encoding="utf-8").splitlines()[:300]
    _check_same_ids(tok, hf, TEXTS + corpus)


def test_transformers_fast_tokenizer_gives_identical_ids(bpe_dir):
    import transformers

    tok = Tokenizer.load(bpe_dir)
    path = export_hf(tok)
    fast = transformers.PreTrainedTokenizerFast(tokenizer_file=path)
    for text in TEXTS:
        assert fast.encode(text, add_special_tokens=False) == tok.encode(text), text
        assert fast(text)["input_ids"] == tok.encode(text), text  # no BOS/EOS added either
    # The directory also loads with AutoTokenizer, special tokens named.
    auto = transformers.AutoTokenizer.from_pretrained(str(bpe_dir))
    assert auto.bos_token_id == tok.bos_id and auto.eos_token_id == tok.eos_id
    assert auto.unk_token_id == tok.unk_id
    for text in [*TEXTS, "literal <s> and </s> stay text"]:
        assert auto.encode(text, add_special_tokens=False) == tok.encode(text), text


def test_user_defined_and_control_symbols(corpus_dir, tmp_path):
    tok = train_tokenizer(
        corpus_dir,
        tmp_path / "t",
        600,
        user_defined_symbols=["<sep>"],
        control_symbols=["<|eot|>"],
    )
    hf = HFTokenizer.from_file(export_hf(tok))
    # SentencePiece never makes control symbols from text; tokenizers needs this flag
    # (not stored in tokenizer.json) to do the same.
    hf.encode_special_tokens = True
    _check_same_ids(tok, hf, ["a<sep>b <sep> c", "end<sep>", " <sep> x", "no <|eot|> here"])
    meta = json.loads((tmp_path / "t" / "tokenizer_config.json").read_text())
    assert meta["bos_token"] == "<s>" and meta["pad_token"] is None


def test_char_export_round_trips(tmp_path):
    text = "First Citizen:\nBefore we proceed any further, hear me speak.\n\n  All:\tSpeak!\n"
    (tmp_path / "c.txt").write_text(text, encoding="utf-8")
    tok = train_tokenizer(tmp_path / "c.txt", tmp_path / "t", model_type="char")
    hf = HFTokenizer.from_file(export_hf(tok))
    hf.encode_special_tokens = True
    ids = tok.encode(text)
    assert hf.encode(text, add_special_tokens=False).ids == ids
    assert hf.decode(ids) == text
    assert hf.encode("Q~", add_special_tokens=False).ids == [tok.unk_id, tok.unk_id]


def test_unsupported_normalization_is_refused(corpus_dir, tmp_path):
    from mindloom_tokenizer import TokenizerError

    tok = train_tokenizer(
        corpus_dir, tmp_path / "t", 600, normalization_rule_name="nmt_nfkc", num_threads=2
    )
    with pytest.raises(TokenizerError, match="identity normalization only"):
        export_hf(tok)
    assert not (tmp_path / "t" / "tokenizer.json").exists()
