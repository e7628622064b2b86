import json
import random

import numpy as np
import pyarrow.parquet as pq
import pytest
from datasketch import MinHash, MinHashLSH
from mindloom_data import CleanError, clean
from mindloom_data._cli import main
from mindloom_data._minhash import MinHasher, jaccard
from mindloom_data._pipeline import DEFAULTS, load_config

PROBES = DEFAULTS["dedup"]["minhash"]["probe_bands"]
MINHASH_ONLY = {
    "normalize": False,
    "filters": {
        k: False
        for k in ("length", "repeated_chars", "garbled", "symbols", "repetition", "boilerplate")
    },
    "dedup": {"exact": False, "paragraph": False},
}


def _vocab(rng, n=4000):
    letters = "abcdefghijklmnopqrstuvwxyz"
    return ["".join(rng.choice(letters) for _ in range(rng.randint(2, 9))) for _ in range(n)]


def _doc(rng, vocab, n):
    words = [rng.choice(vocab) for _ in range(n)]
    return " ".join(words).capitalize() + "."


def _near(rng, vocab, text, changes):
    w = text.split()
    for _ in range(changes):
        w[rng.randrange(len(w))] = rng.choice(vocab)
    return " ".join(w)


def test_signatures_equal_datasketch_minhash_on_the_same_shingles():
    m = MinHasher(num_perm=112, seed=7)
    texts = [
        "The quick brown fox jumps over the lazy dog, again and again and again.",
        "two words",
        "长江是中国最长的河流，全长约六千三百公里。 It flows east.",
        " ".join(f"w{i}" for i in range(20_000)),  # spans several matrix chunks
    ]
    for sh, sig in zip(m.shingle_hashes(texts), m.signatures(texts)):
        ref = MinHash(num_perm=112, seed=7, hashfunc=int)
        ref.update_batch([int(x) for x in sh])
        assert np.array_equal(ref.hashvalues, sig)
    # Latin: word 5-grams, case-insensitive; CJK: character 5-grams ignoring spaces
    assert len(m.shingle_hashes([texts[0]])[0]) == len(texts[0].split()) - 4
    assert len(m.shingle_hashes(["两 个字"])[0]) == 1
    cjk = "".join(texts[2].lower().split())
    assert len(m.shingle_hashes([texts[2]])[0]) == len(cjk) - 4
    a, b = m.shingle_hashes(["One Two three four five six", "one two THREE four five six"])
    assert np.array_equal(a, b)


def test_minhash_agrees_with_datasketch_lsh_on_candidates():
    rng = random.Random(1)
    vocab = _vocab(rng)
    base = [_doc(rng, vocab, 120) for _ in range(60)]
    docs = base + [_near(rng, vocab, t, 1) for t in base[:20]]
    m = MinHasher()
    sigs = m.signatures(docs)
    lsh = MinHashLSH(num_perm=112, params=(14, 8))
    for i, s in enumerate(sigs):
        lsh.insert(str(i), MinHash(num_perm=112, hashvalues=s, scheme="affine32"))
    bands = m.band_hashes(sigs)
    for i in range(len(docs)):
        ours = {j for j in range(len(docs)) if j != i and (bands[j] == bands[i]).any()}
        theirs = {
            int(k) for k in lsh.query(MinHash(num_perm=112, hashvalues=sigs[i], scheme="affine32"))
        } - {i}
        assert ours == theirs
    for i in range(20):
        assert (bands[60 + i] == bands[i]).any()


def _write(path, texts):
    with open(path, "w", encoding="utf-8") as f:
        for t in texts:
            f.write(json.dumps({"text": t}, ensure_ascii=False) + "\n")


