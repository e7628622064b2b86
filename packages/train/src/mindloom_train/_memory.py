"""Per-rank memory estimate of a training run, before anything is built.

Bytes for the most-loaded rank of the layout: parameters, gradients (and the fp32
accumulation buffers of a multi-micro-batch step), AdamW moments (ZeRO-1 partitions whole
parameters over the data-parallel ranks, see `mindloom_parallel.zero_owners`), activations per
layer and per pipeline stage under recompute none / selected / full, communication
buffers, the runtime's own memory (CPU: the RSS of an imported MindSpore with its context,
measured; see the README), and a fragmentation reserve.

The activation inventory follows Korthikanti et al. 2022 ("Reducing Activation
Recomputation in Large Transformer Models", Sec. 4): every tensor a layer keeps for its
backward, written out for the Llama block this package trains (RMSNorm normalised in
fp32, GQA keys/values expanded to every query head before the score matmul, SwiGLU, the
fp32 softmax, fp32 logits and loss) and for the DeepSeek-V3 block (MLA, MoE). The same
inventory machinery with Korthikanti's GPT block reproduces the paper's sbh(34 + 5as/h)
(packages/train/tests/test_train_memory.py checks it, and the weight+optimizer bytes of
Megatron-LM's theoretical memory report).

Pure Python: no MindSpore import, so `mindloom estimate-memory` answers in well under a
second and the trainer can refuse a run before it allocates anything.
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
from dataclasses import dataclass, field
from typing import Any

__all__ = [
    "DEVICES",
    "Estimate",
    "Policy",
    "TensorSaved",
    "check_precision",
    "estimate",
    "format_table",
    "gpt_block",
    "layer_activation_bytes",
    "preflight",
]

GiB = 2**30
MiB = 2**20

# name -> (capacity bytes, usable share, what it is). The usable share leaves what the
# runtime reserves for itself (CUDA context, cuBLAS/cuDNN workspaces; CANN's reserve).
# Ascend: MindFormers' recipes cap a 64 GB 910B at max_device_memory 58GB (0.906).
DEVICES: dict[str, tuple[int, float, str]] = {
    "ascend-910b1": (64 * GiB, 58 / 64, "Ascend 910B1, 64 GB HBM"),
    "ascend-910b2": (64 * GiB, 58 / 64, "Ascend 910B2, 64 GB HBM"),
    "ascend-910b3": (64 * GiB, 58 / 64, "Ascend 910B3, 64 GB HBM"),
    "ascend-910b4": (32 * GiB, 29 / 32, "Ascend 910B4, 32 GB HBM"),
    "ascend-910c": (64 * GiB, 58 / 64, "Ascend 910C, one of its two dies (64 GB each)"),
    "ascend-910a": (32 * GiB, 29 / 32, "Ascend 910 (first generation), 32 GB HBM"),
    "a100-40gb": (40 * GiB, 0.95, "NVIDIA A100 40 GB"),
    "a100-80gb": (80 * GiB, 0.95, "NVIDIA A100 80 GB"),
    "a800-80gb": (80 * GiB, 0.95, "NVIDIA A800 80 GB"),
    "h100-80gb": (80 * GiB, 0.95, "NVIDIA H100 80 GB (SXM / PCIe)"),
    "h800-80gb": (80 * GiB, 0.95, "NVIDIA H800 80 GB"),
    "h200": (141 * 10**9, 0.95, "NVIDIA H200 141 GB"),
    "b200": (180 * 10**9, 0.95, "NVIDIA B200 180 GB"),
    "l40s": (48 * GiB, 0.95, "NVIDIA L40S 48 GB"),
    "a10": (24 * GiB, 0.95, "NVIDIA A10 24 GB"),
    "l4": (24 * GiB, 0.95, "NVIDIA L4 24 GB"),
    "rtx-4090": (24 * GiB, 0.95, "NVIDIA GeForce RTX 4090 24 GB"),
    "rtx-3090": (24 * GiB, 0.95, "NVIDIA GeForce RTX 3090 24 GB"),
    "v100-32gb": (32 * GiB, 0.95, "NVIDIA V100 32 GB"),
    "v100-16gb": (16 * GiB, 0.95, "NVIDIA V100 16 GB"),
    "t4": (16 * GiB, 0.95, "NVIDIA T4 16 GB"),
}
_ALIASES = {
    "910b": "ascend-910b2", "ascend-910b": "ascend-910b2", "910c": "ascend-910c",
    "910b4": "ascend-910b4", "a100": "a100-80gb", "h100": "h100-80gb", "h800": "h800-80gb",
    "a800": "a800-80gb", "v100": "v100-32gb", "4090": "rtx-4090",
}  # fmt: skip
CPU_USABLE_SHARE = 0.9  # of MemTotal: the kernel, page cache and other processes keep some

# The CPU runtime: RSS of a process after `import mindspore`, mindloom_train and
# set_context, before any model (measured: see RUNTIME_CPU_MEASURED in the README and
# `python -m mindloom_train._memory --measure-runtime`). One MindSpore process each rank.
RUNTIME_CPU_BYTES = 407 * MiB
RUNTIME_CPU_MSRUN_EXTRA = 60 * MiB  # the communicator and the msrun worker plumbing
# On the CPU the compiled train step lives in the same RSS: MindSpore's graph compiler
# holds about this much per decoder layer of the graph, plus a fixed part (loss, update,
# the data pipeline). Fit on two runs whose tensors are negligible (the debug width with 2
# and with 8 layers, see the README), not on the runs the tests compare against.
COMPILE_CPU_FIXED = 174 * MiB
COMPILE_CPU_PER_LAYER = 50 * MiB
RUNTIME_GPU_BYTES = 0  # inside the usable share
FRAGMENTATION_SHARE = 0.10  # of everything the run allocates (allocator pools, alignment)

_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}
_SHORT = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}


def _cfg_error(msg: str):
    from mindloom_train._config import ConfigError

    return ConfigError(msg)


# ---------------------------------------------------------------------------------------
# precision


@dataclass(frozen=True)
class Policy:
    """Bytes per parameter of each state. mindloom's: parameters are the master weights
    (param_dtype), gradients come out in param_dtype, AdamW moments are fp32 and the
    accumulation buffers of a multi-micro-batch step are fp32. Megatron's mixed precision
    (bf16 weights, fp32 grads, fp32 master copy) is the other policy the tests use."""

    param: int = 4
    grad: int = 4
    master: int = 0  # a separate fp32 copy (0: the parameters are the masters)
    moments: int = 8  # exp_avg + exp_avg_sq
    accum: int = 4  # per-parameter accumulation buffer (when there are several micro-batches)
    # what ZeRO-1 / the distributed optimizer shards over the data-parallel ranks
    sharded: tuple[str, ...] = ("moments",)
    even_shards: bool = False  # True: flat even split (Megatron); False: whole parameters


def check_precision(cfg, mcfg=None) -> None:
    """The precision settings that cannot train, refused in one line before anything is
    built (ConfigError: exit code 2)."""
    model = cfg.model
    pdt = model.get("param_dtype", getattr(mcfg, "param_dtype", "float32") if mcfg else "float32")
    if pdt in ("float16", "bfloat16"):
        # AdamWeightDecay updates the parameter in place from fp32 moments: MindSpore
        # refuses the mixed dtypes ("Data type conversion is not supported for a
        # 'Parameter'", a TypeError traceback at the first step, float16 and bfloat16
        # alike), and a 16-bit master weight would lose updates below its resolution
        raise _cfg_error(
            f"config key model.param_dtype: {pdt!r} cannot train here: the AdamW update "
            "needs float32 master weights (fp32 moments); keep param_dtype float32 and set "
            "precision.compute_dtype bf16/fp16 for low-precision matmuls"
        )


# ---------------------------------------------------------------------------------------
# activations: an inventory of saved tensors


@dataclass(frozen=True)
class TensorSaved:
    """One tensor a layer keeps for its backward: elements = tokens * width (or, with
    `scores`, micro_batch * heads * s * s), `nbytes` per element, split over TP ranks
    when `tp_split` (head- or FFN-sharded), over TP ranks with sequence parallelism when
    `sp_split` (the replicated norm/residual region)."""

    name: str
    width: float  # per token; for scores: heads
    nbytes: int
    tp_split: bool = False
    sp_split: bool = False
    scores: bool = False
    in_selective: bool = False  # recomputed under Korthikanti's selective recompute

    def bytes(self, b: int, s: int, tp: int, sp: bool) -> float:
        n = b * self.width * (s * s if self.scores else s) * self.nbytes
        if self.tp_split or (self.sp_split and sp):
            n /= tp
        return n


def gpt_block(h: int, a: int, ffn: int | None = None, dropout: bool = True) -> list[TensorSaved]:
    """Korthikanti et al. 2022 Sec. 4.1's GPT block in 16-bit: what its Table 2 counts."""
    f = 4 * h if ffn is None else ffn
    out = [
        TensorSaved("attn layernorm input", h, 2, sp_split=True),
        TensorSaved("qkv input", h, 2, sp_split=True),
        # kept under selective recompute: the inputs of the recomputed QK^T/softmax/PV
        TensorSaved("q, k", 2 * h, 2, tp_split=True),
        TensorSaved("softmax output", a, 2, tp_split=True, scores=True, in_selective=True),
        TensorSaved("v", h, 2, tp_split=True),
        TensorSaved("proj input", h, 2, tp_split=True),
        TensorSaved("mlp layernorm input", h, 2, sp_split=True),
        TensorSaved("fc1 input", h, 2, sp_split=True),
        TensorSaved("gelu input", f, 2, tp_split=True),
        TensorSaved("fc2 input", f, 2, tp_split=True),
    ]
    if dropout:
        out += [
            TensorSaved("attn dropout mask", a, 1, tp_split=True, scores=True, in_selective=True),
            TensorSaved(
                "attn dropout output", a, 2, tp_split=True, scores=True, in_selective=True
            ),  # fmt: skip
            TensorSaved("attn residual dropout mask", h, 1, sp_split=True),
            TensorSaved("mlp residual dropout mask", h, 1, sp_split=True),
        ]
    return out


