"""The distributed side of `_checkpointing.CheckpointManager` (issue 16): every rank
writes its own files and commits after a barrier; every rank reads only its own blocks.

A mixin: `CheckpointManager` holds the state (cfg, rt, runner, state, save_path, log,
metrics, fault, params, `_pending`) and the common helpers (`_common`, `_layout`,
`_saved`, `_save_failed`, `wait_pending`) these methods use."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from mindloom_train import _checkpoint as ck


@dataclass
class PendingSave:
    step: int
    reason: str
    t0: float
    snapshot_s: float
    thread: threading.Thread | None = None
    path: Path | None = None
    error: BaseException | None = None
    t1: float = 0.0
    dist: dict | None = None  # a distributed save: what rank 0 commits after the barrier

    def write(self, write_files: Callable[[], Path]) -> None:
        """Run `write_files` here, keeping its path, or its error for the training thread
        to report (after the barrier, on a distributed save)."""
        try:
            self.path = write_files()
        except BaseException as exc:
            self.error = exc
        self.t1 = time.perf_counter()

    def start(self, write_files: Callable[[], Path]) -> None:
        """`write` in a writer thread of its own."""
        self.thread = threading.Thread(
            target=self.write, args=(write_files,), name=f"checkpoint-{self.step}"
        )
        self.thread.start()


def owned_copy(shards: dict[str, dict[str, np.ndarray]]) -> dict[str, dict[str, np.ndarray]]:
    """The arrays may alias live parameter memory, which the next steps change while a
    background write runs: copies the writer owns."""
    return {f: {k: np.array(v, copy=True) for k, v in t.items()} for f, t in shards.items()}


class DistributedCheckpoints:
    def _own_shards(self):
        """This rank's own files and chunks (`own_shards` of the runner) when several
        ranks hold different parts of the state; None: the gathered path (one process,
        plain data parallel, or a runner without `own_shards`)."""
        own = getattr(self.runner, "own_shards", None)
        if own is None or self.rt.world == 1:
            return None
        return own()

    def _save_distributed(self, step: int, reason: str, background: bool, t0: float, own):
        """Every rank writes its own files (in a writer thread with `background`), then at
        a point every rank reaches together (`_finalize`) a barrier, and only then rank 0
        merges the ranks' indexes into metadata.json and commits."""
        files = owned_copy(own.files) if background else own.files
        job = PendingSave(step, reason, t0, time.perf_counter() - t0)
        job.dist = {"nbytes": sum(a.nbytes for t in files.values() for a in t.values())}
        if self.rt.rank == 0:
            metadata = ck.default_metadata({}, self.rt.world)
            metadata["layout"] = self._layout()
            # the runner's own description of its split (DeepSeek-V3: expert_parallel, ...)
            metadata.update(getattr(self.runner, "checkpoint_metadata", dict)())
            job.dist.update(metadata=metadata, common=self._common(step))
        progress = self.fault.on_save_progress if self.fault else None

        def write() -> Path:
            return ck.write_rank_files(self.save_path, step, files, own.tensors,
                                       self.rt.rank, self.rt.world, progress)  # fmt: skip

        if not background:
            job.write(write)
            self._pending = job
            self.wait_pending()
            return job.path
        self.log(f"checkpoint: writing step {step} in the background, every rank its own "
                 f"files (state copied in {job.snapshot_s:.2f}s)")  # fmt: skip
        job.start(write)
        self._pending = job
        return None

    def _finalize(self, job: PendingSave) -> None:
        """The barrier of a distributed save (every rank, the same point of the loop): an
        all-gather of each rank's 'files written' flag; rank 0 commits only when every
        rank wrote, then tells the others whether the commit held."""
        from mindloom_parallel import gather_rows

        world = self.rt.groups.world
        wrote = gather_rows([0.0 if job.error is not None else 1.0], world)[:, 0]
        failed = [r for r, ok in enumerate(wrote) if ok < 0.5]
        committed, error = 0.0, job.error
        if self.rt.rank == 0:
            if failed:
                ck.abort_rank_files(self.save_path, job.step)
            else:
                c = self.cfg.checkpoint
                try:
                    job.path = ck.commit_rank_files(
                        self.save_path, job.step, self.rt.world, job.dist["metadata"],
                        job.dist["common"], keep_last=c.keep_last,
                        verify_integrity=c.verify_integrity,
                        on_progress=self.fault.on_save_progress if self.fault else None,
                    )  # fmt: skip
                    committed = 1.0
                except BaseException as exc:
                    error = exc
        committed = float(gather_rows([committed], world)[0, 0])
        t1 = time.perf_counter()
        if error is not None:
            if isinstance(error, OSError):
                self._save_failed(job.step, error)
            raise error
        if failed or committed < 0.5:
            who = f"rank {failed[0]}" if failed else "rank 0's commit"
            self._save_failed(job.step, OSError(f"{who} failed (see that rank's log)"))
        path = job.path if self.rt.rank == 0 else self.save_path / ck.step_dirname(job.step)
        extra = {"per_rank": True, "rank_bytes": job.dist["nbytes"]}
        if job.thread is not None:
            extra.update(background=True, snapshot_s=round(job.snapshot_s, 3),
                         completed_at_step=self.state.step)  # fmt: skip
        self._saved(job.step, job.reason, path, t1 - job.t0, **extra)

    def _poll_distributed(self, job: PendingSave, wait: bool) -> None:
        """A background distributed write is committed where every rank agrees it is done:
        while it runs, each step's poll all-gathers one flag per rank (never a collective
        in the writer thread, whose timing differs per rank)."""
        from mindloom_parallel import gather_rows

        if job.thread is not None and not wait:
            done = gather_rows([0.0 if job.thread.is_alive() else 1.0], self.rt.groups.world)
            if done.min() < 0.5:
                return
        if job.thread is not None:
            job.thread.join()
        self._pending = None
        self._finalize(job)

    def _load_state(self, ckpt, where: str, weights_only: bool) -> None:
        """Balanced loading where the runner says which blocks it holds (`load_plan`):
        this rank reads only those bytes, from whichever files hold them, whatever layout
        wrote them. Otherwise (one process, plain data parallel, a runner without a plan)
        the global tensors. The tensor bytes read are logged once per rank."""
        from mindloom_train import _ckpt_read

        _ckpt_read.reset_counters()
        plan = getattr(self.runner, "load_plan", None)
        state = plan() if plan is not None and self.rt.groups is not None else None
        if state is None:
            if weights_only:
                self.runner.load_weights(ckpt.load_tensors([p.name for p in self.params]), where)
            else:  # global tensors (chunks reassembled)
                self.runner.load(ckpt.load_tensors(), where)
            held = None
        else:
            table = ckpt.metadata["tensors"]
            if weights_only:
                missing = sorted(set(state.layout) - set(table))
                if missing:
                    raise ck.CheckpointError(f"{where}: missing tensor {missing[0]!r}")
            else:
                ck.check_tensor_names(state.expected_names(), set(table), where)
            for name in state.layout:
                got = [int(d) for d in table[name].get("global_shape", [])]
                if got != list(state.layout[name].global_shape):
                    raise ck.CheckpointError(
                        f"{where}: tensor {name!r} has shape {got}, the model expects "
                        f"{list(state.layout[name].global_shape)}"
                    )
            state.load(ckpt.read_boxes(state.boxes(weights_only)), weights_only)
            held = state.held_bytes(weights_only)
        n = _ckpt_read.BYTES_READ
        self.log(
            f"checkpoint: rank {self.rt.rank} read {n['tensor']} tensor bytes from {n['files']} "
            f"files" + (f"; it holds {held} bytes of them" if held is not None else "")
        )
