"""Quality filters, each a small step with configurable thresholds and named reasons.

Filters count *units*: whitespace-separated words for Latin script, and single characters
for CJK (Chinese has no spaces, so a "word" would be a whole sentence); in mixed text each
CJK character is a unit and each Latin word is one. Defaults follow Gopher (Rae et al. 2021)
/ FineWeb where a rule exists there; where a rule was written for English web prose and
misjudged Chinese, code, tables or verse on the labeled set
(packages/data/tests/data/filter_eval.jsonl, benchmarks/filters.py), it says below how it
differs.

A filter's `check(text, info)` returns the reason it rejects the document, or None.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, fields

import numpy as np

from mindloom_data._filter_base import (
    _CJK,
    _CJK_CHAR,
    _COMMAND_BLOCK,
    _COMMAND_START,
    _GARBLED,
    _RULE_CODES,
    _RULE_DELETE,
    _SPACE_CODES,
    Filter,
    TextInfo,
)
from mindloom_data._filter_repetition import RepetitionFilter

__all__ = ["FILTERS", "Filter", "TextInfo", "build_filters"]


@dataclass
class LengthFilter(Filter):
    """Too few or too many units, more characters than `max_chars` (e.g. a 50 MB line), or
    non-CJK words longer than `max_mean_word_length` characters on average (Gopher)."""

    min_units: int = 50
    max_units: int = 100_000
    max_chars: int = 1_000_000
    max_mean_word_length: float = 10.0
    name = "length"

    def reasons(self):
        return ["too_short", "too_long", "long_words"]

    def check(self, text, info):
        if len(text) > self.max_chars:
            return "too_long"
        n = len(info.units)
        if n < self.min_units:
            return "too_short"
        if n > self.max_units:
            return "too_long"
        # Gopher's upper bound on the mean word length (base64, hex strings, minified
        # text), over the non-CJK words only: CJK units are single characters.
        words = n - info.cjk_units
        if words and self.max_mean_word_length and not info.code:
            chars = len(text) - text.count(" ") - text.count("\n") - info.cjk_units
            if chars / words > self.max_mean_word_length:  # an upper bound: check exactly
                rest = _CJK_CHAR.sub(" ", text) if info.cjk_units else text
                # table borders and rules are drawings, not words
                # and URLs, paths and code names (`os.path`, `SSL_ERROR_EOF`, `f(x)`) are
                # names, not words
                lens = [
                    len(w)
                    for w in rest.split()
                    if w.translate(_RULE_DELETE)
                    and not _URL_OR_PATH.match(w)
                    and not _CODE_NAME.search(w)
                ]
                if lens and sum(lens) / len(lens) > self.max_mean_word_length:
                    return "long_words"
        return None


@dataclass
class RepeatedCharsFilter(Filter):
    """Too much of the text in runs of one repeated character ("!!!!!!!!!!", "aaaaaaaaaa").

    Unlike Gopher's rule, runs on a line made only of rule and table characters do not
    count: the borders and separators of tables (`+-----+`, `|-----+----|`, `├────┼────┤`)
    and underlines and rules (`=====`, `-----`), which manuals draw on purpose. A line of
    text that contains such a run (`Title ==========`) still counts.
    """

    run_length: int = 10
    max_fraction: float = 0.1
    name = "repeated_chars"

    def __post_init__(self):
        self._needle = b"\x01" * max(0, self.run_length - 1)

    def check(self, text, info):
        if len(text) < self.run_length:
            return None
        # numpy over code points: about 30x faster than a backreference regex
        a = np.frombuffer(info.raw, np.uint8 if info.ascii else np.uint32)
        same = a[1:] == a[:-1]
        # A run of `run_length` is `run_length - 1` equal neighbours in a row; most texts
        # have none, and a byte search says so faster than measuring every run.
        if self._needle not in same.tobytes():
            return None
        bounds = np.flatnonzero(np.concatenate(([True], ~same, [True])))
        lens = np.diff(bounds)
        long = lens >= self.run_length
        if not long.any():
            return None
        starts = bounds[:-1][long]
        lens = lens[long]
        codes = a[starts]
        counted = ~np.isin(codes, _SPACE_CODES)
        covered = int(lens[counted].sum())
        if covered / len(text) <= self.max_fraction:
            return None
        for i in np.flatnonzero(counted & np.isin(codes, _RULE_CODES)):
            start = int(starts[i])
            line_start = text.rfind("\n", 0, start) + 1
            line_end = text.find("\n", start)
            line = text[line_start : len(text) if line_end < 0 else line_end]
            if not line.translate(_RULE_DELETE).strip():
                covered -= int(lens[i])
        if covered / len(text) > self.max_fraction:
            return "repeated_chars"
        return None


_CODE_NAME = re.compile(r"\w_|\.\w|\w\(")
_URL_OR_PATH = re.compile(r"[(\"'<]?(?:\w+:|/|~/|\./)")


@dataclass
class GarbledFilter(Filter):
    """Replacement characters (U+FFFD), private-use code points and UTF-8-as-Latin-1 mojibake
    (`Ã©`, `â€™`, and Chinese read as Latin-1: `ä¸­`): more than `max_ratio` of the
    characters, or `max_matches` occurrences or more (a long English text with a mangled
    apostrophe in every paragraph is still mangled)."""

    max_ratio: float = 0.01
    max_matches: int = 8
    name = "garbled"

    def check(self, text, info):
        if info.ascii:  # every pattern below is non-ASCII
            return None
        found = [m.end() - m.start() for m in _GARBLED.finditer(text)]
        if not found:
            return None
        if sum(found) / len(text) > self.max_ratio or len(found) >= self.max_matches > 0:
            return "garbled"
        return None


@dataclass
class SymbolFilter(Filter):
    """Gopher: hashtags and ellipses per unit above `max_symbol_ratio`; too few units with a
    letter (`few_alpha_units`).

    Two differences from Gopher, both so that code and manuals are judged like prose:

    - `#` counts only as a hashtag (after a space or tab, before a non-space): `#define`
      and `# comment` at the start of a line and `page#anchor` are not hashtags.
    - The letter rule counts each CJK character as a unit with a letter and each other
      whitespace-separated word as one unit; words made only of punctuation and symbols
      (`$`, `|`, `&&`, `>`, `--`, `，`, box drawing) are left out of the count, so the
      prompts, pipes and table borders of a manual do not outvote its sentences. A
      document whose words are all such symbols is dropped. Command blocks and table
      rows (as in `RepetitionFilter`) are left out when prose remains. Source code (see
      `_looks_like_code`: numbers, operators and hex literals are its normal words) is
      not held to the letter rule.
    """

    max_symbol_ratio: float = 0.1
    min_alpha_fraction: float = 0.8
    name = "symbols"

    def reasons(self):
        return ["symbol_ratio", "few_alpha_units"]

    def check(self, text, info):
        n = max(1, len(info.units))
        limit = self.max_symbol_ratio * n
        dots = text.count("...")
        if not info.ascii:
            dots += text.count("\u2026")
        hashes = text.count("#")
        if dots + hashes > limit:  # the cheap upper bound first
            hashes = len(_HASHTAG.findall(text)) if hashes else 0
            if dots + hashes > limit:
                return "symbol_ratio"
        if self.min_alpha_fraction > 0 and not info.code:
            if _COMMAND_START.search(text):
                # a manual's commands, their output and table rows do not decide
                prose = _COMMAND_BLOCK.sub("\n", text)
                if len(prose.split()) >= 20:
                    text, info = prose, TextInfo(prose)
            alpha, numeric = _alpha_counts(text, info)
            if alpha + numeric == 0:
                return "few_alpha_units" if info.units else None
            if alpha / (alpha + numeric) < self.min_alpha_fraction:
                return "few_alpha_units"
        return None


_HASHTAG = re.compile("[ \t]#[^\\s#]")


def _alpha_counts(text: str, info: TextInfo) -> tuple[int, int]:
    """(units with a letter, units with a digit but no letter); symbol-only words ignored."""
    if info.ascii:
        # Letters -> "a", digits -> "0", whitespace -> " ", everything else deleted: a
        # word with a letter keeps an "a", a symbol-only word vanishes.
        t = info.raw.translate(_ALNUM_TABLE, _NOT_ALNUM_OR_SPACE)
        # Words start at the beginning or after a space: counted without splitting.
        words = t.count(b" a") + t.count(b" 0") + (t[:1] in (b"a", b"0"))
        t = t.translate(None, b"0")  # words with a letter keep an "a", others vanish
        alpha = t.count(b" a") + (t[:1] == b"a")
        return alpha, words - alpha
    cjk = info.cjk_units
    # the words between CJK characters and whitespace, joined by spaces: the same words as
    # the text with its CJK characters made spaces, in a shorter string
    rest = " ".join(_NON_CJK_RUN.findall(text)) if cjk else text
    alpha = len(_WORD_WITH_LETTER.findall(rest))
    return cjk + alpha, len(_WORD_WITH_ALNUM.findall(rest)) - alpha


_NON_CJK_RUN = re.compile(f"[^\\s{_CJK}]+")
# One match per whitespace-separated word that has a letter (or a letter or digit).
_WORD_WITH_LETTER = re.compile("\\S*?[^\\W\\d_]\\S*")
_WORD_WITH_ALNUM = re.compile("\\S*?[^\\W_]\\S*")
# The same for ASCII text, on bytes (whitespace is what str.split and \\s split on).
_ASCII_SPACE = b"\t\n\x0b\x0c\r\x1c\x1d\x1e\x1f "
_ASCII_LETTERS = bytes(c for c in range(128) if chr(c).isascii() and chr(c).isalpha())
_ASCII_DIGITS = b"0123456789"
_ALNUM_TABLE = bytes(
    ord("a")
    if c in _ASCII_LETTERS
    else ord("0")
    if c in _ASCII_DIGITS
    else 32
    if c in _ASCII_SPACE
    else c
    for c in range(256)
)
_NOT_ALNUM_OR_SPACE = bytes(
    c for c in range(256) if c not in _ASCII_LETTERS + _ASCII_DIGITS + _ASCII_SPACE
)


@dataclass
class BoilerplateFilter(Filter):
    """Pages that are mostly site furniture: `boilerplate` when at least `max_line_fraction`
    of the non-empty lines carry a boilerplate marker (C4's cookie / terms / JavaScript
    notices and their Chinese counterparts: 版权所有, ICP备, 免责声明, 分享到, ...), and
    `no_sentences` when fewer than `min_sentence_lines` of them hold any sentence or code
    punctuation (`. , ! ? ; :` and CJK ones, brackets, `=`): a navigation menu or a tag
    list. Verse, code, lists with descriptions and tables inside a manual all pass the
    second rule, which asks for any such mark anywhere in a line, not at its end (FineWeb).
    """

    max_line_fraction: float = 0.3
    min_sentence_lines: float = 0.2
    name = "boilerplate"

    def reasons(self):
        return ["boilerplate", "no_sentences"]

    def check(self, text, info):
        lines = text.count("\n") + 1
        low = text.lower()
        if _boiler_hits(low) >= self.max_line_fraction * lines:  # an upper bound first
            nonempty = [x for x in low.split("\n") if x.strip()]
            marked = sum(1 for x in nonempty if _boiler_hits(x))
            if nonempty and marked / len(nonempty) >= self.max_line_fraction:
                return "boilerplate"
        if self.min_sentence_lines > 0:
            marks = len(_SENTENCE_LINE.findall(text))
            if marks < self.min_sentence_lines * lines:
                # table rows and rules are neither sentences nor menu items
                rows = sum(
                    1
                    for x in text.split("\n")
                    if x.translate(_RULE_DELETE).strip() and x.lstrip()[0] not in _TABLE_START
                )
                if marks < self.min_sentence_lines * rows:
                    return "no_sentences"
        return None


# Lowercase markers, found with str.count (a case-insensitive regex alternation cost
# ~20x the whole filter on ordinary text).
_BOILER_MARKERS = (
    "all rights reserved", "privacy policy", "terms of use", "terms of service", "cookie",
    "javascript is", "enable javascript", "powered by", "share this", "leave a comment",
    "skip to content", "skip to main content", "back to top", "sign up for",
    "subscribe to our", "newsletter", "log in or register", "login or register",
    "版权所有", "保留所有权利", "icp备", "公网安备", "备案号", "免责声明", "侵权", "责任编辑",
    "分享到", "上一篇", "下一篇", "扫一扫", "二维码", "公众号", "加载更多", "浏览器版本",
    "返回顶部", "忘记密码", "登录 | 注册", "登录|注册",
)  # fmt: skip


def _boiler_hits(text: str) -> int:
    return sum(map(text.count, _BOILER_MARKERS))


_TABLE_START = "|\u2502\u251c\u250c\u2514"
# A line with any sentence or code punctuation (one match per such line).
_SENTENCE_LINE = re.compile(
    "^.*?[.,!?;:=(){}\\[\\]\u3001\u3002\uff01\uff0c\uff1a\uff1b\uff1f\u2026].*$", re.MULTILINE
)


FILTERS = {
    "length": LengthFilter,
    "repeated_chars": RepeatedCharsFilter,
    "garbled": GarbledFilter,
    "symbols": SymbolFilter,
    "boilerplate": BoilerplateFilter,
    "repetition": RepetitionFilter,
}


def build_filters(cfg: dict | None) -> list[Filter]:
    """Filters from a config mapping `name -> {param: value}` (or `false` to switch off).

    Every filter is on by default with its default thresholds; an unknown filter name or
    parameter raises a one-line ValueError naming it.
    """
    cfg = dict(cfg or {})
    out = []
    for key in cfg:
        if key not in FILTERS:
            raise ValueError(f"unknown filter filters.{key} (known: {', '.join(FILTERS)})")
    for name, cls in FILTERS.items():
        params = cfg.get(name, {})
        if params is False:
            continue
        if params is True or params is None:
            params = {}
        if not isinstance(params, dict):
            raise ValueError(f"filters.{name} must be a mapping or false")
        known = {f.name for f in fields(cls)}
        for k in params:
            if k not in known:
                raise ValueError(
                    f"unknown key filters.{name}.{k} (known: {', '.join(sorted(known))})"
                )
        out.append(cls(**params))
    return out
