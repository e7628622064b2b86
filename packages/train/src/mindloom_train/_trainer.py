"""The training loop: data -> compiled step -> guards -> metrics -> eval -> checkpoints.

Exit codes of `run()` (and `mindloom train`): 0 completed, or stopped cleanly by SIGTERM /
SIGINT after saving; 1 failed (bad config, unusable checkpoint, failed save); 3 stopped by
the anomaly guard (K consecutive skipped updates), with a checkpoint of the last good state.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import random
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np

from mindloom_train import _checkpoint as ck
from mindloom_train._config import Config, ConfigError, drift_hash, dump_config, show
from mindloom_train._faults import FaultInjector
from mindloom_train._metrics import (
    MetricsWriter,
    RunLog,
    mem_rss_mb,
    peak_flops,
    peak_rss_mb,
    progress_text,
)
from mindloom_train._schedule import lr_at, schedule_signature
from mindloom_train._watchdog import EXIT_HANG

EXIT_OK, EXIT_FAILED, EXIT_ANOMALY = 0, 1, 3


class TrainError(RuntimeError):
    """A run that cannot go on; one line."""


def versions() -> dict[str, str]:
    import importlib.metadata as md

    out = {"python": sys.version.split()[0]}
    for dist in [
        "mindspore",
        "numpy",
        "mindloom-train",
        "mindloom-model",
        "mindloom-data",
        "mindloom-tokenizer",
        "mindloom-parallel",
    ]:
        try:
            out[dist] = md.version(dist)
        except md.PackageNotFoundError:
            pass
    return out


def _rng_state() -> dict[str, Any]:
    import mindspore as ms

    name, keys, pos, has_gauss, gauss = np.random.get_state()
    py = random.getstate()
    return {
        "numpy": [name, keys.tolist(), int(pos), int(has_gauss), float(gauss)],
        "python": [py[0], list(py[1]), py[2]],
        "mindspore": ms.get_rng_state().asnumpy().tolist(),
    }


def _set_rng_state(state: dict[str, Any]) -> None:
    import mindspore as ms

    name, keys, pos, has_gauss, gauss = state["numpy"]
    np.random.set_state((name, np.asarray(keys, np.uint32), pos, has_gauss, gauss))
    v, internal, g = state["python"]
    random.setstate((v, tuple(internal), g))
    cur = ms.get_rng_state()
    ms.set_rng_state(ms.Tensor(np.asarray(state["mindspore"], dtype=cur.asnumpy().dtype)))


class Trainer:
    def __init__(self, cfg: Config, *, console=None, fault_spec: str | None = None):
        self.cfg = cfg
        self.console = console
        self.rank, self.world = 0, 1
        self.dp_rank, self.dp_size = 0, 1
        self._fault_spec = fault_spec
        self.groups = None
        self.pcfg = None
        self.par = None  # EngineStep when the layout is not plain data parallel
        self._pending_save: dict[str, Any] | None = None  # the background checkpoint write
        self.watchdog = None  # StepWatchdog when there are several workers
        self._compiled: set[str] = set()  # graphs whose first run the watchdog has timed
        self.fault = FaultInjector(fault_spec, rank=self.rank)
        self._stop_signal: str | None = None

    # ------------------------------------------------------------------ setup

    def _init_dist(self) -> None:
        """Under msrun: communicator, this rank's coordinates and groups. Plain data parallel
        keeps the compiled step; tp / pp / ZeRO-1 go through ParallelEngine (PyNative)."""
        self.groups = None
        self.use_engine = False
        if not any(k in os.environ for k in ("MS_WORKER_NUM", "MS_ROLE", "RANK_SIZE")):
            return
        from mindloom_parallel import ParallelConfigError, ParallelDims, init_parallel

        dims = ParallelDims.from_section(self.cfg.parallelism)
        self.use_engine = dims.needs_engine
        pcfg = dims.for_steps(self.cfg.grad_accum_steps) if self.use_engine else dims
        try:
            groups = init_parallel(pcfg)
        except ParallelConfigError as exc:
            raise ConfigError(f"config parallelism: {exc}") from None
        if self.use_engine:
            import mindspore as ms

            # the engine's pipeline schedule and TP region ops are Python-level
            ms.set_context(mode=ms.PYNATIVE_MODE)
        self.groups = groups
        self.pcfg = pcfg
        self.rank, self.world = groups.rank, groups.world_size
        self.dp_rank, self.dp_size = groups.dp_rank, pcfg.dp
        self.fault = FaultInjector(self._fault_spec, rank=self.rank)

    def _setup_dirs(self) -> None:
        cfg = self.cfg
        self.run_dir = Path(cfg.run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.save_path = Path(os.path.realpath(cfg.save_path))
        is_main = self.rank == 0
        self.log = RunLog(self.run_dir / "train.log" if is_main else None, self.console, self.rank)
        self.metrics = MetricsWriter(self.run_dir / "metrics.jsonl" if is_main else None)
        if cfg.monitor.health.enabled:  # training-health rules on every record
            from mindloom_train._health import HealthMonitor

            self.metrics.health = HealthMonitor(cfg.monitor.health, self.log)
        if is_main:
            ck.atomic_write(self.run_dir / "config.yaml", dump_config(cfg).encode())
            ck.clean_stale_saves(self.save_path, self.log)

    def _setup_context(self) -> None:
        import mindspore as ms

        c = self.cfg.context
        kwargs: dict[str, Any] = {
            "mode": ms.GRAPH_MODE if c.mode == "graph" else ms.PYNATIVE_MODE,
            "device_target": c.device_target,
        }
        if c.device_target != "CPU":
            kwargs["device_id"] = c.device_id
        if c.max_device_memory:
            kwargs["max_device_memory"] = c.max_device_memory
        ms.set_context(**kwargs)
        if c.num_threads:
            ms.set_context(runtime_num_threads=c.num_threads)
        ms.set_seed(self.cfg.seed)
        np.random.seed(self.cfg.seed)
        random.seed(self.cfg.seed)

    def _build_model(self, vocab_size: int):
        from mindloom_model import DeepseekV3, Llama, LlamaWithLoss

        from mindloom_train._modelcfg import _DTYPE, build_model_config
        from mindloom_train._moe import MoELossNet, is_moe

        hf = self.cfg.model.get("init_from_hf")
        if hf:
            from mindloom_model import load_hf

            over: dict[str, Any] = {"compute_dtype": _DTYPE[self.cfg.precision.compute_dtype]}
            if "dropout" in self.cfg.model:
                over["dropout"] = self.cfg.model["dropout"]
            try:
                model = load_hf(hf, **over)
            except (ValueError, OSError) as exc:
                raise TrainError(f"model.init_from_hf: {exc}") from None
            mcfg = model.config
            if vocab_size > mcfg.vocab_size:
                raise TrainError(
                    f"model.init_from_hf: the tokenizer has {vocab_size} ids but the model "
                    f"only {mcfg.vocab_size}"
                )
            if mcfg.max_seq_len < self.cfg.train_dataset.seq_length:
                raise TrainError(
                    f"model.init_from_hf: max_seq_len {mcfg.max_seq_len} < train_dataset.seq_length "
                    f"{self.cfg.train_dataset.seq_length}"
                )
            self.log(f"model: weights from Hugging Face directory {hf}")
        else:
            mcfg = build_model_config(self.cfg, vocab_size)
            model = Llama(mcfg) if not is_moe(mcfg) else DeepseekV3(mcfg)
        self.mcfg = mcfg
        self.model = model
        self.loss_net = LlamaWithLoss(model) if not is_moe(mcfg) else MoELossNet(model)
        self.params = list(model.trainable_params())
        # state that is not trained but checkpointed (the MoE selection biases)
        self.buffers = [p for p in model.get_parameters() if not p.requires_grad]
        if is_moe(mcfg) and not self.buffers:
            raise ConfigError(
                f"config key model.first_k_dense_replace: {mcfg.first_k_dense_replace} of "
                f"{mcfg.num_layers} layers dense and no MTP MoE block leaves no router to train"
            )
        if is_moe(mcfg) and self.use_engine:
            raise ConfigError(
                "config parallelism: family deepseek_v3 trains under plain data parallel only "
                "(tp, pp and zero_stage are not wired for MoE yet)"
            )
        if self.groups is not None:
            from mindloom_parallel import ParallelConfigError

            t = self.cfg.training
            try:
                self.pcfg.check(mcfg, self.world, t.global_batch_size, t.micro_batch_size,
                                self.cfg.train_dataset.seq_length)  # fmt: skip
            except ParallelConfigError as exc:
                raise ConfigError(f"config parallelism: {exc}") from None

    def _build_steps(self) -> None:
        import mindspore as ms

        from mindloom_train import _step
        from mindloom_train._moe import MoEEvalNet, MoELossNet, MoEStepParts, MoEWindow

        cfg = self.cfg
        self.accum = cfg.grad_accum_steps
        # MindSpore cells start in inference mode, where nn.Dropout is the identity
        self.model.set_train(True)
        if self.use_engine:
            from mindloom_train._parallel import EngineStep

            self.par = EngineStep(self.model, cfg, self.pcfg, self.groups, self.log)
            self.train_step = self.accum_step = self.eval_step = None
            return
        p = cfg.parallelism
        if self.groups is None and (p.tp > 1 or p.pp > 1 or p.dp > 1 or p.zero_stage):
            self.log(
                f"parallel: one process (no msrun); parallelism dp={p.dp} tp={p.tp} pp={p.pp} "
                f"zero_stage={p.zero_stage} applies under `mindloom launch`"
            )
        weights = ms.ParameterTuple(self.params)
        flags = _step.decay_flags(self.params, cfg.optimizer.decay_embeddings)
        grad_red = loss_red = eval_red = None
        self.comm_probe, self._last_comm = None, None
        if self.groups is not None and self.dp_size > 1:
            from mindloom_parallel import GradReducer

            dp = self.groups.dp
            grad_red = GradReducer(self.params, dp, cfg.parallelism.bucket_size_mb, mean=True)
            loss_red = _step.MeanOver(dp.name, dp.size)
            eval_red = _step.MeanOver(dp.name, dp.size)
            # The step's all-reduce runs inside the compiled graph, where the host cannot
            # time it; this probe is the same reducer (same buckets, group and bytes) in
            # a graph of its own, timed at deterministic log steps (see _comm_fields).
            # Compiled and warmed up here, where every rank passes at the same time.
            self.comm_probe = GradReducer(
                self.params, dp, cfg.parallelism.bucket_size_mb, mean=True
            )
            self._probe_grads = tuple(ms.Tensor(np.zeros(p.shape, np.float32)) for p in self.params)
            self.comm_probe(self._probe_grads)[0].asnumpy()
        self.moe_parts = None
        eval_net = self.loss_net
        if isinstance(self.loss_net, MoELossNet):  # DeepSeek-V3: stats, bias update, main CE
            dp_name = self.groups.dp.name if self.groups is not None and self.dp_size > 1 else None
            self.moe_parts = MoEStepParts(self.model, dp_name, self.dp_size)
            self.moe_window = MoEWindow(self.moe_parts.n_routers, self.moe_parts.e,
                                        self.mcfg.moe_aux_loss_weight > 0)  # fmt: skip
            eval_net = MoEEvalNet(self.model)
        self.train_step = _step.TrainStep(
            self.loss_net, weights, flags, self.accum, grad_red, loss_red, moe=self.moe_parts,
            numerics=cfg.monitor.numerics)  # fmt: skip
        if cfg.monitor.numerics:
            self.metrics.numerics = _step.NumericsFields(weights)
        self.accum_step = (
            _step.AccumStep(self.loss_net, weights, self.train_step.acc, moe=self.moe_parts)
            if self.accum > 1
            else None
        )
        self.eval_step = _step.EvalStep(eval_net, eval_red)

    # ------------------------------------------------------------------ state

    def _model_tensors(self) -> dict[str, np.ndarray]:
        import mindspore as ms

        return {
            p.name: p.astype(ms.float32).asnumpy() if p.dtype != ms.float32 else p.asnumpy()
            for p in self.params + self.buffers
        }

    def _opt_tensors(self) -> dict[str, np.ndarray]:
        t = {}
        for p in (*self.train_step.exp_avg, *self.train_step.exp_avg_sq):
            t[p.name] = p.asnumpy()
        return t

    def _load_params(
        self, params, tensors: dict[str, np.ndarray], where: str, prefix: str = ""
    ) -> None:
        import mindspore as ms

        names = {p.name for p in params}
        have = {k for k in tensors if k.startswith(prefix)} if prefix else set(tensors)
        ck.check_tensor_names(names, have, where)
        for p in params:
            arr = tensors[p.name]
            if tuple(arr.shape) != tuple(p.shape):
                raise ck.CheckpointError(
                    f"{where}: tensor {p.name!r} has shape {list(arr.shape)}, the model expects {list(p.shape)}"
                )
            p.set_data(ms.Tensor(arr, p.dtype))

    def _common(self) -> dict[str, Any]:
        from mindloom_train._modelcfg import model_shape

        cfg = self.cfg
        settings = cfg.drift_settings()
        return {
            "format": ck.FORMAT,
            "consumed_samples": self.consumed,
            "consumed_tokens": self.consumed * cfg.train_dataset.seq_length,
            "global_batch_size": cfg.training.global_batch_size,
            "world_size": self.world,
            "config_hash": self.config_hash,
            "seed": cfg.seed,
            "adam_step": self.adam_step,
            "skipped_steps": self.skipped_total,
            "loss_smoothed": self.loss_smoothed,
            "loss_scale": {"scale": self.loss_scale, "good_steps": self.scale_good_steps},
            "lr": self.last_lr,
            "lr_scheduler": schedule_signature(cfg.lr_scheduler, cfg.training.train_iters),
            "optimizer": dataclasses.asdict(cfg.optimizer),
            "rng": _rng_state(),
            "data": {"consumed_samples": self.consumed},
            "drift": {"hash": drift_hash(settings), "settings": settings},
            "model_config": dataclasses.asdict(self.mcfg),
            "model_shape": model_shape(self.mcfg),
            "tokenizer": str(self.tok_path.resolve()) if self.tok_path else None,
            "data_contract": getattr(self, "data_contract", None),
            "versions": versions(),
            "time": time.time(),
        }

    def save(self, step: int, reason: str, background: bool = False) -> Path | None:
        """Write a checkpoint of the current state; with `background`, in a writer thread.

        The state is copied to host memory here, at this step, in either case, so a
        background write holds exactly what a synchronous one would even though the
        parameters move on while it runs. At most one write is in flight: a new save (and
        the end of the run) waits for the previous one first.
        """
        self.wait_pending_save()
        t0 = time.perf_counter()
        if self.par is not None:
            # collective: every rank sends its shards, rank 0 writes them all
            from mindloom_train._parallel import chunk_metadata

            shards = self.par.gather_shards()
            if self.rank != 0:
                self.last_saved_step = step
                return None
            metadata = ck.default_metadata({}, self.world)
            metadata["tensors"], _ = chunk_metadata(self.mcfg, self.pcfg, self.world)
        else:
            if self.rank != 0:  # data parallel: the replicas are identical, rank 0 writes
                self.last_saved_step = step
                return None
            shards = {
                ck.shard_name("model", 0, 1): self._model_tensors(),
                ck.shard_name("optim", 0, 1): self._opt_tensors(),
            }
            metadata = ck.default_metadata(shards, self.world)
        if background:  # the arrays may alias live parameter memory: own them
            shards = {
                f: {k: np.array(v, copy=True) for k, v in t.items()} for f, t in shards.items()
            }
        metadata["layout"] = self._layout()
        common = self._common()
        # the held-out loss of exactly these weights, when evaluated at this step (--checkpoint best)
        ev = getattr(self, "last_eval_at", None)
        common["eval"] = {"step": step, "loss": ev[1]} if ev and ev[0] == step else None
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
        snap = time.perf_counter() - t0
        job: dict[str, Any] = {"step": step, "reason": reason, "t0": t0, "snapshot_s": snap}

        def write() -> None:
            try:
                job["path"] = ck.save_checkpoint(self.save_path, step, shards, common, **kwargs)
            except BaseException as exc:  # reported by the training thread
                job["error"] = exc
            job["t1"] = time.perf_counter()

        job["thread"] = threading.Thread(target=write, name=f"checkpoint-{step}")
        job["thread"].start()
        self._pending_save = job
        self.log(f"checkpoint: writing step {step} in the background (state copied in {snap:.2f}s)")
        return None

    def _saved(self, step: int, reason: str, path: Path, seconds: float, **extra) -> None:
        self.log(f"checkpoint: saved step {step} to {path} ({reason}, {seconds:.2f}s)")
        self.metrics.event(
            "checkpoint", step=step, path=str(path), reason=reason, seconds=round(seconds, 3),
            **extra,
        )  # fmt: skip
        self.last_saved_step = step

    def poll_pending_save(self, wait: bool = False) -> None:
        """Report a finished background save (log, event); raise if it failed."""
        job = self._pending_save
        if job is None or (not wait and job["thread"].is_alive()):
            return
        job["thread"].join()
        self._pending_save = None
        if "error" in job:
            exc = job["error"]
            if isinstance(exc, OSError):
                self._save_failed(job["step"], exc)
            raise exc
        self._saved(
            job["step"], job["reason"], job["path"], job["t1"] - job["t0"],
            background=True, snapshot_s=round(job["snapshot_s"], 3), completed_at_step=self.step,
        )  # fmt: skip

    def wait_pending_save(self) -> None:
        self.poll_pending_save(wait=True)

    def _finish_pending_save(self) -> None:
        """On the way out of the loop: never leave a write behind, never hide its failure."""
        failing = sys.exc_info()[1] is not None
        try:
            self.wait_pending_save()
        except Exception as exc:
            if not failing:
                raise
            # already failing for another reason: report this one, raise that one
            self.log(f"error: background checkpoint write failed too: {exc}")

    def _layout(self) -> dict | None:
        """mindloom_parallel's description: global shape and split of every tensor."""
        try:
            from mindloom_parallel import ParallelDims, layout_metadata

            dims = ParallelDims.from_section(self.cfg.parallelism)
            return layout_metadata(dataclasses.asdict(self.mcfg), dims)
        except Exception as exc:  # descriptive only; a checkpoint never fails for it
            return {"error": f"layout unavailable: {exc}"}

    def _resume(self) -> None:
        """Auto-resume, weights-only start, or fresh; sets step / consumed / optimizer state."""
        from mindloom_train._modelcfg import model_shape

        cfg, c = self.cfg, self.cfg.checkpoint
        self.step = 0
        self.consumed = 0
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
            common = ckpt.common
            where = str(ckpt.path)
            self._check_drift(common, where)
            if common.get("model_shape") != model_shape(self.mcfg):
                raise TrainError(
                    f"{where}: model shape {common.get('model_shape')} differs from the config's "
                    f"{model_shape(self.mcfg)}"
                )
            sig = schedule_signature(cfg.lr_scheduler, cfg.training.train_iters)
            if common.get("lr_scheduler") != sig and not c.override_schedule:
                old = common.get("lr_scheduler") or {}
                diff = [k for k in sig if old.get(k) != sig[k]]
                raise TrainError(
                    f"{where}: LR schedule differs from the checkpoint's in {', '.join(diff)} "
                    f"({', '.join(f'{k}: {old.get(k)!r} -> {sig[k]!r}' for k in diff)}); "
                    "set checkpoint.override_schedule=true to accept"
                )
            # global tensors, whatever layout wrote them (chunks reassembled)
            tensors = ckpt.load_tensors()
            saved = (ckpt.metadata.get("layout") or {}).get("parallel")
            if saved:
                self.log(f"checkpoint: written under layout {saved}")
            if self.par is not None:
                self.par.load(tensors, where)
            else:
                opt_names = ("exp_avg.", "exp_avg_sq.")
                weights = {k: v for k, v in tensors.items() if not k.startswith(opt_names)}
                self._load_params(self.params + self.buffers, weights, where)
                opt_params = [*self.train_step.exp_avg, *self.train_step.exp_avg_sq]
                opt = {k: v for k, v in tensors.items() if k.startswith(opt_names)}
                self._load_params(opt_params, opt, where)
            gbs = cfg.training.global_batch_size
            self.consumed = int(common["consumed_samples"])
            old_gbs = int(common.get("global_batch_size", gbs))
            if self.consumed % gbs:
                raise TrainError(
                    f"{where}: consumed_samples {self.consumed} is not a multiple of the new "
                    f"global_batch_size {gbs}"
                )
            self.step = self.consumed // gbs
            if old_gbs != gbs:
                self.log(
                    f"checkpoint: global batch size {old_gbs} -> {gbs}; consumed_samples "
                    f"{self.consumed} kept, step {ckpt.step} -> {self.step}"
                )
            self.adam_step = int(common.get("adam_step", 0))
            self.skipped_total = int(common.get("skipped_steps", 0))
            self.loss_smoothed = common.get("loss_smoothed")
            ls = common.get("loss_scale") or {}
            self.loss_scale = float(ls.get("scale", self.loss_scale))
            self.scale_good_steps = int(ls.get("good_steps", 0))
            if common.get("rng"):
                _set_rng_state(common["rng"])
            self.resumed_from = str(ckpt.path)
            self.log(
                f"checkpoint: resumed from {ckpt.path} (step {self.step}, "
                f"consumed_samples {self.consumed})"
            )
            return
        if c.init_from:
            try:
                src = ck.open_checkpoint(Path(c.init_from), c.verify_integrity)
            except ck.CheckpointError as exc:
                raise TrainError(f"checkpoint.init_from: {exc}") from None
            names = [p.name for p in self.params]
            have = set(src.metadata["tensors"])
            missing = [n for n in names if n not in have]
            if missing:
                raise TrainError(f"checkpoint.init_from: {src.path} has no tensor {missing[0]!r}")
            tensors = src.load_tensors(names)
            if self.par is not None:
                self.par.load_weights(tensors)
            else:
                self._load_params(self.params, tensors, str(src.path))
            self.resumed_from = None
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
        old = rec["settings"]
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

    # ------------------------------------------------------------------ signals

    def _on_signal(self, signum, _frame) -> None:
        name = signal.Signals(signum).name
        if self._stop_signal is None:
            self._stop_signal = name
        else:  # a second signal: stop waiting
            raise KeyboardInterrupt

    def _install_signals(self) -> dict:
        old = {}
        for sig in (signal.SIGTERM, signal.SIGINT):
            try:
                old[sig] = signal.signal(sig, self._on_signal)
            except ValueError:  # not the main thread
                pass
        return old

    def _reassert_signals(self) -> None:
        """Set our handlers again. MindSpore installs C-level SIGINT handlers of its own as
        each of its parts first runs (the first op, the first compiled graph, the first
        gradient), and under msrun those turn SIGINT into SIGTERM; Python's
        ``signal.getsignal`` still reports ours, so only setting them again restores them."""
        for sig in (signal.SIGTERM, signal.SIGINT):
            try:
                signal.signal(sig, self._on_signal)
            except ValueError:  # not the main thread
                pass

    # ------------------------------------------------------------------ eval

    def evaluate(self, step: int) -> float | None:
        if self.eval_data is None:
            return None
        cfg = self.cfg
        mbs = cfg.training.micro_batch_size
        loader = self._make_loader(self.eval_data, 0, cfg.training.eval_iters * mbs * self.dp_size,
                                   gbs=mbs * self.dp_size)  # fmt: skip
        losses = []
        # dropout off while evaluating: the flag is read when a graph compiles, and each
        # step cell keeps the graph it compiled first, so this only matters then
        self.model.set_train(False)
        for batch in loader:
            if self.par is not None:
                losses.append(self.par.eval_loss(batch))
                continue
            out = self.eval_step(*self._tensors(batch))
            losses.append(float(out.asnumpy()))
        loader.close()
        self.model.set_train(True)
        loss = float(np.mean(losses)) if losses else float("nan")
        ppl = math.exp(loss) if loss < 700 else float("inf")
        self.last_eval = (loss, ppl)
        self.last_eval_at = (step, loss)
        self.log(f"eval: step {step} held-out loss {loss:.4f} ppl {ppl:.2f}")
        self.metrics.event("eval", step=step, loss=loss, ppl=ppl)
        return loss

    # ------------------------------------------------------------------ helpers

    def _make_loader(self, dataset, consumed: int, total: int, gbs: int | None = None):
        from mindloom_train._data import build_loader

        return build_loader(dataset, self.cfg, dp_rank=self.dp_rank, dp_size=self.dp_size,
                            consumed=consumed, total=total, global_batch_size=gbs)  # fmt: skip

    @staticmethod
    def _tensors(batch: dict[str, np.ndarray]):
        from mindspore import Tensor

        return (
            Tensor(batch["tokens"]),
            Tensor(batch["labels"]),
            Tensor(batch["position_ids"]),
            Tensor(batch["segment_ids"]),
            Tensor(batch["loss_mask"]),
        )

    def _anomaly(self, step: int, kind: str, value: float, action: str) -> None:
        self.metrics.event(
            "anomaly", step=step, kind=kind, value=value, action=action, rank=self.rank
        )
        self.log(f"anomaly: step {step} rank {self.rank} {kind} value={value} action={action}")

    # ------------------------------------------------------------------ run

    def run(self) -> int:
        """The run with its one error path: every expected failure (the table in
        _errors.classify) is one `error: ...` line and the same reason in the `end`
        event; anything else is a bug and keeps its traceback (its `end` event too)."""
        from mindloom_train._errors import classify

        try:
            self._setup_context()
            self._init_dist()
            self._setup_dirs()
        except Exception as exc:
            known = classify(exc)
            if known is None:
                raise
            print(f"error: {known[1]}", file=sys.stderr)
            return known[0]
        status, reason, code = "failed", "", EXIT_FAILED
        self.step = 0
        try:
            code, status, reason = self._run()
        except RuntimeError as exc:
            if type(exc) is not RuntimeError and classify(exc) is not None:
                code, reason = classify(exc)
            elif self.world <= 1:
                # a step MindSpore failed (an op error, a bad input it caught): one line,
                # not a page of C++ stack
                code = EXIT_FAILED
                reason = f"step {self.step + 1} failed in MindSpore: {_first_line(exc)}"
            else:
                # MindSpore fails a collective whose peer stopped answering (missed
                # heartbeats, MS_NODE_TIMEOUT): one line, not a page of C++ stack
                reason = (
                    f"rank {self.rank}: step {self.step + 1} failed in MindSpore ({_first_line(exc)}); "
                    f"another rank is probably gone: see every rank's log"
                )
                code = EXIT_HANG
            self._log_error(reason)
        except BaseException as exc:
            known = classify(exc)
            if known is None:
                reason = f"internal error: {type(exc).__name__}: {_first_line(exc)}"
                raise
            code, reason = known
            self._log_error(reason)
        finally:
            self._log_peak_memory()
            try:  # best effort: the failure may be the metrics file itself (ENOSPC)
                self.metrics.event("end", step=self.step, status=status, reason=reason,
                                   exit_code=code)  # fmt: skip
            except OSError:
                pass
            try:
                self.metrics.close()
            except OSError:
                pass
            self.log.close()
        return code

    def _dropout_key(self, step: int, micro: int):
        # masks are a function of (seed, step, micro-batch): a resume that restores the step
        # redraws them exactly; each data-parallel rank gets its own micro-batch numbers
        if not self.mcfg.dropout or self.mcfg.family != "llama":
            return None  # DeepSeek-V3 still draws MindSpore's stateful dropout masks
        from mindloom_model import dropout_key

        return dropout_key(self.cfg.seed, step, self.dp_rank * self.accum + micro)

    def _log_peak_memory(self) -> None:
        # every rank's log: the estimate against what happened; before an error line, so
        # `error: ...` stays the last line a failed run prints
        est = getattr(self, "memory_estimate", None)
        if est is None or getattr(self, "_peak_logged", False):
            return
        self._peak_logged = True
        try:
            self.log(f"memory: peak RSS {peak_rss_mb():.1f} MiB on rank {self.rank}; "
                     f"estimate {est.total / 2**20:.1f} MiB")  # fmt: skip
        except OSError:
            pass

    def _log_error(self, reason: str) -> None:
        self._log_peak_memory()
        try:
            self.log(f"error: {reason}")
        except OSError:  # train.log itself failed (ENOSPC): the console still gets it
            print(f"error: {reason}", file=sys.stderr)

    def _run(self) -> tuple[int, str, str]:
        from mindloom_train import _data
        from mindloom_train._step import hyper_vector

        cfg, t = self.cfg, self.cfg.training
        self.config_hash = cfg.hash()
        self.log(
            f"run: {self.run_dir} (config hash {self.config_hash}); checkpoints in {self.save_path}"
        )
        # data first: a missing corpus should fail before any model is built
        tok = _data.prepare_tokenizer(cfg, self.log)
        self.tok = tok
        self.tok_path = (
            _data.tokenizer_dir(cfg) if not cfg.tokenizer.path else Path(cfg.tokenizer.path)
        )
        train_prefixes = _data.prepare_dataset(
            cfg, cfg.train_dataset, "train", self.tok_path, self.log
        )
        eval_prefixes = (
            _data.prepare_dataset(cfg, cfg.eval_dataset, "eval", self.tok_path, self.log)
            if cfg.eval_dataset is not None
            else None
        )
        self.data_contract = _data.data_contract(train_prefixes, eval_prefixes, tok)
        same = "; the held-out data's match" if eval_prefixes else ""
        self.log(f"data: {_data.describe_contract(self.data_contract)}{same}")
        from mindloom_train._memory import check_precision, preflight

        check_precision(cfg)  # settings that cannot train: one line, exit 2
        if not cfg.model.get("init_from_hf"):  # before anything is allocated (exit 2)
            self.memory_estimate = preflight(cfg, tok.vocab_size, self.world, self.log)
        self._build_model(tok.vocab_size)
        # every token id against the model's vocabulary, before step 1 (exit 2 if not)
        _data.check_token_ids(train_prefixes + (eval_prefixes or []), self.mcfg.vocab_size)
        if cfg.precision.compute_dtype != "fp32" and cfg.context.device_target == "CPU":
            self.log(
                f"precision: the CPU backend has no {cfg.precision.compute_dtype} MatMul; computing in fp32"
            )
        self._build_steps()
        self.adam_step = 0
        self.skipped_total = 0
        self.loss_smoothed = None
        dynamic = cfg.precision.loss_scale == "dynamic" or (
            cfg.precision.loss_scale == "auto" and cfg.precision.compute_dtype == "fp16"
        )
        self.loss_scale = cfg.precision.initial_loss_scale if dynamic else 1.0
        self.scale_good_steps = 0
        self.last_lr = 0.0
        self.last_eval = None
        self.last_saved_step = None
        self.resumed_from = None
        self._resume()

        gbs, total_iters = t.global_batch_size, t.train_iters
        seq = cfg.train_dataset.seq_length
        self.train_data = _data.build_dataset(
            cfg, cfg.train_dataset, train_prefixes, total_iters * gbs, "train", tok
        )
        self.eval_data = None
        if eval_prefixes is not None:
            n_eval = t.eval_iters * t.micro_batch_size * self.dp_size
            self.eval_data = _data.build_dataset(
                cfg, cfg.eval_dataset, eval_prefixes, n_eval, "eval", tok
            )
        flops_tok = self.mcfg.flops_per_token(seq)
        peak, peak_src = peak_flops(cfg.context.device_target, cfg.monitor.peak_tflops)
        n_params = self.mcfg.num_params()
        self.log(
            f"model: {n_params / 1e6:.2f}M parameters, {flops_tok / 1e6:.1f} MFLOPs/token; "
            f"peak {peak / 1e12:.3f} TFLOP/s ({peak_src}); {total_iters} steps x {gbs} samples x {seq} tokens"
        )
        self.metrics.event(
            "start",
            step=self.step,
            run_name=self.run_dir.name,
            total_steps=total_iters,
            seed=cfg.seed,
            config_hash=self.config_hash,
            versions=versions(),
            world_size=self.world,
            resumed_from=self.resumed_from,
            num_params=n_params,
            flops_per_token=flops_tok,
            peak_flops=peak,
            global_batch_size=gbs,
            seq_length=seq,
            data_contract=self.data_contract,
        )
        if self.step >= total_iters:
            self.log(f"run: already at step {self.step} of {total_iters}; nothing to train")
            return EXIT_OK, "completed", "already complete"

        old_handlers = self._install_signals()
        self._start_watchdog()
        loader = self._make_loader(self.train_data, self.consumed, total_iters * gbs)
        it = iter(loader)
        o = cfg.optimizer
        consecutive = 0
        window: dict[str, float] = {"t0": time.perf_counter(), "steps": 0, "tokens": 0, "wait": 0.0,
                                    "loss_sum": 0.0, "loss_n": 0, "step_time": 0.0}  # fmt: skip
        wait0 = loader.wait_s
        profiler = None
        code, status, reason = EXIT_OK, "completed", "train_iters reached"
        t_loop = time.perf_counter()
        try:
            while self.step < total_iters:
                step = self.step + 1  # the update being computed
                if cfg.profiler.enabled and step == cfg.profiler.start_step:
                    profiler = self._start_profiler()
                t_step = time.perf_counter()
                self._reassert_signals()  # the previous step or eval may have compiled
                self._watch(f"step {step}", compiles="train")
                self.fault.at_step_start(step, stopped=lambda: self._stop_signal is not None)
                lr = lr_at(self.step, cfg.lr_scheduler, total_iters)
                prev_sum = 0.0
                time_up = False
                for micro_i in range(self.accum - 1 if self.par is None else 0):
                    batch = next(it)
                    hyper = hyper_vector(lr=lr, beta1=o.beta1, beta2=o.beta2, eps=o.eps,
                                         weight_decay=o.weight_decay, adam_step=self.adam_step + 1,
                                         clip=t.grad_clip, spike=t.grad_spike_threshold,
                                         loss_scale=self.loss_scale)  # fmt: skip
                    dkey = self._dropout_key(step, micro_i)
                    prev_sum += float(self.accum_step(*self._tensors(batch), hyper, dkey).asnumpy())
                micro = [next(it) for _ in range(self.accum)] if self.par is not None else None
                batch = micro[-1] if micro is not None else next(it)
                hyper = hyper_vector(
                    lr=lr,
                    beta1=o.beta1,
                    beta2=o.beta2,
                    eps=o.eps,
                    weight_decay=o.weight_decay,
                    adam_step=self.adam_step + 1,
                    clip=t.grad_clip,
                    spike=t.grad_spike_threshold,
                    loss_scale=self.loss_scale,
                    nan_loss=self.fault.step_fault("nan_loss", step),
                    inf_grad=self.fault.step_fault("inf_grad", step),
                    grad_mult=1e6 if self.fault.step_fault("grad_spike", step) else 1.0,
                    prev_loss_sum=prev_sum,
                    n_micro=self.accum,
                    stop=self._stop_signal is not None,
                )
                if self.par is not None:
                    over = (
                        t.time_limit_s is not None and time.perf_counter() - t_loop > t.time_limit_s
                    )
                    loss, gnorm, ok, stop_any, time_up = self.par.step(
                        micro, hyper.asnumpy(), stop=self._stop_signal is not None, time_up=over
                    )
                    # decisions that lead to collectives (save, eval, log) use the agreed
                    # flags, never a signal that reached this rank after the agreement
                    if stop_any and self._stop_signal is None:
                        self._stop_signal = "a stop signal on another rank"
                    stop_now = stop_any
                    window["comm_s"] = window.get("comm_s", 0.0) + self.par.rank_metrics["comm_s"]
                    window["rank_step_s"] = (
                        window.get("rank_step_s", 0.0) + self.par.rank_metrics["step_s"]
                    )
                else:
                    dkey = self._dropout_key(step, self.accum - 1)
                    loss_t, gnorm_t, ok_t, stop_t, *moe_t = self.train_step(
                        *self._tensors(batch), hyper, dkey
                    )
                    if cfg.monitor.numerics:  # the last output; read at the log step only
                        *moe_t, self.metrics.numerics.rows = moe_t
                    if moe_t:
                        self.moe_window.add(moe_t[0].asnumpy())
                    loss, gnorm = float(loss_t.asnumpy()), float(gnorm_t.asnumpy())
                    ok = bool(ok_t.asnumpy())
                    if float(stop_t.asnumpy()) > 0 and self._stop_signal is None:
                        self._stop_signal = "a stop signal on another rank"
                    stop_now = None  # the compiled path reads self._stop_signal as it goes
                dt = time.perf_counter() - t_step
                self.step = step
                self.consumed += gbs
                self.last_lr = lr
                if ok:
                    self.adam_step += 1
                    consecutive = 0
                    if dynamic:
                        self.scale_good_steps += 1
                        if self.scale_good_steps >= cfg.precision.loss_scale_window:
                            self.loss_scale *= 2.0
                            self.scale_good_steps = 0
                    if (
                        t.loss_spike_factor is not None
                        and self.loss_smoothed is not None
                        and step > 10
                        and loss > t.loss_spike_factor * self.loss_smoothed
                    ):
                        self._anomaly(step, "loss_spike", loss, "reported")
                    a = t.loss_smoothing
                    self.loss_smoothed = (
                        loss
                        if self.loss_smoothed is None
                        else a * self.loss_smoothed + (1 - a) * loss
                    )
                    window["loss_sum"] += loss
                    window["loss_n"] += 1
                else:
                    self.skipped_total += 1
                    overflow = not math.isfinite(gnorm)
                    if dynamic and overflow and self.loss_scale > cfg.precision.min_loss_scale:
                        # fp16 overflow: expected now and then; halve the scale, not an anomaly streak
                        self.loss_scale = max(self.loss_scale / 2, cfg.precision.min_loss_scale)
                        self.scale_good_steps = 0
                        self._anomaly(step, "nonfinite_grad", gnorm, "skipped")
                    else:
                        consecutive += 1
                        if not math.isfinite(loss):
                            kind, value = "nonfinite_loss", loss
                        elif overflow:
                            kind, value = "nonfinite_grad", gnorm
                        else:
                            kind, value = "grad_spike", gnorm
                        stop = consecutive >= t.max_consecutive_skips
                        self._anomaly(step, kind, value, "stopped" if stop else "skipped")
                        if stop:
                            reason = (
                                f"step {step} rank {self.rank}: {consecutive} consecutive skipped "
                                f"updates (last: {kind} = {value}); weights are those of the last good step"
                            )
                            self.log(f"error: {reason}")
                            code, status = EXIT_ANOMALY, "stopped"
                            self._watch(f"checkpoint save at step {step}")
                            self._safe_save(step, "anomaly stop")
                            break
                window["steps"] += 1
                window["tokens"] += gbs * seq
                window["step_time"] += dt
                last = self.step == total_iters
                if stop_now is None:
                    stop_now = self._stop_signal is not None
                if step % cfg.monitor.log_interval == 0 or last or stop_now:
                    self._log_metrics(
                        step, total_iters, loss, lr, gnorm, window, loader, wait0, flops_tok, peak
                    )
                    wait0 = loader.wait_s
                    window = {"t0": time.perf_counter(), "steps": 0, "tokens": 0, "wait": 0.0,
                              "loss_sum": 0.0, "loss_n": 0, "step_time": 0.0}  # fmt: skip
                if profiler is not None and step == cfg.profiler.end_step:
                    self._stop_profiler(profiler)
                    profiler = None
                t_pause = time.perf_counter()
                self.poll_pending_save()
                if t.eval_interval and step % t.eval_interval == 0 and not last:
                    self._watch(f"evaluation at step {step}", compiles="eval")
                    self.evaluate(step)
                    self._reassert_signals()
                if stop_now if self.par is not None else self._stop_signal:
                    reason = f"{self._stop_signal} received"
                    self.log(f"run: {reason}; saving step {step} and exiting")
                    self._watch(f"checkpoint save at step {step}")
                    self._safe_save(step, self._stop_signal)
                    return EXIT_OK, "stopped", reason
                if (
                    cfg.checkpoint.save_interval
                    and step % cfg.checkpoint.save_interval == 0
                    and not last
                ):
                    self._watch(f"checkpoint save at step {step}")
                    self._safe_save(step, "interval", background=cfg.checkpoint.async_save)
                if self.par is not None:
                    over = time_up
                else:
                    over = (
                        t.time_limit_s is not None and time.perf_counter() - t_loop > t.time_limit_s
                    )
                if over and not last:
                    reason = f"time limit {t.time_limit_s:g}s reached at step {step}"
                    self.log(f"run: {reason}")
                    break
                # eval and save time is not training time (tokens/s, MFU)
                window["t0"] += time.perf_counter() - t_pause
            if code == EXIT_OK:
                self._watch(f"final evaluation at step {self.step}", compiles="eval")
                self.evaluate(self.step)
                if cfg.checkpoint.save_at_end and self.last_saved_step != self.step:
                    self._watch(f"final checkpoint save at step {self.step}")
                    self._safe_save(self.step, "end")
        finally:
            if self.watchdog is not None:
                self.watchdog.close()
                self.watchdog = None
            loader.close()
            self._finish_pending_save()
            if profiler is not None:
                self._stop_profiler(profiler)
            for sig, h in old_handlers.items():
                signal.signal(sig, h)
        return code, status, reason

    def _start_watchdog(self) -> None:
        if self.world <= 1:
            return
        from mindloom_train._watchdog import StepWatchdog

        def report(msg: str) -> None:  # the record first: the launcher may kill us next
            self.metrics.event("end", step=self.step, status="failed", reason=msg,
                               exit_code=EXIT_HANG)  # fmt: skip
            self.metrics.close()
            self.log(msg)

        self.watchdog = StepWatchdog(self.rank, report)

    def _watch(self, phase: str, compiles: str | None = None) -> None:
        """Start the watchdog's clock for the next phase (several workers only).

        `compiles` names the graph the phase runs; its first run in this process compiles
        it and gets `first_step_timeout_s` instead of `comm_timeout_s`.
        """
        if self.watchdog is None:
            return
        p = self.cfg.parallelism
        first = compiles is not None and compiles not in self._compiled
        if first:
            self._compiled.add(compiles)
        self.watchdog.arm(phase, p.first_step_timeout_s if first else p.comm_timeout_s)

    def _safe_save(self, step: int, reason: str, background: bool = False) -> None:
        try:
            self.save(step, reason, background=background)
        except ck.CheckpointError:
            raise
        except OSError as exc:
            self._save_failed(step, exc)

    def _save_failed(self, step: int, exc: OSError) -> None:
        self.metrics.event("checkpoint", step=step, path=None, status="failed", reason=str(exc))
        prev = ck.read_tracker(self.save_path) if self.save_path.exists() else None
        raise TrainError(
            f"checkpoint save at step {step} failed ({exc}); nothing was left at a final "
            f"path; the latest complete checkpoint is step {prev}"
        ) from None

    def _log_metrics(
        self, step, total, loss, lr, gnorm, window, loader, wait0, flops_tok, peak
    ) -> None:
        wall = max(time.perf_counter() - window["t0"], 1e-9)
        tps = window["tokens"] / wall
        rec = {
            "step": step,
            "loss": window["loss_sum"] / window["loss_n"] if window["loss_n"] else loss,
            "loss_smoothed": self.loss_smoothed,
            "lr": lr,
            "grad_norm": gnorm,
            "tokens_per_s": tps,
            "mfu": tps * flops_tok / peak if peak else None,
            "step_time_s": window["step_time"] / max(window["steps"], 1),
            "tokens": self.consumed * self.cfg.train_dataset.seq_length,
            "consumed_samples": self.consumed,
            "data_wait_frac": min(1.0, (loader.wait_s - wait0) / wall),
            "mem_rss_mb": mem_rss_mb(),
            "skipped_steps": self.skipped_total,
            "step_loss": loss,
        }
        if self.loss_scale != 1.0:
            rec["loss_scale"] = self.loss_scale
        if getattr(self, "moe_parts", None) is not None:
            from mindloom_train._moe import moe_bias_values

            rec.update(self.moe_window.fields(moe_bias_values(self.model)))
            self.moe_window.reset()
        probe = step % self.cfg.monitor.log_interval == 0 or step == total
        rec.update(self._comm_fields(window, probe))
        self.metrics.write(rec)
        self.log.progress(progress_text(rec, total), console=self.cfg.monitor.progress_bar)

    def _comm_fields(self, window, probe: bool = True) -> dict:
        """Communication time per step and its share of the step, this rank and every rank.

        Measured around each collective where the step runs PyNative (ParallelEngine). The
        compiled data-parallel step holds its all-reduce inside the graph, where it cannot
        be timed; there `comm_probe` (the same reducer on the same bytes, its own graph)
        is timed instead, only at log steps every rank reaches (`probe`): a log forced by
        a signal on one rank must not start a collective the others never join; such a
        record repeats the last probe. One process: 0.
        """
        if self.par is None:
            if self.world == 1:
                return {"comm_s": 0.0, "comm_share": 0.0, "comm_s_ranks": [0.0],
                        "comm_share_ranks": [0.0]}  # fmt: skip
            if self.comm_probe is None:
                return {"comm_s": None, "comm_share": None, "comm_s_ranks": None,
                        "comm_share_ranks": None}  # fmt: skip
            if probe or self._last_comm is None:
                self._last_comm = self._probe_comm(window)
            return self._last_comm
        steps = max(window["steps"], 1)
        ranks = self.par.gather_metrics(window.get("comm_s", 0.0), window.get("rank_step_s", 0.0))
        share = [c / s if s > 0 else 0.0 for c, s in ranks]
        return {
            "comm_s": ranks[self.rank][0] / steps,
            "comm_share": share[self.rank],
            "comm_s_ranks": [c / steps for c, _ in ranks],
            "comm_share_ranks": share,
        }

    def _probe_comm(self, window) -> dict:
        from mindloom_parallel import gather_rows

        t0 = time.perf_counter()
        self.comm_probe(self._probe_grads)[0].asnumpy()
        comm = time.perf_counter() - t0
        step_s = window["step_time"] / max(window["steps"], 1)
        ranks = gather_rows([comm, step_s], self.groups.world)
        share = [min(1.0, float(c) / float(s)) if s > 0 else 0.0 for c, s in ranks]
        return {
            "comm_s": comm,
            "comm_share": share[self.rank],
            "comm_s_ranks": [float(c) for c, _ in ranks],
            "comm_share_ranks": share,
        }

    def _start_profiler(self):
        try:
            import mindspore as ms

            out = self.cfg.profiler.output_dir or str(self.run_dir / "profile")
            return ms.Profiler(output_path=out)
        except Exception as exc:  # the profiler is optional; never fail a run for it
            self.log(f"profiler: not started ({exc})")
            return None

    def _stop_profiler(self, prof) -> None:
        try:
            prof.stop()
            prof.analyse()
            self.log("profiler: trace written")
        except Exception as exc:
            self.log(f"profiler: failed to write the trace ({exc})")


def _first_line(exc: BaseException) -> str:
    """The informative line of a MindSpore error (they open with blank and dashed lines)."""
    for line in str(exc).splitlines():
        line = line.strip()
        if line and not line.startswith(("---", "- ")):
            return line
    return type(exc).__name__


def train(cfg: Config, *, console=None, fault_spec: str | None = None) -> int:
    return Trainer(cfg, console=console, fault_spec=fault_spec).run()
