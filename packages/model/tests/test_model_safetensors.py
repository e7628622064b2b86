"""mindloom's one safetensors codec against the `safetensors` package's own reader and
writer: every dtype both ways, bf16 rounding against torch, and every cut or defect of a
file refused with one line naming the file and the byte offset."""

import json
import struct

import numpy as np
import pytest
import torch
from mindloom_model import (
    SafetensorsError,
    encode_safetensors,
    read_safetensors,
    read_safetensors_header,
    write_safetensors,
)
from safetensors.numpy import load_file, save_file
from safetensors.torch import load_file as torch_load_file
from safetensors.torch import save_file as torch_save_file

RNG = np.random.default_rng(0)
ARRAYS = {
    "f64": RNG.standard_normal((2, 3)),
    "f32": RNG.standard_normal((4, 5)).astype(np.float32),
    "f16": RNG.standard_normal(7).astype(np.float16),
    "i64": RNG.integers(-(2**40), 2**40, (3,)),
    "i32": RNG.integers(-(2**30), 2**30, (2, 2)).astype(np.int32),
    "i16": np.array([-300, 7], np.int16),
    "i8": np.array([-5, 3, 127], np.int8),
    "u8": np.array([0, 255], np.uint8),
    "bool": np.array([True, False, True]),
    "scalar": np.array(3.5, np.float32),
    "empty": np.zeros((0, 4), np.float32),
}


def test_our_file_reads_in_the_reference_library_with_metadata(tmp_path):
    path = tmp_path / "ours.safetensors"
    big_endian = {"be": np.arange(4, dtype=">f4")}
    write_safetensors(path, {**ARRAYS, **big_endian}, metadata={"format": "np", "n": 1})
    loaded = load_file(path)
    assert sorted(loaded) == sorted([*ARRAYS, "be"])
    for name, want in {**ARRAYS, **big_endian}.items():
        assert loaded[name].dtype == want.dtype.newbyteorder("=")
        np.testing.assert_array_equal(loaded[name], want)
    with open(path, "rb") as f:
        from safetensors import safe_open

        with safe_open(f.name, "np") as st:
            assert st.metadata() == {"format": "np", "n": "1"}
    assert not list(tmp_path.glob("*.tmp"))


def test_reference_file_reads_here_dtype_for_dtype(tmp_path):
    path = tmp_path / "ref.safetensors"
    save_file(ARRAYS, str(path), metadata={"format": "np"})
    got = read_safetensors(path)
    assert sorted(got) == sorted(ARRAYS)
    for name, want in ARRAYS.items():
        assert got[name].dtype == want.dtype and got[name].shape == want.shape
        np.testing.assert_array_equal(got[name], want)
    assert list(read_safetensors(path, ["i8"])) == ["i8"]


def test_bf16_both_ways_agree_with_torch(tmp_path):
    # ties and carries included: round-to-nearest-even must match torch's conversion
    x = np.concatenate(
        [
            RNG.standard_normal(4000).astype(np.float32) * 100,
            np.array([1 + 2**-8, 1 + 3 * 2**-8, -(1 + 2**-8), 65504.0, 0.0, -0.0], np.float32),
        ]
    )
    ref = torch.from_numpy(x).to(torch.bfloat16)
    write_safetensors(tmp_path / "ours.safetensors", {"x": x}, dtype="bfloat16")
    theirs = torch_load_file(str(tmp_path / "ours.safetensors"))["x"]
    assert theirs.dtype == torch.bfloat16
    assert torch.equal(theirs.view(torch.int16), ref.view(torch.int16))
    torch_save_file({"x": ref, "h": ref.half()}, str(tmp_path / "ref.safetensors"))
    got = read_safetensors(tmp_path / "ref.safetensors")
    assert got["x"].dtype == np.float32  # NumPy has no bf16: exact in fp32
    np.testing.assert_array_equal(got["x"], ref.float().numpy())
    np.testing.assert_array_equal(got["h"], ref.half().numpy())