def test_planted_near_duplicates_are_removed_precisely(tmp_path):
    rng = random.Random(2)
    vocab = _vocab(rng)
    originals = [_doc(rng, vocab, rng.randint(80, 160)) for _ in range(400)]
    planted = {}  # near-dup text -> original text
    docs = list(originals)
    for i in range(0, 400, 4):
        t = _near(rng, vocab, originals[i], 2)
        planted[t] = originals[i]
        docs.append(t)
    rng.shuffle(docs)
    half = len(docs) // 2
    _write(tmp_path / "a.jsonl", docs[:half])
    _write(tmp_path / "b.jsonl", docs[half:])
    report = clean(
        tmp_path / "*.jsonl", tmp_path / "out", config={"filters": {"length": {"min_units": 10}}}
    )
    kept = [
        t
        for f in sorted((tmp_path / "out").glob("shard-*.parquet"))
        for t in pq.read_table(f).column("text").to_pylist()
    ]
    removed = [
        json.loads(line)
        for f in sorted((tmp_path / "out/removed/minhash_dedup").glob("*.jsonl"))
        for line in f.read_text().splitlines()
    ]
    by_id = {}
    for name in ("a", "b"):
        for i, line in enumerate((tmp_path / f"{name}.jsonl").read_text().splitlines(), 1):
            by_id[f"{tmp_path / name}.jsonl:{i}"] = json.loads(line)["text"]
    # LSH at 14x8 catches a pair at Jaccard ~0.77 with p ~0.85, at 0.9 with p ~1.0; so a
    # few of the hardest planted pairs may survive, but nothing that is not planted goes
    assert 95 <= len(removed) <= 100 and len(kept) == 500 - len(removed)
    for r in removed:
        other = by_id[r["duplicate_of"]]
        pair = {r["text"], other}
        assert any(planted.get(x) in pair for x in pair)
        shingles = [set(zip(*[t.lower().split()[k:] for k in range(5)])) for t in pair]
        assert jaccard(*shingles) > 0.6
        # keep-first: the kept document is the earlier one in input order
        assert (r["duplicate_of"].split(":")[0], int(r["duplicate_of"].split(":")[1])) < (
            r["source"],
            r["line"],
        )
    assert report["steps"]["minhash_dedup"]["removed"] == {"near_duplicate": len(removed)}
    assert report["clusters"]["count"] == len(removed)


def test_exact_and_paragraph_dedup_across_the_corpus(tmp_path):
    rng = random.Random(3)
    vocab = _vocab(rng)
    boiler = "Subscribe to our newsletter for the latest updates and offers today."
    docs = []
    for _ in range(30):
        docs.append(_doc(rng, vocab, 60) + "\n\n" + boiler + "\n\n" + _doc(rng, vocab, 40))
    docs.append(docs[5])  # exact duplicate
    docs.append(boiler)  # only a duplicate paragraph: removed entirely
    _write(tmp_path / "in.jsonl", docs)
    # the planted paragraph is a newsletter line, which the boilerplate filter would remove
    # whole; this test is about paragraph dedup
    cfg = {
        "filters": {"length": {"min_units": 1}, "boilerplate": False},
        "dedup": {"minhash": False},
    }
    report = clean(tmp_path / "in.jsonl", tmp_path / "out", config=cfg)
    rows = pq.read_table(tmp_path / "out/shard-00000.parquet").to_pylist()
    texts = [r["text"] for r in rows]
    assert len(texts) == 30
    assert texts[0].count(boiler) == 1 and all(boiler not in t for t in texts[1:])
    assert all(t.count("\n\n") == 1 for t in texts[1:])  # the other paragraph breaks stay
    assert [r["line"] for r in rows] == list(range(1, 31))
    steps = report["steps"]
    assert steps["exact_dedup"]["removed"] == {"exact_duplicate": 1}
    assert steps["paragraph_dedup"]["removed"] == {
        "all_paragraphs_duplicate": 1,
        "duplicate_paragraphs": 29,
    }
    ex = (tmp_path / "out/removed/exact_dedup/shard-00000.jsonl").read_text().splitlines()
    assert json.loads(ex[0])["duplicate_of"] == f"{tmp_path / 'in.jsonl'}:6"


def test_chinese_near_duplicates_use_character_ngrams(tmp_path):
    rng = random.Random(4)
    chars = [chr(c) for c in range(0x4E00, 0x4E00 + 3000)]
    docs = ["".join(rng.choice(chars) for _ in range(200)) + "。" for _ in range(50)]
    near = list(docs[0])
    near[100] = "变"
    docs.append("".join(near))
    _write(tmp_path / "zh.jsonl", docs)
    report = clean(tmp_path / "zh.jsonl", tmp_path / "out")
    assert report["steps"]["minhash_dedup"]["removed"] == {"near_duplicate": 1}
    assert report["output"]["documents"] == 50


