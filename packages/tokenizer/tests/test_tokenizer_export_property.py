"""The Hugging Face export encodes exactly as SentencePiece: property-based and regression tests.

The reference is SentencePiece itself (`SentencePieceProcessor.encode/normalize/decode` on
the trained `tokenizer.model`); the exported `tokenizer.json` is read back from disk with
`tokenizers` (and, for the regression set, with `transformers.AutoTokenizer`).

Round trip, as SentencePiece defines it: decoding the ids of `text` gives SentencePiece's
normalized text with U+2581 turned back into spaces and the one U+2581 that starts the first
piece dropped (the dummy prefix). With identity normalization and whitespace kept that is
`text` with literal U+2581 read as a space; with `remove_extra_whitespaces` it is `text`
with leading/trailing spaces stripped and runs of spaces collapsed. Texts whose ids contain
`<unk>` (no byte fallback) do not round-trip in SentencePiece either and are left out of it.
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from mindloom_tokenizer import Tokenizer, train_tokenizer
from mindloom_tokenizer._export import export_hf
from tokenizers import Tokenizer as HFTokenizer

META = "\u2581"
WORDS = "the of and to in is was that for it with as his on be at by had are but from".split()
HANZI = "的一是不了人我在有他这中大来上国个到说们为子和你地出道也时年得就那要下以生会自之着去过"
USER = ["<sep>", "<|tool|>", "@@"]
CONTROL = ["<|eot|>", "<|im_start|>"]
# Every literal the two libraries could treat specially: control, unknown, byte and
# user-defined pieces, and prefixes of them.
SYMBOLS = [*USER, *CONTROL, "<s>", "</s>", "<unk>", "<pad>", "<0x41>", "<0x0A>", "<0xE4>", "<0x"]

CONFIGS = {
    # Our defaults: byte fallback, split digits, dummy prefix, whitespace kept.
    "bpe": dict(model_type="bpe"),
    "unigram": dict(model_type="unigram"),
    # Every exposed option flipped.
    "bpe-alt": dict(
        model_type="bpe",
        byte_fallback=False,
        split_digits=False,
        add_dummy_prefix=False,
        remove_extra_whitespaces=True,
    ),
    "unigram-alt": dict(
        model_type="unigram",
        byte_fallback=False,
        split_digits=False,
        add_dummy_prefix=True,
        remove_extra_whitespaces=True,
    ),
    "unigram-noprefix": dict(model_type="unigram", add_dummy_prefix=False),
}

# The smallest mismatches of the old export (issue 19), the README's former known
# differences, and whitespace edge cases of SentencePiece's normalizer.
REGRESSION = [
    "a\n    b",
    "x\n  y",
    "def f():\n    return 1",
    "a \n b",
    "if x:\n\tpass\n  \n    y = 2\n",
    "床前明月光，\n  疑是地上霜。",
    "literal <s> and </s> and <unk> stay text",
    "<s>",
    "bytes <0x41><0x0A> written out",
    "<0x41>",
    "<sep>x",
    "<sep> <sep>",
    "a<sep>b <|tool|>c@@d",
    "no <|eot|> here <|im_start|>",
    " leading space",
    "\n\nleading newlines",
    "trailing spaces   ",
    "   ",
    "",
    " ",
    "\u2581 a literal meta-space \u2581",
    "\u2581",
    "x \u2581 ",
    "emoji 😀🚀👍🏽 and e\u0301 and 𝔘 ꙮ",
    "12345 and ١٢٣ digits",
]


def _corpus_lines(corpus_dir) -> list[str]:
    lines = (corpus_dir / "a.txt").read_text(encoding="utf-8").splitlines()
    # Indented code and markup so that whitespace-only pieces and '<' pieces exist.
    lines += [
        "    return x + 1",
        "        if a < b and c > d:",
        "\tfor i in range(10):",
        "  - item <b>bold</b> <i>it</i>",
        "x = a<b; y = c>d; s = 'a''b'",
    ] * 40
    return lines


@pytest.fixture(scope="module")
def trained(tmp_path_factory, corpus_dir) -> dict[str, tuple[Tokenizer, HFTokenizer, str]]:
    """Each configuration trained once on a small corpus, exported and read back from disk."""
    root = tmp_path_factory.mktemp("export_prop")
    corpus = root / "corpus.txt"
    corpus.write_text("\n".join(_corpus_lines(corpus_dir)) + "\n", encoding="utf-8")
    out = {}
    for name, options in CONFIGS.items():
        tok = train_tokenizer(
            corpus,
            root / name,
            700,
            num_threads=2,
            user_defined_symbols=USER,
            control_symbols=CONTROL,
            **options,
        )
        hf = HFTokenizer.from_file(export_hf(tok))
        # Not stored in tokenizer.json; transformers sets it from split_special_tokens.
        hf.encode_special_tokens = True
        out[name] = (tok, hf, str(root / name))
    return out


def _expected_decode(sp, text: str) -> str:
    spec_strips = sp.add_dummy_prefix or sp.remove_extra
    normalized = sp.proc.normalize(text)
    if spec_strips and normalized.startswith(META):
        normalized = normalized[1:]
    return normalized.replace(META, " ")


class _Sp:
    def __init__(self, tok: Tokenizer):
        from sentencepiece import sentencepiece_model_pb2 as pb

        self.proc = tok.sentencepiece
        proto = pb.ModelProto()
        proto.ParseFromString(self.proc.serialized_model_proto())
        self.add_dummy_prefix = proto.normalizer_spec.add_dummy_prefix
        self.remove_extra = proto.normalizer_spec.remove_extra_whitespaces
        self.unigram = proto.trainer_spec.model_type == proto.trainer_spec.UNIGRAM
        self.identity = not proto.normalizer_spec.precompiled_charsmap
        self.unk_id = self.proc.unk_id()
        self.meta_id = self.proc.piece_to_id(META)


_SP_CACHE: dict[int, _Sp] = {}


def check_same(tok: Tokenizer, hf: HFTokenizer, text: str) -> None:
    sp = _SP_CACHE.get(id(tok)) or _SP_CACHE.setdefault(id(tok), _Sp(tok))
    ids = sp.proc.encode(text, out_type=int)
    got = hf.encode(text, add_special_tokens=False).ids
    body = sp.proc.normalize(text)
    if sp.add_dummy_prefix and body.startswith(META):
        body = body[1:]
    if sp.add_dummy_prefix and body in USER:
        # The one documented difference: a text that normalizes to exactly one user-defined
        # symbol gets no dummy prefix from tokenizers (README, "Hugging Face export").
        assert ids == [sp.meta_id, sp.proc.piece_to_id(body)], text
        assert got == ids[1:], text
        return
    if got != ids and sp.unigram:
        # Documented: two unigram segmentations with the same total score (the same pieces
        # in another order, e.g. whitespace-only pieces in a long run of spaces) are a tie
        # that SentencePiece (float32 sums) and tokenizers (float64) may break differently.
        assert sorted(got) == sorted(ids), (text, hf.encode(text).tokens)
        assert sp.proc.decode(got) == sp.proc.decode(ids), text
        ids = got
    assert got == ids, (text, [sp.proc.id_to_piece(i) for i in ids], hf.encode(text).tokens)
    if sp.remove_extra and body.startswith(META):
        # Documented: with remove_extra_whitespaces SentencePiece's decoder drops one
        # U+2581 from every piece until it has output, so a text that starts with a literal
        # U+2581 decodes without it; the tokenizers decoder drops one only.
        return
    if sp.unk_id not in ids:
        expected = _expected_decode(sp, text)
        assert sp.proc.decode(ids) == expected, text
        assert hf.decode(ids) == expected, text
        if not sp.remove_extra and sp.identity:
            assert expected == text.replace(META, " "), text


# Text mixing what real documents have: newlines, runs of spaces and tabs, CJK, emoji,
# combining marks, rare code points (byte fallback), digits, and the special literals.
# Each fragment is decoded from 4 drawn bytes (kind in the low 4 bits, value above):
# drawing plain bytes keeps generation cheap enough for thousands of examples.
WHITESPACE = ["\n", "\r\n", "\t", " ", "  ", "\n    ", "\n\t", " \n ", "\u3000", "\x0b", "\x00"]
ASCII = "abcdefghijklmnopqrstuvwxyzABC.,;:!?'\"()<>/|_-=+*#@&%$"
EMOJI = ["😀", "🚀", "👍🏽", "👨\u200d👩\u200d👧", "🇨🇳", "\u2764\ufe0f"]
MARKS = ["e\u0301", "n\u0303", "\u0301", "a\u0308\u0323", "क्षि", "ﬁ", "Å", "가\u11a8"]
DIGITS = ["١٢٣", "１２３", "３.１４", "0.5", "-12"]


def _fragment(n: int) -> str:
    kind, v = n % 16, n >> 4
    if kind == 0:
        return WHITESPACE[v % len(WHITESPACE)]
    if kind == 1:
        return WORDS[v % len(WORDS)] + " "
    if kind == 2:
        return "".join(ASCII[(v >> (6 * k)) % len(ASCII)] for k in range(1 + v % 6))
    if kind == 3:
        return "".join(HANZI[(v >> (6 * k)) % len(HANZI)] for k in range(1 + v % 4)) + "，。"[v % 2]
    if kind == 4:
        return chr(0x4E00 + v % 0x5200)
    if kind == 5:
        return EMOJI[v % len(EMOJI)]
    if kind == 6:
        return MARKS[v % len(MARKS)]
    if kind == 7:  # any BMP code point but a surrogate: controls, scripts, symbols
        c = v % 0x10000
        return chr(c if not 0xD800 <= c < 0xE000 else c - 0x800)
    if kind == 8:  # astral: rare, usually byte fallback
        return chr(0x10000 + v % 0x100000)
    if kind == 9:
        return str(v % 10**9)
    if kind == 10:
        return DIGITS[v % len(DIGITS)]
    if kind == 11:
        return SYMBOLS[v % len(SYMBOLS)]
    if kind == 12:
        return "\n" + " " * (v % 9)
    if kind == 13:
        return "".join(" \t"[(v >> k) & 1] for k in range(1 + v % 7))
    if kind == 14:
        return chr(0x300 + v % 0x70)
    return META * (1 + v % 3)


def _text(data: bytes) -> str:
    return "".join(
        _fragment(int.from_bytes(data[k : k + 4], "little")) for k in range(0, len(data), 4)
    )


texts = st.binary(max_size=64).map(_text)

# How many values of each fragment kind exist (the lists), or a few values that reach its
# different branches and code-point ranges (the computed kinds).
_KIND_VALUES = {
    0: range(len(WHITESPACE)), 1: range(0, len(WORDS), 5), 2: (0, 1, 5, 4099, 262149),
    3: (0, 1, 3, 4098), 4: (0, 1, 0x51FF), 5: range(len(EMOJI)), 6: range(len(MARKS)),
    7: (0x0A, 0x85, 0x2028, 0xD800, 0xFFFD, 0xFEFF, 0x200B), 8: (0, 0xF0000, 0xFFFFF),
    9: (0, 7, 10**9 - 1), 10: range(len(DIGITS)), 11: range(len(SYMBOLS)), 12: range(9),
    13: (0, 6, 0x55, 0x7F), 14: (0, 1, 0x23, 0x6F), 15: (0, 1, 2),
}  # fmt: skip


def _fragments_of(kind: int) -> list[str]:
    return [_fragment(kind + 16 * v) for v in _KIND_VALUES[kind]]


def _systematic_texts() -> list[str]:
    """What random draws reach only by luck, enumerated: every listed value of every
    fragment kind alone, at the start, middle and end of a text, and every ordered pair of
    kinds (two values each) touching, since most export mismatches were at a boundary
    between two kinds of text (issue 19: whitespace then code, a symbol then a letter)."""
    out = []
    for kind in range(16):
        for frag in _fragments_of(kind):
            out += [frag, frag + "a", "a " + frag, "x" + frag + " y", frag + frag]
    for a in range(16):
        for b in range(16):
            for fa in _fragments_of(a)[:2]:
                for fb in _fragments_of(b)[-2:]:
                    out.append(fa + fb)
    return list(dict.fromkeys(out))


SYSTEMATIC = _systematic_texts()

# The systematic set above carries the coverage of every kind and boundary; the random
# draws (derandomized: the same examples every run, no example database) add longer
# mixtures of up to 16 fragments. 2000 draws per configuration cost 5 s each here.
PROPERTY = settings(
    max_examples=300,
    derandomize=True,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)


def test_the_systematic_set_reaches_every_kind_and_pair():
    assert len(SYSTEMATIC) > 16 * 16 * 3
    for kind in range(16):
        assert len(set(_fragments_of(kind))) == len(_KIND_VALUES[kind]), kind


@pytest.mark.parametrize("name", list(CONFIGS))
def test_export_property_same_ids_and_round_trip(name, trained):
    tok, hf, _ = trained[name]
    for text in SYSTEMATIC:
        check_same(tok, hf, text)

    @PROPERTY
    @given(texts)
    def run(text):
        check_same(tok, hf, text)

    run()


@pytest.mark.parametrize("name", list(CONFIGS))
def test_export_regression_set(name, trained):
    tok, hf, _ = trained[name]
    for text in REGRESSION:
        check_same(tok, hf, text)


@pytest.mark.parametrize("name", ["bpe", "unigram", "bpe-alt"])
def test_export_regression_set_with_transformers(name, trained):
    import transformers  # required: the tokenizer env has it

    tok, _, directory = trained[name]
    auto = transformers.AutoTokenizer.from_pretrained(directory)
    sp = tok.sentencepiece
    for text in REGRESSION:
        body = sp.normalize(text).removeprefix(META)
        if body in USER:
            continue  # the documented difference, checked with tokenizers above
        assert auto.encode(text, add_special_tokens=False) == sp.encode(text), text


def test_export_property_char_model(tmp_path, corpus_dir):
    corpus = "\n".join(_corpus_lines(corpus_dir)[:400]) + "\n\t  😀ꙮ"
    (tmp_path / "c.txt").write_text(corpus, encoding="utf-8")
    tok = train_tokenizer(
        tmp_path / "c.txt", tmp_path / "t", model_type="char", control_symbols=CONTROL
    )
    hf = HFTokenizer.from_file(export_hf(tok))
    hf.encode_special_tokens = True
    vocab = {tok.id_to_piece(i): i for i in range(tok.vocab_size)}

    def check(text):
        ids = tok.encode(text)
        # Independent reference: one id per code point, <unk> for the rest.
        assert ids == [vocab.get(c, tok.unk_id) for c in text]
        assert hf.encode(text, add_special_tokens=False).ids == ids, text
        if tok.unk_id not in ids:
            assert hf.decode(ids) == text

    for text in SYSTEMATIC:
        check(text)
    PROPERTY(given(texts)(check))()


def test_export_refuses_what_tokenizers_cannot_reproduce(corpus_dir, tmp_path):
    from mindloom_tokenizer import TokenizerError
    from sentencepiece import sentencepiece_model_pb2 as pb
    from tokenizers import normalizers

    tok = train_tokenizer(
        corpus_dir, tmp_path / "n", 600, normalization_rule_name="nmt_nfkc", num_threads=2
    )
    proto = pb.ModelProto()
    proto.ParseFromString(tok.sentencepiece.serialized_model_proto())
    precompiled = normalizers.Precompiled(proto.normalizer_spec.precompiled_charsmap)
    # Why NFKC models are refused: the Precompiled normalizer loses a combining mark.
    text = "a\u0308\u0323"
    assert tok.sentencepiece.normalize(text) == "\u2581\u00e4\u0323"
    assert precompiled.normalize_str(text) == "\u00e4"
    with pytest.raises(TokenizerError, match="identity normalization only"):
        export_hf(tok)

    spaced = train_tokenizer(
        corpus_dir, tmp_path / "u", 600, num_threads=2, user_defined_symbols=["<a b>"]
    )
    with pytest.raises(TokenizerError, match="containing a space"):
        export_hf(spaced)
    assert not (tmp_path / "u" / "tokenizer.json").exists()