def _one_line(path, needle):
    with pytest.raises(SafetensorsError) as e:
        read_safetensors(path)
    msg = str(e.value)
    assert "\n" not in msg and str(path) in msg, msg
    assert needle in msg, msg
    return msg


def test_every_cut_of_a_file_is_refused_like_the_reference_does(tmp_path):
    data = encode_safetensors({"a": np.arange(6, dtype=np.float32), "b": np.ones(3, np.int16)})
    (n,) = struct.unpack("<Q", data[:8])
    path = tmp_path / "cut.safetensors"
    for cut in range(len(data)):
        path.write_bytes(data[:cut])
        with pytest.raises(Exception):  # noqa: B017, PT011  (the reference's own error types)
            load_file(path)
        if cut < 8:
            _one_line(path, f"{path}: not a safetensors file ({cut} bytes")
        elif cut < 8 + n:
            _one_line(path, f"header length {n} at byte 0 exceeds the file ({cut} bytes)")
        else:
            _one_line(path, f"truncated at byte {cut}")


def _file(path, header, data_len):
    hb = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(hb)) + hb + b"\0" * data_len)
    return 8 + len(hb)


@pytest.mark.parametrize(
    "case",
    ["overlap", "gap", "trailing", "size", "dtype", "shape", "json", "entry"],
)
def test_defects_are_refused_naming_the_byte(tmp_path, case):
    path = tmp_path / f"{case}.safetensors"
    f32 = lambda b, e, n=2: {"dtype": "F32", "shape": [n], "data_offsets": [b, e]}  # noqa: E731
    if case == "json":
        path.write_bytes(struct.pack("<Q", 6) + b'{"a":x')
        msg = _one_line(path, "not valid JSON at byte 13")
    elif case == "overlap":
        start = _file(path, {"a": f32(0, 8), "b": f32(4, 12)}, 12)
        msg = _one_line(path, f"tensor 'b' overlaps or leaves a gap at byte {start + 4}")
    elif case == "gap":
        start = _file(path, {"a": f32(0, 8), "b": f32(12, 20)}, 20)
        msg = _one_line(path, f"tensor 'b' overlaps or leaves a gap at byte {start + 12}")
    elif case == "trailing":
        start = _file(path, {"a": f32(0, 8)}, 11)
        msg = _one_line(path, f"3 trailing bytes after the last tensor, from byte {start + 8}")
    elif case == "size":
        _file(path, {"a": f32(0, 12)}, 12)
        msg = _one_line(path, "tensor 'a' data_offsets [0, 12] do not fit shape [2] F32")
    elif case == "dtype":
        _file(path, {"a": {"dtype": "X9", "shape": [1], "data_offsets": [0, 8]}}, 8)
        msg = _one_line(path, "tensor 'a' has unsupported dtype 'X9'")
    elif case == "shape":
        _file(path, {"a": {"dtype": "F32", "shape": [-1, 2], "data_offsets": [0, 8]}}, 8)
        msg = _one_line(path, "tensor 'a' has a malformed shape [-1, 2]")
    else:
        _file(path, {"a": {"dtype": "F32", "shape": [2]}}, 8)
        msg = _one_line(path, "tensor 'a' has a malformed header entry")
    with pytest.raises(Exception):  # noqa: B017, PT011
        load_file(path)  # the reference refuses the same file
    with pytest.raises(SafetensorsError, match=msg.split(": ", 1)[1][:20]):
        read_safetensors_header(path)


def test_unsaveable_dtype_is_one_line_and_writes_nothing(tmp_path):
    path = tmp_path / "c.safetensors"
    with pytest.raises(SafetensorsError, match="tensor z: dtype complex64 cannot be saved"):
        write_safetensors(path, {"z": np.zeros(2, np.complex64)})
    assert list(tmp_path.iterdir()) == []
