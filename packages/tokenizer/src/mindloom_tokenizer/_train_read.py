"""Reading a tokenizer's training corpus: a seeded reservoir sample of sentences (bounded
memory whatever the corpus size; over-long sentences counted, not dropped silently), or
the character counts of a `char` model."""

from __future__ import annotations

import random
import time
from collections import Counter
from collections.abc import Callable

from mindloom_tokenizer._readers import ReadStats, iter_texts

PROGRESS_EVERY_S = 2.0


def empty_message(files: list[str], stats: ReadStats) -> str:
    bad = ", ".join(f"{k}={v}" for k, v in sorted(stats.bad.items()))
    shown = files[0] if len(files) == 1 else f"{len(files)} files"
    return f"empty corpus: no text found in {shown}" + (f" (bad records: {bad})" if bad else "")


class Progress:
    def __init__(self, say: Callable[[str], None], stats: ReadStats):
        self.say, self.stats = say, stats
        self.last = time.monotonic()

    def tick(self, sentences: int) -> None:
        now = time.monotonic()
        if now - self.last >= PROGRESS_EVERY_S:
            self.last = now
            self.say(f"  read {self.stats.bytes / 1e6:,.1f} MB, {sentences:,} sentences")


def sample_sentences(files, text_key, stats, k, max_bytes, seed, say):
    """Reservoir-sample `k` lines (Algorithm R, seeded); skip and count over-long lines."""
    rng = random.Random(seed)
    reservoir: list[str] = []
    seen = 0
    too_long = 0
    prog = Progress(say, stats)
    # A line under max_bytes // 4 characters cannot exceed max_bytes in UTF-8.
    safe_chars = max_bytes // 4
    for text in iter_texts(files, text_key=text_key, stats=stats):
        for line in text.split("\n"):
            if line.endswith("\r"):
                line = line[:-1]
            if not line or line.isspace():
                continue
            if len(line) > safe_chars and (
                len(line) > max_bytes or len(line.encode("utf-8", "surrogatepass")) > max_bytes
            ):
                too_long += 1
                continue
            seen += 1
            if len(reservoir) < k:
                reservoir.append(line)
            else:
                j = rng.randrange(seen)
                if j < k:
                    reservoir[j] = line
        prog.tick(seen)
    return reservoir, {
        "sentences_seen": seen,
        "sentences_sampled": len(reservoir),
        "skipped_too_long": too_long,
    }


def count_chars(files, text_key, stats, say):
    counts: Counter = Counter()
    total = 0
    prog = Progress(say, stats)
    for text in iter_texts(files, text_key=text_key, stats=stats):
        counts.update(text)
        total += len(text)
        prog.tick(stats.documents)
    return counts, total