def llama_block(mcfg, c: int) -> list[TensorSaved]:
    """The Llama block of mindloom_model as written (c: compute bytes per element)."""
    h, a, dh, f = mcfg.hidden_size, mcfg.num_heads, mcfg.head_dim, mcfg.ffn_hidden_size
    out = [
        # RMSNorm normalises an fp32 copy; its backward reads that copy
        TensorSaved("attn_norm fp32", h, 4, sp_split=True),
        TensorSaved("qkv input", h, c, sp_split=True),
        TensorSaved("q (after RoPE)", a * dh, c, tp_split=True),
        # GQA: k and v are broadcast to every query head before the score matmul
        TensorSaved("k, v (expanded)", 2 * a * dh, c, tp_split=True),
        TensorSaved("softmax output fp32", a, 4, tp_split=True, scores=True),
        TensorSaved("wo input", a * dh, c, tp_split=True),
        TensorSaved("mlp_norm fp32", h, 4, sp_split=True),
        TensorSaved("w1/w3 input", h, c, sp_split=True),
        # SwiGLU: w1 out (silu's input), silu out, w3 out, their product (w2's input)
        TensorSaved("swiglu (4 x ffn)", 4 * f, c, tp_split=True),
    ]
    if c != 4:
        out.append(TensorSaved("probs in compute dtype", a, c, tp_split=True, scores=True))
    if mcfg.dropout > 0:
        out += [
            TensorSaved("attn dropout mask+output", a, 1 + c, tp_split=True, scores=True),
            TensorSaved("residual dropout masks", 2 * h, 1, sp_split=True),
        ]
    return out


