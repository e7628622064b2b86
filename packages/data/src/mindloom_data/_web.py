"""The web front end of `clean`: WARC and HTML input, and the steps that turn pages into text.

Readers (chosen by file name, like every other input):

- `.warc`, `.warc.gz`: FastWARC; one document per `response` record with an HTML payload
  (`text/html`, `application/xhtml+xml`) and a 2xx status. `line` is the record's byte
  offset in the file (in the compressed file for `.warc.gz`, where each record is its own
  gzip member), so `id` = `file:offset` points straight at the record. The URL, the WARC
  date and the record id go into the document's metadata. A record whose payload is
  shorter than its Content-Length is counted as `truncated_record`; bytes FastWARC cannot
  parse are counted as `corrupt_record` (at the offset where reading resumed after the
  last good record) and reading resumes at the next record start; other HTTP responses
  are counted as `non_html_record`. None of these stop the run.
- `.html`, `.htm`: the whole file is one document (`line` 1).
- JSON Lines with HTML in a field: `html_key: FIELD` (or `--html-key FIELD`) reads that
  field as the document and turns extraction on.

Steps, in order, before normalization and the filters (each is a step of the report with
its counts and examples, and writes what it removes under `removed/<step>/`):

1. `url_filter`: documents whose URL matches a block list (file of domains and URL
   patterns) are removed as `blocked_domain` / `blocked_pattern`.
2. `extract`: HTML -> main text (`_extract`); nothing left -> `extract_empty`.
3. `repair`: ftfy fixes mojibake (`repaired` counts documents it changed), so the
   garbled-text filter later sees the fixed text and keeps it.
4. `language`: lingua (`_langid`); `language` and `language_score` go into the metadata;
   with a keep-list, documents whose kept languages score below the threshold are removed
   as `language_<code>`.

Everything here depends only on the document, never on the rank or worker, so the output
stays the same for any number of workers and executors.
"""

from __future__ import annotations

import fnmatch
import functools
import json
import os
import re
from dataclasses import replace
from urllib.parse import urlsplit

import pyarrow as pa

from mindloom_data._normalize import MissingExtraError
from mindloom_data._readers import Document
from mindloom_data._web_read import iter_web_file

__all__ = ["WEB_DEFAULTS", "WEB_SUFFIXES", "WebSteps", "check_web_config", "iter_web_file"]

WEB_SUFFIXES = (".warc.gz", ".warc", ".html", ".htm")
EXTRA = "web"

WEB_DEFAULTS: dict = {
    "html_key": None,
    # "auto": on when the input is HTML (WARC, .html, or html_key), off otherwise
    "extract": {"enabled": "auto", "method": "resiliparse", "include_tables": False},
    "repair": {"enabled": "auto"},
    "language": {
        "enabled": False,
        "languages": [],  # keep-list of ISO 639-1 codes; empty: label only
        "threshold": 0.5,
        "accuracy": "low",
        "max_chars": 2000,
        "max_words": 32,  # of the non-CJK part, what lingua sees (its cost grows with it)
        # the languages lingua weighs (plus the keep-list): "web" (the web's most common,
        # _langid.WEB_LANGUAGES), "all" (every one lingua has) or a list of codes
        "candidates": "web",
        "split_output": False,  # OUT/<language>/shard-NNNNN.parquet
    },
    "url_filter": {"enabled": True, "block_list": None},
}


def _require(module: str):
    try:
        return __import__(module)
    except ImportError:
        raise MissingExtraError(
            f"{module} is missing: the web steps need the extra, pip install 'mindloom-data[{EXTRA}]'"
        ) from None


def is_web_input(path: str) -> bool:
    return path.endswith(WEB_SUFFIXES)


def _enabled(value, html: bool) -> bool:
    return html if value == "auto" else bool(value)


