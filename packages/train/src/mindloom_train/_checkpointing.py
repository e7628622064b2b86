"""The run's checkpoints: when and how a save is written (in the training thread or a
background writer), and what a start resumes from (the resume policy and its checks).
The files themselves are `_checkpoint.py`'s."""

from __future__ import annotations

import dataclasses
import json
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from mindloom_train import _checkpoint as ck
from mindloom_train._config import Config, ConfigError, drift_hash, show
from mindloom_train._errors import TrainError
from mindloom_train._schedule import schedule_signature
from mindloom_train._schema import RETIRED_DRIFT_KEYS
from mindloom_train._state import TrainState, rng_state, versions


@dataclass
class RunIdentity:
    """What a checkpoint records about where its run came from."""

    config_hash: str
    tokenizer: str | None
    data_contract: dict | None


@dataclass
class _PendingSave:
    step: int
    reason: str
    t0: float
    snapshot_s: float
    thread: threading.Thread | None = None
    path: Path | None = None
    error: BaseException | None = None
    t1: float = 0.0
    dist: dict | None = None  # a distributed save: what rank 0 commits after the barrier


class CheckpointManager:
    def __init__(self, cfg: Config, runtime, state: TrainState, runner, built, *,
                 save_path: Path, log, metrics, fault, identity: RunIdentity):  # fmt: skip
        self.cfg, self.rt, self.state, self.runner = cfg, runtime, state, runner
        self.mcfg, self.params = built.mcfg, built.params
        self.save_path, self.log, self.metrics, self.fault = save_path, log, metrics, fault
        self.identity = identity
        self.last_saved_step: int | None = None
        self.resumed_from: str | None = None
        self.last_eval_at: tuple[int, float] | None = None  # (step, loss) of the last evaluation
        self._pending: _PendingSave | None = None  # the background write, at most one

    # ------------------------------------------------------------------ save

    def _common(self, step: int) -> dict[str, Any]:
        from mindloom_train._modelcfg import model_shape

        cfg, s = self.cfg, self.state.checkpoint_fields(self.cfg.train_dataset.seq_length)
        settings = cfg.drift_settings()
        ev = self.last_eval_at
        return {
            "format": ck.FORMAT,
            "consumed_samples": s["consumed_samples"],
            "consumed_tokens": s["consumed_tokens"],
            "global_batch_size": cfg.training.global_batch_size,
            "world_size": self.rt.world,
            "config_hash": self.identity.config_hash,
            "seed": cfg.seed,
            "adam_step": s["adam_step"],
            "skipped_steps": s["skipped_steps"],
            "loss_smoothed": s["loss_smoothed"],
            "loss_scale": s["loss_scale"],
            "lr": s["lr"],
            "lr_scheduler": schedule_signature(cfg.lr_scheduler, cfg.training.train_iters),
            "optimizer": dataclasses.asdict(cfg.optimizer),
            "rng": rng_state(),
            "data": s["data"],
            "drift": {"hash": drift_hash(settings), "settings": settings},
            "model_config": dataclasses.asdict(self.mcfg),
            "model_shape": model_shape(self.mcfg),
            "tokenizer": self.identity.tokenizer,
            "data_contract": self.identity.data_contract,
            "versions": versions(),
            "time": time.time(),
            # the held-out loss of exactly these weights, when evaluated at this step
            # (--checkpoint best)
            "eval": {"step": step, "loss": ev[1]} if ev and ev[0] == step else None,
        }

    def _layout(self) -> dict | None:
        """mindloom_parallel's description: global shape and split of every tensor."""
        try:
            from mindloom_parallel import ParallelDims, layout_metadata

            dims = ParallelDims.from_section(self.cfg.parallelism)
            return layout_metadata(dataclasses.asdict(self.mcfg), dims)
        except Exception as exc:  # descriptive only; a checkpoint never fails for it
            return {"error": f"layout unavailable: {exc}"}

    def save(self, step: int, reason: str, background: bool = False) -> Path | None:
        """Write a checkpoint of the current state; with `background`, in a writer thread.

        The state is copied to host memory here, at this step, in either case, so a
        background write holds exactly what a synchronous one would even though the
        parameters move on while it runs. At most one write is in flight: a new save (and
        the end of the run) waits for the previous one first.
        """
        self.wait_pending()
        t0 = time.perf_counter()
        own = self._own_shards()
        if own is not None:
            return self._save_distributed(step, reason, background, t0, own)
        out = self.runner.checkpoint_shards()  # a collective on the engine path
        if out is None:  # another rank writes
            self.last_saved_step = step
            return None
        shards, metadata = out
        if background:  # the arrays may alias live parameter memory: own them
            shards = {
                f: {k: np.array(v, copy=True) for k, v in t.items()} for f, t in shards.items()
            }
        metadata["layout"] = self._layout()
        common = self._common(step)
        kwargs = dict(
            metadata=metadata,
            keep_last=self.cfg.checkpoint.keep_last,
            verify_integrity=self.cfg.checkpoint.verify_integrity,
            on_progress=self.fault.on_save_progress if self.fault else None,
        )
        if not background:
            path = ck.save_checkpoint(self.save_path, step, shards, common, **kwargs)
            self._saved(step, reason, path, time.perf_counter() - t0)
            return path
        job = _PendingSave(step, reason, t0, time.perf_counter() - t0)

        def write() -> None:
            try:
                job.path = ck.save_checkpoint(self.save_path, step, shards, common, **kwargs)
            except BaseException as exc:  # reported by the training thread
                job.error = exc
            job.t1 = time.perf_counter()

        job.thread = threading.Thread(target=write, name=f"checkpoint-{step}")
        job.thread.start()
        self._pending = job
        self.log(f"checkpoint: writing step {step} in the background "
                 f"(state copied in {job.snapshot_s:.2f}s)")  # fmt: skip
        return None

    # -------------------------------------------------------------- distributed save

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
        files = own.files
        if background:  # the arrays may alias live parameter memory: own them
            files = {f: {k: np.array(v, copy=True) for k, v in t.items()} for f, t in files.items()}
        job = _PendingSave(step, reason, t0, time.perf_counter() - t0)
        job.dist = {"nbytes": sum(a.nbytes for t in files.values() for a in t.values())}
        if self.rt.rank == 0:
            metadata = ck.default_metadata({}, self.rt.world)
            metadata["layout"] = self._layout()
            job.dist.update(metadata=metadata, common=self._common(step))
        progress = self.fault.on_save_progress if self.fault else None

        def write() -> None:
            try:
                job.path = ck.write_rank_files(self.save_path, step, files, own.tensors,
                                               self.rt.rank, self.rt.world, progress)  # fmt: skip
            except BaseException as exc:  # reported after the barrier
                job.error = exc
            job.t1 = time.perf_counter()

        if not background:
            write()
            self._pending = job
            self.wait_pending()
            return job.path
        job.thread = threading.Thread(target=write, name=f"checkpoint-{step}")
        job.thread.start()
        self._pending = job
        self.log(f"checkpoint: writing step {step} in the background, every rank its own "
                 f"files (state copied in {job.snapshot_s:.2f}s)")  # fmt: skip
        return None

    def _finalize(self, job: _PendingSave) -> None:
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

    def _poll_distributed(self, job: _PendingSave, wait: bool) -> None:
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

    def safe_save(self, step: int, reason: str, background: bool = False) -> None:
        """save(), with a failed write (ENOSPC, EACCES, ...) one TrainError line."""
        try:
            self.save(step, reason, background=background)
        except ck.CheckpointError:
            raise
        except OSError as exc:
            self._save_failed(step, exc)

    def _saved(self, step: int, reason: str, path: Path, seconds: float, **extra) -> None:
        self.log(f"checkpoint: saved step {step} to {path} ({reason}, {seconds:.2f}s)")
        self.metrics.event(
            "checkpoint", step=step, path=str(path), reason=reason, seconds=round(seconds, 3),
            **extra,
        )  # fmt: skip
        self.last_saved_step = step

    def _save_failed(self, step: int, exc: OSError) -> None:
        self.metrics.event("checkpoint", step=step, path=None, status="failed", reason=str(exc))
        prev = ck.read_tracker(self.save_path) if self.save_path.exists() else None
        raise TrainError(
            f"checkpoint save at step {step} failed ({exc}); nothing was left at a final "
            f"path; the latest complete checkpoint is step {prev}"
        ) from None

    def poll_pending(self, wait: bool = False) -> None:
        """Report a finished background save (log, event); raise if it failed."""
        job = self._pending
        if job is not None and job.dist is not None:
            return self._poll_distributed(job, wait)
        if job is None or (not wait and job.thread.is_alive()):
            return
        job.thread.join()
        self._pending = None
        if job.error is not None:
            if isinstance(job.error, OSError):
                self._save_failed(job.step, job.error)
            raise job.error
        self._saved(
            job.step, job.reason, job.path, job.t1 - job.t0,
            background=True, snapshot_s=round(job.snapshot_s, 3), completed_at_step=self.state.step,
        )  # fmt: skip

    def wait_pending(self) -> None:
        self.poll_pending(wait=True)

    def finish_pending(self) -> None:
        """On the way out of the loop: never leave a write behind, never hide its failure."""
        failing = sys.exc_info()[1] is not None
        job = self._pending
        if failing and job is not None and job.dist is not None:
            # no barrier on the way out of a failure (the other ranks may never reach it):
            # the step stays uncommitted, `latest` on the previous one
            if job.thread is not None:
                job.thread.join()
            self._pending = None
            self.log(f"checkpoint: step {job.step} left uncommitted (the run is failing)")
            return
        try:
            self.wait_pending()
        except Exception as exc:
            if not failing:
                raise
            # already failing for another reason: report this one, raise that one
            self.log(f"error: background checkpoint write failed too: {exc}")

    # ------------------------------------------------------------------ resume

    def resume(self) -> None:
        """Auto-resume, weights-only start, or fresh; sets the state and the tensors."""
        c = self.cfg.checkpoint
        ckpt = None
        if c.resume != "never":
            ckpt = ck.find_resumable(self.save_path, self.log, c.verify_integrity)
            if ckpt is None:
                if c.resume == "required":
                    raise TrainError(
                        f"checkpoint.resume=required but {self.save_path} holds no checkpoint"
                    )
                self.log(f"checkpoint: nothing to resume in {self.save_path}; starting fresh")
        if ckpt is not None:
            self._resume_from(ckpt)
        elif c.init_from:
            self._weights_from(Path(c.init_from))

    def _resume_from(self, ckpt) -> None:
        from mindloom_train._modelcfg import model_shape

        cfg, common, where = self.cfg, ckpt.common, str(ckpt.path)
        self._check_drift(common, where)
        if common.get("model_shape") != model_shape(self.mcfg):
            raise TrainError(
                f"{where}: model shape {common.get('model_shape')} differs from the config's "
                f"{model_shape(self.mcfg)}"
            )
        sig = schedule_signature(cfg.lr_scheduler, cfg.training.train_iters)
        if common.get("lr_scheduler") != sig and not cfg.checkpoint.override_schedule:
            old = common.get("lr_scheduler") or {}
            diff = [k for k in sig if old.get(k) != sig[k]]
            raise TrainError(
                f"{where}: LR schedule differs from the checkpoint's in {', '.join(diff)} "
                f"({', '.join(f'{k}: {old.get(k)!r} -> {sig[k]!r}' for k in diff)}); "
                "set checkpoint.override_schedule=true to accept"
            )
        saved = (ckpt.metadata.get("layout") or {}).get("parallel")
        if saved:
            self.log(f"checkpoint: written under layout {saved}")
        self._load_state(ckpt, where, weights_only=False)
        self.state.restore(common, cfg.training.global_batch_size, where, self.log, ckpt.step)
        self.resumed_from = str(ckpt.path)
        self.log(
            f"checkpoint: resumed from {ckpt.path} (step {self.state.step}, "
            f"consumed_samples {self.state.consumed})"
        )

    def _weights_from(self, path: Path) -> None:
        """checkpoint.init_from: the weights only (continued pretraining)."""
        try:
            src = ck.open_checkpoint(path, self.cfg.checkpoint.verify_integrity)
        except ck.CheckpointError as exc:
            raise TrainError(f"checkpoint.init_from: {exc}") from None
        names = [p.name for p in self.params]
        have = set(src.metadata["tensors"])
        missing = [n for n in names if n not in have]
        if missing:
            raise TrainError(f"checkpoint.init_from: {src.path} has no tensor {missing[0]!r}")
        self._load_state(src, str(src.path), weights_only=True)
        self.log(
            f"checkpoint: weights from {src.path} (step {src.step}); fresh optimizer state "
            "and LR schedule (continued pretraining)"
        )

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

    def _check_drift(self, common: dict[str, Any], where: str) -> None:
        """Refuse (exit 2) a resume whose config changes the data stream or the model,
        naming every key that differs, unless checkpoint.override_drift is set."""
        rec = common.get("drift")
        if not isinstance(rec, dict) or not isinstance(rec.get("settings"), dict):
            self.log(f"checkpoint: {where} records no config-drift settings (older format); "
                     "not checked")  # fmt: skip
            return
        now = self.cfg.drift_settings()
        if rec.get("hash") == drift_hash(now):
            return
        old = {k: v for k, v in rec["settings"].items() if k not in RETIRED_DRIFT_KEYS}
        # through JSON, as the checkpoint stored them (tuples become lists)
        now = json.loads(json.dumps(now, default=str))
        diff = sorted(k for k in {*old, *now} if old.get(k) != now.get(k))
        if not diff:
            return
        changes = "; ".join(f"{k}: {show(old.get(k))} -> {show(now.get(k))}" for k in diff)
        if self.cfg.checkpoint.override_drift:
            self.log(f"checkpoint: resuming with changed settings (override_drift): {changes}")
            return
        if len(changes) > 600:
            changes = changes[:599] + "\u2026"
        raise ConfigError(
            f"{where}: resume would change {', '.join(diff)} ({changes}); set "
            "checkpoint.override_drift=true to accept"
        )
