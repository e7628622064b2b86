"""Launch a script on N workers per node with MindSpore's ``msrun``.

``launch`` checks the layout BEFORE any worker starts, runs msrun with its timeouts set
(so a broken worker cannot hang the job), keeps one log per rank in ``log_dir``
(``worker_<rank>.log``, msrun's own output in ``msrun.log``) and turns a failure into one
line: which rank died and its last error, or that the rendezvous timed out.
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
from pathlib import Path

from mindloom_parallel._config import validate

__all__ = ["launch", "LaunchError", "free_port", "diagnose"]


class LaunchError(RuntimeError):
    """A launch that failed; ``str(e)`` is one line, ``e.log_dir`` holds the per-rank logs."""

    def __init__(self, message: str, returncode: int = 1, log_dir: str | None = None):
        super().__init__(message)
        self.returncode = returncode
        self.log_dir = log_dir


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(
    script_args: list[str],
    nproc: int,
    nnodes: int = 1,
    node_rank: int = 0,
    master_addr: str = "127.0.0.1",
    master_port: int | None = None,
    log_dir: str | os.PathLike = "msrun_logs",
    timeout_s: float | None = None,
    cluster_timeout_s: int = 120,
    env: dict | None = None,
    pcfg=None,
    model_cfg=None,
    global_batch_size: int | None = None,
    micro_batch_size: int | None = None,
) -> int:
    """Run ``script_args`` (``["train.py", "--flag", ...]`` or ``["-m", "pkg.mod", ...]``)
    on ``nproc`` workers on this node, ``nproc * nnodes`` in all; returns 0 when every
    worker succeeded, else raises ``LaunchError`` (one-line message).

    With ``pcfg`` given, the layout is validated against the world size (and the model
    and batch, if given) first, raising ``ParallelConfigError`` before anything starts.
    ``cluster_timeout_s`` bounds the rendezvous (msrun's ``--cluster_time_out``);
    ``timeout_s`` bounds the whole job (None: no limit). Several nodes: run the same call
    on every node with its ``node_rank``, the same ``master_addr`` (node 0's address)
    and an explicit ``master_port``.
    """
    world = nproc * nnodes
    if nproc < 1 or nnodes < 1 or not 0 <= node_rank < nnodes:
        raise LaunchError(
            f"bad launch shape: nproc={nproc}, nnodes={nnodes}, node_rank={node_rank}"
        )
    if pcfg is not None:
        validate(pcfg, model_cfg, world, global_batch_size, micro_batch_size)
    if master_port is None:
        if nnodes > 1:
            raise LaunchError("several nodes need an explicit master_port (the same on every node)")
        master_port = free_port()
    args = list(script_args)
    if not args:
        raise LaunchError("nothing to launch: give a script path or -m MODULE")
    if args[0] == "-m":
        import importlib.util

        spec = importlib.util.find_spec(args[1]) if len(args) > 1 else None
        if spec is None or spec.origin is None:
            raise LaunchError(f"module {args[1] if len(args) > 1 else ''!r} not found")
        origin = spec.origin
        if origin.endswith("__init__.py"):
            main_spec = importlib.util.find_spec(args[1] + ".__main__")
            origin = main_spec.origin if main_spec else origin
        args = [origin, *args[2:]]
    elif not Path(args[0]).is_file():
        raise LaunchError(f"script not found: {args[0]}")
    _check_script_options(args[1:])
    log_dir = Path(log_dir).resolve()
    log_dir.mkdir(parents=True, exist_ok=True)
    cmd = [
        "msrun",
        f"--worker_num={world}",
        f"--local_worker_num={nproc}",
        f"--master_addr={master_addr}",
        f"--master_port={master_port}",
        f"--node_rank={node_rank}",
        f"--log_dir={log_dir}",
        "--join=True",
        f"--cluster_time_out={int(cluster_timeout_s)}",
        *args,
    ]
    run_env = dict(os.environ if env is None else env)
    # msrun starts workers with the `python` on PATH: make it this interpreter
    bindir = os.path.dirname(sys.executable)
    run_env["PATH"] = bindir + os.pathsep + run_env.get("PATH", "")
    run_env.setdefault("GLOG_v", "3")
    msrun = os.path.join(bindir, "msrun")
    if os.path.exists(msrun):
        cmd[0] = msrun
    if node_rank > 0:
        # msrun starts a scheduler on every node whose addresses include master_addr; only
        # node 0 may host it (two schedulers on one host, as when nodes are simulated on
        # 127.0.0.1, split the rendezvous), so other nodes run msrun with that check off
        cmd = [sys.executable, "-c", _MSRUN_NOT_MASTER, *cmd[1:]]
    with open(log_dir / "msrun.log", "ab") as out:
        proc = subprocess.Popen(
            cmd, stdout=out, stderr=subprocess.STDOUT, env=run_env, start_new_session=True
        )
        try:
            rc = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            _kill_group(proc)
            raise LaunchError(
                f"job did not finish within {timeout_s:.0f} s and was stopped; logs in {log_dir}",
                124,
                str(log_dir),
            ) from None
        except KeyboardInterrupt:
            _kill_group(proc)
            raise
    if rc != 0:
        raise LaunchError(diagnose(log_dir, rc), rc, str(log_dir))
    return 0


_MSRUN_NOT_MASTER = (
    "import sys\n"
    "from mindspore.parallel.cluster.process_entity import _api\n"
    "_api._is_local_ip = lambda ip: False\n"
    "from mindspore.parallel.cluster.run import main\n"
    "sys.argv[0] = 'msrun'\n"
    "sys.exit(main())\n"
)


_MSRUN_OPTIONS = (
    "help", "worker_num", "local_worker_num", "master_addr", "master_port", "node_rank",
    "log_dir", "join", "cluster_time_out", "bind_core", "bind_numa", "sim_level",
    "sim_rank_id", "rank_table_file", "worker_log_name", "tail_worker_log",
)  # fmt: skip


def _check_script_options(args: list[str]) -> None:
    # msrun's argparse also reads options after the script and expands abbreviations,
    # so a script option that prefixes one of msrun's is taken by msrun
    for a in args:
        if not a.startswith("--") or a == "--":
            continue
        name = a[2:].split("=", 1)[0]
        hits = [o for o in _MSRUN_OPTIONS if o.startswith(name)]
        if hits:
            raise LaunchError(
                f"script option {a.split('=', 1)[0]} would be read by msrun as "
                f"--{hits[0]}: rename it"
            )


def _kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    except ProcessLookupError:
        pass


_TIMEOUT_PAT = re.compile(
    r"(cluster_time_out|Cluster is not ready|timed? ?out|Timeout|exceed.*time)", re.IGNORECASE
)
_RDV_PAT = re.compile(
    r"(initialize distributed job cluster|Cluster is not ready|cluster.*time ?out)", re.IGNORECASE
)
_ERR_PAT = re.compile(r"^\w*(Error|Exception|Interrupt|Exit)\b.*|^\w+Error:.*")


def diagnose(log_dir: str | os.PathLike, returncode: int = 1) -> str:
    """One line on why a launch failed, from the per-rank logs."""
    log_dir = Path(log_dir)
    msrun_log = log_dir / "msrun.log"
    if msrun_log.exists():
        for line in msrun_log.read_text(errors="replace").splitlines():
            if line.startswith("msrun: error:"):
                return f"msrun refused the command line: {line[len('msrun: error:') :].strip()}"
    failed = []
    for log in sorted(log_dir.glob("worker_*.log"), key=_rank_of):
        text = log.read_text(errors="replace")
        if "Traceback (most recent call last)" in text:
            err = ""
            for line in text.splitlines():
                line = line.strip()
                if _ERR_PAT.match(line):
                    err = line
            failed.append((_rank_of(log), err or "traceback (see log)"))
    rendezvous = [r for r, e in failed if _RDV_PAT.search(e)]
    if rendezvous and len(rendezvous) == len(failed):
        return (
            f"rendezvous timed out: not every worker joined the cluster in time (rank "
            f"{rendezvous[0]} gave up; check the other nodes' launch, master address and "
            f"port); logs in {log_dir}"
        )
    if failed:
        rank, err = failed[0]
        more = f" (and {len(failed) - 1} more rank(s))" if len(failed) > 1 else ""
        return f"worker rank {rank} failed: {err[:300]}{more}; logs in {log_dir}"
    texts = [p.read_text(errors="replace") for p in log_dir.glob("*.log")]
    if any(_TIMEOUT_PAT.search(t) for t in texts):
        return (
            f"rendezvous or collective timed out (exit {returncode}): not every worker joined; "
            f"logs in {log_dir}"
        )
    return f"msrun exited with {returncode}: a worker died without a Python error (killed?); logs in {log_dir}"


def _rank_of(p: Path) -> int:
    m = re.search(r"(\d+)", p.stem)
    return int(m.group(1)) if m else -1
