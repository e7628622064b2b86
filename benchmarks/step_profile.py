"""Where the time of one compiled mindloom train step goes, op by op (MindSpore's CPU profiler).

    ./dev bench benchmarks/step_profile.py [--preset shakespeare-char] [--batch 12]
        [--kernels auto|portable] [--steps 20] [--threads 2] [--top 25] [--no-mtp]

Builds the step `benchmarks/train_step.py` times (mindloom_train's TrainStep: forward,
loss, backward, grad-norm clip, guards, AdamW; one GRAPH_MODE graph) on the nanoGPT
recipe's model (`shakespeare-char`, 344-wide SwiGLU as configs/nanogpt-shakespeare-char.yaml
sets it) or any preset (a deepseek_v3 preset: DeepseekV3WithLoss's total loss through the same
TrainStep, the step `benchmarks/moe_step.py` times; `--no-mtp` as its `moe` key), compiles and warms it up, then runs `--steps` steps under
`mindspore.Profiler` (CPU op timing: the runtime stamps every kernel launch's start and
duration) and reads the raw per-op records (`cpu_op_execute_timestamp_*.txt`). Prints:
the step's wall time with and without the profiler and its CPU time; from the first op's
start to the last op's end, the time some op ran and the time none did (the runtime's
launch gaps between ops); per category (matrix products, the fused kernels, AdamW,
elementwise, ...) and op type the sum of each op's median over the steps, split into
forward, backward and update (a fused kernel's hand-written backward is named in its
cell's scope, so it counts as forward). No peer: this explains a step, it
claims no speed (train_step.py and nanogpt.py do that against PyTorch).
"""

from __future__ import annotations

import argparse
import collections
import glob
import importlib.util
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path[:] = [
    p for p in sys.path if os.path.abspath(p or ".") != os.path.dirname(os.path.abspath(__file__))
]

_HERE = Path(__file__).resolve().parent

# op type -> category; anything else is "other"
CATEGORIES = {
    "matmul": ("MatMul", "BatchMatMul", "MatMulExt", "BatchMatMulExt"),
    "fused kernels": ("Custom",),
    "AdamW": ("AdamWeightDecay",),
    "gather/scatter": ("Gather", "GatherD", "GatherV2", "UnsortedSegmentSum", "GatherDGrad",
                       "GatherDGradV2", "ScatterNd", "TensorScatterUpdate", "EmbeddingLookup"),
    "reshape/transpose/copy": ("Reshape", "Transpose", "TransposeExtView", "Concat", "Split",
                               "StridedSlice", "StridedSliceGrad", "Slice", "SliceGrad",
                               "ExpandDims", "Squeeze", "Tile", "BroadcastTo", "Identity",
                               "Cast", "Depend", "Stack", "ZerosLike", "OnesLike", "Fill",
                               "FillV2", "Ones", "Zeros"),
}  # fmt: skip


def category(op_type: str) -> str:
    if op_type.startswith("Custom"):
        return "fused kernels"
    for cat, types in CATEGORIES.items():
        if op_type in types:
            return cat
    return "elementwise/other"


def phase(full_name: str) -> str:
    """forward (the loss net), backward (its gradients) or update (the rest of TrainStep:
    grad norm, clip, guards, AdamW), from the op's scope name."""
    if "Gradients/" in full_name:
        return "backward"
    if "loss_net" in full_name or "LlamaWithLoss" in full_name:
        return "forward"
    return "update"


def load_train_step():
    spec = importlib.util.spec_from_file_location("_bench_train_step", _HERE / "train_step.py")
    mod = importlib.util.module_from_spec(spec)
    # registered: MindSpore resolves a cell class defined there (deepseek_loss_net) by
    # its module's name when it compiles the graph
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


