"""Devices, the precision policy and the runtime constants of the memory estimate
(`_memory`): what a device offers and what a run's dtypes cost per parameter."""

from __future__ import annotations

import os
import re
from dataclasses import dataclass

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
# the same with the fused CPU kernels (a layer is ~30% fewer ops), fit together with
# _memory_activations.cpu_kernel_graph_intermediates on the 17m width with 2 and 12 layers
# (batch 8 x 256), not on the 6-layer runs the tests compare against; the fixed part then
# raised from 115 to 175 MiB by the debug width's runs, where it is most of the peak (2
# layers, batch 8 x 32: one process 598 MiB, dp2 under msrun 732, dp2 + ZeRO-1 768, against
# 540 / 600 / 599 estimated with 115; session 22): the 17m runs stay within 3-11%
COMPILE_CPU_KERNELS_FIXED = 175 * MiB
COMPILE_CPU_KERNELS_PER_LAYER = 6 * MiB
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
