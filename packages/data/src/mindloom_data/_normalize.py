"""Text normalization that keeps what a language model needs: punctuation and paragraphs.

Order of operations (each can be switched off):

1. ANSI escape sequences removed; BOM and zero-width characters removed.
2. Unicode NFKC, CJK-aware by default: full-width Latin letters and digits become ASCII,
   the ideographic space U+3000 becomes a space, compatibility ligatures are split,
   half-width katakana and `｡｢｣､` become their usual forms, but full-width punctuation and
   symbols (`，！？：；（）％～` and the rest of U+FF01-FF0F, FF1A-FF20, FF3B-FF40,
   FF5B-FF60) and the ellipsis `…` stay as written: in Chinese text they are the
   punctuation, not a compatibility form of ASCII. `keep_cjk_punctuation=False` is plain
   NFKC (`，` -> `,`, `…` -> `...`).
3. Line endings become `\\n`; other control characters are removed; tabs and every
   Unicode space become a plain space.
4. Runs of spaces collapse to one, spaces at line ends go, and three or more newlines
   become one blank line, so single line breaks and paragraph breaks (a blank line)
   survive.
5. Optionally Traditional -> Simplified Chinese (the `zh` extra: opencc).
"""

from __future__ import annotations

import re
import unicodedata
from dataclasses import dataclass

_ANSI = re.compile(r"\x1b(?:\[[0-?]*[ -/]*[@-~]|\][^\x07\x1b]*(?:\x07|\x1b\\)|[@-Z\\-_])")
_SPACES = re.compile(r"[ ]{2,}")
_TRAILING = re.compile(r" *\n *")
_PARAS = re.compile(r"\n{3,}")

_ZERO_WIDTH = "\u200b\u200c\u200d\u2060\ufeff\u180e"
_UNICODE_SPACES = "\t\u00a0\u1680\u2000\u2001\u2002\u2003\u2004\u2005\u2006\u2007\u2008\u2009\u200a\u202f\u205f\u3000\x0b\x0c"
# C0/C1 controls except \t and \n (handled separately); \r is handled before this table.
_CONTROLS = [c for c in range(0x20) if c not in (0x09, 0x0A, 0x0D)] + list(range(0x7F, 0xA0))
_TABLE = {ord(c): None for c in _ZERO_WIDTH}
_TABLE.update({ord(c): " " for c in _UNICODE_SPACES})
_TABLE.update({c: None for c in _CONTROLS})
_TABLE[0x2028] = "\n"  # line separator
_TABLE[0x2029] = "\n\n"  # paragraph separator
# Whether `_TABLE` would change anything: a regex search is ~20x str.translate with a
# dict on non-ASCII text, and most texts hold none of these characters.
_HAS_TABLE_CHAR = re.compile("[" + "".join(re.escape(chr(c)) for c in sorted(_TABLE)) + "]")
_BYTE_TABLE = bytes(32 if _TABLE.get(c) == " " else c for c in range(256))
_BYTE_DELETE = bytes(c for c in range(128) if c in _TABLE and _TABLE[c] is None)


# Full-width punctuation and symbols, and the ellipsis, that NFKC would turn into ASCII.
_CJK_PUNCT = (
    "".join(
        chr(c)
        for lo, hi in ((0xFF01, 0xFF0F), (0xFF1A, 0xFF20), (0xFF3B, 0xFF40), (0xFF5B, 0xFF60))
        for c in range(lo, hi + 1)
    )
    + "\u2026"
)
_HAS_CJK_PUNCT = re.compile(f"[{re.escape(_CJK_PUNCT)}]")
# While NFKC runs, each becomes a private-use placeholder (NFKC leaves those alone).
_PLACEHOLDER_BASE = 0xE000
_PROTECT = {ord(c): _PLACEHOLDER_BASE + i for i, c in enumerate(_CJK_PUNCT)}
_RESTORE = {v: k for k, v in _PROTECT.items()}
_HAS_PLACEHOLDER = re.compile(
    f"[{chr(_PLACEHOLDER_BASE)}-{chr(_PLACEHOLDER_BASE + len(_CJK_PUNCT))}]"
)
_BOOL_KEYS = (
    "enabled",
    "nfkc",
    "keep_cjk_punctuation",
    "ansi",
    "control",
    "whitespace",
    "zh_simplified",
)


