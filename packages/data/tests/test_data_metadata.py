"""Record ids and metadata through cleaning, and the BOS/EOS and per-document metadata
side files of `tokenize`, checked against the input records and megatron-core's reader."""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import sentencepiece as spm
from mindloom_data import clean, read_dataset_metadata, tokenize
from mindloom_data._cli import main
from mindloom_tokenizer import train_tokenizer

sys.path.insert(0, str(Path(__file__).parent))
from data_exec_util import make_corpus, make_doc  # noqa: E402


def _records(src: Path) -> dict[str, tuple[dict, str, int]]:
    """Every good input record by the id a reader must give it: its own `id`, else
    `file:line` (the spec), with its file and line."""
    out = {}
    for path in sorted(src.glob("*.jsonl")):
        for lineno, line in enumerate(path.read_text().splitlines(), 1):
            try:
                rec = json.loads(line)
            except ValueError:
                continue
            out[rec.get("id") or f"{path}:{lineno}"] = (rec, str(path), lineno)
    return out


def _datatrove_metadata(rec: dict) -> dict:
    # datatrove's reader adapter: metadata = record.pop("metadata", {}) | rest of the record
    rest = {k: v for k, v in rec.items() if k not in ("text", "id", "metadata")}
    return {**rec.get("metadata", {}), **rest}


@pytest.fixture(scope="module")
def cleaned(tmp_path_factory):
    root = tmp_path_factory.mktemp("meta")
    src = make_corpus(root / "in", files=3, docs=120, seed=3, with_ids=True)
    for w in (1, 2):
        clean(src, root / f"w{w}", workers=w, config={"output": {"jsonl": True}}, progress=False)
    return src, root


def _files(out: Path) -> dict[str, bytes]:
    return {
        str(p.relative_to(out)): p.read_bytes()
        for p in sorted(out.rglob("*"))
        if p.is_file() and ".work" not in p.parts and p.name not in ("report.json", "summary.txt")
    }


def test_clean_keeps_ids_and_metadata_with_1_and_2_workers(cleaned):
    src, root = cleaned
    one, two = _files(root / "w1"), _files(root / "w2")
    assert one == two  # byte-identical kept and removed outputs
    records = _records(src)
    rows = [
        r
        for p in sorted((root / "w1").glob("shard-*.parquet"))
        for r in pq.read_table(p).to_pylist()
    ]
    assert len(rows) > 200
    own = 0
    for r in rows:
        rec, path, line = records[r["id"]]
        own += "id" in rec
        assert (r["source"], r["line"]) == (path, line)  # provenance stays
        assert json.loads(r["metadata"]) == _datatrove_metadata(rec)
    assert 0 < own < len(rows)  # both kinds of record were kept
    # the JSON Lines output holds metadata as an object, as datatrove's writer does
    jl = [
        json.loads(x)
        for p in sorted((root / "w1").glob("shard-*.jsonl"))
        for x in p.read_text().splitlines()
    ]
    assert [(x["id"], x["metadata"]) for x in jl] == [
        (r["id"], json.loads(r["metadata"])) for r in rows
    ]


def test_removed_outputs_carry_ids_and_metadata(cleaned):
    src, root = cleaned
    records = _records(src)
    steps = set()
    for p in sorted((root / "w1" / "removed").rglob("*.jsonl")):
        for line in p.read_text().splitlines():
            r = json.loads(line)
            rec, path, lineno = records[r["id"]]
            assert (r["source"], r["line"]) == (path, lineno)
            assert r["metadata"] == _datatrove_metadata(rec)
            steps.add(p.parent.name)
    # filtered in the scan stage and deduplicated in the write stage
    assert {"length", "exact_dedup", "minhash_dedup"} <= steps


def test_custom_id_key_and_parquet_input(tmp_path):
    rng = random.Random(5)
    rows = [{"doc": f"k{i}", "text": make_doc(rng, 80), "lang": "en"} for i in range(4)]
    path = tmp_path / "in.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert main(["clean", str(path), "-o", str(tmp_path / "o"), "--id-key", "doc", "-q"]) == 0
    got = pq.read_table(tmp_path / "o" / "shard-00000.parquet").to_pylist()
    assert {r["id"]: json.loads(r["metadata"]) for r in got} == {
        f"k{i}": {"lang": "en"} for i in range(4)
    }
    # the cleaned shard read again: ids and metadata come back (source/line become metadata)
    clean(tmp_path / "o" / "shard-00000.parquet", tmp_path / "o2", progress=False)
    again = pq.read_table(tmp_path / "o2" / "shard-00000.parquet").to_pylist()
    assert [r["id"] for r in again] == [r["id"] for r in got]
    assert json.loads(again[0]["metadata"])["lang"] == "en"
    assert json.loads(again[0]["metadata"])["source"] == str(path)


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory, cleaned):
    out = tmp_path_factory.mktemp("tok")
    train_tokenizer([str(cleaned[0])], out, vocab_size=400, model_type="bpe")
    return out


