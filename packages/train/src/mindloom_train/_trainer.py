"""The training loop: data -> step runner -> guards -> metrics -> eval -> checkpoints.

`Trainer` wires the parts and runs a short loop over them: `Runtime` (context, ranks,
signals), `StepRunner` (compiled or engine step), `TrainState` + `LossScaler` +
`AnomalyGuard`, `Evaluator`, `CheckpointManager`, `ThroughputWindow`, the watchdog's
`PhaseClock`. Exit codes: the table in `_errors.py`.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

from mindloom_train import _checkpoint as ck
from mindloom_train._build import (
    BuiltModel,
    PreparedData,
    build_datasets,
    build_model,
    prepare_data,
)
from mindloom_train._checkpointing import CheckpointManager, RunIdentity
from mindloom_train._config import Config, dump_config
from mindloom_train._errors import (
    EXIT_ANOMALY,
    EXIT_FAILED,
    EXIT_HANG,
    EXIT_OK,
    TrainError,
    classify,
)
from mindloom_train._evaluator import Evaluator
from mindloom_train._faults import FaultInjector
from mindloom_train._guards import AnomalyGuard, LossScaler
from mindloom_train._metrics import MetricsWriter, RunLog, peak_flops, progress_text
from mindloom_train._run_end import (
    close_records,
    first_line,
    log_error,
    log_peak_memory,
    runtime_failure,
)
from mindloom_train._runner import StepInputs, StepResult, StepRunner, make_runner
from mindloom_train._runtime import PhaseClock, Profiler, Runtime
from mindloom_train._schedule import lr_at
from mindloom_train._state import TrainState, versions
from mindloom_train._throughput import FlopsBudget, ThroughputWindow, metrics_record

__all__ = ["EXIT_ANOMALY", "EXIT_FAILED", "EXIT_OK", "TrainError", "Trainer", "train", "versions"]


class Trainer:
    def __init__(self, cfg: Config, *, console=None, fault_spec: str | None = None):
        self.cfg = cfg
        self.console = console
        self._fault_spec = fault_spec
        self.rt = Runtime(cfg)
        self.fault = FaultInjector(fault_spec, rank=0)
        self.state = TrainState()
        self.run_dir = Path(cfg.run_dir)
        self.save_path = Path(os.path.realpath(cfg.save_path))
        self.log: RunLog | None = None
        self.metrics: MetricsWriter | None = None
        self.config_hash = cfg.hash()
        self.data: PreparedData | None = None
        self.built: BuiltModel | None = None
        self.runner: StepRunner | None = None
        self.scaler: LossScaler | None = None
        self.guard: AnomalyGuard | None = None
        self.ckpt: CheckpointManager | None = None
        self.evaluator: Evaluator | None = None
        self.clock: PhaseClock | None = None
        self.profiler: Profiler | None = None
        self.memory_estimate = None  # _memory's estimate, logged against the peak at the end
        self._peak_logged = False

    @property
    def step(self) -> int:
        """The last completed step."""
        return self.state.step

    @property
    def last_eval(self) -> tuple[float, float] | None:
        """(held-out loss, perplexity) of the last evaluation, if any."""
        return self.evaluator.last if self.evaluator is not None else None

    @property
    def model(self):
        """The model being trained (after the run has built it)."""
        return self.built.model if self.built is not None else None

    # ------------------------------------------------------------------ setup

    def _setup_dirs(self) -> None:
        self.run_dir.mkdir(parents=True, exist_ok=True)
        is_main = self.rt.rank == 0
        self.log = RunLog(self.run_dir / "train.log" if is_main else None, self.console,
                          self.rt.rank)  # fmt: skip
        self.metrics = MetricsWriter(self.run_dir / "metrics.jsonl" if is_main else None)
        if self.cfg.monitor.health.enabled:  # training-health rules on every record
            from mindloom_train._health import HealthMonitor

            self.metrics.health = HealthMonitor(self.cfg.monitor.health, self.log)
        if is_main:
            ck.atomic_write(self.run_dir / "config.yaml", dump_config(self.cfg).encode())
            ck.clean_stale_saves(self.save_path, self.log)

    def _build(self) -> None:
        """Model, step runner, state, guards and checkpoints, then the resume."""
        from mindloom_train import _data
        from mindloom_train._memory import check_precision, preflight

        cfg, data = self.cfg, self.data
        check_precision(cfg)  # settings that cannot train: one line, exit 2
        if not cfg.model.init_from_hf:  # before anything is allocated (exit 2)
            self.memory_estimate = preflight(cfg, data.tok.vocab_size, self.rt.world, self.log)
        self.built = build_model(cfg, self.rt, data.tok.vocab_size, self.log)
        # every token id against the model's vocabulary, before step 1 (exit 2 if not)
        _data.check_token_ids(data.train_prefixes + (data.eval_prefixes or []),
                              self.built.mcfg.vocab_size)  # fmt: skip
        if cfg.precision.compute_dtype != "fp32" and cfg.context.device_target == "CPU":
            self.log(f"precision: the CPU backend has no {cfg.precision.compute_dtype} MatMul; "
                     "computing in fp32")  # fmt: skip
        # MindSpore cells start in inference mode, where nn.Dropout is the identity
        self.built.model.set_train(True)
        self.runner = make_runner(self.built, cfg, self.rt, self.log)
        from mindloom_train._rankstats import log_state_bytes

        log_state_bytes(self.runner, self.log)  # per rank: what the layout leaves here
        self.metrics.numerics = getattr(self.runner, "numerics", None)  # monitor.numerics
        self.scaler = LossScaler(cfg, self.state)
        self.guard = AnomalyGuard(cfg, self.state, self.scaler, self.rt.rank, self._anomaly)
        identity = RunIdentity(self.config_hash, str(data.tok_path.resolve()), data.contract)
        self.ckpt = CheckpointManager(
            cfg, self.rt, self.state, self.runner, self.built, save_path=self.save_path,
            log=self.log, metrics=self.metrics, fault=self.fault, identity=identity,
        )  # fmt: skip
        self.ckpt.resume()

    def _make_loader(self, dataset, consumed: int, total: int, gbs: int | None = None):
        from mindloom_train._data import build_loader

        return build_loader(dataset, self.cfg, dp_rank=self.rt.dp_rank, dp_size=self.rt.dp_size,
                            consumed=consumed, total=total, global_batch_size=gbs)  # fmt: skip

    def _start_event(self) -> FlopsBudget:
        cfg, t, mcfg = self.cfg, self.cfg.training, self.built.mcfg
        seq, gbs, total = cfg.train_dataset.seq_length, t.global_batch_size, t.train_iters
        flops = FlopsBudget(mcfg.flops_per_token(seq), 0.0)
        peak, peak_src = peak_flops(cfg.context.device_target, cfg.monitor.peak_tflops)
        flops = FlopsBudget(flops.per_token, peak)
        n_params = mcfg.num_params()
        self.log(
            f"model: {n_params / 1e6:.2f}M parameters, {flops.per_token / 1e6:.1f} MFLOPs/token; "
            f"peak {peak / 1e12:.3f} TFLOP/s ({peak_src}); {total} steps x {gbs} samples x {seq} tokens"
        )
        self.metrics.event(
            "start", step=self.state.step, run_name=self.run_dir.name, total_steps=total,
            seed=cfg.seed, config_hash=self.config_hash, versions=versions(),
            world_size=self.rt.world, resumed_from=self.ckpt.resumed_from, num_params=n_params,
            flops_per_token=flops.per_token, peak_flops=peak, global_batch_size=gbs,
            seq_length=seq, data_contract=self.data.contract,
        )  # fmt: skip
        return flops

    # ------------------------------------------------------------------ the run

    def evaluate(self, step: int) -> float | None:
        loss = self.evaluator.evaluate(step)
        if loss is not None:
            self.ckpt.last_eval_at = self.evaluator.last_at
        return loss

    def _anomaly(self, step: int, kind: str, value: float, action: str) -> None:
        rank = self.rt.rank
        self.metrics.event("anomaly", step=step, kind=kind, value=value, action=action, rank=rank)
        self.log(f"anomaly: step {step} rank {rank} {kind} value={value} action={action}")

    def _report_hang(self, msg: str) -> None:  # the record first: the launcher may kill us next
        self.metrics.event("end", step=self.state.step, status="failed", reason=msg,
                           exit_code=EXIT_HANG)  # fmt: skip
        self.metrics.close()
        self.log(msg)

    def _run(self) -> tuple[int, str, str]:
        cfg, t = self.cfg, self.cfg.training
        self.log(
            f"run: {self.run_dir} (config hash {self.config_hash}); checkpoints in {self.save_path}"
        )
        self.data = prepare_data(
            cfg, self.log
        )  # data first: a missing corpus fails before any model
        self._build()
        train_data, eval_data = build_datasets(cfg, self.data, self.rt.dp_size)
        self.evaluator = Evaluator(cfg, eval_data, self.runner, self.built.model,
                                   self._make_loader, self.rt.dp_size, self.log, self.metrics)  # fmt: skip
        flops = self._start_event()
        if self.metrics.health is not None:  # the padding rule, at pack time
            for ev in self.metrics.health.check_packing(train_data, "train", self.state.step):
                self.metrics.write(ev)
        if self.state.step >= t.train_iters:
            self.log(f"run: already at step {self.state.step} of {t.train_iters}; nothing to train")
            return EXIT_OK, "completed", "already complete"
        self.rt.install_signals()
        self.clock = PhaseClock(cfg, self.rt.rank, self.rt.world, self._report_hang)
        self.profiler = Profiler(cfg, str(self.run_dir / "profile"), self.log, self.rt.rank)
        train_data = self.fault.slow_data(train_data, t.global_batch_size)  # test-only
        loader = self._make_loader(train_data, self.state.consumed,
                                   t.train_iters * t.global_batch_size)  # fmt: skip
        try:
            return self._loop(loader, flops)
        finally:
            self.clock.close()
            loader.close()
            self.ckpt.finish_pending()
            self.profiler.stop()
            self.rt.restore_signals()

    def _hyper(self, lr: float, **over):
        from mindloom_train._step import hyper_vector

        o, t = self.cfg.optimizer, self.cfg.training
        return hyper_vector(lr=lr, beta1=o.beta1, beta2=o.beta2, eps=o.eps,
                            weight_decay=o.weight_decay, adam_step=self.state.adam_step + 1,
                            clip=t.grad_clip, spike=t.grad_spike_threshold,
                            loss_scale=self.state.loss_scale, **over)  # fmt: skip

    def _step_inputs(self, step: int, it, lr: float, t_loop: float) -> StepInputs:
        limit = self.cfg.training.time_limit_s

        def flags() -> tuple[bool, bool]:
            over = limit is not None and time.perf_counter() - t_loop > limit
            return self.rt.stop_signal is not None, over

        faults = {
            "nan_loss": self.fault.step_fault("nan_loss", step),
            "inf_grad": self.fault.step_fault("inf_grad", step),
            "grad_mult": 1e6 if self.fault.step_fault("grad_spike", step) else 1.0,
        }
        return StepInputs(step, it, lambda **kw: self._hyper(lr, **kw), flags, faults)

    def _loop(self, loader, flops: FlopsBudget) -> tuple[int, str, str]:
        cfg, t, s = self.cfg, self.cfg.training, self.state
        total, gbs = t.train_iters, t.global_batch_size
        it = iter(loader)
        window = ThroughputWindow(data_wait0=loader.wait_s)
        t_loop = time.perf_counter()
        reason = "train_iters reached"
        while s.step < total:
            step = s.step + 1  # the update being computed
            self.profiler.before_step(step)
            t_step = time.perf_counter()
            self.rt.reassert_signals()  # the previous step or eval may have compiled
            self.clock.watch(f"step {step}", compiles="train")
            self.fault.at_step_start(step, stopped=lambda: self.rt.stop_signal is not None)
            lr = lr_at(s.step, cfg.lr_scheduler, total)
            res = self.runner.step(self._step_inputs(step, it, lr, t_loop))
            step_s = time.perf_counter() - t_step
            s.step, s.last_lr = step, lr
            s.consumed += gbs
            if res.stop and self.rt.stop_signal is None:
                self.rt.stop_signal = "a stop signal on another rank"
            halt = self.guard.after_step(step, res.loss, res.gnorm, res.ok)
            if halt is not None:
                self.log(f"error: {halt.reason}")
                self.clock.watch(f"checkpoint save at step {step}")
                self.ckpt.safe_save(step, "anomaly stop")
                return EXIT_ANOMALY, "stopped", halt.reason
            if res.ok:
                window.add_loss(res.loss)
            window.add(gbs * cfg.train_dataset.seq_length, step_s,
                       res.comm_s, res.rank_step_s)  # fmt: skip
            last = step == total
            if step % cfg.monitor.log_interval == 0 or last or res.stop:
                self._log_metrics(step, res, lr, window, loader.wait_s, flops)
                window = ThroughputWindow(data_wait0=loader.wait_s)
            self.profiler.after_step(step)
            t_pause = time.perf_counter()
            outcome = self._between_steps(step, last, res)
            if outcome is not None:
                if outcome[0] == "stop":
                    return EXIT_OK, "stopped", outcome[1]
                reason = outcome[1]
                break
            window.pause(t_pause)  # eval and save time is not training time (tokens/s, MFU)
        self.clock.watch(f"final evaluation at step {s.step}", compiles="eval")
        self.evaluate(s.step)
        if cfg.checkpoint.save_at_end and self.ckpt.last_saved_step != s.step:
            self.clock.watch(f"final checkpoint save at step {s.step}")
            self.ckpt.safe_save(s.step, "end")
        return EXIT_OK, "completed", reason

    def _between_steps(self, step: int, last: bool, res: StepResult) -> tuple[str, str] | None:
        """Evaluation, the stop, the interval save and the time limit after `step`:
        ("stop", reason) to end the run now, ("end", reason) to finish it normally."""
        cfg, t = self.cfg, self.cfg.training
        self.ckpt.poll_pending()
        if t.eval_interval and step % t.eval_interval == 0 and not last:
            self.clock.watch(f"evaluation at step {step}", compiles="eval")
            self.evaluate(step)
            self.rt.reassert_signals()
        if res.stop:
            reason = f"{self.rt.stop_signal} received"
            self.log(f"run: {reason}; saving step {step} and exiting")
            self.clock.watch(f"checkpoint save at step {step}")
            self.ckpt.safe_save(step, self.rt.stop_signal)
            return "stop", reason
        c = cfg.checkpoint
        if c.save_interval and step % c.save_interval == 0 and not last:
            self.clock.watch(f"checkpoint save at step {step}")
            self.ckpt.safe_save(step, "interval", background=c.async_save)
        if res.time_up and not last:
            reason = f"time limit {t.time_limit_s:g}s reached at step {step}"
            self.log(f"run: {reason}")
            return "end", reason
        return None

    def _log_metrics(self, step: int, res: StepResult, lr: float, window: ThroughputWindow,
                     data_wait_s: float, flops: FlopsBudget) -> None:  # fmt: skip
        total = self.cfg.training.train_iters
        rec = metrics_record(window, step=step, loss=res.loss, lr=lr, gnorm=res.gnorm,
                             state=self.state, seq_length=self.cfg.train_dataset.seq_length,
                             data_wait_s=data_wait_s, flops=flops)  # fmt: skip
        if self.state.loss_scale != 1.0:
            rec["loss_scale"] = self.state.loss_scale
        rec.update(self.runner.extra_fields())
        # a collective on several ranks: only at steps every rank logs (not a forced log)
        probe = step % self.cfg.monitor.log_interval == 0 or step == total
        if self.fault:  # test-only: slow_comm delays the timed collective
            self.runner.comm_delay = self.fault.slow_comm(step)
        rec.update(self.runner.comm_fields(window, probe))
        self.metrics.write(rec)
        self.log.progress(progress_text(rec, total), console=self.cfg.monitor.progress_bar)

    # ------------------------------------------------------------------ the error path

    def run(self) -> int:
        """The run with its one error path: every expected failure (the table in
        _errors.classify) is one `error: ...` line and the same reason in the `end`
        event; anything else is a bug and keeps its traceback (its `end` event too)."""
        try:
            self.rt.setup_context()
            self.rt.init_dist()
            self.fault = FaultInjector(self._fault_spec, rank=self.rt.rank)
            self._setup_dirs()
        except Exception as exc:
            known = classify(exc)
            if known is None:
                raise
            print(f"error: {known[1]}", file=sys.stderr)
            return known[0]
        status, reason, code = "failed", "", EXIT_FAILED
        try:
            code, status, reason = self._run()
        except RuntimeError as exc:
            code, reason = runtime_failure(exc, self.state.step + 1, self.rt.rank, self.rt.world)
            self._log_error(reason)
        except BaseException as exc:
            known = classify(exc)
            if known is None:
                reason = f"internal error: {type(exc).__name__}: {first_line(exc)}"
                raise
            code, reason = known
            self._log_error(reason)
        finally:
            self._close(code, status, reason)
        return code

    def _close(self, code: int, status: str, reason: str) -> None:
        self._log_peak_memory()
        close_records(self.metrics, self.log, self.state.step, code, status, reason)

    def _log_peak_memory(self) -> None:
        # before an error line, so `error: ...` stays the last line a failed run prints
        graphs = getattr(self.runner, "graphs", None)  # the compile cache's hits and misses
        if graphs is not None and graphs.enabled and not getattr(self, "_cache_logged", False):
            self._cache_logged = True
            self.log(graphs.summary())
        if self.memory_estimate is None or self._peak_logged:
            return
        self._peak_logged = True
        cached = graphs is not None and graphs.enabled and graphs.hits > 0 and not graphs.misses
        log_peak_memory(self.log, self.memory_estimate, self.rt.rank, compiled=not cached)

    def _log_error(self, reason: str) -> None:
        self._log_peak_memory()
        log_error(self.log, reason)


def train(cfg: Config, *, console=None, fault_spec: str | None = None) -> int:
    return Trainer(cfg, console=console, fault_spec=fault_spec).run()
