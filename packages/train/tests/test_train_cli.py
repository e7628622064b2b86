"""The `mindloom` command: generate, export-hf, check-env, launch (real msrun)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from mindloom_train._checkpoint import read_tracker
from mindloom_train._cli import main
from train_testutil import (
    SCHED,
    base_config,
    kill_msrun,
    launch_env,
    read_metrics,
    step_records,
)


def _start(out: Path, *args: str, fault: str | None = None) -> subprocess.Popen:
    """`mindloom ARGS` in a fresh process, in the background (quiet MindSpore, the fault hook
    only if given); its stdout and stderr go to OUT.stdout / OUT.stderr, so that a chatty
    job never blocks on a full pipe while the test waits for another one."""
    with open(f"{out}.stdout", "w") as so, open(f"{out}.stderr", "w") as se:
        return subprocess.Popen([sys.executable, "-m", "mindloom_train._cli", *args],
                                stdout=so, stderr=se, text=True, env=launch_env(fault))  # fmt: skip


def test_generate_from_a_checkpoint(run_a, capsys, tmp_path):
    args = ["generate", "--checkpoint", str(run_a / "checkpoints"), "--prompt", "ROMEO:",
            "--max-new-tokens", "20", "--seed", "3"]  # fmt: skip
    store = tmp_path / "store"
    assert main([*args, "--compile-cache-dir", str(store)]) == 0
    got = capsys.readouterr()
    out = got.out
    assert out.startswith("ROMEO:") and len(out.rstrip("\n")) == len("ROMEO:") + 20
    assert f"misses ({store})" in got.err and any(store.iterdir()), got.err  # its own store
    assert main([*args, "--compile-cache", "off"]) == 0
    got = capsys.readouterr()
    assert got.out == out  # seeded: the same text again, uncached
    assert "generate: compile cache: off" in got.err


def test_cli_errors_are_one_line(tmp_path, capsys):
    assert main(["generate", "--checkpoint", str(tmp_path), "--prompt", "x"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1
    assert (
        main(["export-hf", "--checkpoint", str(tmp_path / "nope"), "--out", str(tmp_path / "o")])
        == 1
    )
    assert capsys.readouterr().err.count("\n") == 1
    with pytest.raises(SystemExit) as exc:
        main(["frobnicate"])
    assert exc.value.code == 2 and capsys.readouterr().err.count("\n") == 1


def test_a_too_small_tokenizer_vocab_is_a_config_error(tmp_path, capsys):
    # the bundled corpus' characters need 320 pieces; 256 must stop the run with one line
    # naming the key, not a traceback from the tokenizer trainer
    cfg = {
        "model": {"preset": "debug", "vocab_size": None},
        "tokenizer": {"train_input": "bundled", "model_type": "bpe", "vocab_size": 256},
        "train_dataset": {"text_input": "bundled", "seq_length": 32},
        "training": {"train_iters": 2, "global_batch_size": 4, "micro_batch_size": 4},
        "lr_scheduler": {"warmup_iters": 1},
        "monitor": {"progress_bar": False},
        "run_dir": str(tmp_path / "run"),
    }
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(cfg))
    assert main(["train", str(path)]) == 2  # a ConfigError during the run (was 1 once)
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("error: ")]
    assert len(lines) == 1 and "tokenizer.vocab_size=256" in lines[0], err[-1500:]
    assert "Traceback" not in err


def test_export_hf_loads_in_transformers(run_a, tmp_path):
    import numpy as np
    import torch
    import transformers
    from mindloom_train._generate import load_model

    out = tmp_path / "hf"
    assert main(["export-hf", "--checkpoint", str(run_a / "checkpoints"), "--out", str(out)]) == 0
    hf = transformers.LlamaForCausalLM.from_pretrained(str(out)).eval()
    model, _ = load_model(run_a / "checkpoints")
    tokens = np.arange(16, dtype=np.int32).reshape(1, 16) % 60
    import mindspore as ms

    ours = model(ms.Tensor(tokens)).asnumpy()
    with torch.no_grad():
        theirs = hf(torch.tensor(tokens, dtype=torch.long)).logits.numpy()
    np.testing.assert_allclose(ours, theirs, atol=1e-4, rtol=1e-4)


def test_export_hf_refuses_to_overwrite_an_existing_output(run_a, tmp_path, capsys):
    # issue 23 item 10: a second export into the same --out used to replace files silently
    out = tmp_path / "hf"
    out.mkdir()
    (out / "config.json").write_text("{}")
    args = ["export-hf", "--checkpoint", str(run_a / "checkpoints"), "--out", str(out)]
    assert main(args) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"error: export-hf: {out} exists"), err
    assert sorted(p.name for p in out.iterdir()) == ["config.json"]
    assert (out / "config.json").read_text() == "{}"


def test_check_env_single_process(capsys):
    assert main(["check-env"]) == 0
    out = capsys.readouterr().out
    assert "matmul 256x256" in out and "ok" in out and "mindspore" in out and "backend" in out


@pytest.fixture(scope="module")
def msrun_jobs(prepared, tmp_path_factory) -> dict:
    """Both msrun jobs of this file, started together so that one's start-up, rendezvous and
    compile overlap the other's: `check-env --nproc 2`, and the dp=2 run of the launch test
    below. -> {name: (process, output prefix, run dir)}; each test waits for its own."""
    root = tmp_path_factory.mktemp("msrun")
    run = root / "dp"
    cfg = base_config(prepared, run, lr_scheduler=SCHED,
                      training={"train_iters": 6, "micro_batch_size": 2},
                      parallelism={"dp": 2})  # fmt: skip
    (root / "dp.yaml").write_text(yaml.safe_dump(cfg))
    jobs = {
        "check_env": (_start(root / "check_env", "check-env", "--nproc", "2", "--timeout", "240"),
                      root / "check_env", None),
        "dp": (_start(root / "dp", "launch", "--nproc", "2", str(root / "dp.yaml"), "--timeout",
                      "240", fault="sigint@3:1"), root / "dp", run),
    }  # fmt: skip
    yield jobs
    for proc, _, job_run in jobs.values():  # only after a failed test: nothing left behind
        if proc.poll() is None:
            if job_run is not None:
                kill_msrun(job_run / "msrun_logs")
            proc.kill()
            proc.wait()


def _finished(job) -> subprocess.CompletedProcess:
    """Wait for a job of `msrun_jobs` (bounded: the launches' own --timeout ends them first)."""
    proc, out, _ = job
    proc.wait(timeout=600)
    stdout, stderr = Path(f"{out}.stdout").read_text(), Path(f"{out}.stderr").read_text()
    return subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr)


