"""The checks of a parsed config: impossible values and combinations, each refused with one
line naming the key and the value; the `model` section is checked by `_modelcfg`."""

from __future__ import annotations

import math
from typing import Any

from mindloom_train._errors import ConfigError
from mindloom_train._health import check_config
from mindloom_train._modelcfg import validate_section
from mindloom_train._parse import show
from mindloom_train._schema import Config


def _check(cond: bool, key: str, value: Any, why: str) -> None:
    if not cond:
        raise ConfigError(f"config key {key}: {why}, got {show(value)}")


def _check_range(key: str, rng: list[float]) -> None:
    _check(
        len(rng) == 2 and 0.0 <= rng[0] < rng[1] <= 1.0,
        key,
        rng,
        "must be [start, end] with 0 <= start < end <= 1",
    )


def validate(cfg: Config, *, check_model: bool = True) -> Config:
    """Impossible values, each refused with one line naming the key and the value."""
    _check_counts(cfg)
    _check_optimization(cfg)
    _check_data(cfg)
    if check_model:
        validate_section(cfg.model)
    return cfg


def _check_counts(cfg: Config) -> None:
    """Counts, intervals, timeouts and the batch / layout arithmetic."""
    t, s, p, c = cfg.training, cfg.lr_scheduler, cfg.parallelism, cfg.checkpoint
    for key, val in [
        ("training.train_iters", t.train_iters),
        ("training.global_batch_size", t.global_batch_size),
        ("training.micro_batch_size", t.micro_batch_size),
        ("training.eval_iters", t.eval_iters),
        ("training.max_consecutive_skips", t.max_consecutive_skips),
        ("monitor.log_interval", cfg.monitor.log_interval),
        ("train_dataset.seq_length", cfg.train_dataset.seq_length),
        ("precision.loss_scale_window", cfg.precision.loss_scale_window),
    ]:
        _check(val >= 1, key, val, "must be >= 1")
    for key, val in [
        ("training.eval_interval", t.eval_interval),
        ("checkpoint.save_interval", c.save_interval),
        ("lr_scheduler.warmup_iters", s.warmup_iters),
        ("context.device_id", cfg.context.device_id),
        ("seed", cfg.seed),
        ("profiler.start_step", cfg.profiler.start_step),
        ("profiler.warmup_steps", cfg.profiler.warmup_steps),
    ]:
        _check(val >= 0, key, val, "must be >= 0")
    if cfg.context.num_threads is not None:
        _check(cfg.context.num_threads >= 1, "context.num_threads", cfg.context.num_threads,
               "must be >= 1")  # fmt: skip
    for key, opt in [
        ("training.time_limit_s", t.time_limit_s),
        ("monitor.peak_tflops", cfg.monitor.peak_tflops),
        ("monitor.output_logit_bound", cfg.monitor.output_logit_bound),
    ]:
        if opt is not None:
            _check(opt > 0, key, opt, "must be > 0 (or null)")
    if (bad := check_config(cfg.monitor.health)) is not None:
        _check(False, *bad)
    for key, val in [
        ("parallelism.comm_timeout_s", p.comm_timeout_s),
        ("parallelism.first_step_timeout_s", p.first_step_timeout_s),
    ]:
        _check(val > 0, key, val, "must be > 0")
    _check(c.keep_last >= 2, "checkpoint.keep_last", c.keep_last, "must be >= 2")
    _check_layout(cfg)


def _check_layout(cfg: Config) -> None:
    """The degrees against each other and the batch: mindloom_parallel's one rule set
    (the same message as `mindloom launch` and every worker give)."""
    from mindloom_parallel import ParallelConfigError, ParallelDims

    t = cfg.training
    try:
        ParallelDims.from_section(cfg.parallelism).check(
            global_batch_size=t.global_batch_size, micro_batch_size=t.micro_batch_size
        )
    except ParallelConfigError as exc:
        raise ConfigError(f"config parallelism: {exc}") from None