def deepseek_blocks(mcfg, c: int) -> tuple[list[TensorSaved], list[TensorSaved]]:
    """(dense layer, MoE layer) inventories of the DeepSeek-V3 block: MLA attention, then a
    dense SwiGLU (the first first_k_dense_replace layers) or DeepSeekMoE. Routed expert
    activations are per routed token copy (N*k), the even load; a capacity factor caps
    them at capacity_factor times that."""
    h, a = mcfg.hidden_size, mcfg.num_heads
    qk = mcfg.qk_nope_head_dim + mcfg.qk_rope_head_dim
    vd, kvr, qr = mcfg.v_head_dim, mcfg.kv_lora_rank, mcfg.q_lora_rank
    attn = [
        TensorSaved("attn_norm fp32", h, 4, sp_split=True),
        TensorSaved("q/kv down input", h, c, sp_split=True),
        TensorSaved("kv latent + rope key", kvr + mcfg.qk_rope_head_dim, c),
        TensorSaved("kv_norm fp32 + output", kvr, 4 + c),
        TensorSaved("q, k (nope+rope)", 2 * a * qk, c, tp_split=True),
        TensorSaved("v", a * vd, c, tp_split=True),
        TensorSaved("softmax output fp32", a, 4, tp_split=True, scores=True),
        TensorSaved("o_proj input", a * vd, c, tp_split=True),
        TensorSaved("mlp_norm fp32", h, 4, sp_split=True),
        TensorSaved("mlp input", h, c, sp_split=True),
    ]
    if qr:
        attn.append(TensorSaved("q latent + q_norm", qr, 4 + 2 * c))
    if c != 4:
        attn.append(TensorSaved("probs in compute dtype", a, c, tp_split=True, scores=True))
    dense = attn + [TensorSaved("swiglu (4 x ffn)", 4 * mcfg.ffn_hidden_size, c, tp_split=True)]
    k, e, fm = mcfg.num_experts_per_tok, mcfg.n_routed_experts, mcfg.moe_intermediate_size
    load = k if mcfg.moe_capacity_factor is None else min(k * mcfg.moe_capacity_factor, e)
    moe = attn + [
        TensorSaved("router scores fp32", 3 * e, 4),  # logits, sigmoid, biased copy
        TensorSaved("routed token copies", load * h, c),
        TensorSaved("expert swiglu (4 x Fm x k)", 4 * fm * load, c, tp_split=True),
        TensorSaved("expert outputs", load * h, c),
        TensorSaved("shared expert swiglu", 4 * fm * mcfg.n_shared_experts, c, tp_split=True),
    ]
    return dense, moe


