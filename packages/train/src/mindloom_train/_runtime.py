"""The process a run lives in: MindSpore's context and seeds, the distributed init under
msrun, the stop signals, the profiler window, and the watchdog's phase clock."""

from __future__ import annotations

import os
import random
import signal
from collections.abc import Callable
from typing import Any

import numpy as np

from mindloom_train._config import Config, ConfigError


class Runtime:
    """Where this process stands: rank, world, data-parallel coordinates, and whether the
    layout needs the engine (tp / pp / ZeRO-1) or keeps the compiled step."""

    def __init__(self, cfg: Config):
        self.cfg = cfg
        self.rank, self.world = 0, 1
        self.dp_rank, self.dp_size = 0, 1
        self.groups = None  # mindloom_parallel's process groups under msrun
        self.pcfg = None  # the layout they were built from
        self.use_engine = False
        self.compiled_tp = False  # tp > 1 as a compiled step (_tp_step), not the engine
        self.compiled_zero = False  # dp > 1 with ZeRO-1 as a compiled step (_zero_step)
        self.compiled_ep = False  # ep > 1 (DeepSeek-V3) in the compiled step (_ep_step)
        # pp > 1: compiled stage graphs under the engine runner's schedule (_pp_step)
        self.compiled_pp = False
        self.stop_signal: str | None = None  # the first SIGTERM / SIGINT received
        self._old_handlers: dict = {}

    def setup_context(self) -> None:
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
        # MindSpore's default (1000 nested calls while it compiles a graph) is too few for
        # DeepSeek-V3's update under data parallel with several micro-batches ("Exceed
        # function call depth limit 1000", session 15); the limit only bounds recursion
        ms.set_recursion_limit(10000)
        if c.num_threads:
            ms.set_context(runtime_num_threads=c.num_threads)
        ms.set_seed(self.cfg.seed)
        np.random.seed(self.cfg.seed)
        random.seed(self.cfg.seed)

    def init_dist(self) -> None:
        """Under msrun: communicator, this rank's coordinates and groups. Plain data parallel
        and (graph mode) tensor parallel and ZeRO-1 keep the compiled step; pp (graph mode)
        runs compiled stage graphs under the engine runner's Python schedule (_pp_step);
        in pynative mode tp / pp / ZeRO-1 go through ParallelEngine (PyNative)."""
        if not any(k in os.environ for k in ("MS_WORKER_NUM", "MS_ROLE", "RANK_SIZE")):
            return
        from mindloom_parallel import ParallelConfigError, ParallelDims, init_parallel

        from mindloom_train._ep_step import compiled_ep
        from mindloom_train._pp_step import compiled_pp
        from mindloom_train._tp_step import compiled_tp
        from mindloom_train._zero_step import compiled_zero

        dims = ParallelDims.from_section(self.cfg.parallelism)
        self.compiled_tp = compiled_tp(dims, self.cfg.context.mode)
        self.compiled_zero = compiled_zero(dims, self.cfg.context.mode)
        self.compiled_ep = compiled_ep(dims)
        self.compiled_pp = compiled_pp(dims, self.cfg.context.mode)
        self.use_engine = dims.needs_engine and not (
            self.compiled_tp or self.compiled_zero or self.compiled_ep
        )
        pcfg = dims.for_steps(self.cfg.grad_accum_steps) if self.use_engine else dims
        try:
            groups = init_parallel(pcfg)
        except ParallelConfigError as exc:
            raise ConfigError(f"config parallelism: {exc}") from None
        if self.use_engine:
            import mindspore as ms

            # the engine's pipeline schedule and TP region ops are Python-level (compiled
            # pp: the stage graphs are ms.jit, compiled from PyNative)
            ms.set_context(mode=ms.PYNATIVE_MODE)
        self.groups = groups
        self.pcfg = pcfg
        self.rank, self.world = groups.rank, groups.world_size
        self.dp_rank, self.dp_size = groups.dp_rank, pcfg.dp

    # ------------------------------------------------------------------ signals

    def _on_signal(self, signum, _frame) -> None:
        name = signal.Signals(signum).name
        if self.stop_signal is None:
            self.stop_signal = name
        else:  # a second signal: stop waiting
            raise KeyboardInterrupt("interrupted twice")

    def install_signals(self) -> None:
        for sig in (signal.SIGTERM, signal.SIGINT):
            try:
                self._old_handlers[sig] = signal.signal(sig, self._on_signal)
            except ValueError:  # not the main thread
                pass

    def reassert_signals(self) -> None:
        """Set our handlers again. MindSpore installs C-level SIGINT handlers of its own as
        each of its parts first runs (the first op, the first compiled graph, the first
        gradient), and under msrun those turn SIGINT into SIGTERM; Python's
        ``signal.getsignal`` still reports ours, so only setting them again restores them."""
        for sig in (signal.SIGTERM, signal.SIGINT):
            try:
                signal.signal(sig, self._on_signal)
            except ValueError:  # not the main thread
                pass

    def restore_signals(self) -> None:
        for sig, handler in self._old_handlers.items():
            signal.signal(sig, handler)
        self._old_handlers = {}


