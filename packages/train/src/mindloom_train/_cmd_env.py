"""`mindloom check-env`: MindSpore, the device and (with --nproc) msrun, checked."""

from __future__ import annotations

import os
import time
from pathlib import Path

from mindloom_train._errors import CommandError


def add_parser(sub) -> None:
    p = sub.add_parser("check-env", help="check MindSpore, the device and (with --nproc) msrun")
    p.add_argument("--nproc", type=int, default=0, help="also all-reduce across N msrun workers")
    p.add_argument("--device-target", default="CPU", choices=["CPU", "Ascend", "GPU"])
    p.add_argument("--timeout", type=int, default=120)
    p.set_defaults(func=_cmd_check_env)


def _cmd_check_env(args) -> int:
    from mindloom_train._state import versions

    for key, val in versions().items():
        print(f"{key:20s} {val}")
    import mindspore as ms
    import numpy as np

    try:
        ms.set_context(device_target=args.device_target)
        a = np.random.default_rng(0).standard_normal((256, 256)).astype(np.float32)
        t0 = time.perf_counter()
        got = ms.ops.matmul(ms.Tensor(a), ms.Tensor(a)).asnumpy()
        dt = time.perf_counter() - t0
    except Exception as exc:  # any backend failure is the answer to "does it work"
        raise CommandError(
            f"check-env: a 256x256 matmul on {args.device_target} failed: {exc}"
        ) from None
    err = float(np.abs(got - a @ a).max())
    if not err < 1e-3:
        raise CommandError(f"check-env: matmul result differs from numpy by {err}")
    print(f"{'backend':20s} {ms.get_context('device_target')}")
    print(f"{'device':20s} {_device_name(args.device_target)}")
    print(f"{'matmul 256x256':20s} ok (max |diff| vs numpy {err:.1e}, {dt * 1000:.1f} ms)")
    if args.nproc and args.nproc > 1:
        import tempfile

        from mindloom_parallel import LaunchError, launch

        log_dir = tempfile.mkdtemp(prefix="mindloom-check-env-")
        try:
            launch(["-m", "mindloom_train._envcheck", str(args.nproc)], nproc=args.nproc,
                   log_dir=log_dir, timeout_s=args.timeout, cluster_timeout_s=min(args.timeout, 120))  # fmt: skip
        except LaunchError as exc:
            raise CommandError(
                f"check-env: all-reduce across {args.nproc} workers failed: {exc}"
            ) from None
        lines = []
        for p in sorted(Path(log_dir).glob("worker_*.log")):
            lines += [
                ln
                for ln in p.read_text(errors="replace").splitlines()
                if ln.startswith("allreduce")
            ]
        if len(lines) != args.nproc or not all(ln.endswith("ok") for ln in lines):
            raise CommandError(f"check-env: all-reduce results missing or wrong, see {log_dir}")
        print(f"{'all-reduce':20s} ok across {args.nproc} msrun workers (logs in {log_dir})")
    print("check-env: ok")
    return 0


def _device_name(target: str) -> str:
    if target == "CPU":
        import platform

        name = platform.processor() or platform.machine()
        try:
            for line in open("/proc/cpuinfo", encoding="ascii", errors="replace"):
                if line.startswith("model name"):
                    name = line.split(":", 1)[1].strip()
                    break
        except OSError:
            pass
        return f"{name}, {os.cpu_count()} logical CPUs"
    return target
