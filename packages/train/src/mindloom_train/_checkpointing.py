"""The run's checkpoints: when and how a save is written (in the training thread or a
background writer), and what a start resumes from (the resume policy and its checks).
The files themselves are `_checkpoint.py`'s."""

from __future__ import annotations

import dataclasses
import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mindloom_train import _checkpoint as ck
from mindloom_train._ckpt_dist import DistributedCheckpoints, PendingSave, owned_copy
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


class CheckpointManager(DistributedCheckpoints):
    def __init__(self, cfg: Config, runtime, state: TrainState, runner, built, *,
                 save_path: Path, log, metrics, fault, identity: RunIdentity):  # fmt: skip
        self.cfg, self.rt, self.state, self.runner = cfg, runtime, state, runner
        self.mcfg, self.params = built.mcfg, built.params
        self.save_path, self.log, self.metrics, self.fault = save_path, log, metrics, fault
        self.identity = identity
        self.last_saved_step: int | None = None
        self.resumed_from: str | None = None
        self.last_eval_at: tuple[int, float] | None = None  # (step, loss) of the last evaluation
        self._pending: PendingSave | None = None  # the background write, at most one

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
        if background:
            shards = owned_copy(shards)
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
        job = PendingSave(step, reason, t0, time.perf_counter() - t0)
        # logged before the writer starts: a kill during the write finds the line in train.log
        self.log(f"checkpoint: writing step {step} in the background "
                 f"(state copied in {job.snapshot_s:.2f}s)")  # fmt: skip
        job.start(lambda: ck.save_checkpoint(self.save_path, step, shards, common, **kwargs))
        self._pending = job
        return None

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