def _check_optimization(cfg: Config) -> None:
    """Clipping, guards, AdamW, the LR schedule and loss scaling."""
    t, o, s = cfg.training, cfg.optimizer, cfg.lr_scheduler
    _check(t.grad_clip >= 0 and math.isfinite(t.grad_clip), "training.grad_clip", t.grad_clip,
           "must be a finite number >= 0")  # fmt: skip
    if t.grad_spike_threshold is not None:
        _check(t.grad_spike_threshold > 0, "training.grad_spike_threshold",
               t.grad_spike_threshold, "must be > 0")  # fmt: skip
    if t.loss_spike_factor is not None:
        _check(t.loss_spike_factor > 1, "training.loss_spike_factor", t.loss_spike_factor,
               "must be > 1")  # fmt: skip
    _check(0 <= t.loss_smoothing < 1, "training.loss_smoothing", t.loss_smoothing,
           "must be in [0, 1)")  # fmt: skip
    _check(0 <= o.beta1 < 1, "optimizer.beta1", o.beta1, "must be in [0, 1)")
    _check(0 <= o.beta2 < 1, "optimizer.beta2", o.beta2, "must be in [0, 1)")
    _check(o.eps > 0, "optimizer.eps", o.eps, "must be > 0")
    _check(o.weight_decay >= 0, "optimizer.weight_decay", o.weight_decay, "must be >= 0")
    _check(s.lr > 0 and math.isfinite(s.lr), "lr_scheduler.lr", s.lr, "must be a finite number > 0")
    _check(0 <= s.min_lr <= s.lr, "lr_scheduler.min_lr", s.min_lr, f"must be in [0, lr={s.lr}]")
    decay = s.decay_iters if s.decay_iters is not None else t.train_iters
    if s.decay_iters is not None:
        _check(s.decay_iters >= 1, "lr_scheduler.decay_iters", s.decay_iters, "must be >= 1")
    _check(s.warmup_iters <= decay, "lr_scheduler.warmup_iters", s.warmup_iters,
           f"must be <= decay_iters ({decay})")  # fmt: skip
    _check(0 < s.wsd_decay_fraction <= 1, "lr_scheduler.wsd_decay_fraction",
           s.wsd_decay_fraction, "must be in (0, 1]")  # fmt: skip
    pr = cfg.precision
    _check(pr.initial_loss_scale >= 1, "precision.initial_loss_scale", pr.initial_loss_scale,
           "must be >= 1")  # fmt: skip
    _check(0 < pr.min_loss_scale <= pr.initial_loss_scale, "precision.min_loss_scale",
           pr.min_loss_scale, f"must be in (0, initial_loss_scale={pr.initial_loss_scale:g}]")  # fmt: skip


def _check_data(cfg: Config) -> None:
    """Datasets, tokenizer, run directory and profiler window."""
    for name, ds in [("train_dataset", cfg.train_dataset), ("eval_dataset", cfg.eval_dataset)]:
        if ds is None:
            continue
        _check_range(f"{name}.char_range", ds.char_range)
        _check_range(f"{name}.doc_range", ds.doc_range)
        _check(
            bool(ds.data_prefix) != bool(ds.text_input),
            f"{name}.data_prefix",
            ds.data_prefix,
            "set exactly one of data_prefix and text_input",
        )
        if ds.weights is not None:
            _check(len(ds.weights) == len(ds.data_prefix), f"{name}.weights", ds.weights,
                   "needs one weight per data_prefix entry")  # fmt: skip
            _check(all(w > 0 for w in ds.weights), f"{name}.weights", ds.weights,
                   "must all be > 0")  # fmt: skip
    if cfg.eval_dataset is not None:
        _check(
            cfg.eval_dataset.seq_length == cfg.train_dataset.seq_length,
            "eval_dataset.seq_length",
            cfg.eval_dataset.seq_length,
            f"must equal train_dataset.seq_length ({cfg.train_dataset.seq_length})",
        )
    tok = cfg.tokenizer
    if tok.vocab_size is not None:
        _check(tok.vocab_size >= 2, "tokenizer.vocab_size", tok.vocab_size, "must be >= 2")
    else:
        _check(tok.model_type == "char", "tokenizer.vocab_size", tok.vocab_size,
               "may be null only with model_type char")  # fmt: skip
    needs_tok = any(
        ds is not None and ds.text_input for ds in (cfg.train_dataset, cfg.eval_dataset)
    )
    if needs_tok:
        _check(tok.path is not None or tok.train_input is not None, "tokenizer.path", tok.path,
               "a tokenizer path or train_input is needed to tokenize text_input")  # fmt: skip
    _check(bool(cfg.run_dir), "run_dir", cfg.run_dir, "must not be empty")
    _check(cfg.profiler.start_step <= cfg.profiler.end_step, "profiler.start_step",
           cfg.profiler.start_step, "must be <= profiler.end_step")  # fmt: skip
