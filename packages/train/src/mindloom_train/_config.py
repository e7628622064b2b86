"""The run configuration: one YAML file parsed into dataclasses and validated up front.

Everything here is cheap (no MindSpore import) so that a bad config is refused in well
under a second, before any data is read or any worker is started.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import re
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml

from mindloom_train._health import HealthConfig, check_config


class ConfigError(ValueError):
    """A config problem, always one line naming the key and the value."""


# Anything echoed from a config into a message is cut to this many characters: a hostile
# or mistaken value (a megabyte string, a huge nested list) must not become the message.
MAX_ECHO = 200


def show(value: Any) -> str:
    """repr(value) for an error message, at most MAX_ECHO characters (then an ellipsis)."""
    text = reprlib_repr(value)
    return text if len(text) <= MAX_ECHO else text[: MAX_ECHO - 1] + "\u2026"


def reprlib_repr(value: Any) -> str:
    # reprlib bounds the work as well as the text: a deeply shared structure (YAML
    # aliases, if they ever got through) is never expanded in full just to be cut
    import reprlib

    r = reprlib.Repr()
    r.maxstring = r.maxother = r.maxlong = MAX_ECHO
    r.maxlist = r.maxdict = r.maxtuple = r.maxset = 32
    r.maxlevel = 4
    return r.repr(value)


@dataclass
class ContextConfig:
    device_target: Literal["CPU", "Ascend", "GPU"] = "CPU"
    # graph = compiled train step (the normal path); pynative = eager, for debugging
    mode: Literal["graph", "pynative"] = "graph"
    device_id: int = 0
    max_device_memory: str | None = None
    # MindSpore's CPU runtime threads; null leaves MindSpore's default
    num_threads: int | None = None


@dataclass
class TokenizerConfig:
    # A tokenizer directory. When it holds no tokenizer and `train_input` is set, one is
    # trained there first (null path: RUN_DIR/tokenizer).
    path: str | None = None
    train_input: str | None = None
    model_type: Literal["bpe", "unigram", "char"] = "bpe"
    vocab_size: int | None = 8000  # null with model_type char: one id per character seen
    # false: no unk/bos/eos/pad ids (nanoGPT's character vocabulary)
    special_tokens: bool = True


@dataclass
class DatasetConfig:
    # Megatron .bin/.idx prefixes (already tokenized), blended by `weights` when several.
    data_prefix: list[str] = field(default_factory=list)
    weights: list[float] | None = None
    # Or raw input (a file, directory or glob; "bundled" = the corpus shipped with
    # mindloom-data), tokenized once into RUN_DIR/data/ with the run's tokenizer.
    text_input: str | None = None
    text_key: str = "text"
    txt_mode: Literal["paragraph", "line", "file"] = "paragraph"  # documents in .txt input
    append_eos: bool = True
    append_bos: bool = False  # recorded in PREFIX.dataset.json; generate follows it
    # Keep only this fraction range of the input: by characters of the concatenated text
    # (nanoGPT's 90/10 split of one long text) or by documents.
    char_range: list[float] = field(default_factory=lambda: [0.0, 1.0])
    doc_range: list[float] = field(default_factory=lambda: [0.0, 1.0])
    seq_length: int = 256
    pack_mode: Literal["concat", "best_fit"] = "concat"
    mask_eos_loss: bool = False
    shuffle: bool = True


@dataclass
class TrainingConfig:
    train_iters: int = 100
    global_batch_size: int = 8
    micro_batch_size: int = 8
    eval_interval: int = 0  # 0: evaluate only at the end
    eval_iters: int = 10  # held-out batches per evaluation
    grad_clip: float = 1.0  # global grad-norm clipping; 0 disables
    # Guards: skip an update on a non-finite loss / grad norm or a grad norm above
    # `grad_spike_threshold`; this many skips in a row stop the run (non-zero exit).
    max_consecutive_skips: int = 5
    grad_spike_threshold: float | None = None
    # Report (never skip) a loss above factor * smoothed loss; null disables.
    loss_spike_factor: float | None = 2.0
    loss_smoothing: float = 0.9
    # Stop (completed, with the final eval and checkpoint) after this much training time
    time_limit_s: float | None = None
    # Start even when the memory estimate (mindloom estimate-memory) exceeds the device
    ignore_memory_estimate: bool = False


@dataclass
class OptimizerConfig:
    type: Literal["adamw"] = "adamw"
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    weight_decay: float = 0.1
    # Norms and biases never decay; embeddings (and a tied head) decay unless false.
    decay_embeddings: bool = True


@dataclass
class LRSchedulerConfig:
    type: Literal["cosine", "linear", "constant", "wsd"] = "cosine"
    lr: float = 3e-4
    min_lr: float = 0.0
    warmup_iters: int = 0
    decay_iters: int | None = None  # null: training.train_iters
    # warmup-stable-decay: the last `wsd_decay_fraction` of decay_iters decays
    wsd_decay_fraction: float = 0.1
    wsd_decay_style: Literal["linear", "cosine", "sqrt"] = "linear"


@dataclass
class PrecisionConfig:
    compute_dtype: Literal["fp32", "bf16", "fp16"] = "fp32"
    # auto: dynamic loss scaling for fp16, none otherwise
    loss_scale: Literal["auto", "dynamic", "none"] = "auto"
    initial_loss_scale: float = 65536.0
    loss_scale_window: int = 1000
    min_loss_scale: float = 1.0


@dataclass
class RecomputeConfig:
    mode: Literal["none", "full", "selected"] = "none"
    layers: list[int] = field(default_factory=list)


@dataclass
class ParallelismConfig:
    dp: int = 1
    tp: int = 1
    pp: int = 1
    sequence_parallel: bool = False
    micro_batch_num: int = 1
    zero_stage: int = 0
    bucket_size_mb: float = 25.0
    # Several workers: a step (or evaluation, or save) that makes no progress for this long
    # ends the worker with exit code 4 (a rank hung or died inside a collective). The
    # first step and the first evaluation compile graphs: they get first_step_timeout_s.
    comm_timeout_s: float = 600.0
    first_step_timeout_s: float = 1800.0


@dataclass
class CheckpointConfig:
    save_path: str | None = None  # null: RUN_DIR/checkpoints
    save_interval: int = 0  # 0: only at the end and on SIGTERM / SIGINT
    keep_last: int = 2
    save_at_end: bool = True
    # auto: resume from save_path/latest when there is one; required: fail without one
    resume: Literal["auto", "required", "never"] = "auto"
    # Weights-only start (continued pretraining) when there is nothing to resume: a step
    # directory or a save_path; fresh optimizer state and LR schedule.
    init_from: str | None = None
    verify_integrity: bool = False  # write and check a SHA-256 manifest
    # Write interval checkpoints in a background thread: the step's state is copied to host
    # memory at the save step and training goes on while the files are written. At most
    # one save is in flight (the next waits for it); end, SIGTERM and anomaly saves wait
    # for it, then write synchronously.
    async_save: bool = False
    # Allow resuming with LR-schedule hyperparameters that differ from the checkpoint's
    override_schedule: bool = False
    # Allow resuming with settings that change the data stream or the model (seed, data,
    # tokenizer, optimizer, model section; see drift_settings) that differ from the
    # checkpoint's; a global batch size change is always allowed (its own resume mode)
    override_drift: bool = False


@dataclass
class MonitorConfig:
    log_interval: int = 10
    progress_bar: bool = True
    peak_tflops: float | None = None  # overrides the device peak table (MFU)
    health: HealthConfig = field(default_factory=HealthConfig)  # training-health rules
    numerics: bool = False  # per-layer grad/param norms, update ratio, AdamW moments


@dataclass
class ProfilerConfig:
    enabled: bool = False
    start_step: int = 2
    end_step: int = 4
    output_dir: str | None = None  # null: RUN_DIR/profile


@dataclass
class Config:
    context: ContextConfig = field(default_factory=ContextConfig)
    # `preset` plus any ModelConfig field of mindloom_model; `vocab_size: null` takes
    # the tokenizer's; `init_from_hf` starts from a Hugging Face Llama directory.
    model: dict[str, Any] = field(default_factory=lambda: {"preset": "debug"})
    tokenizer: TokenizerConfig = field(default_factory=TokenizerConfig)
    train_dataset: DatasetConfig = field(default_factory=DatasetConfig)
    eval_dataset: DatasetConfig | None = None
    training: TrainingConfig = field(default_factory=TrainingConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    lr_scheduler: LRSchedulerConfig = field(default_factory=LRSchedulerConfig)
    precision: PrecisionConfig = field(default_factory=PrecisionConfig)
    recompute: RecomputeConfig = field(default_factory=RecomputeConfig)
    parallelism: ParallelismConfig = field(default_factory=ParallelismConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    monitor: MonitorConfig = field(default_factory=MonitorConfig)
    profiler: ProfilerConfig = field(default_factory=ProfilerConfig)
    seed: int = 1234
    run_dir: str = "runs/default"

    # -- derived ---------------------------------------------------------------------
    @property
    def save_path(self) -> Path:
        if self.checkpoint.save_path:
            return Path(self.checkpoint.save_path)
        return Path(self.run_dir) / "checkpoints"

    @property
    def world_size(self) -> int:
        p = self.parallelism
        return p.dp * p.tp * p.pp

    @property
    def grad_accum_steps(self) -> int:
        t = self.training
        return t.global_batch_size // (t.micro_batch_size * self.parallelism.dp)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def hash(self) -> str:
        """Short content hash of the resolved config (in every event and checkpoint)."""
        blob = json.dumps(self.to_dict(), sort_keys=True, default=str).encode()
        return hashlib.sha256(blob).hexdigest()[:16]

    def drift_settings(self) -> dict[str, Any]:
        """The settings a resume must not change silently, flat by dotted key: those that
        change the training data stream (seed, data, tokenizer, sequence length, packing)
        or the model and its optimizer. Not the global batch size (resuming with another
        one is a supported mode), parallel layout, schedule (checked on its own), eval,
        logging or checkpoint settings."""
        d = self.to_dict()
        out: dict[str, Any] = {"seed": self.seed}
        for section in ("train_dataset", "tokenizer", "optimizer", "model"):
            for key, val in (d[section] or {}).items():
                out[f"{section}.{key}"] = val
        out["precision.compute_dtype"] = self.precision.compute_dtype
        return out


def drift_hash(settings: dict[str, Any]) -> str:
    blob = json.dumps(settings, sort_keys=True, default=str).encode()
    return hashlib.sha256(blob).hexdigest()[:16]


# ---------------------------------------------------------------------------------------
# parsing


_FLOAT_RE = re.compile(r"^[-+]?(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?$|^[-+]?(inf|nan)$", re.I)


def _type_name(tp: Any) -> str:
    origin = typing.get_origin(tp)
    if origin is Literal:
        return " | ".join(repr(a) for a in typing.get_args(tp))
    if origin in (typing.Union, types.UnionType):
        return " | ".join(_type_name(a) for a in typing.get_args(tp))
    if origin is list:
        return f"list[{_type_name(typing.get_args(tp)[0])}]"
    if origin is dict:
        return "mapping"
    if tp is type(None):
        return "null"
    return getattr(tp, "__name__", str(tp))


def _bad(key: str, value: Any, want: str) -> ConfigError:
    return ConfigError(f"config key {key}: expected {want}, got {show(value)}")


def _coerce(key: str, value: Any, tp: Any) -> Any:
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        errors = []
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _coerce(key, value, arg)
            except ConfigError as exc:
                errors.append(exc)
        if len(errors) == 1:  # `X | None`: X's own, more precise, message
            raise errors[0]
        raise _bad(key, value, _type_name(tp))
    if origin is Literal:
        if value not in typing.get_args(tp):
            raise _bad(key, value, "one of " + _type_name(tp))
        return value
    if origin is list:
        if not isinstance(value, list):
            raise _bad(key, value, _type_name(tp))
        (item,) = typing.get_args(tp)
        return [_coerce(f"{key}[{i}]", v, item) for i, v in enumerate(value)]
    if origin is dict:
        if not isinstance(value, dict):
            raise _bad(key, value, "a mapping")
        return dict(value)
    if dataclasses.is_dataclass(tp):
        return _build(tp, value, key)
    if tp is bool:
        if not isinstance(value, bool):
            raise _bad(key, value, "true or false")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise _bad(key, value, "an integer")
        if not -(2**63) <= value < 2**63:
            raise _bad(key, value, "an integer that fits in 64 bits")
        return value
    if tp is float:
        # Every number of every section passes here (the model section too): one place
        # refuses inf and nan, which no setting means and which a checkpoint (JSON)
        # could not even record.
        if isinstance(value, bool):
            raise _bad(key, value, "a number")
        if isinstance(value, int):
            if not -(2**63) <= value < 2**63:
                raise _bad(key, value, "a finite number")
            return float(value)
        if isinstance(value, float):
            number = value
        # YAML 1.1 reads `1e-3` as a string; accept any plain number spelling
        elif isinstance(value, str) and _FLOAT_RE.match(value.strip()):
            number = float(value)
        else:
            raise _bad(key, value, "a number")
        if not math.isfinite(number):
            raise _bad(key, value, "a finite number")
        return number
    if tp is str:
        if not isinstance(value, str):
            raise _bad(key, value, "a string")
        return value
    raise _bad(key, value, _type_name(tp))


def _build(cls: type, data: Any, prefix: str) -> Any:
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"config key {prefix or '<top>'}: expected a mapping, got {show(data)}")
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    for key in data:
        if key not in names:
            name = key if isinstance(key, str) and len(key) <= MAX_ECHO else show(key)
            where = f"{prefix}.{name}" if prefix else str(name)
            raise ConfigError(
                f"config key {where}: unknown key (known: {', '.join(sorted(names))})"
            )
    kwargs = {}
    for name in names:
        if name in data:
            kwargs[name] = _coerce(f"{prefix}.{name}" if prefix else name, data[name], hints[name])
    return cls(**kwargs)


# ---------------------------------------------------------------------------------------
# validation


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


def _validate_model(model: dict[str, Any]) -> None:
    from mindloom_train import _modelcfg

    _modelcfg.validate_section(model)


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


def validate(cfg: Config, *, check_model: bool = True) -> Config:
    """Impossible values, each refused with one line naming the key and the value."""
    t, o, s, p, c = cfg.training, cfg.optimizer, cfg.lr_scheduler, cfg.parallelism, cfg.checkpoint
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
    ]:
        _check(val >= 0, key, val, "must be >= 0")
    if cfg.context.num_threads is not None:
        _check(cfg.context.num_threads >= 1, "context.num_threads", cfg.context.num_threads,
               "must be >= 1")  # fmt: skip
    for key, opt in [
        ("training.time_limit_s", t.time_limit_s),
        ("monitor.peak_tflops", cfg.monitor.peak_tflops),
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
    if check_model:
        _validate_model(cfg.model)
    return cfg


# ---------------------------------------------------------------------------------------
# entry points


def _parse_override(item: str) -> tuple[list[str], Any]:
    if "=" not in item:
        raise ConfigError(f"--set {show(item)}: expected section.key=value")
    key, raw = item.split("=", 1)
    path = [k for k in key.strip().split(".")]
    if not all(path):
        raise ConfigError(f"--set {show(item)}: expected section.key=value")
    try:
        value = _safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError as exc:
        problem = show(getattr(exc, "problem", None) or "invalid YAML")[1:-1]
        raise ConfigError(
            f"--set {show(key)[1:-1]}: cannot parse value {show(raw)} ({problem})"
        ) from None
    return path, value


def apply_overrides(data: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    for item in overrides:
        path, value = _parse_override(item)
        node = data
        for part in path[:-1]:
            nxt = node.get(part)
            if nxt is None:
                nxt = node[part] = {}
            if not isinstance(nxt, dict):
                raise ConfigError(f"--set {'.'.join(path)}: {part} is not a section")
            node = nxt
        node[path[-1]] = value
    return data


class _NoAliasLoader(yaml.SafeLoader):
    """yaml.SafeLoader that refuses every alias (`*name`) before expanding anything.

    A few nested aliases expand to billions of nodes ("billion laughs"): 1.4 KB of YAML
    took 34 s and 2.1 GB and made a 722 MB error message. Run configs are small and
    flat; `--set` and separate configs replace what anchors would share.
    """

    def compose_node(self, parent, index):  # type: ignore[override]
        if self.check_event(yaml.AliasEvent):
            event = self.peek_event()
            raise yaml.composer.ComposerError(
                None, None, f"aliases (*{show(event.anchor)[1:-1]}) are not supported in a "
                "run config; write the value out", event.start_mark,
            )  # fmt: skip
        return super().compose_node(parent, index)


def _safe_load(text: str) -> Any:
    loader = _NoAliasLoader(text)  # what yaml.safe_load does, with this SafeLoader
    try:
        return loader.get_single_data()
    finally:
        loader.dispose()


def read_yaml(path: str | os.PathLike[str]) -> dict[str, Any]:
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError(f"config file {p}: not found") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"config file {p}: unreadable ({exc})") from None
    try:
        data = _safe_load(text)  # a SafeLoader: a config must not run code
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" line {mark.line + 1} column {mark.column + 1}" if mark else ""
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        if len(problem) > MAX_ECHO:
            problem = problem[: MAX_ECHO - 1] + "\u2026"
        raise ConfigError(f"config file {p}:{where}: invalid YAML ({problem})") from None
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"config file {p}: top level must be a mapping, got {show(data)}")
    return data


def from_dict(data: dict[str, Any], *, check_model: bool = True) -> Config:
    cfg = _build(Config, data, "")
    if not isinstance(cfg.model, dict):
        raise ConfigError(f"config key model: expected a mapping, got {show(cfg.model)}")
    return validate(cfg, check_model=check_model)


def load_config(
    path: str | os.PathLike[str] | None,
    overrides: list[str] | None = None,
    *,
    check_model: bool = True,
) -> Config:
    """Read, override (`section.key=value`) and validate a config; ConfigError if bad."""
    data = read_yaml(path) if path is not None else {}
    data = apply_overrides(data, list(overrides or []))
    return from_dict(data, check_model=check_model)


def dump_config(cfg: Config) -> str:
    return yaml.safe_dump(cfg.to_dict(), sort_keys=False, default_flow_style=None)