class Profiler:
    """MindSpore's profiler over [profiler.start_step, profiler.end_step] on the ranks the
    section names (`_profiling` maps each key); optional, so a profiler failure is a log
    line, never a failed run."""

    def __init__(self, cfg: Config, default_dir: str, log: Callable[[str], None], rank: int = 0):
        from mindloom_train._profiling import profiler_plan

        self.cfg = cfg.profiler
        self.device_target = cfg.context.device_target
        self.plan = profiler_plan(cfg.profiler, rank, default_dir)
        self.log = log
        self._prof = None

    def before_step(self, step: int) -> None:
        if self.plan is None or step != self.plan.first_step:
            return
        try:
            from mindloom_train._profiling import start

            self._prof = start(self.plan, self.device_target)
            self.log(self.plan.describe())
        except Exception as exc:
            self.log(f"profiler: not started ({exc})")

    def after_step(self, step: int) -> None:
        if self._prof is None:
            return
        try:
            self._prof.step()
        except Exception as exc:
            self.log(f"profiler: step failed ({exc})")
        if step >= self.plan.end_step:
            self.stop()

    def stop(self) -> None:
        prof, self._prof = self._prof, None
        if prof is None:
            return
        try:
            prof.stop()
            self.log(f"profiler: trace written to {self.plan.output_dir} "
                     f"({self.plan.worker_name}_*_ascend_ms)")  # fmt: skip
        except Exception as exc:
            self.log(f"profiler: failed to write the trace ({exc})")


class PhaseClock:
    """The step watchdog's clock (several workers only): each phase (a step, an evaluation,
    a save) gets a budget; the first run of a graph compiles, so it gets
    `first_step_timeout_s` instead of `comm_timeout_s`."""

    def __init__(self, cfg: Config, rank: int, world: int, report: Callable[[str], None]):
        self.first_s = cfg.parallelism.first_step_timeout_s
        self.comm_s = cfg.parallelism.comm_timeout_s
        self._compiled: set[str] = set()  # graphs whose first run has been timed
        self.watchdog = None
        if world > 1:
            from mindloom_train._watchdog import StepWatchdog

            self.watchdog = StepWatchdog(rank, report)

    def watch(self, phase: str, compiles: str | None = None) -> None:
        """Start the clock for `phase`; `compiles` names the graph the phase runs."""
        if self.watchdog is None:
            return
        first = compiles is not None and compiles not in self._compiled
        if first:
            self._compiled.add(compiles)
        self.watchdog.arm(phase, self.first_s if first else self.comm_s)

    def close(self) -> None:
        if self.watchdog is not None:
            self.watchdog.close()
            self.watchdog = None
