"""The web pipeline's fast paths against the plain definitions they replaced (issue 20's
speed work: numpy script counts, str.replace instead of str.translate, lingua on fewer
languages): each gives exactly what the slower definition gives, on strings built to hit
the edges (every range bound, compatibility forms next to kept punctuation)."""

import json
import random
import re
import unicodedata

import pytest
from mindloom_data import _filter_base, _langid, _normalize, clean
from mindloom_data._pipeline import CleanError

SWAHILI = (
    "Mito ya kaskazini huleta kila mwaka maji ya theluji iliyoyeyuka kutoka milima mirefu, na "
    "mafuriko yake yameunda mabonde mapana kwa maelfu ya miaka. Wakulima wameona kwamba maji "
    "sasa yanakuja mapema zaidi kuliko zamani."
)


def _edges(ranges: str) -> list[str]:
    """The characters at and next to each bound of a regex class's ranges."""
    out = []
    for lo, hi in re.findall("(.)-(.)", ranges):
        for c in (ord(lo) - 1, ord(lo), ord(hi), ord(hi) + 1):
            if not 0xD800 <= c < 0xE000:
                out.append(chr(c))
    return out


def _strings(pool: list[str], n: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    common = list("ab cd xy 12 _ \n") + ["中文", "かな", "한국", "word", "，", "。"]
    return [
        "".join(rng.choice(pool) if rng.random() < 0.4 else rng.choice(common) for _ in range(300))
        for _ in range(n)
    ]


def test_script_counts_and_words_equal_the_regex_definitions():
    han, kana, hangul = (
        r.encode().decode("unicode_escape") for r in (_langid._HAN, _langid._KANA, _langid._HANGUL)
    )
    cjk_re, kana_re, hangul_re = (re.compile(f"[{r}]") for r in (han + kana + hangul, kana, hangul))
    word_re = re.compile(r"[^\W\d_]{2,}")  # a word of the text with its CJK made spaces
    rng = random.Random(0)
    pool = _edges(han + kana + hangul) + [chr(rng.randrange(0x20, 0xD800)) for _ in range(3000)]
    for s in _strings(pool, 300, 1):
        assert _langid._script_counts(s) == (
            len(cjk_re.findall(s)),
            len(kana_re.findall(s)),
            len(hangul_re.findall(s)),
        ), s
        assert _langid._LATIN_WORD.findall(s) == word_re.findall(cjk_re.sub(" ", s)), s


def test_cjk_unit_count_equals_the_regex():
    pool = _edges(_filter_base._CJK) + [chr(c) for c in range(0x2E00, 0x3200)]
    for s in _strings(pool, 300, 2):
        raw = s.encode("utf-32-le")
        assert _filter_base._count_cjk(raw) == len(_filter_base._CJK_CHAR.findall(s)), s


def _reference_keep_cjk(text: str) -> str:
    # the definition: NFKC with each kept mark swapped for a private-use placeholder
    if not _normalize._HAS_CJK_PUNCT.search(text):
        return unicodedata.normalize("NFKC", text)
    return unicodedata.normalize("NFKC", text.translate(_normalize._PROTECT)).translate(
        _normalize._RESTORE
    )


def _reference_normalize(text: str) -> str:
    text = text.replace("\r\n", "\n").replace("\r", "\n").translate(_normalize._TABLE)
    if not unicodedata.is_normalized("NFKC", text):
        text = _reference_keep_cjk(text).translate(_normalize._TABLE)
    text = _normalize._SPACES.sub(" ", text)
    text = _normalize._TRAILING.sub("\n", text)
    return _normalize._PARAS.sub("\n\n", text).strip()


def test_normalize_fast_paths_equal_the_translate_definition():
    # kept marks next to compatibility forms (full-width letters, ligatures, half-width
    # katakana, ideographic space, NBSP, circled digits), combining marks after a mark,
    # zero-width and control characters, the table's spaces
    pool = list(_normalize._CJK_PUNCT) + list(
        "ＡＢｃ１２ﬁﬂｶﾞ\u3000\u00a0①\u0301\u0308\u200b\x07\x85"
    )
    pool += list(_normalize._UNICODE_SPACES) + ["\u2028", "\u2029", "e\u0301", "，\u0301"]
    norm = _normalize.Normalizer()
    texts = _strings(pool, 400, 3) + ["北京，上海。", "ＡＢＣ，１２３", "plain ascii", "全角：１"]
    for t in texts:
        assert _normalize.nfkc_keep_cjk_punctuation(t) == _reference_keep_cjk(t), t
        assert norm(t) == _reference_normalize(t), t


def test_language_candidates():
    from mindloom_data._langid import LanguageIdentifier

    assert LanguageIdentifier(candidates="all").identify(SWAHILI).language == "sw"
    # Swahili is not among the web's most common languages: another label by default...
    assert LanguageIdentifier().identify(SWAHILI).language != "sw"
    # ...unless a keep-list or the candidates name it
    assert LanguageIdentifier(keep=["sw", "en"]).identify(SWAHILI).language == "sw"
    assert LanguageIdentifier(candidates=["en", "sw"]).identify(SWAHILI).language == "sw"
    with pytest.raises(ValueError, match="lingua has no language xx"):
        LanguageIdentifier(candidates=["en", "xx"])


def test_language_candidates_config_is_checked_in_one_line(tmp_path):
    src = tmp_path / "a.jsonl"
    src.write_text(json.dumps({"text": SWAHILI}) + "\n")
    for cands, message in (
        ("some", "must be web, all or a list"),
        (["en", "xx"], "no language xx"),
    ):
        cfg = {"language": {"enabled": True, "candidates": cands}}
        with pytest.raises((CleanError, ValueError), match=message) as err:
            clean(src, tmp_path / "out", config=cfg, progress=False)
        assert "\n" not in str(err.value)


def test_table_rules_are_left_out_of_the_ngram_statistics():
    # The repetition filter drops rule-only units (`|`, `+------+`) from its n-gram counts,
    # now tested once per distinct unit: a manual's table must not be its top n-gram.
    from mindloom_data._filter_base import TextInfo
    from mindloom_data._filter_repetition import RepetitionFilter

    rng = random.Random(0)
    words = "river valley flood spring farmers snow water mountain village study".split()
    words += [f"w{i}" for i in range(300)]
    prose = " ".join(rng.choice(words) for _ in range(120))
    rows = "\n".join(
        f"| {rng.choice(words)} | {rng.randint(0, 999)} |\n+------+------+" for _ in range(40)
    )
    table = prose + "\n\n" + rows
    assert RepetitionFilter().check(table, TextInfo(table)) is None
    # the same words with the rules drawn in letters are a repeated 2-gram
    lettered = table.replace("|", "ab").replace("+------+------+", "border line here")
    assert RepetitionFilter().check(lettered, TextInfo(lettered)) == "top_2gram"
