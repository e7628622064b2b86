"""Main-content extraction: HTML -> the article's text, without menus, footers and scripts.

Two extractors, chosen with `extract: {method: ...}`:

- `resiliparse` (default): Resiliparse's `extract_plain_text` with its main-content
  heuristics, formatting kept (headings, paragraphs and list items on lines of their own).
- `trafilatura`: trafilatura's `extract` (text output, tables and comments off).

Both give plain text with paragraphs separated by a blank line; the benchmark
(`benchmarks/web.py`) measures both on the same pages for speed and for how much of the
article body they recover and how much boilerplate they keep.
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
        return _tidy(text)


def _tidy(text: str) -> str:
    # One paragraph break (a blank line) between blocks and no trailing spaces, whichever
    # extractor ran; the paragraph dedup step splits on exactly this.
    lines = [ln.rstrip() for ln in text.strip().splitlines()]
    return _BLANKS.sub("\n\n", "\n".join(lines)).strip()
