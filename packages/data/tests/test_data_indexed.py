"""The indexed dataset: exact byte layout, validation on open (reliability test 21), merge."""

from __future__ import annotations

import os
import struct
import subprocess
import sys

import numpy as np
import pytest
from mindloom_data import IndexedDataset, IndexedDatasetBuilder, IndexedDatasetError
from mindloom_data._cli import main
from mindloom_data._indexed import merge_datasets, optimal_dtype

DOCS = [[5, 6, 7, 2], [9, 2], [1, 1, 1, 1, 1, 2], [3, 2]]


def write(prefix, docs=DOCS, dtype=np.uint16):
    with IndexedDatasetBuilder(prefix, dtype=dtype) as b:
        for d in docs:
            b.add_document(np.asarray(d))
    return str(prefix)


def test_byte_layout_matches_the_megatron_spec(tmp_path):
    prefix = write(tmp_path / "d")
    idx = open(prefix + ".idx", "rb").read()
    n = len(DOCS)
    assert len(idx) == 42 + 20 * n  # formats.md: document-level size
    assert idx[:9] == b"MMIDIDX\x00\x00"
    assert struct.unpack("<QBQQ", idx[9:34]) == (1, 8, n, n + 1)
    lengths = np.frombuffer(idx, np.int32, n, 34)
    pointers = np.frombuffer(idx, np.int64, n, 34 + 4 * n)
    docs = np.frombuffer(idx, np.int64, n + 1, 34 + 12 * n)
    assert lengths.tolist() == [4, 2, 6, 2]
    assert pointers.tolist() == [0, 8, 12, 24]
    assert docs.tolist() == [0, 1, 2, 3, 4]
    flat = [t for d in DOCS for t in d]
    assert open(prefix + ".bin", "rb").read() == np.asarray(flat, "<u2").tobytes()
    assert not any(p.name.endswith(".partial") for p in tmp_path.iterdir())


def test_reader_returns_documents_and_int32_dtype(tmp_path):
    prefix = write(tmp_path / "d", dtype=np.int32)
    ds = IndexedDataset(prefix, vocab_size=10)
    assert ds.dtype == np.int32 and len(ds) == 4 and ds.num_documents == 4
    assert [ds[i].tolist() for i in range(4)] == DOCS
    assert ds[-1].tolist() == DOCS[-1]
    assert ds.get(2, 1, 3).tolist() == [1, 1, 1]
    assert ds.num_tokens == sum(map(len, DOCS))
    with pytest.raises(IndexError):
        ds[4]


def test_raw_writes_with_lengths_in_bulk_equal_add_document(tmp_path):
    ref = write(tmp_path / "ref")
    with IndexedDatasetBuilder(tmp_path / "raw", dtype=np.uint16) as b:
        b.write_raw(np.asarray(DOCS[0], "<u2").tobytes())
        b.add_document_length(len(DOCS[0]))
        rest = DOCS[1:]
        b.write_raw(np.asarray([t for d in rest for t in d], "<u2").tobytes())
        b.add_document_lengths(np.array([len(d) for d in rest], dtype=np.int64))
    for ext in (".bin", ".idx"):
        assert open(ref + ext, "rb").read() == open(str(tmp_path / "raw") + ext, "rb").read()


def test_optimal_dtype_threshold():
    assert optimal_dtype(65499) is np.uint16
    assert optimal_dtype(65500) is np.int32


def test_multi_sequence_and_empty_documents(tmp_path):
    with IndexedDatasetBuilder(tmp_path / "m", dtype=np.uint16) as b:
        b.add_document(np.asarray([1, 2, 3, 4]), lengths=[1, 3])
        b.add_document(np.asarray([], dtype=np.int64), lengths=[])  # Megatron keeps the boundary
        b.add_document(np.asarray([7]))
    ds = IndexedDataset(tmp_path / "m")
    assert ds.document_indices.tolist() == [0, 2, 2, 3]
    assert ds.document(0).tolist() == [1, 2, 3, 4]
    assert ds.document(1).tolist() == []
    assert ds.document(2).tolist() == [7]


def _corrupt(prefix, offset, data):
    with open(prefix, "r+b") as f:
        f.seek(offset)
        f.write(data)