def check_web_config(cfg: dict, files: list[str] | None = None) -> None:
    """Refuse a bad web config with one line (ValueError); check the extra is installed
    when a web step will run. Makes the block list's path absolute (ranks may run elsewhere)."""
    ex, rep, lang, uf = cfg["extract"], cfg["repair"], cfg["language"], cfg["url_filter"]
    for name, value in (("extract", ex["enabled"]), ("repair", rep["enabled"])):
        if value not in ("auto", True, False):
            raise ValueError(f"{name}.enabled must be true, false or auto, got {value!r}")
    from mindloom_data._extract import EXTRACTORS

    if ex["method"] not in EXTRACTORS:
        raise ValueError(
            f"extract.method must be one of {', '.join(EXTRACTORS)}, got {ex['method']!r}"
        )
    if cfg["html_key"] is not None and not isinstance(cfg["html_key"], str):
        raise ValueError("html_key must be a string")
    langs = lang["languages"]
    if not isinstance(langs, list) or not all(isinstance(x, str) and x for x in langs):
        raise ValueError("language.languages must be a list of ISO 639-1 codes, e.g. [zh, en]")
    if not isinstance(lang["threshold"], (int, float)) or not 0 <= lang["threshold"] <= 1:
        raise ValueError("language.threshold must be a number from 0 to 1")
    for key in ("max_chars", "max_words"):
        if not isinstance(lang[key], int) or isinstance(lang[key], bool) or lang[key] < 1:
            raise ValueError(f"language.{key} must be a positive integer, got {lang[key]!r}")
    if lang["accuracy"] not in ("low", "high"):
        raise ValueError(f"language.accuracy must be low or high, got {lang['accuracy']!r}")
    cands = lang["candidates"]
    if cands not in ("web", "all") and not (
        isinstance(cands, list) and cands and all(isinstance(x, str) and x for x in cands)
    ):
        raise ValueError(
            f"language.candidates must be web, all or a list of ISO 639-1 codes, got {cands!r}"
        )
    if lang["split_output"] and not lang["enabled"]:
        raise ValueError("language.split_output needs language.enabled: true")
    if uf["block_list"] is not None:
        path = os.path.abspath(os.fspath(uf["block_list"]))
        if not os.path.isfile(path):
            raise ValueError(f"url_filter.block_list: no such file {uf['block_list']}")
        uf["block_list"] = path
    if files is None:
        return
    html = cfg["html_key"] is not None or any(is_web_input(f) for f in files)
    if any(is_web_input(f) for f in files):
        _require("fastwarc")
        _require("resiliparse")
    if _enabled(ex["enabled"], html):
        _require("resiliparse" if ex["method"] == "resiliparse" else "trafilatura")
    if _enabled(rep["enabled"], html):
        _require("ftfy")
    if lang["enabled"]:
        _require("lingua")
        if isinstance(cands, list):
            from mindloom_data._langid import candidate_languages

            candidate_languages(cands, langs)  # a code lingua does not know: one line


# --- readers ------------------------------------------------------------------------


class UrlBlockList:
    """Domains (a line `example.com` blocks it and its subdomains) and URL patterns (a line
    with `/` or `*`: shell-style, matched against the whole URL, case-insensitive).
    `#` starts a comment."""

    def __init__(self, path: str):
        self.domains: set[str] = set()
        patterns = []
        with open(path, encoding="utf-8") as f:
            for raw in f:
                line = raw.split("#", 1)[0].strip().lower()
                if not line:
                    continue
                if "/" in line or "*" in line or "?" in line:
                    patterns.append(fnmatch.translate(line))
                else:
                    self.domains.add(line.lstrip("."))
        self._pattern = re.compile("|".join(patterns)) if patterns else None

    def check(self, url: str | None) -> str | None:
        if not url:
            return None
        try:
            host = (urlsplit(url).hostname or "").rstrip(".")
        except ValueError:
            host = ""
        parts = host.split(".")
        if any(".".join(parts[i:]) in self.domains for i in range(len(parts))):
            return "blocked_domain"
        if self._pattern is not None and self._pattern.match(url.lower()):
            return "blocked_pattern"
        return None


class WebSteps:
    """The web steps of one scan rank; `process(doc)` returns the document to go on with
    (text rewritten, metadata added) or None when a step removed it."""

    def __init__(self, cfg: dict, path: str):
        html = cfg["html_key"] is not None or is_web_input(path)
        self.block = None
        if cfg["url_filter"]["enabled"] and cfg["url_filter"]["block_list"]:
            self.block = UrlBlockList(cfg["url_filter"]["block_list"])
        self.extract = None
        if _enabled(cfg["extract"]["enabled"], html):
            from mindloom_data._extract import Extractor

            ex = cfg["extract"]
            self.extract = Extractor(ex["method"], include_tables=ex["include_tables"])
        self.fix = None
        if _enabled(cfg["repair"]["enabled"], html):
            ftfy = _require("ftfy")
            # Encoding repairs only: ftfy's defaults also fold full-width punctuation
            # (Chinese ，。：) to ASCII, uncurl quotes and NFC the text, which is not its job
            # here (the normalize step decides about width and forms).
            config = ftfy.TextFixerConfig(
                unescape_html=False,
                remove_terminal_escapes=False,
                uncurl_quotes=False,
                fix_latin_ligatures=False,
                fix_character_width=False,
                fix_line_breaks=False,
                remove_control_chars=False,
                normalization=None,
            )
            self.fix = functools.partial(
                repair_text, functools.partial(ftfy.fix_text, config=config)
            )
        self.lang = None
        lcfg = cfg["language"]
        if lcfg["enabled"]:
            from mindloom_data._langid import LanguageIdentifier

            self.keep = list(lcfg["languages"])
            self.lang = LanguageIdentifier(
                lcfg["accuracy"],
                lcfg["max_chars"],
                lcfg["max_words"],
                lcfg["candidates"],
                self.keep,
            )
            self.threshold = float(lcfg["threshold"])
        self.names = [
            name
            for name, on in (
                ("url_filter", self.block),
                ("extract", self.extract),
                ("repair", self.fix),
                ("language", self.lang),
            )
            if on is not None
        ]
        self.active = bool(self.names)

    def process(self, doc: Document, steps: dict, removed: dict) -> Document | None:
        text, meta = doc.text, dict(doc.metadata or {})
        nbytes = _nbytes(text)
        if self.block is not None:
            st = steps["url_filter"]
            st.docs_in += 1
            st.bytes_in += nbytes
            reason = self.block.check(meta.get("url"))
            if reason is not None:
                st.drop(reason, doc.id, text)
                removed["url_filter"].add(doc.id, doc.source, doc.line, reason, text, meta)
                return None
            st.docs_out += 1
            st.bytes_out += nbytes
        if self.extract is not None:
            st = steps["extract"]
            st.docs_in += 1
            st.bytes_in += nbytes
            try:
                out = self.extract(text)
            except Exception as exc:  # a parser giving up on one page must not stop the run
                out = ""
                meta["extract_error"] = (
                    str(exc).splitlines()[0][:200] if str(exc) else type(exc).__name__
                )
            if not out.strip():
                st.drop("extract_empty", doc.id, text)
                removed["extract"].add(doc.id, doc.source, doc.line, "extract_empty", text, meta)
                return None
            text, nbytes = out, _nbytes(out)
            st.docs_out += 1
            st.bytes_out += nbytes
        if self.fix is not None:
            st = steps["repair"]
            st.docs_in += 1
            st.bytes_in += nbytes
            fixed = self.fix(text)
            if fixed != text:
                st.drop("repaired", doc.id, text)  # counted, not removed: the doc goes on
                text, nbytes = fixed, _nbytes(fixed)
            st.docs_out += 1
            st.bytes_out += nbytes
        if self.lang is not None:
            st = steps["language"]
            st.docs_in += 1
            st.bytes_in += nbytes
            res = self.lang.identify(text)
            meta["language"] = res.language
            meta["language_score"] = res.score
            if len(res.scores) > 1:
                meta["language_scores"] = res.scores
            if self.keep and res.kept_score(self.keep) < self.threshold:
                reason = f"language_{res.language}"
                st.drop(reason, doc.id, text)
                removed["language"].add(doc.id, doc.source, doc.line, reason, text, meta)
                return None
            st.docs_out += 1
            st.bytes_out += nbytes
        return replace(doc, text=text, metadata=meta)