def read_ops(root: str, steps: int) -> list[tuple[str, str, list[tuple[float, float]]]]:
    """(full name, type, [(start ns, duration ms) per step]) of every op of the graph: each
    op runs once per step, so its k-th launch in time belongs to step k."""
    files = glob.glob(os.path.join(root, "**", "cpu_op_execute_timestamp_*.txt"), recursive=True)
    if not files:
        raise SystemExit(f"error: no cpu_op_execute_timestamp_*.txt under {root}")
    out = []
    for path in files:
        for line in Path(path).read_text().splitlines():
            parts = line.strip().split(";")
            if len(parts) < 3:
                continue
            runs = sorted(
                (float(t.split(",")[0]), float(t.split(",")[1])) for t in parts[-1].split()
            )
            if len(runs) != steps:
                continue  # not one launch per step: not an op of the step's graph
            # the type is the name's last part without its "-opN" (the record's type
            # field says HostCpuOps for every op here)
            scopes = parts[0].split("/")
            typ = scopes[-1].rsplit("-op", 1)[0]
            if typ == "Custom" and len(scopes) > 1:  # which kernel: its cell's class
                typ = "Custom " + scopes[-2].rsplit("-", 1)[-1]
            out.append((parts[0], typ, runs))
    return out


def rope_outside(net) -> None:
    """Puts `net`'s attention back to session 13's path: RoPE (and q's scale) as MindSpore
    ops before the fused kernel (`KernelAttention`), for --rope-ab."""
    from mindloom_model import _kernels
    from mindloom_model._layers import apply_rope
    from mindspore import nn

    class RopeOutside(nn.Cell):
        def __init__(self, scale):
            super().__init__()
            self.scale = scale
            self.attn = _kernels.KernelAttention()

        def construct(self, q, k, v, seg, cos, sin):
            cos, sin = cos.expand_dims(2), sin.expand_dims(2)  # [B|1, S, 1, Dh]
            q = apply_rope(q, cos * self.scale, sin * self.scale)
            return self.attn(q, apply_rope(k, cos, sin), v, seg)

    for layer in net.model.layers:
        layer.attn.kernel = RopeOutside(layer.attn.scale)


