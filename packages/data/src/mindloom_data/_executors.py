"""Executors: run the ranks of a stage here (processes) or on a Ray cluster (tasks).

A job (`clean`, `tokenize`) is a list of stages, each a number of independent ranks. A
rank is named by `(job_ref, payload, stage, rank)`: `job_ref` is `"module:NAME"` of the
job's `Job` (imported where the rank runs, so this module imports no job); `payload` is
the job's plain data as a JSON string (never a pickled object), so the same rank runs the
same code whatever runs it. A rank writes its outputs atomically and then its completion marker, so a retried or
rerun rank skips finished work or rewrites the same bytes.

- `LocalExecutor(workers)`: the reference. One worker runs ranks in this process, in
  order; more workers run them in a pool of forked processes.
- `RayExecutor(address)`: one Ray Core task per rank, with retries and CPU/memory hints.
  It joins the cluster at `address` (`"auto"`, `"ray://..."` or `"HOST:PORT"`), joins the
  one this process is already connected to, or starts a local one. Every node must see
  the input and output paths (a shared filesystem) and have `mindloom-data` installed.

A failed rank is retried `max_retries` times; if it still fails, the run stops with one
line naming the stage, the rank and its input files.
"""

from __future__ import annotations

import importlib
import json
import os
import sys
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait
from dataclasses import dataclass
from multiprocessing import get_context
from typing import Any

from mindloom_data._faults import FAULT_ENV, fault_spec

RAY_HINT = "pip install 'mindloom-data[ray]'"


class ExecutorError(RuntimeError):
    """A rank failed for good, or an executor cannot start (one line)."""


# --- ranks ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Job:
    """What an executor needs to know about a job, found through its reference.

    A job module defines one `Job` at module level; executors are handed its reference
    `"module:NAME"` (a string: it travels to pool workers and Ray tasks as it is) and import
    it where the rank runs, so this module never imports the jobs it runs.
    """

    name: str  # in messages and Ray task names: "clean", "tokenize"
    load: Callable[[dict], Any]  # the payload's plain data -> the job's run object
    run_rank: Callable[[Any, str, int], None]  # (run, stage, rank), skips a marked rank
    rank_inputs: Callable[[Any, str, int], list[str]]  # what a rank reads, for messages


def resolve_job(ref: str) -> Job:
    """The `Job` named by `"module:NAME"`."""
    module, _, attr = ref.partition(":")
    job = getattr(importlib.import_module(module), attr, None)
    if not isinstance(job, Job):
        raise ExecutorError(f"job reference {ref!r} does not name a Job")
    return job


def rank_inputs(job_ref: str, payload: str, stage: str, rank: int) -> list[str]:
    """What a rank reads, for error messages."""
    job = resolve_job(job_ref)
    return job.rank_inputs(job.load(json.loads(payload)), stage, rank)


def execute_rank(
    job_ref: str, payload: str, stage: str, rank: int, fault: str = "", in_ray: bool = False
):
    """Run one rank unless its completion marker exists; the entry point of every executor.

    Returns the rank and, inside a Ray task (`in_ray`), the id of the node that ran it.
    """
    job = resolve_job(job_ref)
    run = job.load(json.loads(payload))
    with fault_spec(fault):
        job.run_rank(run, stage, rank)
    node = sys.modules["ray"].get_runtime_context().get_node_id() if in_ray else None
    return rank, node


