"""Quality filters on the labeled evaluation set: ours (defaults and each filter alone) and
datatrove's Gopher quality, Gopher repetition and FineWeb quality filters with their
defaults, on the same documents in the same run.

    ./dev bench benchmarks/filters.py [--set FILE] [--errors]

Every document is first normalized with mindloom's default Normalizer, as `clean` does,
and each system sees the same normalized text. "Drop" is the positive class: precision is
the share of dropped documents labeled drop, recall the share of labeled-drop documents
dropped; "good kept" and "bad removed" are the same figures from each label's side.

datatrove's English word tokenizer is NLTK's, whose data needs a download; here it is
replaced by a regex that splits words and punctuation the way NLTK's word tokenizer does
(`\\w+` runs and single punctuation marks), so a CJK run without spaces is one word, as
it is for NLTK.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections import defaultdict
from pathlib import Path

from mindloom_data import Normalizer, TextInfo, build_filters

LANGS = ("zh", "mixed", "en", "code")
DEFAULT_SET = Path(__file__).parent.parent / "packages/data/tests/data/filter_eval.jsonl"


def load(path: Path) -> list[dict]:
    docs = [json.loads(x) for x in path.read_text(encoding="utf-8").split("\n") if x]
    norm = Normalizer()
    for d in docs:
        d["norm"] = norm(d["text"])
    return docs


def ours(filters):
    def decide(text):
        info = TextInfo(text)
        for f in filters:
            r = f.check(text, info)
            if r:
                return r
        return None

    return decide


def datatrove_systems() -> dict:
    try:
        from datatrove.data import Document
        from datatrove.pipeline.filters import (
            FineWebQualityFilter,
            GopherQualityFilter,
            GopherRepetitionFilter,
        )
        from datatrove.utils import word_tokenizers
        from datatrove.utils.typeshelper import Languages
    except ImportError as exc:
        print(f"datatrove not importable ({exc}); run with ./dev bench", file=sys.stderr)
        return {}

    class _Words:
        _re = re.compile(r"\w+|[^\w\s]")

        def word_tokenize(self, text):
            return self._re.findall(text)

    word_tokenizers.WORD_TOKENIZER_CACHE[Languages.english] = _Words()
    made = {
        "datatrove GopherQuality": [GopherQualityFilter()],
        "datatrove GopherRepetition": [GopherRepetitionFilter()],
        "datatrove FineWebQuality": [FineWebQualityFilter()],
    }
    made["datatrove all three"] = [f for fs in made.values() for f in fs]

    def wrap(fs):
        def decide(text):
            for f in fs:
                doc = Document(text=text, id="x")
                r = f.filter(doc)
                ok, why = (r, f.name) if isinstance(r, bool) else r
                if not ok:
                    return why or f.name
            return None

        return decide

    return {name: wrap(fs) for name, fs in made.items()}


def speed(docs, repeat=4):
    """MB of text per CPU-second (best of 3): mindloom's normalize + default filters, and
    datatrove's three filters on the normalized text, over the set `repeat` times."""
    import time

    texts = [d["text"] for d in docs] * repeat
    mb = sum(len(t.encode()) for t in texts) / 1e6
    norm, mine = Normalizer(), ours(build_filters({}))
    runs = {"mindloom normalize + defaults": lambda t: mine(norm(t))}
    dt = datatrove_systems().get("datatrove all three")
    if dt:
        normalized = {t: norm(t) for t in set(texts)}
        runs["datatrove all three (filters only)"] = lambda t: dt(normalized[t])
    for name, fn in runs.items():
        best = float("inf")
        for _ in range(3):
            c = time.process_time()
            for t in texts:
                fn(t)
            best = min(best, time.process_time() - c)
        print(f"{name}: {mb / best:.2f} MB per CPU-second ({mb:.1f} MB)")
    print()


def score(docs, decide):
    """Per language (and 'all'): counts of good kept, bad removed, and the reasons."""
    by = defaultdict(lambda: {"good": 0, "bad": 0, "tp": 0, "fp": 0, "errors": []})
    for d in docs:
        reason = decide(d["norm"])
        for lang in (d["lang"], "all"):
            s = by[lang]
            if d["label"] == "keep":
                s["good"] += 1
                if reason:
                    s["fp"] += 1
                    if lang != "all":
                        s["errors"].append((d["id"], f"dropped ({reason})", d["reason"]))
            else:
                s["bad"] += 1
                if reason:
                    s["tp"] += 1
                elif lang != "all":
                    s["errors"].append((d["id"], "kept", d["reason"]))
    return by


def _pct(a, b):
    return f"{100 * a / b:.1f}" if b else "-"


def _cell(s):
    return f"{_pct(s['good'] - s['fp'], s['good'])} / {_pct(s['tp'], s['bad'])}"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--set", default=str(DEFAULT_SET), help="labeled JSON Lines file")
    p.add_argument("--errors", action="store_true", help="list every misjudged document")
    p.add_argument("--speed", action="store_true", help="also time normalize + filters")
    args = p.parse_args(argv)
    docs = load(Path(args.set))
    if args.speed:
        speed(docs)

    systems = {"mindloom defaults": ours(build_filters({}))}
    for f in build_filters({}):
        systems[f"mindloom {f.name} alone"] = ours([f])
    systems.update(datatrove_systems())
    results = {name: score(docs, fn) for name, fn in systems.items()}

    counts = results["mindloom defaults"]
    print(
        f"{len(docs)} documents; per language good/bad: "
        + ", ".join(f"{lang} {counts[lang]['good']}/{counts[lang]['bad']}" for lang in LANGS)
    )
    print()
    print("good kept % / bad removed %, and precision / recall of 'drop' over all documents")
    print()
    print("| filters | " + " | ".join(LANGS) + " | precision | recall |")
    print("|---" * (len(LANGS) + 3) + "|")
    for name, by in results.items():
        a = by["all"]
        prec = _pct(a["tp"], a["tp"] + a["fp"])
        print(
            f"| {name} | "
            + " | ".join(_cell(by[lang]) for lang in LANGS)
            + f" | {prec} | {_pct(a['tp'], a['bad'])} |"
        )
    print()
    print("precision / recall of 'drop' per language")
    print()
    print("| filters | " + " | ".join(LANGS) + " |")
    print("|---" * (len(LANGS) + 1) + "|")
    for name, by in results.items():
        cells = [
            f"{_pct(by[lang]['tp'], by[lang]['tp'] + by[lang]['fp'])} / {_pct(by[lang]['tp'], by[lang]['bad'])}"
            for lang in LANGS
        ]
        print(f"| {name} | " + " | ".join(cells) + " |")
    if args.errors:
        print()
        for lang in LANGS:
            for e in results["mindloom defaults"][lang]["errors"]:
                print("mindloom defaults:", *e)
    return 0


if __name__ == "__main__":
    sys.exit(main())
