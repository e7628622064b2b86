"""What the quality filters share: the `Filter` base, `TextInfo` (a document's units and
lines, computed once for all filters) and the character classes and patterns that several
filters use (CJK, rule and table characters, command blocks)."""

from __future__ import annotations

import re
from dataclasses import dataclass

import numpy as np

_CJK = "\u2e80-\u2fdf\u3040-\u30ff\u3100-\u312f\u3190-\u31ff\u3400-\u4dbf\u4e00-\u9fff\uac00-\ud7af\uf900-\ufaff"
_HAS_CJK = re.compile(f"[{_CJK}]")
_CJK_CHAR = _HAS_CJK
_UNITS_CJK = re.compile(f"[{_CJK}]|[^\\s{_CJK}]+")
_GARBLED = re.compile(
    "[\ufffd\ue000-\uf8ff\U000f0000-\U0010ffff]|[\u00c2\u00c3][\u00a0-\u00bf]|\u00e2\u20ac"
    # the lead byte of a 3-byte UTF-8 sequence (CJK) read as Latin-1, then a continuation
    "|[\u00e0-\u00ef][\u00a0-\u00bf\u0152\u0153\u0160\u0161\u0178\u017d\u017e\u0192\u02c6\u02dc\u2013-\u203a\u20ac\u2122]"
)
_P64 = np.uint64(0x100000001B3)


class TextInfo:
    """Per-document analysis shared by the filters (computed lazily, once)."""

    __slots__ = (
        "text",
        "_units",
        "_ids",
        "_lengths",
        "cjk",
        "ascii",
        "_raw",
        "_cjk_units",
        "_code",
    )

    def __init__(self, text: str):
        self.text = text
        self.ascii = text.isascii()
        self.cjk = not self.ascii and _HAS_CJK.search(text) is not None
        self._units = None
        self._ids = None
        self._lengths = None
        self._raw = None
        self._cjk_units = None
        self._code = None

    @property
    def code(self) -> bool:
        """Whether the text looks like source code (see `_looks_like_code`)."""
        if self._code is None:
            self._code = _looks_like_code(self.text)
        return self._code

    @property
    def cjk_units(self) -> int:
        """How many units are CJK characters (0 for text without CJK)."""
        if self._cjk_units is None:
            self._cjk_units = _count_cjk(self.raw) if self.cjk else 0
        return self._cjk_units

    @property
    def raw(self) -> bytes:
        """The text as bytes: ASCII (one byte per character) when `ascii`, else UTF-32."""
        if self._raw is None:
            self._raw = self.text.encode("ascii" if self.ascii else "utf-32-le")
        return self._raw

    @property
    def units(self) -> list[str]:
        if self._units is None:
            self._units = _UNITS_CJK.findall(self.text) if self.cjk else self.text.split()
        return self._units

    @property
    def ids(self) -> np.ndarray:
        """Each unit as a 64-bit value (equal units get equal values), for n-gram statistics.

        Python's str hash is salted per process, but it is only compared within one
        document, so decisions do not depend on the salt.
        """
        if self._ids is None:
            self._ids, self._lengths = _unit_arrays(self.units)
        return self._ids

    @property
    def lengths(self) -> np.ndarray:
        self.ids  # noqa: B018 - fills _lengths
        return self._lengths


_CODE_LINE = re.compile(
    r"[:;{}()\[\]\\]\s*$|^\s*(?:#|//|/\*|\*|@)|\s(?:=|==|!=|->|=>|:=|\+=)\s", re.MULTILINE
)


def _looks_like_code(text: str) -> bool:
    """At least 5 lines, 40% or more of them code-shaped: ending in `: ; { } ( ) [ ] \\`,
    starting with a comment or decorator marker, or holding an assignment or comparison."""
    lines = text.count("\n") + 1 - text.count("\n\n")
    if lines < 5:
        return False
    return len(_CODE_LINE.findall(text)) >= 0.4 * lines


def _may_have_rules(text: str) -> bool:
    """Whether to look for rule tokens: a table bar, box drawing or a doubled rule
    character. Substring tests are C-fast; the token regex (a look-behind at every
    position) is not, and a lone `-` in prose is not worth it."""
    return any(c in text for c in _RULE_HINTS) or _BOX_DRAWING.search(text) is not None


_RULE_HINTS = (
    "|",
    "--",
    "==",
    "__",
    "**",
    "~~",
    "++",
    "..",
    "##",
    "::",
    "\u2014",
    "\u2013",
    "\u2015",
)
_BOX_DRAWING = re.compile("[\u2500-\u257f]")


# _CJK's ranges as [start, end) bounds: a code point is CJK when it falls after an odd
# number of bounds (numpy over UTF-32 is ~20x a regex findall on CJK text).
_CJK_BOUNDS = np.array(
    [b for lo, hi in re.findall("(.)-(.)", _CJK) for b in (ord(lo), ord(hi) + 1)], np.uint32
)


def _count_cjk(raw: bytes) -> int:
    """How many characters of a UTF-32-LE text are in `_CJK`."""
    codes = np.frombuffer(raw, np.uint32)
    return int(np.count_nonzero(np.searchsorted(_CJK_BOUNDS, codes, side="right") & 1))


def _unit_arrays(units: list[str]) -> tuple[np.ndarray, np.ndarray]:
    ids = np.fromiter(map(hash, units), np.int64, len(units)).view(np.uint64)
    return ids, np.fromiter(map(len, units), np.int64, len(units))


@dataclass
class Filter:
    name = "filter"

    def reasons(self) -> list[str]:
        return [self.name]

    def check(self, text: str, info: TextInfo) -> str | None:  # pragma: no cover
        raise NotImplementedError


# Characters that draw rules and table borders: ASCII ones and the Box Drawing block.
_RULE_CHARS = "-=_~*+.#|:<>\u2014\u2013\u2015\u2550" + "".join(map(chr, range(0x2500, 0x2580)))
_RULE_CODES = np.array([ord(c) for c in _RULE_CHARS], np.uint32)
_RULE_DELETE = {ord(c): None for c in _RULE_CHARS}
_RULE_TOKEN = re.compile("(?<!\\S)[" + re.escape(_RULE_CHARS) + "]+(?!\\S)")
_SPACE_CODES = np.array([9, 10, 11, 12, 13, 32, 0xA0, 0x3000], np.uint32)


# A command block: from a line starting with a shell or Python prompt to the next blank
# line, or a Markdown code fence.
_COMMAND_START = re.compile(r"^(?:[$%#] |>>> |```|[ \t]*[|\u2502\u251c\u250c\u2514])", re.MULTILINE)
_COMMAND_BLOCK = re.compile(
    r"(?:^|\n)(?:[$%#] |>>> ).*?(?=\n\n|\Z)|```.*?(?:```|\Z)"
    r"|(?:^|\n)[ \t]*[|\u2502\u251c\u250c\u2514][^\n]*",
    re.DOTALL,
)