@pytest.fixture(scope="module")
def mcore():
    import megatron.core.datasets.indexed_dataset as indexed  # required: the data env has it

    return indexed


@pytest.mark.parametrize("bos", [False, True])
@pytest.mark.parametrize("chunk_chars", [1 << 20, 40])
def test_tokenize_bos_and_docmeta_align_with_megatron(
    tmp_path, tok_dir, cleaned, mcore, bos, chunk_chars
):
    src, root = cleaned
    shards = sorted(str(p) for p in (root / "w1").glob("shard-*.parquet"))
    prefix = tmp_path / "ds"
    args = ["tokenize", "--tokenizer", str(tok_dir), "--input", *shards, "--output-prefix",
            str(prefix), "--metadata-fields", "url,lang,missing", "--chunk-chars", str(chunk_chars)]  # fmt: skip
    assert main(args + (["--bos"] if bos else [])) == 0
    sp = spm.SentencePieceProcessor(model_file=str(tok_dir / "tokenizer.model"))
    meta = read_dataset_metadata(prefix)
    assert (meta["append_bos"], meta["append_eos"]) == (bos, True)
    assert (meta["bos_id"], meta["eos_id"]) == (sp.bos_id(), sp.eos_id())
    theirs = mcore.IndexedDataset(str(prefix))
    side = [json.loads(x) for x in Path(f"{prefix}.docmeta.jsonl").read_text().splitlines()]
    assert len(side) == len(theirs) == meta["documents"]
    records = _records(src)
    for i in range(len(theirs)):
        ids = theirs[i].tolist()
        rec = records[side[i]["id"]][0]
        body = [sp.bos_id()] * bos + sp.encode(rec["text"]) + [sp.eos_id()]
        if chunk_chars > 1000:  # chunked encoding may differ from whole at a hard cut
            assert ids == body
        assert ids[0] == sp.bos_id() if bos else ids[0] != sp.bos_id()
        assert ids.count(sp.bos_id()) == bos and ids[-1] == sp.eos_id()
        md = _datatrove_metadata(rec)
        assert side[i] == {
            "id": side[i]["id"],
            "url": md["url"],
            "lang": md.get("lang"),
            "missing": None,
        }
    # the Megatron bytes do not depend on the side files
    plain = tmp_path / "plain"
    tokenize(shards, tok_dir, plain, append_bos=bos, chunk_chars=chunk_chars)
    assert Path(f"{plain}.bin").read_bytes() == Path(f"{prefix}.bin").read_bytes()
    assert Path(f"{plain}.idx").read_bytes() == Path(f"{prefix}.idx").read_bytes()
    assert not Path(f"{plain}.docmeta.jsonl").exists()


def test_ranked_tokenize_merges_side_files(tmp_path, tok_dir, cleaned):
    _, root = cleaned
    shards = sorted(str(p) for p in (root / "w1").glob("shard-*.parquet"))
    one = tmp_path / "one"
    tokenize(shards, tok_dir, one, append_bos=True, metadata_fields=["url"])
    args = ["tokenize", "--tokenizer", str(tok_dir), "--input", *shards, "--output-prefix",
            str(tmp_path / "ranked"), "--bos", "--metadata-fields", "url", "--tasks", "3"]  # fmt: skip
    assert main(args) == 0
    for ext in (".bin", ".idx", ".docmeta.jsonl"):
        assert Path(f"{tmp_path / 'ranked'}{ext}").read_bytes() == Path(f"{one}{ext}").read_bytes()
    assert read_dataset_metadata(tmp_path / "ranked")["append_bos"] is True


def test_bos_without_a_bos_id_is_one_line(tmp_path, capsys, cleaned):
    _, root = cleaned
    tok = tmp_path / "tok"
    train_tokenizer([str(cleaned[0])], tok, vocab_size=300, model_type="bpe", bos_id=-1)
    shard = str(next((root / "w1").glob("shard-*.parquet")))
    rc = main(
        [
            "tokenize",
            "--tokenizer",
            str(tok),
            "--input",
            shard,
            "--output-prefix",
            str(tmp_path / "x"),
            "--bos",
        ]
    )
    err = capsys.readouterr().err
    assert rc == 1 and "has no BOS id" in err and len(err.strip().splitlines()) == 1