def _what(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


def _one_line(text: str) -> str:
    return " ".join(str(text).split())


def _failed(job_ref, payload, stage, rank, attempts, exc_text) -> ExecutorError:
    inputs = ", ".join(rank_inputs(job_ref, payload, stage, rank))
    return ExecutorError(
        f"{resolve_job(job_ref).name} stage {stage} rank {rank} failed after {attempts} attempts "
        f"(inputs: {inputs}): {_one_line(exc_text)}"
    )


# --- executors --------------------------------------------------------------------------


class Executor:
    """Runs every rank of a stage; `on_done(rank)` is called as each one completes."""

    name = "base"

    def map_ranks(
        self, job_ref: str, payload: str, stage: str, ranks: int, on_done: Callable[[int], None]
    ) -> None:
        raise NotImplementedError

    def close(self) -> None:
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class LocalExecutor(Executor):
    """Ranks in this process (`workers=1`) or in a pool of forked processes."""

    name = "local"

    def __init__(self, workers: int = 1, max_retries: int = 2):
        if workers < 1:
            raise ValueError("workers must be at least 1")
        self.workers = workers
        self.max_retries = max_retries
        self._pool: ProcessPoolExecutor | None = None

    def _get_pool(self) -> ProcessPoolExecutor:
        if self._pool is None:
            ctx = get_context("fork") if os.name == "posix" else get_context("spawn")
            from mindloom_data._lifeline import die_with_parent

            # every worker dies with this process, even when it is killed with SIGKILL
            self._pool = ProcessPoolExecutor(
                max_workers=self.workers,
                mp_context=ctx,
                initializer=die_with_parent,
                initargs=(os.getpid(),),
            )
        return self._pool

    def map_ranks(self, job_ref, payload, stage, ranks, on_done) -> None:
        fault = os.environ.get(FAULT_ENV, "")
        attempts = self.max_retries + 1
        if self.workers == 1:
            for rank in range(ranks):
                for attempt in range(1, attempts + 1):
                    try:
                        execute_rank(job_ref, payload, stage, rank, fault)
                        break
                    except Exception as exc:
                        if attempt == attempts:
                            raise _failed(
                                job_ref, payload, stage, rank, attempts, _what(exc)
                            ) from exc
                on_done(rank)
            return
        pool = self._get_pool()
        tries = dict.fromkeys(range(ranks), 1)
        futures = {pool.submit(execute_rank, job_ref, payload, stage, r, fault): r for r in tries}
        try:
            while futures:
                finished, _ = wait(futures, return_when=FIRST_COMPLETED)
                for fut in finished:
                    rank = futures.pop(fut)
                    exc = fut.exception()
                    if exc is None:
                        on_done(rank)
                    elif tries[rank] < attempts:
                        tries[rank] += 1
                        futures[pool.submit(execute_rank, job_ref, payload, stage, rank, fault)] = (
                            rank
                        )
                    else:
                        raise _failed(job_ref, payload, stage, rank, attempts, _what(exc)) from exc
        except BaseException:
            for fut in futures:
                fut.cancel()
            raise

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(cancel_futures=True)
            self._pool = None


def _import_ray():
    try:
        import ray
    except ImportError:
        raise ExecutorError(f"the ray executor needs Ray: {RAY_HINT}") from None
    return ray


class RayExecutor(Executor):
    """One Ray Core task per rank.

    `address`: a running cluster (`"auto"`, `"HOST:PORT"`, `"ray://HOST:10001"`); None
    joins the cluster this process is already connected to, or else starts a local
    instance with `num_cpus` CPUs (all by default). `cpus_per_task`/`memory_per_task` (bytes) are scheduling hints;
    `max_retries` covers both raised exceptions and lost workers or nodes.
    """

    name = "ray"

    def __init__(
        self,
        address: str | None = None,
        *,
        num_cpus: int | None = None,
        cpus_per_task: float = 1,
        memory_per_task: int | None = None,
        max_retries: int = 2,
    ):
        self.ray = _import_ray()
        self.address = address
        self.num_cpus = num_cpus
        self.cpus_per_task = cpus_per_task
        self.memory_per_task = memory_per_task
        self.max_retries = max_retries
        self.nodes_used: set[str] = set()  # ids of the nodes that ran ranks
        self._started = False
        self._remote = None

    def _connect(self):
        ray = self.ray
        if not ray.is_initialized():
            kwargs = {"include_dashboard": False, "log_to_driver": False}
            if self.address is None:
                kwargs["num_cpus"] = self.num_cpus
            try:
                # "local": a new instance, not whatever cluster this machine last started
                ray.init(address=self.address or "local", **kwargs)
            except (ConnectionError, RuntimeError, ValueError) as exc:
                where = self.address or "a local cluster"
                raise ExecutorError(
                    f"cannot start or join Ray at {where}: {_one_line(exc)}"
                ) from None
            self._started = True
        if self._remote is None:
            opts = {
                "num_cpus": self.cpus_per_task,
                "max_retries": self.max_retries,
                "retry_exceptions": True,
            }
            if self.memory_per_task:
                opts["memory"] = self.memory_per_task
            self._remote = ray.remote(**opts)(execute_rank)
        return self._remote

    def map_ranks(self, job_ref, payload, stage, ranks, on_done) -> None:
        ray = self.ray
        remote = self._connect()
        fault = os.environ.get(FAULT_ENV, "")
        # Small payloads travel inline in the task spec (no object the driver must own);
        # a large one (thousands of input files) is stored once and shared.
        payload_ref = ray.put(payload) if len(payload) > 64 * 1024 else payload
        refs = {
            remote.options(name=f"{resolve_job(job_ref).name}:{stage}:{r}").remote(
                job_ref, payload_ref, stage, r, fault, True
            ): r
            for r in range(ranks)
        }
        try:
            while refs:
                ready, _ = ray.wait(list(refs), num_returns=1)
                for ref in ready:
                    rank = refs.pop(ref)
                    try:
                        self.nodes_used.add(ray.get(ref)[1])
                    except ray.exceptions.RayError as exc:
                        cause = getattr(exc, "cause", None)
                        text = f"{type(cause).__name__}: {cause}" if cause else str(exc)
                        raise _failed(
                            job_ref, payload, stage, rank, self.max_retries + 1, text
                        ) from None
                    on_done(rank)
        except BaseException:
            for ref in refs:
                ray.cancel(ref)
            raise

    def close(self) -> None:
        if self._started:
            self.ray.shutdown()
            self._started = False
        self._remote = None


def make_executor(
    executor: Executor | str | None = None,
    *,
    workers: int = 1,
    ray_address: str | None = None,
) -> Executor:
    """An executor from a name (`local`, `ray`) or the instance itself."""
    if isinstance(executor, Executor):
        return executor
    if executor in (None, "local"):
        return LocalExecutor(workers)
    if executor == "ray":
        return RayExecutor(
            ray_address, num_cpus=workers if workers > 1 and not ray_address else None
        )
    raise ExecutorError(f"unknown executor {executor!r} (known: local, ray)")


def add_executor_args(parser, tasks_help: str) -> None:
    """`--executor`, `--ray-address`, `--tasks` for a subcommand."""
    parser.add_argument(
        "--executor",
        choices=("local", "ray"),
        default=None,
        help=f"run ranks in local processes (default) or as Ray tasks ({RAY_HINT})",
    )
    parser.add_argument(
        "--ray-address",
        metavar="ADDR",
        default=None,
        help="Ray cluster to join (auto, HOST:PORT, ray://HOST:10001); default: start one here",
    )
    parser.add_argument("--tasks", type=int, default=None, metavar="N", help=tasks_help)