# ftfy (with the encoding fixes only, as configured above) changes a text only where its
# mojibake heuristic `ftfy.badness.BADNESS_RE` matches, or at C1 controls and surrogates;
# every branch of that regex needs one of these characters (the tests derive the set from
# ftfy's own regex), so a text without any (ASCII, CJK, full-width punctuation: most
# English and Chinese pages) skips ftfy's line-by-line pass, about 1 ms a page.
MOJIBAKE_CHARS = re.compile("[\x80-\u25ff\ud800-\udfff\uf8ff\ufb01\ufb02\ufffd]")


def repair_text(fix, text: str) -> str:
    return fix(text) if MOJIBAKE_CHARS.search(text) else text


def _nbytes(text: str) -> int:
    return len(text) if text.isascii() else len(text.encode("utf-8"))


# --- output -------------------------------------------------------------------------


def has_metadata(cfg: dict, files: list[str]) -> bool:
    """Whether this run's shards carry a `metadata` column (JSON): web runs do."""
    return (
        cfg["html_key"] is not None
        or cfg["language"]["enabled"]
        or any(is_web_input(f) for f in files)
    )


def metadata_fields(cfg: dict, files: list[str]) -> list[tuple[str, pa.DataType]]:
    # every cleaned shard now carries a `metadata` column (the records' own fields and
    # the web steps' URL, date and language): nothing to add for web runs
    return []


def metadata_value(doc: Document) -> str:
    return json.dumps(doc.metadata or {}, ensure_ascii=False, sort_keys=True)


class LanguageRouter:
    """Kept documents of one task into OUT/<language>/shard-NNNNN.parquet (and .jsonl)."""

    def __init__(self, out, task: int, schema: pa.Schema, jsonl: bool):
        self.out, self.task, self.schema, self.jsonl = out, task, schema, jsonl
        self._writers: dict[str, tuple] = {}

    def _writer(self, lang: str):
        from mindloom_data._writers import JsonlWriter, ParquetShardWriter

        if lang not in self._writers:
            shard = self.out / _safe_lang(lang) / f"shard-{self.task:05d}.parquet"
            self._writers[lang] = (
                ParquetShardWriter(shard, schema=self.schema),
                JsonlWriter(shard.with_suffix(".jsonl")) if self.jsonl else None,
            )
        return self._writers[lang]

    def write_table(self, table: pa.Table) -> None:
        if not table.num_rows:
            return
        langs = [
            json.loads(m).get("language", "unknown") for m in table.column("metadata").to_pylist()
        ]
        for lang in sorted(set(langs)):
            mask = pa.array([x == lang for x in langs])
            part = table.filter(mask)
            pw, jw = self._writer(lang)
            pw.write_table(part)
            if jw is not None:
                for rec in part.to_pylist():
                    jw.write(rec)

    def close(self) -> None:
        for pw, jw in self._writers.values():
            pw.close()
            if jw is not None:
                jw.close()


def _safe_lang(lang: str) -> str:
    return lang if re.fullmatch(r"[a-z]{2,3}", lang) else "unknown"
