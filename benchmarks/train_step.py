"""One compiled training step (forward, backward, AdamW) of mindloom_model vs PyTorch eager.

    ./dev bench benchmarks/train_step.py [--presets shakespeare-char,17m] [--steps 10]
        [--threads 2] [--batch-shakespeare-char 12] [--batch-17m 4] [--rounds 2]

For each preset: the compiled step `mindloom train` runs (mindloom_train's TrainStep:
LlamaWithLoss, global grad-norm clipping at 1.0, the non-finite/spike guard and AdamW
with bias correction, one GRAPH_MODE graph) and the same architecture written in
PyTorch eager (SDPA attention, clip_grad_norm_(1.0), torch.optim.AdamW), same batch (packed: several documents per row with segment ids and
restarting position ids), same thread count. Each framework runs in a fresh process of its
own, in its default threading environment (no OMP_WAIT_POLICY: a peer runs the way its
users run it); rounds alternate torch / MindSpore (fused kernels) / MindSpore (portable
ops, `model.kernels: portable`) so all see the same load, and the per-preset figure is
the median over rounds of each process's median step. MFU is against the machine's fp32 matmul ceiling, measured here as
the best square matmul (256..2048) in NumPy, torch and MindSpore at the same thread
count. The machine is shared: read the load averages it prints.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

# benchmarks/ holds other scripts (e.g. tokenize.py) that would shadow standard modules
# of the same name, which MindSpore imports lazily: drop this directory from the path
sys.path[:] = [
    p for p in sys.path if os.path.abspath(p or ".") != os.path.dirname(os.path.abspath(__file__))
]

import numpy as np  # noqa: E402


def parse(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--presets", default="shakespeare-char,17m")
    p.add_argument("--steps", type=int, default=10, help="timed steps per framework")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--batch-shakespeare-char", type=int, default=12)
    p.add_argument("--batch-17m", type=int, default=4)
    p.add_argument("--no-segments", action="store_true", help="plain causal batches")
    p.add_argument("--rounds", type=int, default=2, help="fresh processes per framework")
    p.add_argument(
        "--kernels-ab",
        action="store_true",
        help="MindSpore only: fused kernels vs portable ops, steps interleaved in one process",
    )
    p.add_argument("--child", choices=("torch", "auto", "portable"), help=argparse.SUPPRESS)
    p.add_argument("--json", help=argparse.SUPPRESS)
    return p.parse_args(argv)


# ----------------------------------------------------------------------------- data


def make_batch(cfg, batch, seed=0, segments=True):
    rng = np.random.default_rng(seed)
    s = cfg.max_seq_len
    tokens = rng.integers(0, cfg.vocab_size, (batch, s + 1)).astype(np.int32)
    seg = np.zeros((batch, s), np.int32)
    pos = np.tile(np.arange(s, dtype=np.int32), (batch, 1))
    if segments:
        for b in range(batch):  # three documents per row, boundaries at random places
            cuts = np.sort(rng.choice(np.arange(1, s), 2, replace=False))
            for c in cuts:
                seg[b, c:] += 1
                pos[b, c:] = np.arange(s - c)
    return {
        "tokens": tokens[:, :-1].copy(),
        "labels": tokens[:, 1:].copy(),
        "position_ids": pos,
        "segment_ids": seg,
        "loss_mask": np.ones((batch, s), np.float32),
    }


# ----------------------------------------------------------------------------- torch peer


def torch_llama(cfg):
    import torch
    import torch.nn.functional as F
    from torch import nn

    class RMSNorm(nn.Module):
        def __init__(self, d, eps):
            super().__init__()
            self.eps = eps
            self.weight = nn.Parameter(torch.ones(d))

        def forward(self, x):
            return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps))

    def rope(x, cos, sin):
        x1, x2 = x.chunk(2, -1)
        return x * cos + torch.cat((-x2, x1), -1) * sin

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            d, h, kv, dh, f = (
                cfg.hidden_size,
                cfg.num_heads,
                cfg.num_kv_heads,
                cfg.head_dim,
                cfg.ffn_hidden_size,
            )
            self.h, self.kv, self.dh = h, kv, dh
            self.attn_norm, self.mlp_norm = (
                RMSNorm(d, cfg.rms_norm_eps),
                RMSNorm(d, cfg.rms_norm_eps),
            )
            self.wq, self.wk, self.wv = (
                nn.Linear(d, h * dh, False),
                nn.Linear(d, kv * dh, False),
                nn.Linear(d, kv * dh, False),
            )
            self.wo = nn.Linear(h * dh, d, False)
            self.w1, self.w2, self.w3 = (
                nn.Linear(d, f, False),
                nn.Linear(f, d, False),
                nn.Linear(d, f, False),
            )

        def forward(self, x, cos, sin, mask):
            b, s, _ = x.shape
            h = self.attn_norm(x)
            q = self.wq(h).view(b, s, self.h, self.dh).transpose(1, 2)
            k = self.wk(h).view(b, s, self.kv, self.dh).transpose(1, 2)
            v = self.wv(h).view(b, s, self.kv, self.dh).transpose(1, 2)
            q, k = rope(q, cos, sin), rope(k, cos, sin)
            o = F.scaled_dot_product_attention(
                q, k, v, attn_mask=mask, enable_gqa=self.kv != self.h
            )
            x = x + self.wo(o.transpose(1, 2).reshape(b, s, -1))
            h = self.mlp_norm(x)
            return x + self.w2(F.silu(self.w1(h)) * self.w3(h))

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
            self.layers = nn.ModuleList([Block() for _ in range(cfg.num_layers)])
            self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
            self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, False)
            if cfg.tie_embeddings:
                self.lm_head.weight = self.embed.weight
            inv = 1.0 / (
                cfg.rope_theta ** (torch.arange(0, cfg.head_dim, 2).float() / cfg.head_dim)
            )
            self.register_buffer("inv_freq", inv)

        def forward(self, tokens, pos, seg, labels, loss_mask):
            s = tokens.shape[1]
            f = pos.float()[..., None] * self.inv_freq
            emb = torch.cat((f, f), -1)[:, None]
            cos, sin = emb.cos(), emb.sin()
            causal = torch.ones(s, s, dtype=torch.bool).tril()
            mask = (causal & (seg[:, :, None] == seg[:, None, :]))[:, None]
            x = self.embed(tokens)
            for layer in self.layers:
                x = layer(x, cos, sin, mask)
            logits = self.lm_head(self.norm(x)).float()
            nll = F.cross_entropy(
                logits.view(-1, logits.shape[-1]), labels.reshape(-1), reduction="none"
            )
            m = loss_mask.reshape(-1)
            return (nll * m).sum() / m.sum().clamp(min=1)

    return Model()


# ----------------------------------------------------------------------------- ceiling


def matmul_ceiling(reps=5):
    """Best fp32 GFLOP/s of square matmuls (256..2048) across NumPy, torch and MindSpore."""
    import mindspore as ms
    import torch

    results = {}

    def best(fn, n):
        fn()
        times = []
        for _ in range(reps):
            t = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t)
        return 2 * n**3 / min(times) / 1e9

    mm = ms.ops.MatMul()
    for n in (256, 512, 1024, 2048):
        a = np.random.default_rng(0).standard_normal((n, n), dtype=np.float32)
        ta, ma = torch.from_numpy(a), ms.Tensor(a)
        for lib, fn in (
            ("numpy", lambda a=a: a @ a),
            ("torch", lambda ta=ta: ta @ ta),
            ("mindspore", lambda ma=ma: mm(ma, ma).asnumpy()),
        ):
            results[lib] = max(results.get(lib, 0.0), best(fn, n))
    return max(results.values()), results


def ms_step_fn(name, batch, args, kernels):
    from mindloom_model import get_preset

    cfg = get_preset(name, kernels=kernels)
    return _ms_train_step(cfg, make_batch(cfg, batch, segments=not args.no_segments), kernels)


def deepseek_loss_net(model):
    """DeepseekV3WithLoss(model)'s first output (the total loss) as a cell: TrainStep
    differentiates a scalar loss (moe_step.py and step_profile.py time this step)."""
    from mindloom_model import DeepseekV3WithLoss
    from mindspore import nn

    class TotalLoss(nn.Cell):
        def __init__(self, net):
            super().__init__(auto_prefix=False)
            self.net = net

        def construct(self, tokens, labels, position_ids, segment_ids, loss_mask):
            return self.net(tokens, labels, position_ids, segment_ids, loss_mask)[0]

    return TotalLoss(DeepseekV3WithLoss(model))


def compiled_step(net, data):
    """mindloom_train's TrainStep over the loss cell `net` on `data`, as a no-argument
    callable -> loss (its first call compiles)."""
    import mindspore as ms
    from mindloom_train import TrainStep, decay_flags, hyper_vector
    from mindspore import Tensor

    weights = ms.ParameterTuple(net.trainable_params())
    step = TrainStep(net, weights, decay_flags(weights, decay_embeddings=False))
    step.set_train(True)
    hyper = hyper_vector(lr=1e-4, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.1,
                         adam_step=1, clip=1.0, spike=None, loss_scale=1.0)  # fmt: skip
    keys = ("tokens", "labels", "position_ids", "segment_ids", "loss_mask")
    ms_in = [Tensor(data[k]) for k in keys]
    return lambda: float(step(*ms_in, hyper)[0].asnumpy())


def _ms_train_step(cfg, data, kernels, patch=None):
    """One compiled mindloom train step on `data`, as a no-argument callable -> loss;
    `patch(net)` may change the loss net before the step is built (step_profile.py). A
    deepseek_v3 config trains DeepseekV3 (seed 0) on its total loss."""
    from mindloom_model import DeepseekV3, Llama, LlamaWithLoss

    if cfg.family == "deepseek_v3":
        model = DeepseekV3(cfg, seed=0)
        net = deepseek_loss_net(model)
    else:
        model = Llama(cfg)
        net = LlamaWithLoss(model)
    if kernels == "auto" and model.loss_kernel is None:
        raise SystemExit("error: model.kernels=auto but the fused kernels are unavailable")
    if patch is not None:
        patch(net)
    return compiled_step(net, data)


def kernels_ab(args) -> int:
    """Fused kernels vs portable ops, both compiled in this process, steps interleaved
    so both see the same load; prints medians and the median of per-step ratios."""
    import mindspore as ms
    from mindloom_model import get_preset

    ms.set_context(mode=ms.GRAPH_MODE, device_target="CPU", runtime_num_threads=args.threads)
    print(f"load average at start: {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs")
    # the ceiling measured in this process, so the step's share of it is of this load
    ceiling, per_lib = matmul_ceiling()
    libs = "  ".join(f"{k}={v:.1f}" for k, v in per_lib.items())
    print(f"fp32 matmul ceiling ({args.threads} threads): {ceiling:.1f} GFLOP/s  ({libs})")
    for name in args.presets.split(","):
        batch = getattr(args, "batch_" + name.replace("-", "_"))
        fns = {k: ms_step_fn(name, batch, args, k) for k in ("auto", "portable")}
        losses = {k: fn() for k, fn in fns.items()}  # compiles
        for _ in range(args.warmup):
            for fn in fns.values():
                fn()
        times = {k: [] for k in fns}
        for _ in range(args.steps):
            for k, fn in fns.items():
                t = time.perf_counter()
                fn()
                times[k].append(time.perf_counter() - t)
        med = {k: statistics.median(v) for k, v in times.items()}
        ratio = statistics.median(
            p / a for p, a in zip(times["portable"], times["auto"], strict=True)
        )
        print(f"{name}: kernels {med['auto'] * 1e3:.1f} ms/step, portable {med['portable'] * 1e3:.1f}"
              f" ms/step: x{med['portable'] / med['auto']:.2f} (per-step ratios' median x{ratio:.2f});"
              f" first losses {losses['auto']:.6f} / {losses['portable']:.6f}")  # fmt: skip
        cfg = get_preset(name)
        flops = cfg.flops_per_token(cfg.max_seq_len) * batch * cfg.max_seq_len
        print(f"{name}: share of the matmul ceiling (MFU): kernels "
              f"{flops / med['auto'] / (ceiling * 1e9):.1%}, portable "
              f"{flops / med['portable'] / (ceiling * 1e9):.1%}")  # fmt: skip
    print(f"load average at end: {os.getloadavg()[0]:.1f}")
    return 0


def time_preset(name, batch, args, which):
    """Median seconds per step of one framework (`which`: torch, or MindSpore with
    model.kernels auto / portable) on one preset, in this process."""
    cfg_kernels = "portable" if which == "portable" else "auto"
    import mindspore as ms  # noqa: F401
    from mindloom_model import get_preset

    cfg = get_preset(name, kernels=cfg_kernels)
    data = make_batch(cfg, batch, segments=not args.no_segments)
    if which == "torch":
        import torch

        tm = torch_llama(cfg)
        topt = torch.optim.AdamW(tm.parameters(), lr=1e-4, weight_decay=0.1)
        t_keys = ("tokens", "position_ids", "segment_ids", "labels", "loss_mask")
        t_in = [torch.from_numpy(data[k]).long() if data[k].dtype == np.int32
                else torch.from_numpy(data[k]) for k in t_keys]  # fmt: skip

        def fn():
            topt.zero_grad(set_to_none=True)
            loss = tm(*t_in)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(tm.parameters(), 1.0)
            topt.step()
            return loss.item()

        compile_s = 0.0
    else:
        fn = _ms_train_step(cfg, data, which)

        t0 = time.perf_counter()
        fn()  # compiles
        compile_s = time.perf_counter() - t0
    for _ in range(args.warmup):
        fn()
    times = []
    for _ in range(args.steps):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return {"step_s": statistics.median(times), "compile_s": compile_s}


def child(args) -> int:
    import json

    import mindspore as ms

    if args.child == "torch":
        import torch

        torch.set_num_threads(args.threads)
    ms.set_context(mode=ms.GRAPH_MODE, device_target="CPU", runtime_num_threads=args.threads)
    out = {}
    for name in args.presets.split(","):
        batch = getattr(args, "batch_" + name.replace("-", "_"))
        out[name] = time_preset(name, batch, args, args.child)
    with open(args.json, "w") as f:
        json.dump(out, f)
    return 0


def main(argv=None) -> int:
    args = parse(argv)
    # pin every thread pool before the libraries start them; no OMP_WAIT_POLICY
    for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
        os.environ[var] = str(args.threads)
    os.environ.setdefault("GLOG_v", "3")
    if args.child:
        return child(args)
    if args.kernels_ab:
        return kernels_ab(args)
    import json
    import subprocess
    import tempfile

    import mindspore as ms
    import torch

    torch.set_num_threads(args.threads)
    ms.set_context(mode=ms.GRAPH_MODE, device_target="CPU", runtime_num_threads=args.threads)
    print(
        f"load average at start: {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs;"
        f" {args.threads} threads each; OMP_WAIT_POLICY="
        f"{os.environ.get('OMP_WAIT_POLICY', '(unset: default)')}"
    )
    ceiling, per_lib = matmul_ceiling()
    libs = "  ".join(f"{k}={v:.1f}" for k, v in per_lib.items())
    print(f"fp32 matmul ceiling ({args.threads} threads): {ceiling:.1f} GFLOP/s  ({libs})")
    runs = {"torch": [], "auto": [], "portable": []}
    for r in range(args.rounds):
        for which in runs:
            with tempfile.NamedTemporaryFile(suffix=".json") as out:
                cmd = [sys.executable, os.path.abspath(__file__), "--child", which,
                       "--json", out.name, "--presets", args.presets,
                       "--steps", str(args.steps), "--warmup", str(args.warmup),
                       "--threads", str(args.threads),
                       "--batch-shakespeare-char", str(args.batch_shakespeare_char),
                       "--batch-17m", str(args.batch_17m)]  # fmt: skip
                if args.no_segments:
                    cmd.append("--no-segments")
                subprocess.run(cmd, check=True)
                runs[which].append(json.loads(open(out.name).read()))
        print(
            f"round {r + 1}/{args.rounds} done, load average {os.getloadavg()[0]:.1f}", flush=True
        )
    label = {"torch": "torch eager", "auto": "ms kernels", "portable": "ms portable"}
    print(f"{'preset':18} {'batch':>5} {'framework':12} {'ms/step':>9} {'tokens/s':>9} {'MFU':>6}")
    from mindloom_model import get_preset

    for name in args.presets.split(","):
        batch = getattr(args, "batch_" + name.replace("-", "_"))
        cfg = get_preset(name)
        ntok = batch * cfg.max_seq_len
        flops = cfg.flops_per_token(cfg.max_seq_len) * ntok
        med = {w: statistics.median(x[name]["step_s"] for x in runs[w]) for w in runs}
        for w in runs:
            mfu = flops / med[w] / (ceiling * 1e9)
            print(
                f"{name:18} {batch:>5} {label[w]:12} {med[w] * 1e3:9.1f} {ntok / med[w]:9.0f} {mfu:6.1%}"
            )
        rounds = [
            t[name]["step_s"] / a[name]["step_s"]
            for t, a in zip(runs["torch"], runs["auto"], strict=True)
        ]
        print(
            f"{name:18} tokens/s: kernels/torch {med['torch'] / med['auto']:.2f}x"
            f" (per round {', '.join(f'{x:.2f}' for x in rounds)}),"
            f" kernels/portable {med['portable'] / med['auto']:.2f}x,"
            f" portable/torch {med['torch'] / med['portable']:.2f}x;"
            f" {cfg.num_params() / 1e6:.1f}M params"
        )
    print(f"load average at end: {os.getloadavg()[0]:.1f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
