"""The web front end of `clean`: WARC/HTML readers, extraction, language id, mojibake
repair and the URL block list, checked against pages and WARC files built here."""

import json
import sys
from pathlib import Path

import fastwarc  # noqa: F401  (the web extra; the data env installs it)
import pyarrow.parquet as pq
import pytest
import warcio
from mindloom_data import clean
from mindloom_data._readers import ReadStats, iter_file

sys.path.insert(0, str(Path(__file__).parent))
from web_util import (  # noqa: E402
    DE_BODY,
    EN_BODY,
    FOOTER,
    LABELED,
    MIXED_BODY,
    NAV,
    SCRIPT,
    SIDEBAR,
    ZH_BODY,
    http_response,
    page,
    warc_record,
    write_warc,
)

ARTICLES = [
    ("http://news.example.com/rivers", page("Rivers of the north", EN_BODY), EN_BODY),
    ("http://news.example.cn/rivers", page("北方的河流", ZH_BODY, "zh"), ZH_BODY),
    ("http://blog.example.org/pytorch", page("安装 PyTorch", MIXED_BODY, "zh"), MIXED_BODY),
    ("http://zeitung.example.de/fluesse", page("Flüsse", DE_BODY, "de"), DE_BODY),
]


def _records():
    """Good HTML responses, a request, an image and a 404: (records, index of each HTML one)."""
    recs, html_at = [], []
    for i, (url, html, _) in enumerate(ARTICLES):
        recs.append(warc_record(url, b"GET / HTTP/1.1\r\nHost: x\r\n\r\n", "request", n=10 + i))
        html_at.append(len(recs))
        recs.append(warc_record(url, http_response(html.encode()), n=i))
    recs.append(
        warc_record("http://x.example.com/a.png", http_response(b"\x89PNG..", "image/png"), n=20)
    )
    recs.append(
        warc_record(
            "http://x.example.com/gone", http_response(b"<p>no</p>", status="404 Not Found"), n=21
        )
    )
    return recs, html_at


@pytest.mark.parametrize("gz", [False, True])
def test_warc_reader_one_document_per_html_response(tmp_path, gz):
    recs, html_at = _records()
    path = tmp_path / ("a.warc.gz" if gz else "a.warc")
    offsets = write_warc(path, recs, gz)
    stats = ReadStats()
    docs = list(iter_file(str(path), stats=stats))
    assert [d.line for d in docs] == [offsets[i] for i in html_at]
    assert [d.id for d in docs] == [f"{path}:{offsets[i]}" for i in html_at]
    assert [d.metadata["url"] for d in docs] == [a[0] for a in ARTICLES]
    assert [d.text for d in docs] == [a[1] for a in ARTICLES]
    assert docs[1].metadata["date"] == "2024-03-02T10:00:00Z"
    assert docs[1].metadata["record_id"] == "<urn:uuid:00000000-0000-0000-0000-000000000002>"
    assert stats.documents == 4 and dict(stats.counts) == {"non_html_record": 2}
    assert stats.bad_records == 0
    # the second reader agrees on which records are HTML responses
    with open(path, "rb") as f:
        theirs = [
            r.rec_headers.get_header("WARC-Target-URI")
            for r in warcio.ArchiveIterator(f)
            if r.rec_type == "response"
            and r.http_headers.get_statuscode() == "200"
            and r.http_headers.get_header("Content-Type").startswith("text/html")
        ]
    assert theirs == [d.metadata["url"] for d in docs]