def cpu_graph_intermediates(mcfg, b: int, s: int, recomputed: bool) -> tuple[float, float]:
    """(bytes per layer, bytes of the head and loss) of MindSpore's CPU backend in graph
    mode, fp32. Measured there: the compiled step keeps essentially every intermediate of
    its forward and backward alive until the step ends (no reuse across the graph; the
    17m preset at 8 x 256 peaks at ~4.3 GB where the saved-for-backward set is ~0.7 GB).
    So this counts op outputs, not saved tensors: per layer, of width hidden (the two
    RMSNorms 3 each; q/k/v and their transposes; RoPE's products, halves, concat and sum
    on q and k; GQA's expanded k and v; the attention output, its transpose and wo; w2;
    two residual sums), four of width ffn (w1, silu, w3, product) and three score-sized
    (scores, + bias, softmax); the backward makes one gradient per forward output, two
    more score-sized in the softmax backward. A recomputed layer runs its forward twice."""
    h, a, f = mcfg.hidden_size, mcfg.num_heads, mcfg.ffn_hidden_size
    g = mcfg.num_kv_heads / a
    n = b * s
    fwd_h = 3 + (1 + 2 * g) * 2 + 5 * (1 + g) + (2 if g < 1 else 0) + 3 + 1 + 3 + 1 + 1
    fwd = 4 * n * (fwd_h * h + 4 * f) + 4 * b * a * s * s * (3 + (mcfg.dropout > 0))
    bwd = fwd + 4 * b * a * s * s * 2
    layer = fwd * (2 if recomputed else 1) + bwd
    # logits, logits - max, exp; backward: d exp, d (logits - max), their sum, the
    # gather's scatter
    head = 4 * n * mcfg.vocab_size * 7 + 4 * n * h * 6
    return layer, head


def layer_activation_bytes(inventory, b, s, tp=1, sp=False, recompute="none") -> float:
    """Bytes one layer keeps for one micro-batch. recompute: none; `selective`
    (Korthikanti: attention core recomputed); `full` (only the layer input is kept)."""
    if recompute == "full":
        first = inventory[0]  # the layer input: one residual-stream tensor
        return TensorSaved("layer input", first.width, 2 if first.nbytes <= 2 else first.nbytes,
                           sp_split=True).bytes(b, s, tp, sp)  # fmt: skip
    return sum(
        t.bytes(b, s, tp, sp)
        for t in inventory
        if not (recompute == "selective" and t.in_selective)
    )


# ---------------------------------------------------------------------------------------
# the estimate


@dataclass
class Estimate:
    components: dict[str, int]  # bytes per rank, most-loaded rank
    total: int
    usable: int
    device: str
    device_note: str
    layout: dict[str, Any]
    per_layer_activation: int
    stage_activations: list[int]  # per pipeline stage
    stage_totals: list[int]
    notes: list[str] = field(default_factory=list)
    suggestions: list[dict[str, Any]] = field(default_factory=list)

    @property
    def fits(self) -> bool:
        return self.total <= self.usable

    @property
    def verdict(self) -> str:
        return "fits" if self.fits else "does not fit"

    def to_json(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["verdict"] = self.verdict
        d["fits"] = self.fits
        return d


def _parse_mem(text: str) -> int | None:
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?)B?\s*", str(text), re.I)
    if not m:
        return None
    mult = {"": 1, "K": 2**10, "M": MiB, "G": GiB, "T": 2**40}[m.group(2).upper()]
    return int(float(m.group(1)) * mult)


def host_memory_bytes() -> int:
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def resolve_device(cfg, name: str | None, ranks_per_host: int) -> tuple[str, int, str, bool]:
    """(name, usable bytes per rank, description, is_cpu). context.max_device_memory caps
    the device's usable memory (MindSpore's own cap)."""
    target = cfg.context.device_target
    key = (name or "").strip().lower()
    key = _ALIASES.get(key, key)
    if not key:
        key = "cpu" if target == "CPU" else ("ascend-910b2" if target == "Ascend" else "a100-80gb")
    if key == "cpu":
        total = host_memory_bytes()
        usable = int(total * CPU_USABLE_SHARE) // max(1, ranks_per_host)
        desc = f"this host's RAM {total / GiB:.1f} GiB x {CPU_USABLE_SHARE:g}"
        if ranks_per_host > 1:
            desc += f", shared by {ranks_per_host} ranks"
        return "cpu", usable, desc, True
    if key not in DEVICES:
        raise _cfg_error(
            f"--device {name!r}: unknown device (known: cpu, {', '.join(sorted(DEVICES))})"
        )
    cap, share, desc = DEVICES[key]
    usable = int(cap * share)
    if cfg.context.max_device_memory:
        cap_bytes = _parse_mem(cfg.context.max_device_memory)
        if cap_bytes is None:
            raise _cfg_error(
                f"config key context.max_device_memory: expected a size like '58GB', got "
                f"{cfg.context.max_device_memory!r}"
            )
        usable = min(cap_bytes, cap)
        desc += f", capped by context.max_device_memory {cfg.context.max_device_memory}"
    return key, usable, desc, False


def _model_config(cfg, vocab_size: int | None):
    """ModelConfig of the run (any family: the estimate covers deepseek_v3 too)."""
    from mindloom_model import ModelConfig, get_preset

    from mindloom_train._modelcfg import _DTYPE, _RECOMPUTE, _overrides

    if vocab_size is None and cfg.model.get("vocab_size") is None:
        vocab_size = _tokenizer_vocab(cfg)
    over = _overrides(cfg.model, vocab_size, cfg.train_dataset.seq_length)
    over["compute_dtype"] = _DTYPE[cfg.precision.compute_dtype]
    if cfg.recompute.mode != "none":
        over["recompute"] = _RECOMPUTE[cfg.recompute.mode]
        over["recompute_layers"] = list(cfg.recompute.layers)
    try:
        preset = cfg.model.get("preset")
        return get_preset(preset, **over) if preset else ModelConfig(**over)
    except (ValueError, TypeError) as exc:
        raise _cfg_error(f"config key model: {exc}") from None


