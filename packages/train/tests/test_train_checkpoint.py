"""Checkpoint files on disk: atomic layout, retention, corruption, security (no MindSpore)."""

from __future__ import annotations

import errno
import json
import os
import re
import stat
from pathlib import Path

import numpy as np
import pytest
from mindloom_train import _checkpoint as ck
from mindloom_train._faults import FaultInjector

SRC = Path(__file__).resolve().parents[1] / "src" / "mindloom_train"


def _shards(step: int) -> dict[str, dict[str, np.ndarray]]:
    rng = np.random.default_rng(step)
    return {
        ck.shard_name("model", 0, 1): {
            "embed.weight": rng.standard_normal((16, 8)).astype(np.float32),
            "norm.weight": np.ones(8, np.float32) * step,
        },
        ck.shard_name("optim", 0, 1): {"exp_avg.embed.weight": np.zeros((16, 8), np.float32)},
    }


def _save(save: Path, step: int, **kw) -> Path:
    return ck.save_checkpoint(save, step, _shards(step), {"consumed_samples": step * 4}, **kw)


def _resume(save: Path, **kw):
    logs: list[str] = []
    got = ck.find_resumable(save, logs.append, **kw)
    return got, logs


def test_layout_tracker_modes_and_roundtrip(tmp_path):
    save = tmp_path / "ckpt"
    path = _save(save, 5, verify_integrity=True)
    assert path.name == "step_00000005"
    names = sorted(p.name for p in path.iterdir())
    assert names == sorted([
        "model-0000000-0000001.safetensors", "optim-0000000-0000001.safetensors",
        "metadata.json", "common.json", "manifest.json",
    ])  # fmt: skip
    assert (save / "latest").read_text().strip() == "5"
    assert stat.S_IMODE(path.stat().st_mode) == 0o750
    assert stat.S_IMODE((path / "common.json").stat().st_mode) == 0o640
    meta = json.loads((path / "metadata.json").read_text())
    assert meta["tensors"]["embed.weight"]["global_shape"] == [16, 8]
    got, _ = _resume(save, verify_integrity=True)
    assert got.step == 5 and got.common["consumed_samples"] == 20
    tensors = got.load_tensors()
    np.testing.assert_array_equal(
        tensors["embed.weight"], _shards(5)["model-0000000-0000001.safetensors"]["embed.weight"]
    )
    # our writer is plain safetensors: the reference library reads it too
    from safetensors.numpy import load_file

    ref = load_file(str(path / "model-0000000-0000001.safetensors"))
    np.testing.assert_array_equal(ref["norm.weight"], tensors["norm.weight"])


def test_retention_keeps_newest_complete_and_ignores_incomplete(tmp_path):
    save = tmp_path / "ckpt"
    (save / ".tmp-step_00000099").mkdir(parents=True)  # an interrupted save
    for step in range(1, 8):
        _save(save, step, keep_last=3)
    assert ck.complete_steps(save) == [5, 6, 7]
    got, logs = _resume(save)
    assert got.step == 7
    assert any("incomplete" in line for line in logs)


def test_empty_save_path_means_fresh_start(tmp_path):
    got, _ = _resume(tmp_path / "nothing")
    assert got is None


@pytest.mark.parametrize("text", ["abc", "", "12 13", "-3"])
def test_bad_tracker_is_an_error(tmp_path, text):
    save = tmp_path / "ckpt"
    _save(save, 2)
    (save / "latest").write_text(text)
    with pytest.raises(ck.CheckpointError, match="latest"):
        _resume(save)


def test_tracker_naming_a_missing_step_is_an_error(tmp_path):
    save = tmp_path / "ckpt"
    _save(save, 2)
    (save / "latest").write_text("9\n")
    with pytest.raises(ck.CheckpointError, match="step 9"):
        _resume(save)


