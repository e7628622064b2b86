"""The parallel layout: `ParallelDims`, the only conversion from a run config's `parallelism`
section, and ONE validation that names the numbers that disagree.

Every place that refuses a layout (train's config check, `mindloom launch` before any worker
starts, each worker after init) calls `ParallelDims.check`, so the same bad input gives the
same one-line message wherever it is caught.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields, replace


class ParallelConfigError(ValueError):
    """A layout that cannot run; the message is one line naming the numbers that disagree."""


@dataclass(frozen=True)
class ParallelDims:
    """How a run is split: ``world_size == dp * tp * pp``.

    ``micro_batch_num`` is the number of micro-batches each data-parallel rank runs per step
    (pipeline micro-batches, or gradient accumulation when ``pp == 1``).
    ``zero_stage`` 0 keeps full optimizer state on every DP rank, 1 shards it over DP.
    ``ep`` (expert parallel, DeepSeek-V3 only) is carved out of data parallel, as in
    Megatron and MindSpore Transformers: it divides ``dp``, each group of ``ep`` consecutive
    data-parallel ranks splits the routed experts, and the ``dp / ep`` ranks holding the
    same experts form the expert-data-parallel group. It adds no ranks to the world.

    ``dp`` left out of a section read with a world size (``from_section(section,
    world_size)``) is derived: ``world_size / (tp * pp)``, torchtitan's ``dp_shard = -1``
    (``derive_dp``); a ``dp`` that is given keeps its meaning, and without a world size
    (one process) it is 1.
    """

    dp: int = 1
    tp: int = 1
    pp: int = 1
    sequence_parallel: bool = False
    micro_batch_num: int = 1
    zero_stage: int = 0
    bucket_size_mb: float = 25.0
    ep: int = 1

    @property
    def expert_dp(self) -> int:
        """The expert-data-parallel size: data-parallel ranks holding the same experts."""
        return self.dp // self.ep if self.ep >= 1 and self.dp % self.ep == 0 else 1

    @property
    def world_size(self) -> int:
        return self.dp * self.tp * self.pp

    @property
    def needs_engine(self) -> bool:
        """Tensor, pipeline or ZeRO-1: the step runs through ``ParallelEngine`` (PyNative);
        one process and plain data parallel keep a compiled step."""
        return self.tp > 1 or self.pp > 1 or self.zero_stage > 0

    @classmethod
    def from_dict(cls, d: dict | None) -> ParallelDims:
        """Build from a config section; an unknown key is a one-line error naming it."""
        d = dict(d or {})
        known = {f.name for f in fields(cls)}
        for key in d:
            if key not in known:
                raise ParallelConfigError(
                    f"parallelism.{key}: unknown key (known: {', '.join(sorted(known))})"
                )
        for key in ("dp", "tp", "pp", "micro_batch_num", "zero_stage", "ep"):
            if key in d and (isinstance(d[key], bool) or not isinstance(d[key], int)):
                raise ParallelConfigError(f"parallelism.{key}: expected an integer, got {d[key]!r}")
        if "sequence_parallel" in d and not isinstance(d["sequence_parallel"], bool):
            raise ParallelConfigError(
                f"parallelism.sequence_parallel: expected true/false, got {d['sequence_parallel']!r}"
            )
        return cls(**d)

    @classmethod
    def from_section(cls, section, world_size: int | None = None) -> ParallelDims:
        """The layout fields of a run config's ``parallelism`` section: a mapping or an object
        with those attributes (mindloom-train's parsed section). Keys that are not about the
        layout (train's timeouts) are left to their owner. With ``world_size`` (msrun's
        worker count), a mapping without ``dp`` gets ``derive_dp``'s degree."""
        names = [f.name for f in fields(cls)]
        if isinstance(section, dict):
            d = {k: section[k] for k in names if k in section}
            if world_size is not None and d.get("dp") is None:
                d.pop("dp", None)
                dims = cls.from_dict(d)
                return replace(dims, dp=derive_dp(world_size, dims.tp, dims.pp))
            return cls.from_dict(d)
        return cls(**{k: getattr(section, k) for k in names if hasattr(section, k)})

    def for_steps(self, grad_accum_steps: int) -> ParallelDims:
        """The layout a worker runs: ``micro_batch_num`` left at 1 means the trainer's
        gradient accumulation, so it becomes that count (a pipeline keeps its own)."""
        if self.micro_batch_num > 1 or self.pp > 1:
            return self
        return replace(self, micro_batch_num=int(grad_accum_steps))

    def to_dict(self) -> dict:
        return asdict(self)

    def check(
        self,
        model_cfg=None,
        world_size: int | None = None,
        global_batch_size: int | None = None,
        micro_batch_size: int | None = None,
        seq_length: int | None = None,
    ) -> ParallelDims:
        """``validate(self, ...)``: raise ParallelConfigError naming what disagrees."""
        return validate(self, model_cfg, world_size, global_batch_size, micro_batch_size,
                        seq_length)  # fmt: skip


def derive_dp(world_size: int, tp: int = 1, pp: int = 1) -> int:
    """The data-parallel degree of a layout that does not give one: every rank that tensor
    and pipeline parallel leave over, ``world_size / (tp * pp)``; one line naming the
    numbers when they do not divide."""
    for key, v in (("tp", tp), ("pp", pp)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ParallelConfigError(f"parallelism.{key} = {v!r}: must be an integer >= 1")
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ParallelConfigError(f"world size {world_size!r}: must be an integer >= 1")
    if world_size % (tp * pp):
        raise ParallelConfigError(
            f"world size {world_size} is not divisible by tp*pp = {tp}*{pp} = {tp * pp}: "
            f"parallelism.dp is not given, so it is derived as world / (tp*pp)"
        )
    return world_size // (tp * pp)


# The earlier name of the same class (README examples, external callers).
ParallelConfig = ParallelDims


def validate(
    pcfg: ParallelDims,
    model_cfg=None,
    world_size: int | None = None,
    global_batch_size: int | None = None,
    micro_batch_size: int | None = None,
    seq_length: int | None = None,
) -> ParallelDims:
    """Check a layout against the model, the world and the batch; raise ParallelConfigError.

    The one place every layout rule lives, so the launcher (before any worker starts) and
    each worker (after init) refuse the same configs with the same message.
    ``model_cfg`` is a ``mindloom_model.ModelConfig`` (or a dict with its keys). Returns
    ``pcfg`` so it can be used inline.
    """
    p = pcfg
    for key in ("dp", "tp", "pp", "micro_batch_num", "ep"):
        v = getattr(p, key)
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ParallelConfigError(f"parallelism.{key} = {v!r}: must be an integer >= 1")
    if p.zero_stage not in (0, 1):
        raise ParallelConfigError(
            f"parallelism.zero_stage = {p.zero_stage!r}: only 0 (off) and 1 (optimizer state) exist"
        )
    if isinstance(p.bucket_size_mb, bool) or not p.bucket_size_mb > 0:
        raise ParallelConfigError(
            f"parallelism.bucket_size_mb = {p.bucket_size_mb!r}: must be a number > 0"
        )
    if p.sequence_parallel and p.tp == 1:
        raise ParallelConfigError(
            "parallelism.sequence_parallel = true needs tp > 1 (tp = 1): it splits the "
            "sequence over the tensor-parallel group"
        )
    if p.dp % p.ep:
        raise ParallelConfigError(
            f"parallelism.ep = {p.ep} does not divide parallelism.dp = {p.dp}: expert parallel "
            f"is carved out of data parallel (expert-data-parallel size = dp / ep)"
        )
    if world_size is not None and world_size != p.world_size:
        raise ParallelConfigError(
            f"world size {world_size} != dp*tp*pp = {p.dp}*{p.tp}*{p.pp} = {p.world_size}"
        )
    if model_cfg is not None:
        _check_model(p, model_cfg)
    if global_batch_size is not None:
        mbs = micro_batch_size or 1
        if global_batch_size % (p.dp * mbs):
            raise ParallelConfigError(
                f"training.global_batch_size = {global_batch_size} is not divisible by "
                f"parallelism.dp * training.micro_batch_size = {p.dp} * {mbs} = {p.dp * mbs}"
            )
        # micro_batch_num = 1 leaves gradient accumulation to the trainer
        # (global / (dp * micro batch) steps); a pipeline needs the count to match exactly
        if (
            p.micro_batch_num > 1 or p.pp > 1
        ) and global_batch_size != p.dp * mbs * p.micro_batch_num:
            raise ParallelConfigError(
                f"training.global_batch_size = {global_batch_size} != parallelism.dp * "
                f"training.micro_batch_size * parallelism.micro_batch_num = "
                f"{p.dp} * {mbs} * {p.micro_batch_num} = {p.dp * mbs * p.micro_batch_num}"
            )
    if seq_length is not None and p.sequence_parallel and seq_length % p.tp:
        raise ParallelConfigError(
            f"train_dataset.seq_length = {seq_length} is not divisible by parallelism.tp = "
            f"{p.tp} (sequence parallel splits the sequence)"
        )
    return p


def _check_model(p: ParallelDims, model_cfg) -> None:
    """The degrees against the model: heads, widths and layers divisible, ep only for a
    MoE model (DeepSeek-V3: the vocabulary whole under tp, the shared experts split)."""
    n_heads = _field(model_cfg, "num_heads", "n_heads")
    n_kv = _field(model_cfg, "num_kv_heads", "n_kv_heads") or n_heads
    checks = [
        ("num_heads", n_heads, p.tp, "tp"),
        ("num_kv_heads", n_kv, p.tp, "tp"),
        ("vocab_size", _field(model_cfg, "vocab_size"), p.tp, "tp"),
        (
            "ffn_hidden_size",
            _field(model_cfg, "ffn_hidden_size", "intermediate_size"),
            p.tp,
            "tp",
        ),
        ("num_layers", _field(model_cfg, "num_layers", "n_layers"), p.pp, "pp"),
    ]
    family = _field(model_cfg, "family") or "llama"
    experts = _field(model_cfg, "n_routed_experts") or 0
    if family == "deepseek_v3":
        # the vocabulary stays whole under tp (deepseek_tp_plan); the shared experts split
        # (and the dense MLP's width matters only where a dense layer exists)
        dense = (_field(model_cfg, "first_k_dense_replace") or 0) > 0
        checks = [c for c in checks
                  if c[0] != "vocab_size" and (dense or c[0] != "ffn_hidden_size")]  # fmt: skip
        shared = (_field(model_cfg, "moe_intermediate_size") or 0) * (
            _field(model_cfg, "n_shared_experts") or 0
        )
        checks.append(("moe_intermediate_size * n_shared_experts", shared, p.tp, "tp"))
        if p.sequence_parallel:
            raise ParallelConfigError(
                "parallelism.sequence_parallel = true is not built for model.family = "
                "deepseek_v3 (tensor parallel without it is)"
            )
    if p.ep > 1:
        if family != "deepseek_v3" or not experts:
            raise ParallelConfigError(
                f"parallelism.ep = {p.ep} needs a MoE model (model.family = deepseek_v3 "
                f"with routed experts), found family {family} with "
                f"n_routed_experts = {experts}"
            )
        checks.append(("n_routed_experts", experts, p.ep, "ep"))
    for key, value, by, axis in checks:
        if value is not None and int(value) % by:
            raise ParallelConfigError(
                f"model.{key} = {value} is not divisible by parallelism.{axis} = {by}"
            )


def _field(cfg, *names):
    for n in names:
        v = cfg.get(n) if isinstance(cfg, dict) else getattr(cfg, n, None)
        if v is not None:
            return v
    return None