def _tokenizer_vocab(cfg) -> int | None:
    """The vocabulary of the run's tokenizer: the one at tokenizer.path when it is there,
    else the size the run would train (tokenizer.vocab_size; null: the preset's)."""
    path = cfg.tokenizer.path
    if path and os.path.isdir(path):
        try:
            from mindloom_tokenizer import Tokenizer

            return Tokenizer.load(path).vocab_size
        except Exception:  # an unreadable tokenizer is the run's error to report, not ours
            pass
    return cfg.tokenizer.vocab_size


def _stage_param_sizes(mcfg, tp: int, pp: int) -> list[list[int]]:
    """Sizes of the local tensors of each pipeline stage (one TP rank)."""
    if mcfg.family == "llama":
        from mindloom_parallel import tensor_layout

        specs = tensor_layout(mcfg, {"dp": 1, "tp": tp, "pp": pp}).values()
        return [
            [math.prod(sp.local_shape(tp)) for sp in specs if st in sp.pp_stages]
            for st in range(pp)
        ]
    # deepseek_v3: layers split evenly (MTP with the last stage), matrices over TP
    v, h = mcfg.vocab_size, mcfg.hidden_size
    head = 0 if mcfg.tie_embeddings else v * h
    body = mcfg.num_params(include_embeddings=False) - head - h
    stages = [[int(body / pp / tp)] for _ in range(pp)]
    stages[0].append(v * h // tp)
    stages[-1] += [h] + ([head // tp] if head else ([v * h // tp] if pp > 1 else []))
    return stages


def _zero_max_share(sizes: list[int], dp: int, even: bool) -> int:
    if dp <= 1:
        return sum(sizes)
    if even:
        return math.ceil(sum(sizes) / dp)
    from mindloom_parallel import zero_owners

    load = [0] * dp
    for size, owner in zip(sizes, zero_owners(sizes, dp)):
        load[owner] += size
    return max(load)


def _static_bytes(sizes, policy: Policy, dp, zero, accum_micro) -> dict[str, float]:
    n = sum(sizes)
    shard = _zero_max_share(sizes, dp, policy.even_shards) if zero else n
    per = {"parameters": policy.param, "gradients": policy.grad, "master weights": policy.master,
           "optimizer states": policy.moments}  # fmt: skip
    key = {"parameters": "params", "gradients": "grads", "master weights": "master",
           "optimizer states": "moments"}  # fmt: skip
    out = {name: (shard if key[name] in policy.sharded else n) * b for name, b in per.items()}
    out["gradients"] += (n * policy.accum) if accum_micro > 1 else 0
    return out


def estimate(
    cfg,
    *,
    nproc: int | None = None,
    device: str | None = None,
    vocab_size: int | None = None,
    mcfg=None,
    runtime_bytes: int | None = None,
    ranks_per_host: int | None = None,
    suggest: bool = True,
) -> Estimate:
    """The per-rank estimate of `cfg` on `nproc` ranks (default: the layout's world)."""
    if mcfg is None:
        mcfg = _model_config(cfg, vocab_size)
    p, t = cfg.parallelism, cfg.training
    world = nproc or cfg.world_size
    if world == 1:
        dp = tp = pp = 1  # one process trains the whole model (parallelism needs msrun)
        zero, sp = False, False
    else:
        dp, tp, pp, zero, sp = p.dp, p.tp, p.pp, p.zero_stage == 1, p.sequence_parallel
        if dp * tp * pp != world:
            raise _cfg_error(
                f"config parallelism: dp*tp*pp = {dp * tp * pp} does not match {world} ranks"
            )
    if mcfg.num_layers % pp:
        raise _cfg_error(f"config parallelism: pp={pp} does not divide {mcfg.num_layers} layers")
    dname, usable, ddesc, is_cpu = resolve_device(cfg, device, ranks_per_host or world)
    notes: list[str] = []
    # compute dtype: the CPU backend has no 16-bit MatMul, the trainer computes in fp32
    cdt = mcfg.compute_dtype if not is_cpu else "float32"
    c = _BYTES[cdt]
    pbytes = _BYTES[mcfg.param_dtype]
    policy = Policy(param=pbytes, grad=pbytes)
    b, s = t.micro_batch_size, cfg.train_dataset.seq_length
    engine = world > 1 and (tp > 1 or pp > 1 or zero)
    micro = p.micro_batch_num if (p.micro_batch_num > 1 or pp > 1) else cfg.grad_accum_steps
    if not engine:
        micro = cfg.grad_accum_steps

    stages = _stage_param_sizes(mcfg, tp, pp)
    if mcfg.family == "llama":
        inv_dense = inv_moe = llama_block(mcfg, c)
        n_moe = 0
    else:
        inv_dense, inv_moe = deepseek_blocks(mcfg, c)
        n_moe = mcfg.num_layers - mcfg.first_k_dense_replace
        notes.append("deepseek_v3: per-stage parameters split evenly; MoE activations at even load")
    per_layer_dense = layer_activation_bytes(inv_dense, b, s, tp, sp)
    per_layer_moe = layer_activation_bytes(inv_moe, b, s, tp, sp)
    recomputed = set()
    if mcfg.recompute == "full":
        recomputed = set(range(mcfg.num_layers))
    elif mcfg.recompute == "selected":
        recomputed = set(mcfg.recompute_layers)
    v_local = mcfg.vocab_size / tp
    n_tok = b * s
    from mindloom_parallel import stage_layers

    # MindSpore's CPU backend, compiled step (one process or plain data parallel)
    cpu_graph = is_cpu and cfg.context.mode == "graph" and not engine
    stage_act, stage_tot, comps_by_stage = [], [], []
    for st in range(pp):
        layers = stage_layers(mcfg.num_layers, pp, st)
        in_flight = min(pp - st, micro) if pp > 1 else 1
        act = 0.0
        recompute_work = 0.0
        for i in layers:
            inv = (
                inv_moe
                if (mcfg.family != "llama" and i >= mcfg.first_k_dense_replace)
                else inv_dense
            )
            full = layer_activation_bytes(inv, b, s, tp, sp)
            if i in recomputed and cpu_graph:
                # the CPU graph keeps every intermediate to the step's end: a recomputed
                # layer's forward is kept twice, nothing is freed (Llama: op outputs below)
                act += 2 * full
            elif i in recomputed:
                act += layer_activation_bytes(inv, b, s, tp, sp, "full")
                recompute_work = max(recompute_work, full)  # rebuilt one layer at a time
            else:
                act += full
        # the [B, 1, S, S] fp32 attention bias (segment ids: one per sample) and its masks
        mask = 6 * b * s * s
        act = act * in_flight + mask + recompute_work
        if st == pp - 1:
            # final norm (fp32 copy + head input), fp32 logits, the loss's exp (kept for its
            # backward) and the gradient of the logits; a 16-bit head adds its own output
            depths = 1 + (mcfg.num_nextn_predict_layers if mcfg.family != "llama" else 0)
            head = n_tok * mcfg.hidden_size * (4 + c) + 3 * 4 * n_tok * v_local
            if c != 4:
                head += c * n_tok * v_local
            act += head * depths
        # backward transient: the gradient of a layer's largest saved tensor, twice
        largest = max(x.bytes(b, s, tp, sp) for x in inv_dense + inv_moe)
        act += 2 * largest
        if cpu_graph and mcfg.family == "llama":
            act = mask
            for i in layers:
                act += cpu_graph_intermediates(mcfg, b, s, i in recomputed)[0]
            act += cpu_graph_intermediates(mcfg, b, s, False)[1]
        comps = _static_bytes(stages[st], policy, dp, zero, micro)
        # communication: what lives during the backward (TP region all-reduces, pipeline
        # send/recv) adds to the activations; what lives at the optimizer step, after the
        # backward freed the activations (the gradient buckets' concatenation and its
        # all-reduced copy; ZeRO-1's flat vector of the owners' new values and its
        # all-reduce), counts only where it exceeds them
        comm = 0.0
        if tp > 1:
            comm += 2 * n_tok * mcfg.hidden_size * c
        if pp > 1:
            comm += 2 * in_flight * n_tok * mcfg.hidden_size * c
        step_comm = 0.0
        if dp > 1:
            step_comm += 2 * min(p.bucket_size_mb * MiB, sum(stages[st]) * policy.grad)
        if zero and dp > 1:
            step_comm = max(step_comm, 2 * sum(stages[st]) * pbytes)
        comm += max(0.0, step_comm - act)
        comps["activations"] = act
        comps["communication buffers"] = comm
        comps_by_stage.append(comps)
        stage_act.append(int(act))
    if runtime_bytes is None:
        runtime_bytes = (
            RUNTIME_CPU_BYTES + (RUNTIME_CPU_MSRUN_EXTRA if world > 1 else 0)
            if is_cpu
            else RUNTIME_GPU_BYTES
        )
    for st, comps in enumerate(comps_by_stage):
        alloc = sum(comps.values())
        comps["fragmentation reserve"] = FRAGMENTATION_SHARE * alloc
        comps["runtime"] = runtime_bytes
        if cpu_graph:
            n_layers = len(stage_layers(mcfg.num_layers, pp, st))
            comps["graph compiler"] = COMPILE_CPU_FIXED + COMPILE_CPU_PER_LAYER * n_layers
        stage_tot.append(int(sum(comps.values())))
    worst = max(range(pp), key=lambda i: stage_tot[i])
    components = {k: int(v) for k, v in comps_by_stage[worst].items()}
    if is_cpu and cdt != mcfg.compute_dtype:
        notes.append(f"CPU: compute in float32 (no {mcfg.compute_dtype} MatMul)")
    if n_moe:
        per_layer = int(per_layer_moe)
    else:
        per_layer = int(per_layer_dense)
    est = Estimate(
        components=components,
        total=int(sum(components.values())),
        usable=int(usable),
        device=dname,
        device_note=ddesc,
        layout={
            "world": world,
            "dp": dp,
            "tp": tp,
            "pp": pp,
            "zero_stage": int(zero),
            "sequence_parallel": sp,
            "micro_batch_size": b,
            "seq_length": s,
            "micro_batches": micro,
            "recompute": mcfg.recompute,
            "recompute_layers": sorted(recomputed),
            "most_loaded_stage": worst,
            "compute_dtype": cdt,
            "param_dtype": mcfg.param_dtype,
            "num_params": mcfg.num_params(),
            "family": mcfg.family,
        },  # fmt: skip
        per_layer_activation=per_layer,
        stage_activations=stage_act,
        stage_totals=stage_tot,
        notes=notes,
    )
    if suggest and not est.fits:
        est.suggestions = _suggestions(cfg, est, nproc=world, device=device, mcfg=mcfg,
                                       runtime_bytes=runtime_bytes, ranks_per_host=ranks_per_host)  # fmt: skip
    return est


def _variant(cfg, **changes):
    import copy

    new = copy.deepcopy(cfg)
    for dotted, value in changes.items():
        section, key = dotted.split(".")
        setattr(getattr(new, section), key, value)
    return new


def _suggestions(cfg, est, *, nproc, device, mcfg, runtime_bytes, ranks_per_host) -> list[dict]:
    """Each single change that could make it fit, with its estimate."""
    p, t = cfg.parallelism, cfg.training
    lay = est.layout
    tries: list[tuple[str, Any, int]] = []
    if lay["recompute"] != "full":
        tries.append(("recompute.mode=full", _variant(cfg, **{"recompute.mode": "full"}), nproc))
    if lay["dp"] > 1 and not lay["zero_stage"]:
        tries.append(("parallelism.zero_stage=1",
                      _variant(cfg, **{"parallelism.zero_stage": 1}), nproc))  # fmt: skip
    world = max(nproc, 1)
    for axis, limit in (("tp", mcfg.num_kv_heads), ("pp", mcfg.num_layers)):
        cur = lay[axis] if world > 1 else 1
        new = cur * 2
        if limit % new:
            continue
        dp = lay["dp"] if world > 1 else 1
        same_world = dp % 2 == 0
        changes = {f"parallelism.{axis}": new}
        if world > 1:
            changes["parallelism.tp" if axis == "pp" else "parallelism.pp"] = (
                lay["pp"] if axis == "tp" else lay["tp"]
            )
        else:
            changes["parallelism.tp" if axis == "pp" else "parallelism.pp"] = 1
        changes["parallelism.dp"] = dp // 2 if same_world else dp
        n = world if same_world else world * 2
        if axis == "pp" and p.micro_batch_num < new:
            changes["parallelism.micro_batch_num"] = new
        var = _variant(cfg, **changes)
        if not same_world:
            var.training.global_batch_size = t.global_batch_size
        if var.training.global_batch_size % (var.training.micro_batch_size * var.parallelism.dp):
            continue
        label = f"parallelism.{axis}={new}" + ("" if same_world else f" ({n} ranks)")
        if same_world and dp > 1:
            label += f", dp={dp // 2}"
        tries.append((label, var, n))
    mbs = t.micro_batch_size
    while mbs > 1:
        mbs //= 2
        var = _variant(cfg, **{"training.micro_batch_size": mbs})
        tries.append((f"training.micro_batch_size={mbs} (more accumulation steps)", var, nproc))
        if estimate(var, nproc=nproc, device=device, mcfg=_with(mcfg, var),
                    runtime_bytes=runtime_bytes, ranks_per_host=ranks_per_host,
                    suggest=False).fits:  # fmt: skip
            break
    out = []
    for label, var, n in tries:
        try:
            e = estimate(var, nproc=n, device=device, mcfg=_with(mcfg, var),
                         runtime_bytes=runtime_bytes,
                         ranks_per_host=(ranks_per_host or nproc) * n // max(nproc, 1),
                         suggest=False)  # fmt: skip
        except ValueError:
            continue
        out.append({"change": label, "total": e.total, "usable": e.usable, "fits": e.fits})
    if out and not any(o["fits"] for o in out):
        out += _combined(cfg, nproc, device, mcfg, runtime_bytes)
    return out


def _combined(cfg, nproc, device, mcfg, runtime_bytes) -> list[dict]:
    """None fits alone: full recompute + ZeRO-1, then doubling TP (within the KV heads),
    then PP (within the layers), at the same number of ranks while dp allows."""
    var = _variant(cfg, **{"recompute.mode": "full", "parallelism.zero_stage": 1})
    steps = ["recompute.mode=full", "parallelism.zero_stage=1"]
    world = max(nproc, 1)
    if world == 1:
        var.parallelism.dp = var.parallelism.tp = var.parallelism.pp = 1
    for _ in range(16):
        e = estimate(var, nproc=world, device=device, mcfg=_with(mcfg, var),
                     runtime_bytes=runtime_bytes, suggest=False)  # fmt: skip
        if e.fits:
            break
        p = var.parallelism
        if p.dp % 2 == 0 and mcfg.num_kv_heads % (p.tp * 2) == 0:
            p.dp, p.tp = p.dp // 2, p.tp * 2
        elif p.dp % 2 == 0 and mcfg.num_layers % (p.pp * 2) == 0:
            p.dp, p.pp = p.dp // 2, p.pp * 2
            p.micro_batch_num = max(p.micro_batch_num, p.pp)
        elif mcfg.num_kv_heads % (p.tp * 2) == 0:
            p.tp, world = p.tp * 2, world * 2
        elif mcfg.num_layers % (p.pp * 2) == 0:
            p.pp, world = p.pp * 2, world * 2
            p.micro_batch_num = max(p.micro_batch_num, p.pp)
        else:
            break
        if var.training.global_batch_size % (var.training.micro_batch_size * p.dp):
            break
    p = var.parallelism
    steps.append(f"dp={p.dp} tp={p.tp} pp={p.pp} on {world} ranks")
    return [{"change": "together: " + ", ".join(steps), "total": e.total, "usable": e.usable,
             "fits": e.fits}]  # fmt: skip


def _with(mcfg, cfg):
    return dataclasses.replace(
        mcfg,
        recompute=cfg.recompute.mode,
        recompute_layers=list(cfg.recompute.layers) if cfg.recompute.mode == "selected" else [],
    )


# ---------------------------------------------------------------------------------------
# output


def _fmt(n: float) -> str:
    return f"{n / GiB:.2f} GiB" if n >= GiB else f"{n / MiB:.1f} MiB"


def format_table(est: Estimate, compact: bool = False) -> str:
    lay = est.layout
    head = (
        f"memory estimate per rank (most-loaded: pipeline stage {lay['most_loaded_stage']} of "
        f"{lay['pp']}; dp={lay['dp']} tp={lay['tp']} pp={lay['pp']} zero={lay['zero_stage']}; "
        f"micro-batch {lay['micro_batch_size']} x {lay['seq_length']}, recompute "
        f"{lay['recompute']}; params {lay['param_dtype']}, compute {lay['compute_dtype']})"
    )
    lines = [head]
    for name, val in est.components.items():
        lines.append(f"  {name:24s} {_fmt(val):>12s}")
    if not compact:
        lines.append(f"  {'(activations per layer)':24s} {_fmt(est.per_layer_activation):>12s}")
        if lay["pp"] > 1:
            per = ", ".join(_fmt(x) for x in est.stage_totals)
            lines.append(f"  {'(total per stage)':24s} {per}")
    lines.append(f"  {'total':24s} {_fmt(est.total):>12s}")
    lines.append(f"  {'usable on ' + est.device:24s} {_fmt(est.usable):>12s}  ({est.device_note})")
    pct = 100.0 * est.total / est.usable if est.usable else float("inf")
    lines.append(f"  verdict: {est.verdict} ({pct:.0f}% of usable)")
    for note in est.notes:
        lines.append(f"  note: {note}")
    if est.suggestions:
        lines.append("  what would make it fit (one change each):")
        for sug in est.suggestions:
            mark = "fits" if sug["fits"] else "still too big"
            lines.append(f"    {sug['change']:52s} {_fmt(sug['total']):>12s}  {mark}")
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------
# the trainer's and the launcher's check


def preflight(cfg, vocab_size: int | None, world: int, log, mcfg=None,
              ranks_per_host: int | None = None) -> Estimate:  # fmt: skip
    """Precision check, then the estimate printed compactly to `log`; a run that would not
    fit is refused (ConfigError, exit 2) unless training.ignore_memory_estimate."""
    check_precision(cfg, mcfg)
    est = estimate(
        cfg, nproc=world, vocab_size=vocab_size, mcfg=mcfg, ranks_per_host=ranks_per_host
    )
    for line in format_table(est, compact=True).splitlines():
        log(line)
    if not est.fits:
        if getattr(cfg.training, "ignore_memory_estimate", False):
            log(
                "memory: the estimate exceeds the device; training.ignore_memory_estimate=true, going on"
            )
        else:
            raise _cfg_error(
                f"memory: the estimate {_fmt(est.total)} per rank exceeds the usable "
                f"{_fmt(est.usable)} on {est.device} (table above; `mindloom estimate-memory` "
                "shows what would fit); --set training.ignore_memory_estimate=true overrides"
            )
    return est


def measure_runtime_bytes() -> int:
    """RSS of this process after importing MindSpore and mindloom_train and setting the
    CPU context: the runtime baseline (run in a fresh process)."""
    import mindspore as ms

    import mindloom_train._trainer  # noqa: F401  (what a training process has imported)

    ms.set_context(mode=ms.GRAPH_MODE, device_target="CPU")
    from mindloom_train._metrics import mem_rss_mb

    return int(mem_rss_mb() * MiB)


if __name__ == "__main__":
    import sys

    if sys.argv[1:] == ["--measure-runtime"]:
        print(f"runtime RSS {measure_runtime_bytes() / MiB:.1f} MiB")