def rope_ab(args, bench, cfg) -> int:
    """RoPE inside the attention kernel vs before it, both compiled in this process, steps
    interleaved (the machine is shared): medians and the median of per-step ratios."""
    steps = {}
    for which in ("inside", "outside"):
        data = bench.make_batch(cfg, args.batch)
        steps[which] = bench._ms_train_step(
            cfg, data, "auto", patch=rope_outside if which == "outside" else None
        )
    first = {k: fn() for k, fn in steps.items()}
    for _ in range(3):
        for fn in steps.values():
            fn()
    times = {k: [] for k in steps}
    for _ in range(args.steps):
        for k, fn in steps.items():
            t = time.perf_counter()
            fn()
            times[k].append(time.perf_counter() - t)
    med = {k: statistics.median(v) for k, v in times.items()}
    ratio = statistics.median(o / i for o, i in zip(times["outside"], times["inside"]))
    print(f"RoPE inside the kernel {med['inside'] * 1e3:.1f} ms/step, before it "
          f"{med['outside'] * 1e3:.1f} ms/step: x{med['outside'] / med['inside']:.2f} "
          f"(per-step ratios' median x{ratio:.2f}); first losses {first['inside']:.6f} / "
          f"{first['outside']:.6f}")  # fmt: skip
    print(f"load average at end: {os.getloadavg()[0]:.1f}")
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--preset", default="shakespeare-char")
    p.add_argument("--batch", type=int, default=12)
    p.add_argument("--ffn", type=int, default=None,
                   help="ffn_hidden_size (default: 344 for shakespeare-char, as the recipe)")  # fmt: skip
    p.add_argument("--kernels", choices=("auto", "portable"), default="auto")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--top", type=int, default=25)
    p.add_argument("--no-mtp", action="store_true",
                   help="deepseek_v3 presets: no MTP depth (moe_step.py's `moe` key)")  # fmt: skip
    p.add_argument("--rope-ab", action="store_true",
                   help="no profile: RoPE inside the attention kernel vs before it, interleaved")  # fmt: skip
    args = p.parse_args(argv)
    for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
        os.environ[var] = str(args.threads)
    os.environ.setdefault("GLOG_v", "3")
    import mindspore as ms
    from mindloom_model import get_preset

    ms.set_context(mode=ms.GRAPH_MODE, device_target="CPU", runtime_num_threads=args.threads)
    bench = load_train_step()
    ffn = args.ffn or (344 if args.preset == "shakespeare-char" else None)
    over = {"ffn_hidden_size": ffn} if ffn else {}
    if args.no_mtp:
        over["num_nextn_predict_layers"] = 0
    cfg = get_preset(args.preset, kernels=args.kernels, **over)
    deepseek = cfg.family == "deepseek_v3"
    print(f"load average at start: {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs; "
          f"{args.preset} batch {args.batch}, kernels={args.kernels}, {args.threads} threads")  # fmt: skip
    if args.rope_ab:
        if deepseek:
            raise SystemExit("error: --rope-ab runs the Llama attention; not a deepseek_v3 preset")
        return rope_ab(args, bench, cfg)
    # a deepseek_v3 step on plain causal rows, as moe_step.py's transformers peer takes them
    data = bench.make_batch(cfg, args.batch, segments=not deepseek)
    step = bench._ms_train_step(cfg, data, args.kernels)
    step()  # compiles
    for _ in range(3):
        step()
    plain = []
    cpu0 = time.process_time()
    for _ in range(args.steps):
        t = time.perf_counter()
        step()
        plain.append(time.perf_counter() - t)
    # CPU seconds of this process per step: less at the mercy of the machine's other users
    # than wall time (which counts the time its threads wait for a core)
    cpu = (time.process_time() - cpu0) / args.steps
    with tempfile.TemporaryDirectory(prefix="step-profile-") as out:
        prof = ms.Profiler(output_path=out)
        t0 = time.perf_counter()
        for _ in range(args.steps):
            step()
        wall = (time.perf_counter() - t0) / args.steps
        prof.stop()
        ops = read_ops(out, args.steps)
    n = args.steps
    # per op its median over the steps: the machine is shared, and a descheduled op
    # (several ms) would otherwise weigh on whichever category it fell in
    med = [(name, typ, statistics.median(d for _, d in runs)) for name, typ, runs in ops]
    spans, busies = [], []
    for k in range(n):
        starts = [runs[k][0] for *_, runs in ops]
        ends = [runs[k][0] + runs[k][1] * 1e6 for *_, runs in ops]
        spans.append((max(ends) - min(starts)) / 1e6)
        busies.append(sum(runs[k][1] for *_, runs in ops))
    total = sum(d for *_, d in med)
    print(f"step: {statistics.median(plain) * 1e3:.1f} ms without the profiler (median of {n}), "
          f"{wall * 1e3:.1f} ms with it; {cpu * 1e3:.1f} CPU-ms per step without it; "
          f"{len(ops)} ops per step")  # fmt: skip
    print(f"first op start to last op end: {statistics.median(spans):.1f} ms (median step); "
          f"ops running {statistics.median(busies):.1f} ms of it, nothing running "
          f"{statistics.median(s - b for s, b in zip(spans, busies)):.1f} ms (launch gaps); "
          f"the ops' medians summed: {total:.1f} ms")  # fmt: skip
    by_cat: dict = collections.defaultdict(lambda: collections.Counter())
    counts: dict = collections.Counter()
    by_type: dict = collections.Counter()
    type_n: dict = collections.Counter()
    for name, typ, dur in med:
        cat = category(typ)
        by_cat[cat][phase(name)] += dur
        counts[cat] += 1
        by_type[typ] += dur
        type_n[typ] += 1
    print(f"\n{'category':24s} {'ms/step':>8s} {'ops':>5s} {'fwd':>7s} {'bwd':>7s} {'update':>7s}")
    for cat, ph in sorted(by_cat.items(), key=lambda kv: -sum(kv[1].values())):
        print(f"{cat:24s} {sum(ph.values()):8.2f} {counts[cat]:5d} {ph['forward']:7.2f} "
              f"{ph['backward']:7.2f} {ph['update']:7.2f}")  # fmt: skip
    print(f"\n{'op type':28s} {'ms/step':>8s} {'ops':>5s} {'us each':>8s}")
    for typ, ms_ in by_type.most_common(args.top):
        print(f"{typ:28s} {ms_:8.2f} {type_n[typ]:5d} {ms_ / type_n[typ] * 1e3:8.1f}")
    print(f"load average at end: {os.getloadavg()[0]:.1f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
