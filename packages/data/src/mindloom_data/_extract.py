"""Main-content extraction: HTML -> the article's text, without menus, footers and scripts.

Two extractors, chosen with `extract: {method: ...}`:

- `resiliparse` (default): Resiliparse's `extract_plain_text` with its main-content
  heuristics, formatting kept. On the benchmark's pages (`benchmarks/web.py`, README) it
  recovers the whole article body, like trafilatura, at about eight times trafilatura's
  pages per CPU second; it keeps more boilerplate on pages without semantic tags (45% of
  the boilerplate characters against 14%) and drops short lists inside an article. With
  it the whole pipeline is faster per CPU second than datatrove's (README, measured).
- `trafilatura`: trafilatura's `extract` (text output, tables and comments off, its
  fallback extractors on): the cleaner text, for a corpus where CPU is cheaper than the
  boilerplate left in.

Both give plain text with headings and paragraphs as blocks separated by a blank line and
the items of a list as consecutive `- ` lines of one block.
"""

from __future__ import annotations

import re

__all__ = ["EXTRACTORS", "Extractor"]

EXTRACTORS = ("resiliparse", "trafilatura")
_BLANKS = re.compile(r"\n[ \t]*\n(?:[ \t]*\n)*")


class Extractor:
    def __init__(self, method: str = "resiliparse", include_tables: bool = False):
        if method not in EXTRACTORS:
            raise ValueError(
                f"extract.method must be one of {', '.join(EXTRACTORS)}, got {method!r}"
            )
        self.method = method
        self.include_tables = include_tables
        if method == "resiliparse":
            from resiliparse.extract.html2text import extract_plain_text
            from resiliparse.parse.html import HTMLTree

            self._parse = HTMLTree.parse
            self._extract = extract_plain_text
        else:
            import trafilatura

            self._trafilatura = trafilatura

    def __call__(self, html: str) -> str:
        """The main text of `html`, or "" when there is none."""
        if self.method == "resiliparse":
            text = self._extract(
                self._parse(html),
                preserve_formatting=True,
                main_content=True,
                list_bullets=True,
                alt_texts=False,
                links=False,
                form_fields=False,
                noscript=False,
                comments=False,
            )
        else:
            text = self._trafilatura.extract(
                html,
                output_format="txt",
                include_comments=False,
                include_tables=self.include_tables,
                include_images=False,
                include_links=False,
                deduplicate=False,
                with_metadata=False,
            )
        if not text:
            return ""
        if self.method == "trafilatura":
            text = _blocks(text)
        return _tidy(text)


def _blocks(text: str) -> str:
    # trafilatura puts each block on one line; make each a paragraph (the unit of the
    # paragraph dedup step), keeping the items of a list together.
    out: list[str] = []
    for line in text.splitlines():
        item = line.startswith("- ")
        if out and item and out[-1].startswith("- "):
            out[-1] += "\n" + line
        else:
            out.append(line)
    return "\n\n".join(out)


def _tidy(text: str) -> str:
    # One paragraph break (a blank line) between blocks and no trailing spaces, whichever
    # extractor ran; the paragraph dedup step splits on exactly this.
    lines = [ln.rstrip() for ln in text.strip().splitlines()]
    return _BLANKS.sub("\n\n", "\n".join(lines)).strip()
