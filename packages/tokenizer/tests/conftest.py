"""Shared corpora for the tokenizer tests: small, deterministic, made here."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[3]
SHAKESPEARE = REPO_ROOT / "packages/data/src/mindloom_data/corpora/tinyshakespeare.txt"

WORDS = (
    "the of and to in is was that for it with as his on be at by had are but from not "
    "this have they which one you were her all she there would their we him been has when "
    "who will more no if out so said what up its about into than them can only other new "
    "some could time these two may then do first any my now such like our over man me even"
).split()
HANZI = "的一是不了人我在有他这中大来上国个到说们为子和你地出道也时年得就那要下以生会自之着去过家学对可她里后小么心多天而能好都然没日于起还发成事只作当想看文无开手十用主行方又如前所本见经头面公同三已老从动两长知民样现"


def make_lines(n: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    lines = []
    for i in range(n):
        kind = i % 5
        if kind == 3:
            lines.append("".join(rng.choice(HANZI) for _ in range(rng.randint(8, 30))) + "。")
        elif kind == 4:
            lines.append(f"In {rng.randint(1000, 2999)} there were {rng.randint(0, 99999)} items.")
        else:
            words = [rng.choice(WORDS) for _ in range(rng.randint(5, 20))]
            lines.append(" ".join(words).capitalize() + ".")
    return lines


@pytest.fixture(scope="session")
def corpus_dir(tmp_path_factory) -> Path:
    """A text file and a JSONL file of mixed English, Chinese and numbers."""
    d = tmp_path_factory.mktemp("corpus")
    lines = make_lines(3000)
    (d / "a.txt").write_text("\n".join(lines[:1500]) + "\n", encoding="utf-8")
    with open(d / "b.jsonl", "w", encoding="utf-8") as f:
        for i in range(1500, 3000, 3):
            f.write(json.dumps({"text": "\n".join(lines[i : i + 3])}, ensure_ascii=False) + "\n")
    return d


@pytest.fixture(scope="session")
def bpe_dir(corpus_dir, tmp_path_factory) -> Path:
    from mindloom_tokenizer import train_tokenizer

    out = tmp_path_factory.mktemp("tok") / "bpe"
    train_tokenizer(corpus_dir, out, 600, model_type="bpe")
    return out


@pytest.fixture(scope="session")
def unigram_dir(corpus_dir, tmp_path_factory) -> Path:
    from mindloom_tokenizer import train_tokenizer

    out = tmp_path_factory.mktemp("tok") / "unigram"
    train_tokenizer(corpus_dir, out, 600, model_type="unigram", num_threads=2)
    return out


@pytest.fixture(scope="session")
def shakespeare() -> Path:
    if not SHAKESPEARE.exists():
        pytest.skip("not inside the mindloom monorepo (bundled corpus missing)")
    return SHAKESPEARE
