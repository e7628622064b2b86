"""Issue 23, train side: hostile configs, corrupt checkpoint metadata, bad token data and the
one error path (exit-code table in the README). Each test reproduces a reported defect."""

from __future__ import annotations

import dataclasses
import json
import random
import shutil
import subprocess
import sys
import typing
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import yaml
from mindloom_train import _checkpoint as ck
from mindloom_train import _config
from mindloom_train._config import ConfigError, from_dict
from train_testutil import (
    SCHED,
    base_config,
    events,
    one_layer_config,
    read_metrics,
    run_cli,
    run_config,
)

# ---------------------------------------------------------------------------------------
# configs: every number finite, ranges, YAML aliases, echo limit (no MindSpore)


def _float_keys(cls, prefix: str = "") -> list[str]:
    """Every float-typed key of the train config schema, found by walking it."""
    out = []
    for f in dataclasses.fields(cls):
        tp = typing.get_type_hints(cls)[f.name]
        args = typing.get_args(tp) or (tp,)
        key = f"{prefix}{f.name}"
        inner = [a for a in args if dataclasses.is_dataclass(a)]
        if inner:
            out += _float_keys(inner[0], key + ".")
        elif float in args or any(typing.get_args(a) == (float,) for a in args):
            out.append(key)
    return out


def _minimal(tmp_path) -> dict:
    return {"train_dataset": {"data_prefix": ["x"]}, "run_dir": str(tmp_path)}


def _set(data: dict, key: str, value) -> dict:
    node = data
    parts = key.split(".")
    for part in parts[:-1]:
        node = node.setdefault(part, {})
    node[parts[-1]] = value
    return data


FLOAT_KEYS = _float_keys(_config.Config)


def test_every_float_key_is_found():
    # the walk sees the keys of the report (and the lists of floats)
    for key in ("optimizer.eps", "optimizer.weight_decay", "training.time_limit_s",
                "lr_scheduler.lr", "train_dataset.char_range", "train_dataset.weights"):  # fmt: skip
        assert key in FLOAT_KEYS
    assert len(FLOAT_KEYS) >= 20


@pytest.mark.parametrize("bad", [float("inf"), float("-inf"), float("nan"), "-inf", "NaN"])
@pytest.mark.parametrize("key", FLOAT_KEYS)
def test_non_finite_numbers_are_refused_for_every_key(tmp_path, key, bad):
    is_list = key.endswith(("_range", "weights"))
    data = _set(_minimal(tmp_path), key, [0.5, bad] if is_list else bad)
    if key.startswith("eval_dataset."):
        data["eval_dataset"].setdefault("data_prefix", ["y"])
    with pytest.raises(ConfigError) as exc:
        from_dict(data, check_model=False)
    assert f"config key {key}" in str(exc.value) and "finite" in str(exc.value)


@pytest.mark.parametrize(
    "override, key",
    [
        ("optimizer.eps=inf", "optimizer.eps"),
        ("optimizer.weight_decay=.inf", "optimizer.weight_decay"),
        ("optimizer.weight_decay=-0.1", "optimizer.weight_decay"),
        ("lr_scheduler.lr=-1e-3", "lr_scheduler.lr"),
        ("optimizer.beta1=1.0", "optimizer.beta1"),
        ("optimizer.beta2=-0.5", "optimizer.beta2"),
        ("training.time_limit_s=-5", "training.time_limit_s"),
        ("training.time_limit_s=0", "training.time_limit_s"),
        ("parallelism.bucket_size_mb=0", "parallelism.bucket_size_mb"),
        ("precision.min_loss_scale=-1", "precision.min_loss_scale"),
        ("monitor.peak_tflops=-2", "monitor.peak_tflops"),
        ("model.rope_theta=nan", "model.rope_theta"),
        ("training.train_iters=100000000000000000000000", "training.train_iters"),
    ],
)
def test_out_of_range_settings_are_refused_naming_the_key(tmp_path, override, key):
    data = _config.apply_overrides(_minimal(tmp_path), [override])
    with pytest.raises(ConfigError) as exc:
        from_dict(data)
    msg = str(exc.value)
    # the parallelism section's degrees are checked by mindloom_parallel.ParallelDims (the
    # one rule set launch and the workers use), whose line names the key after its prefix
    named = (f"config key {key}:", f"config parallelism: {key} ")
    assert msg.startswith(named) and "\n" not in msg, msg