class MissingExtraError(ImportError):
    pass


def check_normalize_config(cfg: dict) -> None:
    """One-line ValueError for a `normalize` config value that is not true or false."""
    for key in _BOOL_KEYS:
        if key in cfg and not isinstance(cfg[key], bool):
            raise ValueError(f"normalize.{key} must be true or false, not {cfg[key]!r}")


def nfkc_keep_cjk_punctuation(text: str) -> str:
    """NFKC except for full-width punctuation and symbols and `…`, which stay as written."""
    if not _HAS_CJK_PUNCT.search(text):
        return unicodedata.normalize("NFKC", text)
    if not _HAS_PLACEHOLDER.search(text):
        # str.replace for the few marks present is ~10x str.translate over all of them
        present = [(c, chr(_PROTECT[ord(c)])) for c in _CJK_PUNCT if c in text]
        protected = text
        for c, mark in present:
            protected = protected.replace(c, mark)
        if unicodedata.is_normalized("NFKC", protected):
            return text  # the marks were all there was to keep (most Chinese text)
        out = unicodedata.normalize("NFKC", protected)
        for c, mark in present:
            out = out.replace(mark, c)
        return out
    # The text uses our placeholders itself: normalize the pieces between the marks.
    parts = _SPLIT_CJK_PUNCT.split(text)
    return "".join(p if i % 2 else unicodedata.normalize("NFKC", p) for i, p in enumerate(parts))


_SPLIT_CJK_PUNCT = re.compile(f"([{re.escape(_CJK_PUNCT)}])")


@dataclass
class Normalizer:
    """A step that rewrites each document's text; counts documents it changed."""

    nfkc: bool = True
    keep_cjk_punctuation: bool = True
    ansi: bool = True
    control: bool = True
    whitespace: bool = True
    zh_simplified: bool = False
    name: str = "normalize"

    def __post_init__(self):
        check_normalize_config({k: getattr(self, k) for k in _BOOL_KEYS if k != "enabled"})
        self._opencc = None
        if self.zh_simplified:
            try:
                import opencc  # from opencc-python-reimplemented
            except ImportError as exc:
                raise MissingExtraError(
                    "normalize.zh_simplified needs the zh extra: pip install 'mindloom-data[zh]'"
                ) from exc
            self._opencc = opencc.OpenCC("t2s")

    def __call__(self, text: str) -> str:
        if self.ansi and "\x1b" in text:
            text = _ANSI.sub("", text)
        if "\r" in text:
            text = text.replace("\r\n", "\n").replace("\r", "\n")
        ascii = text.isascii()
        if self.control:
            if ascii:  # the same table on bytes, ~3x faster than str.translate
                text = text.encode("ascii").translate(_BYTE_TABLE, _BYTE_DELETE).decode("ascii")
            elif _HAS_TABLE_CHAR.search(text):
                text = text.translate(_TABLE)
        if self.nfkc and not ascii and not unicodedata.is_normalized("NFKC", text):
            if self.keep_cjk_punctuation:
                text = nfkc_keep_cjk_punctuation(text)
            else:
                text = unicodedata.normalize("NFKC", text)
            if self.control and _HAS_TABLE_CHAR.search(text):  # NFKC can make new spaces
                text = text.translate(_TABLE)
        if self.whitespace:
            if "  " in text:
                text = _SPACES.sub(" ", text)
            if " \n" in text or "\n " in text:
                text = _TRAILING.sub("\n", text)
            if "\n\n\n" in text:
                text = _PARAS.sub("\n\n", text)
            text = text.strip()
        if self._opencc is not None:
            text = self._opencc.convert(text)
        return text


def split_paragraphs(text: str) -> list[str]:
    """Paragraphs of normalized text: blocks separated by a blank line."""
    return text.split("\n\n")
