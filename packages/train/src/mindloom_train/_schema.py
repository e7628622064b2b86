"""The run configuration's schema: one dataclass per YAML section, their defaults and
the values derived from them. No parsing and no checks here (`_parse.py`, `_checks.py`);
nothing of MindSpore or mindloom_model."""

from __future__ import annotations

import copy
import dataclasses
import hashlib
import json
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Literal

from mindloom_train._health import HealthConfig


@dataclass
class ContextConfig:
    device_target: Literal["CPU", "Ascend", "GPU"] = "CPU"
    # graph = compiled train step (the normal path); pynative = eager, for debugging
    mode: Literal["graph", "pynative"] = "graph"
    device_id: int = 0
    max_device_memory: str | None = None
    # MindSpore's CPU runtime threads; null leaves MindSpore's default
    num_threads: int | None = None
    # auto: compiled graphs come from / go to a verified, per-graph store (the train
    # README's "Compile cache"); off: compile every graph afresh (YAML reads a bare `off`
    # as false, which means the same)
    compile_cache: Literal["auto", "off", False] = "auto"
    # the store; null: $MINDLOOM_COMPILE_CACHE, else ~/.cache/mindloom/compile
    compile_cache_dir: str | None = None


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
    # Keys this section no longer has: a config that sets one is refused with this reason
    # (never silently ignored). Samples come in Megatron's pretraining order from `seed`.
    removed: ClassVar[dict[str, str]] = {
        "shuffle": "removed: it was never read (the sample order is Megatron's pretraining "
        "order, shuffled per epoch from `seed`); delete the key",
    }


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
    ep: int = 1  # expert parallel (deepseek_v3): carved out of dp, divides dp
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
    max_logits: bool = False  # largest attention logit per layer (llama, MLA), at log steps
    output_logit_bound: float = 30.0  # logits_over_bound_frac: top output logit above this


@dataclass
class ProfilerConfig:
    enabled: bool = False
    start_step: int = 2
    end_step: int = 4
    output_dir: str | None = None  # null: RUN_DIR/profile
    warmup_steps: int = 0  # profiled before start_step and dropped (the profiler's start-up)
    profile_memory: bool = False  # operator memory records
    with_stack: bool = False  # Python call stacks of the operators
    ranks: list[int] | None = None  # which ranks profile; null: every rank


@dataclass(eq=False)
class ModelSection(Mapping):
    """The `model` section: `preset` (a mindloom_model preset), `init_from_hf` (a Hugging
    Face Llama directory to start from) and `overrides`, any ModelConfig field over the
    preset (`vocab_size: null` takes the tokenizer's); `_modelcfg` checks the overrides
    against ModelConfig's types and coerces them.

    It also reads as the mapping the config gave, keys in their order (`given`): that
    mapping, not the dataclass, is what config.yaml, the config hash and the drift
    settings record, so they are what they were when the section was a dict."""

    preset: str | None = None
    init_from_hf: str | None = None
    overrides: dict[str, Any] = field(default_factory=dict)
    given: tuple = ()  # the keys the config set, in its order

    # keys of the section that are not ModelConfig fields
    EXTRA: ClassVar[tuple[str, ...]] = ("preset", "init_from_hf")

    @classmethod
    def from_mapping(cls, data: dict) -> ModelSection:
        """The section as the YAML gave it (`_parse` calls this; no checks here)."""
        extra = {k: data[k] for k in cls.EXTRA if k in data}
        overrides = {k: v for k, v in data.items() if k not in cls.EXTRA}
        return cls(**extra, overrides=overrides, given=tuple(data))

    def __getitem__(self, key: Any) -> Any:
        if key not in self.given:
            raise KeyError(key)
        return getattr(self, key) if key in self.EXTRA else self.overrides[key]

    def __iter__(self) -> Iterator:
        return iter(self.given)

    def __len__(self) -> int:
        return len(self.given)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Mapping) and self.to_dict() == dict(other.items())

    __hash__ = None  # mutable, like the dict it replaces

    def to_dict(self) -> dict[str, Any]:
        return {k: copy.deepcopy(self[k]) for k in self.given}


def _debug_preset() -> ModelSection:
    return ModelSection.from_mapping({"preset": "debug"})


@dataclass
class Config:
    context: ContextConfig = field(default_factory=ContextConfig)
    model: ModelSection = field(default_factory=_debug_preset)
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
        d = dataclasses.asdict(self)
        d["model"] = self.model.to_dict()  # the section as given (see ModelSection)
        return d

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


# Drift settings of keys that no longer exist (checkpoints written before their removal
# still record them): not a change of the data stream, so a resume does not compare them.
RETIRED_DRIFT_KEYS = frozenset({"train_dataset.shuffle"})


def drift_hash(settings: dict[str, Any]) -> str:
    blob = json.dumps(settings, sort_keys=True, default=str).encode()
    return hashlib.sha256(blob).hexdigest()[:16]