@pytest.mark.msrun
def test_check_env_all_reduce_under_msrun(msrun_jobs):
    proc = _finished(msrun_jobs["check_env"])
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "all-reduce" in proc.stdout and "ok across 2 msrun workers" in proc.stdout


@pytest.mark.msrun
def test_launch_data_parallel_matches_one_process_and_agrees_on_sigterm(run_a, msrun_jobs):
    """dp=2 under msrun (each rank half of every global batch) = the one-process run; a
    SIGINT that reaches only rank 1 at step 3 stops both ranks after step 3, saved; rank 0
    reports "a stop signal on another rank", rank 1 names the SIGINT it got, never
    "SIGTERM" (issue 23 item 10: MindSpore's own SIGINT handler, installed as its runtime
    first runs, turned the worker's SIGINT into SIGTERM until the trainer set its handlers
    again after every step)."""
    proc, run = _finished(msrun_jobs["dp"]), msrun_jobs["dp"][2]
    assert proc.returncode == 0, proc.stderr[-2000:]
    dp, a = step_records(run), step_records(run_a)
    assert sorted(dp) == [1, 2, 3]
    for step in (1, 2, 3):
        assert dp[step]["step_loss"] == pytest.approx(a[step]["step_loss"], rel=1e-5)
        assert dp[step]["consumed_samples"] == a[step]["consumed_samples"]
        # the compiled step's all-reduce, timed through the probe on every rank
        assert dp[step]["comm_s"] > 0 and 0 < dp[step]["comm_share"] <= 1
        assert len(dp[step]["comm_s_ranks"]) == 2 and all(c > 0 for c in dp[step]["comm_s_ranks"])
        assert dp[step]["comm_share_ranks"][0] == pytest.approx(dp[step]["comm_share"])
    end = [r for r in read_metrics(run) if r.get("event") == "end"][-1]
    assert end["status"] == "stopped" and end["step"] == 3
    assert end["reason"] == "a stop signal on another rank received"
    rank1 = (run / "msrun_logs" / "worker_1.log").read_text(errors="replace")
    assert "[rank 1] run: SIGINT received; saving step 3 and exiting" in rank1, rank1[-2000:]
    assert "SIGTERM" not in rank1
    assert read_tracker(run / "checkpoints") == 3
    assert (run / "msrun_logs" / "worker_1.log").exists()
    # issue 18 on the same launch: each rank's peak RSS (its log's last `memory:` line)
    # within 20% of the estimate for the compiled dp2 step (the README's table)
    for r in (0, 1):
        log = (run / "msrun_logs" / f"worker_{r}.log").read_text(errors="replace")
        peak, est = re.findall(
            rf"memory: peak RSS ([\d.]+) MiB on rank {r}; estimate ([\d.]+)", log
        )[-1]
        print(f"memory dp2 compiled: rank {r} peak {peak} MiB estimate {est} MiB")
        assert abs(float(est) - float(peak)) <= 0.2 * float(peak), (r, peak, est)


def test_launch_refuses_a_layout_that_does_not_fit(prepared, tmp_path, capsys):
    cfg = base_config(
        prepared, tmp_path / "bad", parallelism={"dp": 2}, training={"micro_batch_size": 2}
    )
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(cfg))
    assert main(["launch", "--nproc", "3", str(path)]) == 2  # a config error
    err = capsys.readouterr().err
    assert "world size 3" in err and err.count("\n") == 1
    assert not (tmp_path / "bad" / "msrun_logs").exists()