def test_pairs_near_the_threshold_are_decided_by_their_exact_jaccard(tmp_path):
    rng = random.Random(5)
    vocab = _vocab(rng, 20_000)
    originals = [_doc(rng, vocab, 100) for _ in range(240)]
    # 2-4 changed words in 100 move Jaccard across 0.7 (about 0.81, 0.73, 0.66), where a
    # 112-permutation estimate (standard error ~0.04) often lands on the wrong side
    copies = [_near(rng, vocab, t, 2 + i % 3) for i, t in enumerate(originals)]
    _write(tmp_path / "in.jsonl", originals + copies)
    m = MinHasher(probe_bands=PROBES)  # the bands of the default config
    sh = [np.unique(x) for x in m.shingle_hashes(originals + copies)]
    bands = m.band_hashes(m.signatures(originals + copies))
    n = len(originals)
    exact = [
        len(np.intersect1d(sh[i], sh[n + i])) / len(np.union1d(sh[i], sh[n + i])) for i in range(n)
    ]
    candidate = [bool((bands[i] == bands[n + i]).any()) for i in range(n)]
    assert sum(c and 0.66 < j < 0.76 for c, j in zip(candidate, exact)) >= 20  # near the line

    def removed_copies(verify):
        out = tmp_path / f"out-{verify}"
        report = clean(
            tmp_path / "in.jsonl",
            out,
            config={
                "normalize": False,
                "filters": {
                    k: False
                    for k in (
                        "length",
                        "repeated_chars",
                        "garbled",
                        "symbols",
                        "repetition",
                        "boilerplate",
                    )
                },
                "dedup": {"exact": False, "paragraph": False, "minhash": {"verify": verify}},
            },
        )
        lines = {
            json.loads(x)["line"]
            for f in (out / "removed/minhash_dedup").glob("*.jsonl")
            for x in f.read_text().splitlines()
        }
        assert all(line > n for line in lines)  # keep-first: only copies go
        return [n + 1 + i in lines for i in range(n)], report

    got, report = removed_copies(True)
    want = [c and j >= 0.7 for c, j in zip(candidate, exact)]
    assert got == want
    assert report["clusters"]["similar_pairs"] == sum(want)
    checks = [
        json.loads(f.read_text()) for f in (tmp_path / "out-True/.work/done/lsh").glob("*.json")
    ]
    assert 0 < sum(c["exact_checks"] for c in checks) <= sum(c["candidate_checks"] for c in checks)
    # the estimate alone gets some of them wrong, both ways
    est_only, _ = removed_copies(False)
    assert any(w and not e for w, e in zip(want, est_only))
    assert any(e and not w for w, e in zip(want, est_only))