@pytest.mark.parametrize("gz", [False, True])
def test_warc_truncated_and_corrupt_records_are_counted_not_fatal(tmp_path, gz):
    recs, html_at = _records()
    # garbage between records, a record whose Content-Length is not a number, and the
    # file cut in the middle of the last HTML record
    recs.insert(3, b"this is not a WARC record at all\r\n\r\n")
    recs.insert(5, warc_record("http://bad.example.com/", http_response(b"<p>x</p>"), length="x7"))
    last = warc_record(
        "http://cut.example.com/", http_response(page("cut", EN_BODY).encode()), n=30
    )
    recs.append(last)
    path = tmp_path / ("b.warc.gz" if gz else "b.warc")
    offsets = write_warc(path, recs, gz)
    data = path.read_bytes()
    path.write_bytes(data[: offsets[-1] + (len(data) - offsets[-1]) // 2])
    stats = ReadStats()
    docs = list(iter_file(str(path), stats=stats))
    good = [a[0] for a in ARTICLES]
    assert [d.metadata["url"] for d in docs] == good
    assert stats.counts["truncated_record"] == 1
    assert stats.examples["truncated_record"] == [f"{path}:{offsets[-1]}"]
    assert stats.counts["corrupt_record"] >= 2
    assert stats.bad_records == stats.counts["truncated_record"] + stats.counts["corrupt_record"]


def test_html_files_and_directories(tmp_path):
    site = tmp_path / "site" / "a"
    site.mkdir(parents=True)
    (site / "one.html").write_text(ARTICLES[0][1])
    (site / "two.htm").write_bytes(ARTICLES[1][1].encode("gb18030").replace(b"utf-8", b"gb2312"))
    (site / "notes.md").write_text("ignored")
    out = tmp_path / "out"
    # (normalization off: NFKC would rewrite the Chinese punctuation compared below)
    clean(tmp_path / "site", out, config={"normalize": False}, progress=False)
    rows = pq.read_table(sorted(out.glob("shard-*.parquet"))[0]).to_pylist()
    rows += pq.read_table(sorted(out.glob("shard-*.parquet"))[1]).to_pylist()
    assert [r["id"] for r in rows] == [f"{site}/one.html:1", f"{site}/two.htm:1"]
    assert all(p in rows[0]["text"] for p in EN_BODY)
    assert all(p in rows[1]["text"] for p in ZH_BODY)  # decoded from its declared charset


@pytest.mark.parametrize("method", ["resiliparse", "trafilatura"])
def test_extract_keeps_the_article_and_drops_the_boilerplate(method):
    from mindloom_data._extract import Extractor

    text = Extractor(method)(ARTICLES[0][1])
    assert "Rivers of the north" in text
    for p in EN_BODY:
        assert p in text
    for junk in [*NAV, FOOTER, SIDEBAR, SCRIPT, "color:red"]:
        assert junk not in text, junk
    # paragraphs stay paragraphs
    assert text.index(EN_BODY[0]) < text.index(EN_BODY[1]) < text.index(EN_BODY[2])
    assert "<p>" not in text and "<" not in text


def test_extract_keeps_headings_and_lists_as_plain_text():
    from mindloom_data._extract import Extractor

    html = page("Rivers of the north", EN_BODY).replace(
        "</article>",
        "<h2>What changed</h2><p>Three things stand out in the records of the basin.</p>"
        "<ul><li>The thaw starts earlier</li><li>Peak flow is higher</li>"
        "<li>Dry summers are longer</li></ul></article>",
    )
    text = Extractor("trafilatura")(html)
    blocks = text.split("\n\n")
    assert blocks[0] == "Rivers of the north" and "What changed" in blocks
    assert "- The thaw starts earlier\n- Peak flow is higher\n- Dry summers are longer" in blocks


def _clean_warc(tmp_path, cfg, name="out", workers=1, **kw):
    recs, _ = _records()
    src = tmp_path / "in.warc.gz"
    if not src.exists():
        write_warc(src, recs, gz=True)
    out = tmp_path / name
    cfg = {"normalize": False, **cfg}  # bodies are compared as written
    report = clean(src, out, config=cfg, workers=workers, progress=False, **kw)
    rows = []
    for p in sorted(out.rglob("shard-*.parquet")):
        rows.extend(pq.read_table(p).to_pylist())
    return report, rows, out


def test_language_keep_list_keeps_chinese_english_and_mixed(tmp_path):
    cfg = {"language": {"enabled": True, "languages": ["zh", "en"], "threshold": 0.5}}
    report, rows, out = _clean_warc(tmp_path, cfg)
    meta = {json.loads(r["metadata"])["url"]: json.loads(r["metadata"]) for r in rows}
    assert sorted(meta) == sorted(a[0] for a in ARTICLES[:3])
    assert meta[ARTICLES[0][0]]["language"] == "en"
    assert meta[ARTICLES[1][0]]["language"] == "zh"
    mixed = meta[ARTICLES[2][0]]
    assert mixed["language"] in ("zh", "en")
    assert set(mixed["language_scores"]) >= {"zh", "en"}
    assert mixed["language_scores"]["zh"] + mixed["language_scores"]["en"] >= 0.9
    lang = report["steps"]["language"]
    assert lang["removed"] == {"language_de": 1}
    assert lang["examples"]["language_de"][0]["text"].startswith("Flüsse")
    gone = [json.loads(x) for x in (out / "removed" / "language").rglob("*.jsonl")
            for x in x.read_text().splitlines()]  # fmt: skip
    assert [g["metadata"]["url"] for g in gone] == [ARTICLES[3][0]] and gone[0]["metadata"][
        "language"
    ] == "de"
    # every page's extracted body made it through, and no menu
    by_url = {json.loads(r["metadata"])["url"]: r["text"] for r in rows}
    for url, _, body in ARTICLES[:3]:
        assert all(p in by_url[url] for p in body) and NAV[1] not in by_url[url]


def test_language_split_output(tmp_path):
    cfg = {"language": {"enabled": True, "split_output": True}, "filters": {"length": False}}
    _, rows, out = _clean_warc(tmp_path, cfg)
    folders = sorted(p.parent.name for p in out.rglob("shard-*.parquet"))
    assert "de" in folders and "zh" in folders
    for p in out.rglob("shard-*.parquet"):
        for r in pq.read_table(p).to_pylist():
            assert json.loads(r["metadata"])["language"] == p.parent.name


def test_mojibake_is_repaired_not_removed(tmp_path):
    good = [
        "Le café où nous étions hier soir était très agréable, et la crème brûlée était "
        "parfaite; le garçon a même apporté une deuxième tarte à la fin du dîner.",
        "北方的河流每年春天都会带来高山上的融雪，这些洪水在数千年里塑造了下游宽阔的河谷。",
    ]
    broken = [t.encode("utf-8").decode("cp1252", errors="replace") for t in good[:1]]
    broken.append(good[1].encode("utf-8").decode("latin-1"))
    assert all(b != g for b, g in zip(broken, good))
    src = tmp_path / "in.jsonl"
    src.write_text("".join(json.dumps({"text": t}) + "\n" for t in broken))
    cfg = {"filters": {"length": {"min_units": 5}}, "dedup": {"minhash": False}, "normalize": False}
    plain = clean(src, tmp_path / "plain", config=cfg, progress=False)
    assert plain["steps"]["garbled"]["removed"].get("garbled", 0) >= 1  # the failure it fixes
    report = clean(src, tmp_path / "fixed", config={**cfg, "repair": True}, progress=False)
    assert report["steps"]["repair"]["removed"] == {"repaired": 2}
    rows = pq.read_table(tmp_path / "fixed" / "shard-00000.parquet").to_pylist()
    assert [r["text"] for r in rows] == [g.strip() for g in good]


@pytest.mark.parametrize(("max_words", "candidates"), [(32, "web"), (10**6, "web"), (32, "all")])
def test_language_id_on_the_labeled_set(max_words, candidates):
    # lingua sees only the first `max_words` non-CJK words and weighs the web's common
    # languages by default: the labels must depend on neither
    from mindloom_data._langid import LanguageIdentifier

    lid = LanguageIdentifier(max_words=max_words, candidates=candidates)
    for label, text in LABELED:
        res = lid.identify(text)
        if label == "zh+en":
            assert res.language in ("zh", "en") and res.kept_score(["zh", "en"]) >= 0.9, res
        else:
            assert res.language == label, (label, res)


def test_repair_skips_only_text_ftfy_cannot_change():
    # The shortcut is sound only if every branch of ftfy's mojibake regex needs a character
    # of MOJIBAKE_CHARS: derive that from ftfy's own regex (a newer ftfy may add characters).
    import re._parser as sre

    from ftfy.badness import BADNESS_RE
    from mindloom_data._web import MOJIBAKE_CHARS, WEB_DEFAULTS, WebSteps

    def non_ascii_set(item):
        op, av = item
        if op is sre.LITERAL:
            return [av] if av >= 0x80 else None
        if op is sre.IN and all(o in (sre.LITERAL, sre.RANGE) for o, _ in av):
            codes = []
            for o, a in av:
                lo, hi = (a, a) if o is sre.LITERAL else a
                if lo < 0x80:
                    return None
                codes.extend(range(lo, hi + 1))
            return codes
        return None

    ((op, (_, branches)),) = sre.parse(BADNESS_RE.pattern, BADNESS_RE.flags)
    assert op is sre.BRANCH and len(branches) > 20
    for branch in branches:
        needed = [c for c in map(non_ascii_set, branch) if c is not None]
        assert needed, f"a branch of BADNESS_RE matches ASCII-only text: {branch}"
        assert all(MOJIBAKE_CHARS.match(chr(c)) for c in needed[0]), branch
    fix = WebSteps({**WEB_DEFAULTS, "repair": {"enabled": True}}, "x.jsonl").fix
    broken = "Le cafÃ© oÃ¹ nous Ã©tions hier soir Ã©tait trÃ¨s agrÃ©able."
    assert MOJIBAKE_CHARS.search(broken) and fix(broken).startswith("Le café où")
    unguarded = fix.args[0]  # ftfy.fix_text with the step's config
    samples = [text for _, text in LABELED] + [broken, ZH_BODY[0].encode().decode("latin-1")]
    for text in samples:  # skipped or not, the text comes out as ftfy leaves it
        assert fix(text) == unguarded(text)
    assert sum(fix(t) != t for t in samples) == 2


def test_url_block_list(tmp_path):
    block = tmp_path / "block.txt"
    block.write_text("# ads and spam\nexample.de\n*://blog.example.org/py*\n")
    cfg = {"url_filter": {"block_list": str(block)}}
    report, rows, out = _clean_warc(tmp_path, cfg)
    urls = sorted(json.loads(r["metadata"])["url"] for r in rows)
    assert urls == sorted([ARTICLES[0][0], ARTICLES[1][0]])
    assert report["steps"]["url_filter"]["removed"] == {"blocked_domain": 1, "blocked_pattern": 1}
    assert report["steps"]["url_filter"]["docs_in"] == 4


def test_html_key_jsonl(tmp_path):
    src = tmp_path / "pages.jsonl"
    src.write_text("".join(json.dumps({"html": a[1], "url": a[0]}) + "\n" for a in ARTICLES[:2]))
    src2 = tmp_path / "empty.jsonl"
    src2.write_text(
        json.dumps({"html": "<html><body><script>var a=1;</script><img src=a.png></body></html>"})
        + "\n"
    )
    report = clean([src, src2], tmp_path / "out", config={"html_key": "html"}, progress=False)
    rows = pq.read_table(tmp_path / "out" / "shard-00000.parquet").to_pylist()
    assert [r["id"] for r in rows] == [f"{src}:1", f"{src}:2"]
    assert all(p in rows[0]["text"] for p in EN_BODY) and "<p>" not in rows[0]["text"]
    assert report["steps"]["extract"]["removed"] == {"extract_empty": 1}


def test_output_identical_for_one_and_two_workers(tmp_path):
    recs, _ = _records()
    src = tmp_path / "in"
    src.mkdir()
    for k in range(3):  # several files: several scan ranks; page 0 repeats (exact dedup)
        write_warc(src / f"p{k}.warc.gz", recs[k * 2 :] + recs[:2], gz=True)
    (src / "x.html").write_text(ARTICLES[1][1])
    cfg = {"language": {"enabled": True, "languages": ["zh", "en"]}}

    def result(name, workers):
        out = tmp_path / name
        report = clean(src, out, config=cfg, workers=workers, progress=False)
        files = {p.relative_to(out).as_posix(): p.read_bytes() for p in sorted(out.rglob("*"))
                 if p.is_file() and ".work" not in p.parts and p.name not in ("report.json", "summary.txt")}  # fmt: skip
        report.pop("seconds")
        return files, report

    one, two = result("one", 1), result("two", 2)
    assert one[0].keys() == two[0].keys() and one[0] == two[0]
    assert one[1] == two[1]
    assert one[1]["steps"]["exact_dedup"]["removed"]["exact_duplicate"] >= 2


def test_missing_extra_is_one_line(tmp_path, monkeypatch):
    from mindloom_data._normalize import MissingExtraError

    src = tmp_path / "a.jsonl"
    src.write_text(json.dumps({"text": "hello"}) + "\n")
    monkeypatch.setitem(sys.modules, "lingua", None)  # as if not installed
    with pytest.raises(MissingExtraError) as err:
        clean(src, tmp_path / "out", config={"language": True}, progress=False)
    assert "mindloom-data[web]" in str(err.value) and "\n" not in str(err.value)