@pytest.mark.parametrize("damage", ["cut1", "half", "header"])
def test_corrupt_latest_shard_falls_back_to_previous(tmp_path, damage):
    save = tmp_path / "ckpt"
    _save(save, 2)
    _save(save, 4)
    shard = save / "step_00000004" / "model-0000000-0000001.safetensors"
    data = shard.read_bytes()
    if damage == "cut1":
        shard.write_bytes(data[:-1])
    elif damage == "half":
        shard.write_bytes(data[: len(data) // 2])
    else:
        shard.write_bytes(b"\xff" * 8 + data[8:])
    with pytest.raises(ck.CheckpointError, match=re.escape(str(shard))):
        ck.Checkpoint(save / "step_00000004")
    got, logs = _resume(save)
    assert got.step == 2
    assert any("step 4 is unusable" in line and shard.name in line for line in logs)


def test_no_usable_checkpoint_is_a_clear_error(tmp_path):
    save = tmp_path / "ckpt"
    _save(save, 2)
    shard = save / "step_00000002" / "model-0000000-0000001.safetensors"
    shard.write_bytes(shard.read_bytes()[:10])
    with pytest.raises(ck.CheckpointError, match="no usable checkpoint"):
        _resume(save)


def test_sha256_manifest_catches_a_same_size_bit_flip(tmp_path):
    save = tmp_path / "ckpt"
    _save(save, 3, verify_integrity=True)
    shard = save / "step_00000003" / "model-0000000-0000001.safetensors"
    data = bytearray(shard.read_bytes())
    data[-1] ^= 0x01  # inside tensor data: the header still parses
    shard.write_bytes(bytes(data))
    ck.Checkpoint(save / "step_00000003")  # structure alone looks fine
    with pytest.raises(ck.CheckpointError, match="SHA-256"):
        ck.Checkpoint(save / "step_00000003", verify_integrity=True)


def test_failed_save_leaves_nothing_and_keeps_previous(tmp_path):
    save = tmp_path / "ckpt"
    _save(save, 2)
    inj = FaultInjector("fail_save@4:1")
    with pytest.raises(OSError) as exc:
        _save(save, 4, on_progress=inj.on_save_progress)
    assert exc.value.errno == errno.ENOSPC
    assert sorted(p.name for p in save.iterdir()) == ["latest", "step_00000002"]
    assert ck.read_tracker(save) == 2
    assert _resume(save)[0].step == 2


def test_pickle_payload_is_rejected_without_running(tmp_path):
    import pickle

    sentinel = tmp_path / "pwned"

    class Evil:
        def __reduce__(self):
            return (open, (str(sentinel), "w"))

    save = tmp_path / "ckpt"
    _save(save, 1)
    step = save / "step_00000001"
    payload = pickle.dumps(Evil())
    (step / "model-0000000-0000001.safetensors").write_bytes(payload)
    with pytest.raises(ck.CheckpointError):
        ck.Checkpoint(step)
    (step / "metadata.json").write_bytes(payload)
    with pytest.raises(ck.CheckpointError, match="metadata.json"):
        ck.Checkpoint(step)
    assert not sentinel.exists()


def test_huge_header_length_and_overlapping_offsets_rejected(tmp_path):
    import struct

    big = tmp_path / "big.safetensors"
    big.write_bytes(struct.pack("<Q", 2**40) + b"{}")
    with pytest.raises(ck.CheckpointError, match="header length"):
        ck.read_safetensors_header(big)
    header = {"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
              "b": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]}}  # fmt: skip
    blob = json.dumps(header).encode()
    overlap = tmp_path / "overlap.safetensors"
    overlap.write_bytes(struct.pack("<Q", len(blob)) + blob + b"\0" * 12)
    with pytest.raises(ck.CheckpointError, match="overlaps"):
        ck.read_safetensors_header(overlap)


@pytest.mark.parametrize(
    "name", ["../../etc/passwd", "/abs/x.safetensors", "sub/x.safetensors", "link.safetensors"]
)
def test_shard_paths_are_contained(tmp_path, name):
    save = tmp_path / "ckpt"
    _save(save, 1)
    step = save / "step_00000001"
    outside = tmp_path / "outside.safetensors"
    outside.write_bytes((step / "model-0000000-0000001.safetensors").read_bytes())
    if name == "link.safetensors":
        (step / name).symlink_to(outside)
    meta = json.loads((step / "metadata.json").read_text())
    meta["tensors"]["embed.weight"]["chunks"][0]["file"] = name
    (step / "metadata.json").write_text(json.dumps(meta))
    with pytest.raises(ck.CheckpointError, match="symlink|not a plain name|outside"):
        ck.Checkpoint(step)


def test_load_paths_never_unpickle():
    """Static check: no pickle, unsafe yaml, allow_pickle or torch.load in the package."""
    bad = re.compile(
        r"pickle\.load|yaml\.load\(|allow_pickle\s*=\s*True|torch\.load|yaml\.unsafe_load"
    )
    for path in SRC.rglob("*.py"):
        for i, line in enumerate(path.read_text().splitlines(), 1):
            assert not bad.search(line), f"{path}:{i}: {line.strip()}"


def test_atomic_write_replaces_whole_file(tmp_path):
    target = tmp_path / "f.txt"
    ck.atomic_write(target, b"one")
    ck.atomic_write(target, b"two")
    assert target.read_bytes() == b"two"
    assert [p.name for p in tmp_path.iterdir()] == ["f.txt"]
    assert os.stat(target).st_size == 3