def test_probe_bands_regroup_the_signature_and_never_copy_a_primary_band():
    m = MinHasher(probe_bands=30)
    assert m.groups.shape == (44, 8)
    assert np.array_equal(m.groups[:14].ravel(), np.arange(112))  # datasketch's bands first
    primary_of = m.groups[:14].ravel() // 8
    for g in m.groups[14:]:
        assert len(set(g.tolist())) == 8
        assert len(set(primary_of[g].tolist())) == 8  # one row from each of 8 primary bands
    assert len({frozenset(g.tolist()) for g in m.groups}) == 44
    # fixed by the seed: the same grouping in every process, another for another seed
    assert np.array_equal(MinHasher(probe_bands=30).groups, m.groups)
    assert not np.array_equal(MinHasher(probe_bands=30, seed=2).groups, m.groups)
    # probes only add columns: the primary band hashes are unchanged
    sigs = m.signatures(["a b c d e f g h", "one two three four five six"])
    assert np.array_equal(m.band_hashes(sigs)[:, :14], MinHasher().band_hashes(sigs))
    # with fewer bands than rows a probe band still mixes primary bands
    few = MinHasher(num_perm=112, bands=4, rows=16, probe_bands=8)
    for g in few.groups[4:]:
        assert np.bincount(g // 16, minlength=4).max() <= 4


def test_probe_bands_find_pairs_no_primary_band_holds_and_verify_them(tmp_path):
    rng = random.Random(6)
    vocab = _vocab(rng, 20_000)
    originals = [_doc(rng, vocab, 100) for _ in range(240)]
    # Jaccard about 0.81, 0.73, 0.66: around the threshold, where 14 bands of 8 miss often
    copies = [_near(rng, vocab, t, 2 + i % 3) for i, t in enumerate(originals)]
    n = len(originals)
    # two files so that two workers have two scan ranks; copy i is line i + 1 of b.jsonl
    _write(tmp_path / "a.jsonl", originals)
    _write(tmp_path / "b.jsonl", copies)
    m = MinHasher(probe_bands=PROBES)
    sh = [np.unique(x) for x in m.shingle_hashes(originals + copies)]
    bands = m.band_hashes(m.signatures(originals + copies))
    exact = [
        len(np.intersect1d(sh[i], sh[n + i])) / len(np.union1d(sh[i], sh[n + i])) for i in range(n)
    ]
    primary = [bool((bands[i, :14] == bands[n + i, :14]).any()) for i in range(n)]
    probe = [bool((bands[i, 14:] == bands[n + i, 14:]).any()) for i in range(n)]
    probe_only = [pr and not p for p, pr in zip(primary, probe)]
    # what the test is about exists in this corpus: true pairs only a probe band finds,
    # and pairs below the threshold that collide in a probe band (and in no primary one)
    assert sum(po and j >= 0.7 for po, j in zip(probe_only, exact)) >= 10
    assert sum(po and j < 0.7 for po, j in zip(probe_only, exact)) >= 3

    def run(name, probe_bands, workers=1):
        cfg = {**MINHASH_ONLY, "dedup": {**MINHASH_ONLY["dedup"], "minhash": {}}}
        cfg["dedup"]["minhash"]["probe_bands"] = probe_bands
        out = tmp_path / name
        clean(tmp_path / "*.jsonl", out, config=cfg, workers=workers)
        rem = {p.name: p.read_text() for p in sorted(out.glob("removed/minhash_dedup/*.jsonl"))}
        shards = {p.name: p.read_bytes() for p in sorted(out.glob("shard-*.parquet"))}
        recs = [json.loads(x) for text in rem.values() for x in text.splitlines()]
        assert all(r["source"].endswith("b.jsonl") for r in recs)  # keep-first
        assert all(r["duplicate_of"] == f"{tmp_path / 'a.jsonl'}:{r['line']}" for r in recs)
        return [i + 1 in {r["line"] for r in recs} for i in range(n)], (shards, rem)

    on, out_on = run("on", PROBES)
    off, _ = run("off", 0)
    assert off == [p and j >= 0.7 for p, j in zip(primary, exact)]
    assert on == [(p or pr) and j >= 0.7 for p, pr, j in zip(primary, probe, exact)]
    assert any(o and not f for o, f in zip(on, off))  # found only with probes on
    # a probe collision below the threshold is checked like any candidate: not removed
    assert not any(o for o, po, j in zip(on, probe_only, exact) if po and j < 0.7)
    # the result does not depend on the number of processes
    on2, out_on2 = run("on2", PROBES, workers=2)
    assert on2 == on and out_on2 == out_on


def test_probe_bands_validation_is_one_line_naming_the_key(tmp_path, capsys):
    for bad in (-1, "14", True, 1.5, 5000):
        with pytest.raises(CleanError, match=r"^dedup\.minhash\.probe_bands .*") as e:
            load_config({"dedup": {"minhash": {"probe_bands": bad}}})
        assert "\n" not in str(e.value)
    with pytest.raises(CleanError, match="probe_bands needs minhash.bands >= 2"):
        load_config({"dedup": {"minhash": {"bands": 1, "rows": 8}}})
    assert load_config({"dedup": {"minhash": {"bands": 1, "rows": 8, "probe_bands": 0}}})
    _write(tmp_path / "in.jsonl", ["some text here"])
    cfg = tmp_path / "c.yaml"
    cfg.write_text("dedup:\n  minhash: {probe_bands: -3}\n")
    code = main(["clean", str(tmp_path / "in.jsonl"), "-o", str(tmp_path / "o"), "-c", str(cfg)])
    err = capsys.readouterr().err
    assert code == 1 and err.count("\n") == 1
    assert err.startswith("error: dedup.minhash.probe_bands must be an integer from 0 to 1024")
    assert not (tmp_path / "o" / "report.json").exists()
