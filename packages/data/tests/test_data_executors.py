"""The local executor: ranks give the same output for any number of workers, a failing
rank is retried or named, tokenize-as-ranks merges to the single-process bytes, and Ray
stays optional."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from mindloom_data import clean
from mindloom_data._cli import main
from mindloom_data._executors import FAULT_ENV, ExecutorError, LocalExecutor
from mindloom_data._ranked_tokenize import tokenize_ranks

sys.path.insert(0, str(Path(__file__).parent))
from data_exec_util import (  # noqa: E402
    file_bytes,
    make_corpus,
    outcome,
    removed_reasons,
    shared_reference,
)


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    return make_corpus(tmp_path_factory.mktemp("exec_small") / "in", files=3, docs=150, seed=1)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    return shared_reference(tmp_path_factory)


@pytest.fixture(scope="module")
def small_reference(small, tmp_path_factory):
    out = tmp_path_factory.mktemp("small_ref") / "clean"
    clean(small, out, workers=1, progress=False)
    return outcome(out)


def test_reference_run_plants_every_kind_of_removal(reference):
    o = reference["outcome"]
    reasons = removed_reasons(o)
    assert reasons[("exact_dedup", "exact_duplicate")] > 50
    assert reasons[("minhash_dedup", "near_duplicate")] > 50
    assert reasons[("length", "too_short")] > 0
    assert len(o["kept"]) + len(o["removed"]) == o["read"]["documents"] == 2400
    assert o["read"]["bad"] == {"malformed_json": 6}


def test_two_workers_and_other_tasks_give_identical_output(reference, tmp_path):
    out = tmp_path / "clean"
    clean(reference["src"], out, workers=2, tasks=7, progress=False)
    assert outcome(out) == reference["outcome"]
    assert json.loads((out / "report.json").read_text())["config"]["partitions"] == 7


@pytest.mark.parametrize("workers,tasks", [(1, 1), (2, 3), (2, 6)])
def test_tokenize_ranks_merge_equals_single_process(reference, tmp_path, workers, tasks):
    prefix = tmp_path / "tokens"
    r = tokenize_ranks(reference["shards"], reference["tok"], prefix, workers=workers, tasks=tasks)
    assert file_bytes(prefix) == reference["tokens"]
    assert r["ranks"] == tasks and r["documents"] == len(reference["outcome"]["kept"])
    assert not list(tmp_path.glob("tokens.work/rank-*.bin"))  # merged, then removed


def test_rank_failing_once_is_retried_and_output_unchanged(
    small, small_reference, tmp_path, monkeypatch
):
    monkeypatch.setenv(FAULT_ENV, "scan:1:once,lsh:2:once")
    out = tmp_path / "clean"
    clean(small, out, workers=2, progress=False)
    assert outcome(out) == small_reference
    assert sorted(p.name for p in (out / ".work" / "faults").iterdir()) == ["lsh-2", "scan-1"]


def test_rank_failing_always_names_stage_rank_and_inputs(small, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv(FAULT_ENV, "scan:2:always")
    with pytest.raises(ExecutorError) as err:
        clean(small, tmp_path / "api", workers=2, progress=False)
    msg = str(err.value)
    assert "\n" not in msg
    assert "stage scan rank 2 failed after 3 attempts" in msg
    assert f"inputs: {small / 'part2.jsonl'}" in msg and "injected fault" in msg

    rc = main(["clean", str(small), "-o", str(tmp_path / "cli"), "-q", "-j", "2"])
    err_lines = capsys.readouterr().err.strip().splitlines()
    assert rc == 1 and len(err_lines) == 1
    assert err_lines[0].startswith("error: clean stage scan rank 2 failed")
    assert "part2.jsonl" in err_lines[0]


def test_failed_ranks_resume_without_redoing_finished_ones(reference, tmp_path, monkeypatch):
    prefix = tmp_path / "tokens"
    monkeypatch.setenv(FAULT_ENV, "tokenize:2:always")
    with pytest.raises(
        ExecutorError,
        match=r"tokenize stage tokenize rank 2 failed .*shard-00004.parquet, .*shard-00005",
    ):
        tokenize_ranks(reference["shards"], reference["tok"], prefix, tasks=3)
    done = prefix.parent / "tokens.work" / "done" / "tokenize"
    before = {p.name: p.stat().st_mtime_ns for p in done.iterdir()}
    assert sorted(before) == ["00000.json", "00001.json"]
    monkeypatch.delenv(FAULT_ENV)
    with LocalExecutor(workers=2) as ex:
        tokenize_ranks(reference["shards"], reference["tok"], prefix, tasks=3, executor=ex)
    assert file_bytes(prefix) == reference["tokens"]
    assert {p.name: p.stat().st_mtime_ns for p in done.iterdir() if p.name in before} == before


def test_cli_tokenize_with_tasks(reference, tmp_path, capsys):
    prefix = tmp_path / "cli"
    args = ["tokenize", "--tokenizer", reference["tok"], "--output-prefix", str(prefix)]
    rc = main([*args, "--input", *reference["shards"], "--tasks", "4", "--workers", "2"])
    assert rc == 0, capsys.readouterr().err
    assert "from 4 ranks (local executor)" in capsys.readouterr().out
    assert file_bytes(prefix) == reference["tokens"]


_NO_RAY = "import sys; sys.modules['ray'] = None; from mindloom_data._cli import main; "


@pytest.mark.parametrize("sub", ["clean", "tokenize"])
def test_without_ray_the_ray_executor_says_how_to_install_it(small, reference, tmp_path, sub):
    # sys.modules['ray'] = None makes `import ray` fail as if Ray were not installed.
    if sub == "clean":
        argv = ["clean", str(small), "-o", str(tmp_path / "o"), "--executor", "ray"]
    else:
        argv = ["tokenize", "--tokenizer", reference["tok"], "--input", *reference["shards"]]
        argv += ["--output-prefix", str(tmp_path / "t"), "--executor", "ray"]
    code = _NO_RAY + f"sys.exit(main({argv!r}))"
    p = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=os.environ
    )
    assert p.returncode == 1, p.stderr
    assert p.stderr.strip().splitlines() == [
        "error: the ray executor needs Ray: pip install 'mindloom-data[ray]'"
    ]
    assert not list(tmp_path.glob("*.bin")) and not list(tmp_path.glob("o/shard-*"))


def test_progress_sums_the_counts_of_ranks_run_elsewhere(small, tmp_path, capsys):
    report = clean(small, tmp_path / "o", workers=2, progress=True)
    lines = [ln.rsplit("\r", 1)[-1] for ln in capsys.readouterr().err.split("\n")]
    scan = next(ln for ln in lines if ln.startswith("scan "))
    write = next(ln for ln in lines if ln.startswith("write "))
    steps = report["steps"]
    assert f"read {report['read']['documents']}," in scan
    assert f"length removed {steps['length']['removed']['too_short']}" in scan
    assert write.endswith(f"kept {report['output']['documents']}")
    assert f"exact_dedup removed {steps['exact_dedup']['removed']['exact_duplicate']}" in write