def test_cli_refuses_infinite_eps_in_one_line(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(_minimal(tmp_path)))
    proc = run_cli("train", str(path), "--set", "optimizer.eps=inf", timeout=120)
    assert proc.returncode == 2
    assert proc.stderr == "error: config key optimizer.eps: expected a finite number, got 'inf'\n"


# The report's amplification config: 1.4 KB of nested aliases inside one key, expanding to
# 9**9 strings (before: 34 s, 2.1 GB and a 722 MB "one-line" error echoing the value).
_LAUGHS = "\n".join(
    [
        "# billion laughs: every level is nine aliases of the previous one",
        "training:",
        "  train_iters:",
        '    - &laughs_0 ["lol lol lol lol lol lol lol lol lol lol lol lol lol lol lol lol"]',
        *(
            f"    - &laughs_{i} [{', '.join(f'*laughs_{i - 1}' for _ in range(9))}]"
            for i in range(1, 10)
        ),
        "train_dataset:",
        "  data_prefix: [x]",
        "",
    ]
)


def test_yaml_alias_amplification_fails_fast_with_a_short_message(tmp_path):
    path = tmp_path / "laughs.yaml"
    path.write_text(_LAUGHS)
    assert 1000 < len(_LAUGHS.encode()) < 2000
    proc = run_cli("train", str(path), timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.count("\n") == 1 and len(proc.stderr) < 300
    assert proc.stderr.startswith(f"error: config file {path}: line 5 column")
    assert "aliases (*laughs_0) are not supported" in proc.stderr


def test_values_echoed_in_errors_are_capped(tmp_path):
    for override in ("optimizer.eps=" + "9" * 5000 + "x", "seed=[" + "1," * 5000 + "1]"):
        with pytest.raises(ConfigError) as exc:
            from_dict(_config.apply_overrides(_minimal(tmp_path), [override]))
        msg = str(exc.value)
        assert len(msg) < 300 and ("..." in msg or msg.endswith("\u2026"))
    with pytest.raises(ConfigError) as exc:
        _config.load_config(None, ["x" * 5000])
    assert len(str(exc.value)) < 300


def test_generate_refuses_a_negative_token_count(capsys):
    from mindloom_train._cli import main

    with pytest.raises(SystemExit) as exc:
        main(["generate", "--checkpoint", "x", "--prompt", "p", "--max-new-tokens", "-5"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "--max-new-tokens" in err and ">= 1" in err and err.count("\n") == 1


def test_launch_checks_the_layout_before_training_a_tokenizer(prepared, tmp_path, capsys):
    """pp=2 with 3 layers: refused (exit 2, a config error) before any tokenizer work."""
    from mindloom_train._cli import main

    cfg = base_config(prepared, tmp_path / "run", parallelism={"pp": 2, "micro_batch_num": 2},
                      model={"preset": "debug", "vocab_size": None, "num_layers": 3},
                      training={"micro_batch_size": 2})  # fmt: skip
    cfg["tokenizer"] = {"path": str(tmp_path / "tok"), "train_input": "bundled",
                        "model_type": "char", "vocab_size": None}  # fmt: skip
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(cfg))
    assert main(["launch", "--nproc", "2", str(path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [
        "error: config parallelism: model.num_layers = 3 is not divisible by parallelism.pp = 2"
    ]
    assert not (tmp_path / "tok").exists()


# ---------------------------------------------------------------------------------------
# checkpoint metadata: validated like headers, with the same fallback (no MindSpore)


def _common(step: int, gbs: int = 4) -> dict:
    rng_np = np.random.RandomState(step).get_state()
    py = random.Random(step).getstate()
    return {
        "consumed_samples": step * gbs,
        "global_batch_size": gbs,
        "adam_step": step,
        "skipped_steps": 0,
        "loss_smoothed": 3.2,
        "loss_scale": {"scale": 1.0, "good_steps": 0},
        "lr": 1e-3,
        "rng": {
            "numpy": [
                rng_np[0],
                rng_np[1].tolist(),
                int(rng_np[2]),
                int(rng_np[3]),
                float(rng_np[4]),
            ],  # fmt: skip
            "python": [py[0], list(py[1]), py[2]],
            "mindspore": [1234, 0],
        },
    }


def _two_steps(save: Path) -> None:
    for step in (4, 8):
        rng = np.random.default_rng(step)
        shards = {
            ck.shard_name("model", 0, 1): {
                "embed.weight": rng.standard_normal((16, 8)).astype(np.float32),
                "norm.weight": np.ones(8, np.float32) * step,
            }
        }
        ck.save_checkpoint(save, step, shards, _common(step))


def _edit_meta(d: Path, fn) -> None:
    p = d / "metadata.json"
    meta = json.loads(p.read_text())
    fn(meta["tensors"]["embed.weight"])
    p.write_text(json.dumps(meta))


def _edit_common(d: Path, fn) -> None:
    p = d / "common.json"
    common = json.loads(p.read_text())
    fn(common)
    p.write_text(json.dumps(common))


def _chunk(key, value):
    def fn(entry):
        entry["chunks"][0][key] = value

    return fn


CORRUPTIONS = {
    "chunk_offset_not_a_list": (_edit_meta, _chunk("offset", "0,0"), "offset"),
    "chunk_offset_of_strings": (_edit_meta, _chunk("offset", ["0", "0"]), "offset"),
    "chunk_negative_offset": (_edit_meta, _chunk("offset", [-1, 0]), "offset"),
    "chunk_offset_outside": (_edit_meta, _chunk("offset", [8, 0]), "outside global_shape"),
    "chunk_shape_of_wrong_type": (_edit_meta, _chunk("shape", "16x8"), "shape"),
    "chunk_shape_not_in_shard": (_edit_meta, _chunk("shape", [8, 8]), "its shard holds"),
    "chunks_not_a_list": (_edit_meta, lambda e: e.update(chunks={"file": 1}), "chunks"),
    "chunk_not_an_object": (_edit_meta, lambda e: e.update(chunks=[[0, 1]]), "chunks"),
    "chunk_file_not_a_string": (_edit_meta, _chunk("file", 5), "file name"),
    "global_shape_7_tib": (
        _edit_meta,
        lambda e: e.update(global_shape=[1 << 21, 1 << 20]),  # 2**41 fp32 = 8 TiB
        "global_shape",
    ),
    "global_shape_of_strings": (_edit_meta, lambda e: e.update(global_shape="big"), "global_shape"),
    "no_consumed_samples": (_edit_common, lambda c: c.pop("consumed_samples"), "consumed_samples"),
    "consumed_samples_string": (
        _edit_common,
        lambda c: c.update(consumed_samples="32"),
        "consumed_samples",
    ),  # fmt: skip
    "consumed_past_the_end": (
        _edit_common,
        lambda c: c.update(consumed_samples=10**12),
        "consumed_samples",
    ),  # fmt: skip
    "negative_step": (_edit_common, lambda c: c.update(step=-8), "step"),
    "rng_numpy_garbage": (_edit_common, lambda c: c["rng"].update(numpy=[1, 2, 3]), "rng.numpy"),
    "rng_numpy_key_too_big": (
        _edit_common,
        lambda c: c["rng"]["numpy"][1].__setitem__(0, 2**40),
        "rng.numpy",
    ),  # fmt: skip
    "rng_python_garbage": (_edit_common, lambda c: c["rng"].update(python="x"), "rng.python"),
    "rng_mindspore_garbage": (
        _edit_common,
        lambda c: c["rng"].update(mindspore=["a"]),
        "rng.mindspore",
    ),  # fmt: skip
    "rng_not_an_object": (_edit_common, lambda c: c.update(rng=[1]), "rng"),
    "loss_scale_garbage": (
        _edit_common,
        lambda c: c.update(loss_scale={"scale": -1}),
        "loss_scale",
    ),  # fmt: skip
    "adam_step_string": (_edit_common, lambda c: c.update(adam_step="x"), "adam_step"),
}


@pytest.mark.parametrize("name", sorted(CORRUPTIONS))
def test_corrupt_metadata_falls_back_or_fails_in_one_line(tmp_path, name):
    edit, fn, words = CORRUPTIONS[name]
    save = tmp_path / "ck"
    _two_steps(save)
    bad = save / ck.step_dirname(8)
    edit(bad, fn)
    # resume=auto: the previous complete checkpoint, the problem logged naming the file
    logs: list[str] = []
    got = ck.find_resumable(save, logs.append)
    assert got is not None and got.step == 4
    assert any("step 8 is unusable" in m and str(bad) in m and words in m for m in logs), logs
    assert got.load_tensors()["norm.weight"][0] == 4
    # opened directly (generate, export-hf, init_from): one line naming the file
    with pytest.raises(ck.CheckpointError) as exc:
        ck.open_checkpoint(bad)
    assert str(bad) in str(exc.value) and "\n" not in str(exc.value)


def test_consumed_count_past_the_end_no_longer_completes(prepared, run_a, tmp_path, train_cli):
    """Before: common.json saying 10**9 consumed samples made the run 'complete' (exit 0)
    without training. Now the checkpoint is unusable: with nothing to fall back to, exit 1
    and the reason in one line."""
    run = tmp_path / "r"
    shutil.copytree(run_a / "checkpoints", run / "checkpoints")
    step_dir = run / "checkpoints" / "step_00000008"
    _edit_common(step_dir, lambda c: c.update(consumed_samples=10**9))
    proc = train_cli(base_config(prepared, run, lr_scheduler=SCHED))
    assert proc.returncode == 1, proc.stderr
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("error: ") and "consumed_samples 1000000000" in last
    assert "Traceback" not in proc.stderr
    assert events(run, "end")[-1]["reason"] == last[len("error: ") :]


# ---------------------------------------------------------------------------------------
# resume drift


def test_resume_refuses_changed_data_or_model_settings(prepared, run_a, tmp_path, train_cli):
    run = tmp_path / "r"
    shutil.copytree(run_a / "checkpoints", run / "checkpoints")
    # no held-out set (evaluation is no drift setting): the resumed step needs no eval graph
    cfg = base_config(prepared, run, lr_scheduler=SCHED, training={"train_iters": 9}, seed=8,
                      optimizer={"beta1": 0.8}, eval_dataset=None)  # fmt: skip
    proc = train_cli(cfg)
    assert proc.returncode == 2, proc.stderr
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("error: ") and "resume would change optimizer.beta1, seed (" in last
    assert "seed: 7 -> 8" in last and "override_drift=true" in last
    end = events(run, "end")[-1]
    assert end["exit_code"] == 2 and "optimizer.beta1" in end["reason"]
    # the explicit override resumes (and says what changed)
    cfg["checkpoint"]["override_drift"] = True
    assert run_config(cfg) == 0
    assert "resuming with changed settings (override_drift)" in (run / "train.log").read_text()
    assert events(run, "start")[-1]["resumed_from"].endswith("step_00000008")


# ---------------------------------------------------------------------------------------
# token data


def _copy_dataset(src_prefix: str, dst_prefix: Path, edit=None, dtype=None) -> str:
    from mindloom_data import IndexedDataset, IndexedDatasetBuilder

    src = IndexedDataset(src_prefix)
    with IndexedDatasetBuilder(dst_prefix, dtype=dtype or src.dtype) as b:
        for k in range(src.num_documents):
            doc = np.array(src.document(k), dtype=np.int64)
            if edit is not None:
                doc = edit(k, doc, src.num_documents)
            b.add_document(doc)
    return str(dst_prefix)


@pytest.fixture
def train_cli(tmp_path, capsys, monkeypatch):
    """`mindloom train CFG` through the CLI's `main` in this process (what the `mindloom`
    script calls; no new process, so no second MindSpore import and, for the runs that
    fail before step 1, no compile at all) -> (exit code, stderr). The fault hook is set
    only for the call that names one."""
    from mindloom_train._cli import main

    def run(cfg: dict, fault: str | None = None) -> SimpleNamespace:
        path = tmp_path / f"cfg-{len(list(tmp_path.glob('cfg-*')))}.yaml"
        path.write_text(yaml.safe_dump(cfg))
        monkeypatch.delenv("MINDLOOM_FAULT", raising=False)
        if fault:
            monkeypatch.setenv("MINDLOOM_FAULT", fault)
        capsys.readouterr()
        code = main(["train", str(path)])  # an unexpected exception would fail the test here
        monkeypatch.delenv("MINDLOOM_FAULT", raising=False)
        return SimpleNamespace(returncode=code, stderr=capsys.readouterr().err)

    return run


def _one_error_line(proc) -> str:
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("error: ")
    return last


def test_out_of_vocabulary_token_is_refused_before_step_1(prepared, tmp_path, train_cli):
    """One id >= vocab near the end of the data (the reported run crashed at step 421 with
    a C++ stack and an empty end reason): exit 2 before step 1, naming file, id, vocab."""

    def plant(k, doc, n):
        if k == n - 1:
            doc[len(doc) // 2] = 65  # the char tokenizer has 65 ids: 0..64
        return doc

    bad = _copy_dataset(prepared["train"], tmp_path / "bad", plant)
    run = tmp_path / "r"
    cfg = base_config(prepared, run, train_dataset={"data_prefix": [bad]})
    proc = train_cli(cfg)
    assert proc.returncode == 2
    last = _one_error_line(proc)
    assert f"{bad}.bin: token id 65 at token" in last and "vocabulary of 65 ids" in last
    recs = read_metrics(run)
    assert not [r for r in recs if "event" not in r]  # no step ran
    assert events(run, "end")[-1]["reason"] == last[len("error: ") :]


def test_float_token_dtype_is_refused(prepared, tmp_path):
    """An .idx whose dtype code is float32 trained on garbage with exit 0 before."""
    from mindloom_data import IndexedDataset, IndexedDatasetError

    bad = _copy_dataset(prepared["train"], tmp_path / "f32", dtype=np.float32)
    with pytest.raises(IndexedDatasetError) as exc:
        IndexedDataset(bad)
    assert str(exc.value) == f"{bad}.idx: dtype code 7 (float32) is not an integer token type"
    run = tmp_path / "r"
    assert run_config(base_config(prepared, run, train_dataset={"data_prefix": [bad]})) == 2
    assert "dtype code 7" in events(run, "end")[-1]["reason"]


# ---------------------------------------------------------------------------------------
# the error path: one row of the README's exit-code table per test


def test_row_corrupt_dataset_inside_train_is_one_line(prepared, tmp_path, train_cli):
    bad = _copy_dataset(prepared["train"], tmp_path / "cut")
    with open(bad + ".bin", "r+b") as f:  # one byte short
        f.truncate(Path(bad + ".bin").stat().st_size - 1)
    run = tmp_path / "r"
    proc = train_cli(base_config(prepared, run, train_dataset={"data_prefix": [bad]}))
    assert proc.returncode == 2
    assert f"{bad}.bin: size does not match" in _one_error_line(proc)
    assert events(run, "end")[-1]["exit_code"] == 2


def test_row_empty_dataset_is_one_line(prepared, tmp_path):
    from mindloom_data import IndexedDatasetBuilder

    empty = tmp_path / "empty"
    with IndexedDatasetBuilder(empty, dtype=np.uint16):
        pass
    run = tmp_path / "r"
    assert run_config(base_config(prepared, run, eval_dataset={"data_prefix": [str(empty)]})) == 2
    reason = events(run, "end")[-1]["reason"]
    assert reason.startswith("eval dataset: ") and str(empty) in reason


def test_row_config_error_during_the_run_exits_2(prepared, tmp_path, train_cli):
    """A tokenizer vocabulary too small for the corpus is found while training it: a
    ConfigError during the run, exit 2 like any bad config (it was 1)."""
    run = tmp_path / "r"
    cfg = base_config(prepared, run)
    cfg["tokenizer"] = {"path": str(tmp_path / "tok"), "train_input": "bundled",
                        "model_type": "bpe", "vocab_size": 20}  # fmt: skip
    proc = train_cli(cfg)
    assert proc.returncode == 2
    assert _one_error_line(proc).startswith("error: config key tokenizer.vocab_size=20: ")
    assert events(run, "end")[-1]["exit_code"] == 2


def test_row_failed_step_exits_1_in_one_line(prepared, tmp_path, train_cli):
    # one layer, no held-out set: the failed step needs a compiled step, not a big one (the
    # graph of test_train_loop's guard run: one_layer_config)
    run = tmp_path / "r"
    cfg = one_layer_config(prepared, run)
    proc = train_cli(cfg, fault="step_error@3")
    assert proc.returncode == 1
    last = _one_error_line(proc)
    assert (
        last == "error: step 3 failed in MindSpore: MINDLOOM_FAULT: step_error injected at step 3"
    )
    end = events(run, "end")[-1]
    assert end["exit_code"] == 1 and end["reason"] == last[len("error: ") :]


def _can_mount_tmpfs(where: Path) -> bool:
    if not shutil.which("unshare"):
        return False
    where.mkdir(exist_ok=True)
    probe = subprocess.run(["unshare", "-rm", "sh", "-c", f"mount -t tmpfs -o size=4k tmpfs {where}"],
                           capture_output=True)  # fmt: skip
    return probe.returncode == 0


def test_row_enospc_on_metrics_ends_with_one_line_and_whole_records(prepared, tmp_path):
    """A full disk under the run directory (a 16 KiB tmpfs in a private mount namespace):
    before, metrics.jsonl was left with a partial last line, no end event, a traceback."""
    run = tmp_path / "small"
    if not _can_mount_tmpfs(run):
        pytest.skip("cannot mount a tmpfs here (unshare -rm not permitted)")
    cfg = one_layer_config(
        prepared,
        run,
        training={"train_iters": 60},
        checkpoint={"save_path": str(tmp_path / "ck"), "save_at_end": False},
    )
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(cfg))
    out = tmp_path / "copy"
    script = (f"mount -t tmpfs -o size=16k tmpfs {run} && "
              f"{sys.executable} -m mindloom_train._cli train {path}; rc=$?; "
              f"cp -r {run} {out}; exit $rc")  # fmt: skip
    proc = subprocess.run(["unshare", "-rm", "sh", "-c", script], capture_output=True, text=True,
                          env={**__import__("os").environ, "GLOG_v": "3"}, timeout=600)  # fmt: skip
    assert proc.returncode == 1, proc.stderr[-3000:]
    last = _one_error_line(proc)
    assert "No space left on device" in last and str(run) in last
    text = (out / "metrics.jsonl").read_text()
    assert text.endswith("\n")
    records = [json.loads(line) for line in text.splitlines()]  # every line whole
    assert any("step" in r and "event" not in r for r in records)


def test_model_constructor_builds_no_seq_squared_buffer():
    """A 9.3 GiB causal mask was built in Llama's constructor at max_seq_len 100000. Here
    at 20000 (the old buffer: 400 MB, built twice): the constructor's peak memory growth
    stays far below it, and a short forward still masks causally."""
    code = (
        "import resource, numpy as np, mindspore as ms\n"
        "from mindloom_model import Llama, get_preset\n"
        "ms.set_context(mode=ms.PYNATIVE_MODE, device_target='CPU')\n"
        "before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss\n"
        "m = Llama(get_preset('debug', max_seq_len=20000, vocab_size=64))\n"
        "grown = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before\n"
        "t = np.array([[1, 2, 3, 4, 5, 6]], np.int32)\n"
        "a = m(ms.Tensor(t)).asnumpy()\n"
        "t[0, 4:] = [9, 9]\n"
        "b = m(ms.Tensor(t)).asnumpy()\n"
        "print(grown, float(np.abs(a[0, :4] - b[0, :4]).max()), float(np.abs(a[0, 4:] - b[0, 4:]).max()))\n"
    )  # fmt: skip
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=300, env={**__import__("os").environ, "GLOG_v": "3"})  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    grown_kib, same_prefix, changed_suffix = proc.stdout.split()
    assert int(grown_kib) < 200 * 1024  # < 200 MiB
    assert float(same_prefix) == 0.0 and float(changed_suffix) > 0  # causal: the past only