CASES = {
    "bin truncated by 1 byte": ("bin", "truncate", "expected 28 bytes, got 27"),
    "bad magic": ("idx", (0, b"XXXXXXX\x00\x00"), "bad magic"),
    "wrong version": ("idx", (9, struct.pack("<Q", 2)), "expected 1, got 2"),
    "unknown dtype code": ("idx", (17, bytes([9])), "unknown dtype code"),
    "sequence_count != document_indices[-1]": (
        "idx",
        (34 + 12 * 4 + 8 * 4, struct.pack("<q", 3)),
        "sequence_count != document_indices[-1]: expected 4, got 3",
    ),
    "pointer past the end of .bin": (
        "idx",
        (34 + 16 + 8 * 3, struct.pack("<q", 40)),
        "ends past the end of",
    ),
    "pointers out of order": (
        "idx",
        (34 + 16 + 8 * 2, struct.pack("<q", 4)),
        "pointers out of order at sequence 2",
    ),
    "idx truncated": ("idx", "truncate", "does not match its header"),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_validation_refuses_with_one_line(tmp_path, case):
    which, how, expect = CASES[case]
    prefix = write(tmp_path / "d")
    path = f"{prefix}.{which}"
    if how == "truncate":
        os.truncate(path, os.path.getsize(path) - 1)
    else:
        _corrupt(path, *how)
    with pytest.raises(IndexedDatasetError) as err:
        IndexedDataset(prefix)
    msg = str(err.value)
    assert "\n" not in msg and expect in msg
    assert msg.startswith(prefix)  # names the file


def test_validation_pair_from_different_runs(tmp_path):
    a = write(tmp_path / "a")
    write(tmp_path / "b", docs=[[1, 2, 3]])
    os.replace(tmp_path / "b.bin", tmp_path / "a.bin")
    with pytest.raises(IndexedDatasetError, match=r"a\.bin: size does not match a\.idx"):
        IndexedDataset(a)


def test_validation_token_id_out_of_vocab(tmp_path):
    prefix = write(tmp_path / "d")
    IndexedDataset(prefix, vocab_size=10)
    with pytest.raises(IndexedDatasetError, match=r"token id out of range .* < 8, got 9"):
        IndexedDataset(prefix, vocab_size=8)


def test_validation_missing_file(tmp_path):
    prefix = write(tmp_path / "d")
    os.unlink(prefix + ".idx")
    with pytest.raises(IndexedDatasetError, match=r"d\.idx: file not found"):
        IndexedDataset(prefix)


def test_validation_runs_under_python_O(tmp_path):
    prefix = write(tmp_path / "d")
    os.truncate(prefix + ".bin", 27)
    code = (
        "import sys\n"
        "from mindloom_data import IndexedDataset, IndexedDatasetError\n"
        "try:\n    IndexedDataset(sys.argv[1])\nexcept IndexedDatasetError as e:\n"
        "    print('REFUSED', e)\n"
    )
    out = subprocess.run(
        [sys.executable, "-O", "-c", code, prefix], capture_output=True, text=True, check=True
    )
    assert "REFUSED" in out.stdout and "expected 28 bytes, got 27" in out.stdout


def test_inspect_cli_refuses_corrupt_pair_with_one_line(tmp_path, capsys):
    prefix = write(tmp_path / "d")
    assert main(["inspect", prefix]) == 0
    out = capsys.readouterr().out
    assert "documents 4" in out and "tokens 14" in out and "uint16" in out
    os.truncate(prefix + ".bin", 27)
    assert main(["inspect", prefix]) == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "\n" not in err and "got 27" in err


def test_builder_abort_leaves_no_final_files(tmp_path):
    prefix = tmp_path / "x"
    with pytest.raises(RuntimeError):
        with IndexedDatasetBuilder(prefix, dtype=np.uint16) as b:
            b.add_document(np.asarray([1, 2]))
            raise RuntimeError("boom")
    assert list(tmp_path.iterdir()) == []


def test_rewrite_never_pairs_a_stale_idx(tmp_path):
    prefix = write(tmp_path / "d")
    b = IndexedDatasetBuilder(prefix, dtype=np.uint16)
    b.add_document(np.asarray([4, 4, 4]))
    # before finalize the old complete pair is untouched
    assert IndexedDataset(prefix).num_tokens == 14
    b.finalize()
    assert IndexedDataset(prefix)[0].tolist() == [4, 4, 4]


def test_merge_is_exact_concatenation(tmp_path):
    a = write(tmp_path / "a")
    b = write(tmp_path / "b", docs=[[8, 8], [7, 2]])
    merged = merge_datasets([a, b], tmp_path / "ab")
    assert [merged[i].tolist() for i in range(len(merged))] == DOCS + [[8, 8], [7, 2]]
    whole = write(tmp_path / "whole", docs=DOCS + [[8, 8], [7, 2]])
    for ext in (".bin", ".idx"):
        assert open(whole + ext, "rb").read() == open(str(tmp_path / "ab") + ext, "rb").read()
    assert main(["merge", a, b, "--output-prefix", str(tmp_path / "cli")]) == 0
    assert open(str(tmp_path / "cli.idx"), "rb").read() == open(whole + ".idx", "rb").read()


def test_merge_refuses_mixed_dtypes(tmp_path):
    a = write(tmp_path / "a")
    b = write(tmp_path / "b", dtype=np.int32)
    with pytest.raises(IndexedDatasetError, match="dtype: expected uint16, got int32"):
        merge_datasets([a, b], tmp_path / "ab")
