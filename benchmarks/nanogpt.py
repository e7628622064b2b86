"""nanoGPT's CPU recipe: mindloom (MindSpore, compiled step) against nanoGPT in PyTorch.

    ./dev bench benchmarks/nanogpt.py                 # the full recipe, 2000 iterations each
    ./dev bench benchmarks/nanogpt.py --iters 300     # a shorter comparison
    ./dev bench benchmarks/nanogpt.py --nanogpt-dir ~/nanoGPT   # + the real nanoGPT too

Both runs: character-level tiny Shakespeare split 90/10 by characters, 4 layers, 4 heads,
128 wide, block 64, batch 12, AdamW (0.9, 0.99), weight decay 0.1 on matrices, clip 1.0,
dropout 0, lr 1e-3 -> 1e-4 cosine with 100 warmup steps, evaluation of 20 held-out batches
every 250 steps, the same number of threads, each in a fresh process of its own started
by this one, one after the other, each in its default threading environment (no
OMP_WAIT_POLICY is set for either: a peer runs the way its users run it). The PyTorch side is a
faithful re-implementation of karpathy/nanoGPT's model.py (GPT-2 block, tied embeddings,
no biases) and train.py loop (random windows, `get_lr`, `estimate_loss`), eager mode as
nanoGPT's CPU instructions say (`--compile=False`). Differences, on purpose: the PyTorch
side evaluates only the held-out split (nanoGPT also re-estimates the train loss; that
would only slow it down) and saves no checkpoints; mindloom writes its four (every 500
steps).

With `--nanogpt-dir`, the real nanoGPT's `train.py` (a checkout whose
`data/shakespeare_char` is prepared) also runs, with the README's CPU recipe, in the same
run, and its step time and held-out losses are printed next to the re-implementation's.

Prints wall time, steady-state tokens/s and final held-out loss of each, the ratio, and the
time from process start (compile included) at which mindloom's held-out loss first reaches
the peer's final one, against the peer's time to that loss; then what 1.5x nanoGPT would take: the step time it means, next to the time of the step's
matrix products alone (every product of forward and backward, timed one by one at its
own shape in torch, at the same thread count), for both models.
"""

from __future__ import annotations

import sys

# benchmarks/tokenize.py would shadow the standard library's tokenize module
sys.path[:] = [p for p in sys.path if not p or not p.endswith("benchmarks")]

import argparse  # noqa: E402
import math  # noqa: E402
import os  # noqa: E402
import statistics  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
RECIPE = ROOT / "configs" / "nanogpt-shakespeare-char.yaml"


# ---------------------------------------------------------------------------------------
# nanoGPT (PyTorch), after karpathy/nanoGPT model.py and train.py


def run_nanogpt(text: str, iters: int, threads: int, t_launch: float, seed: int = 1337) -> dict:
    import numpy as np
    import torch
    import torch.nn as nn
    from torch.nn import functional as F

    torch.set_num_threads(threads)
    torch.manual_seed(seed)
    chars = sorted(set(text))
    stoi = {c: i for i, c in enumerate(chars)}
    n = len(text)
    data = np.array([stoi[c] for c in text], dtype=np.uint16)
    train_data, val_data = data[: int(n * 0.9)], data[int(n * 0.9) :]
    vocab, block, batch = len(chars), 64, 12
    n_layer, n_head, n_embd = 4, 4, 128

    class LayerNorm(nn.Module):
        def __init__(self, ndim):
            super().__init__()
            self.weight = nn.Parameter(torch.ones(ndim))

        def forward(self, x):
            return F.layer_norm(x, self.weight.shape, self.weight, None, 1e-5)

    class CausalSelfAttention(nn.Module):
        def __init__(self):
            super().__init__()
            self.c_attn = nn.Linear(n_embd, 3 * n_embd, bias=False)
            self.c_proj = nn.Linear(n_embd, n_embd, bias=False)

        def forward(self, x):
            B, T, C = x.size()
            q, k, v = self.c_attn(x).split(n_embd, dim=2)
            k = k.view(B, T, n_head, C // n_head).transpose(1, 2)
            q = q.view(B, T, n_head, C // n_head).transpose(1, 2)
            v = v.view(B, T, n_head, C // n_head).transpose(1, 2)
            y = F.scaled_dot_product_attention(
                q, k, v, attn_mask=None, dropout_p=0.0, is_causal=True
            )
            y = y.transpose(1, 2).contiguous().view(B, T, C)
            return self.c_proj(y)

    class MLP(nn.Module):
        def __init__(self):
            super().__init__()
            self.c_fc = nn.Linear(n_embd, 4 * n_embd, bias=False)
            self.gelu = nn.GELU()
            self.c_proj = nn.Linear(4 * n_embd, n_embd, bias=False)

        def forward(self, x):
            return self.c_proj(self.gelu(self.c_fc(x)))

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.ln_1, self.attn = LayerNorm(n_embd), CausalSelfAttention()
            self.ln_2, self.mlp = LayerNorm(n_embd), MLP()

        def forward(self, x):
            x = x + self.attn(self.ln_1(x))
            return x + self.mlp(self.ln_2(x))

    class GPT(nn.Module):
        def __init__(self):
            super().__init__()
            self.transformer = nn.ModuleDict(
                dict(
                    wte=nn.Embedding(vocab, n_embd),
                    wpe=nn.Embedding(block, n_embd),
                    h=nn.ModuleList([Block() for _ in range(n_layer)]),
                    ln_f=LayerNorm(n_embd),
                )
            )
            self.lm_head = nn.Linear(n_embd, vocab, bias=False)
            self.transformer.wte.weight = self.lm_head.weight  # weight tying
            self.apply(self._init_weights)
            for pn, p in self.named_parameters():
                if pn.endswith("c_proj.weight"):
                    torch.nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * n_layer))

        def _init_weights(self, module):
            if isinstance(module, nn.Linear | nn.Embedding):
                torch.nn.init.normal_(module.weight, mean=0.0, std=0.02)

        def forward(self, idx, targets):
            t = idx.size(1)
            pos = torch.arange(0, t, dtype=torch.long)
            x = self.transformer.wte(idx) + self.transformer.wpe(pos)
            for blk in self.transformer.h:
                x = blk(x)
            logits = self.lm_head(self.transformer.ln_f(x))
            return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))

    model = GPT()
    params = [p for p in model.parameters() if p.requires_grad]
    decay = [p for p in params if p.dim() >= 2]
    nodecay = [p for p in params if p.dim() < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.1}, {"params": nodecay, "weight_decay": 0.0}],
        lr=1e-3,
        betas=(0.9, 0.99),
        fused=False,
    )

    def get_batch(split):
        d = train_data if split == "train" else val_data
        ix = torch.randint(len(d) - block, (batch,))
        x = torch.stack([torch.from_numpy(d[i : i + block].astype(np.int64)) for i in ix])
        y = torch.stack([torch.from_numpy(d[i + 1 : i + 1 + block].astype(np.int64)) for i in ix])
        return x, y

    def get_lr(it):
        if it < 100:
            return 1e-3 * (it + 1) / (100 + 1)
        if it > iters:
            return 1e-4
        ratio = (it - 100) / (iters - 100)
        return 1e-4 + 0.5 * (1.0 + math.cos(math.pi * ratio)) * (1e-3 - 1e-4)

    @torch.no_grad()
    def val_loss():
        model.eval()
        losses = [model(*get_batch("val")).item() for _ in range(20)]
        model.train()
        return float(np.mean(losses))

    step_times = []
    evals = []  # (step, held-out loss, seconds since this process was launched)
    t_start = time.perf_counter()
    last_val = None
    for it in range(iters):
        if it % 250 == 0 and it > 0:
            last_val = val_loss()
            evals.append((it, last_val, time.time() - t_launch))
        for g in opt.param_groups:
            g["lr"] = get_lr(it)
        t0 = time.perf_counter()
        x, y = get_batch("train")
        loss = model(x, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        step_times.append(time.perf_counter() - t0)
    last_val = val_loss()
    evals.append((iters, last_val, time.time() - t_launch))
    wall = time.perf_counter() - t_start
    tokens = batch * block
    return {
        "wall_s": wall,
        "tokens_per_s": tokens / statistics.median(step_times[10:] or step_times),
        "val_loss": last_val,
        "iters": iters,
        "evals": evals,
    }


def run_real_nanogpt(checkout: Path, iters: int, threads: int) -> dict:
    """karpathy/nanoGPT's own train.py with its README's CPU recipe, in its default
    environment; step times from its log lines ("iter N: loss L, time T ms")."""
    import re
    import subprocess

    if not (checkout / "train.py").is_file():
        raise SystemExit(f"error: --nanogpt-dir {checkout}: no train.py there")
    if not (checkout / "data" / "shakespeare_char" / "train.bin").is_file():
        raise SystemExit(
            f"error: --nanogpt-dir {checkout}: run data/shakespeare_char/prepare.py first"
        )
    cmd = [sys.executable, "train.py", "config/train_shakespeare_char.py", "--device=cpu",
           "--compile=False", "--eval_iters=20", "--log_interval=1", "--block_size=64",
           "--batch_size=12", "--n_layer=4", "--n_head=4", "--n_embd=128",
           f"--max_iters={iters}", f"--lr_decay_iters={iters}", "--dropout=0.0",
           "--always_save_checkpoint=False", "--eval_interval=250"]  # fmt: skip
    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    env["OMP_NUM_THREADS"] = str(threads)
    t_launch = time.time()
    proc = subprocess.Popen(cmd, cwd=checkout, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)  # fmt: skip
    step_ms, evals = [], []
    for line in proc.stdout:
        if m := re.match(r"iter (\d+): loss [\d.]+, time ([\d.]+)ms", line):
            step_ms.append(float(m.group(2)))
        elif m := re.match(r"step (\d+): train loss [\d.]+, val loss ([\d.]+)", line):
            evals.append((int(m.group(1)), float(m.group(2)), time.time() - t_launch))
    if proc.wait() != 0 or not evals or len(step_ms) < 20:
        raise SystemExit(f"error: nanoGPT's train.py failed (exit {proc.returncode})")
    return {
        "wall_s": time.time() - t_launch,
        "tokens_per_s": 12 * 64 / (statistics.median(step_ms[10:]) / 1e3),
        "val_loss": evals[-1][1],
        "iters": iters,
        "evals": evals,
    }


# ---------------------------------------------------------------------------------------
# what a given speed-up would take: the step's matrix products alone, at their own shapes


def step_gemms(
    d: int, layers: int, heads: int, ffn: list[tuple[int, int]], vocab: int, batch: int, block: int
) -> list[tuple[int, int, int, int]]:
    """(count, m, k, n) of every matrix product in one forward + backward step.

    `ffn`: the MLP's linear layers as (in, out). Each linear of a [tokens, in] input does
    its forward product and two backward ones (input and weight gradients); attention
    does QK^T and AV per (sample, head) forward, twice that backward.
    """
    t, dh = batch * block, d // heads
    linears = [(d, 3 * d), (d, d), *ffn]
    out = []
    for i, o in linears:
        out += [(layers, t, i, o), (layers, t, o, i), (layers, i, t, o)]
    out += [(1, t, d, vocab), (1, t, vocab, d), (1, d, t, vocab)]  # the tied head
    bh = layers * batch * heads
    out += [(bh, block, dh, block), (bh, block, block, dh)]  # forward
    out += [(2 * bh, block, block, dh), (2 * bh, block, dh, block)]  # backward
    return out


def gemm_floor(gemms, threads: int, reps: int = 30) -> tuple[float, float]:
    """Seconds and FLOPs of the products alone, each timed in torch at its own shape
    (median of `reps`), batched products as one bmm; nothing else of the step."""
    import torch

    torch.set_num_threads(threads)
    total_s, flops = 0.0, 0.0
    for count, m, k, n in gemms:
        flops += 2.0 * count * m * k * n
        batched = count > 64  # attention: one bmm over (layers x) batch x heads
        if batched:
            a, b = torch.randn(count, m, k), torch.randn(count, k, n)
            fn, calls = (lambda a=a, b=b: torch.bmm(a, b)), 1
        else:
            a, b = torch.randn(m, k), torch.randn(k, n)
            fn, calls = (lambda a=a, b=b: a @ b), count
        for _ in range(5):
            fn()
        ts = []
        for _ in range(reps):
            t0 = time.perf_counter()
            fn()
            ts.append(time.perf_counter() - t0)
        total_s += statistics.median(ts) * calls
    return total_s, flops


def roofline(threads: int) -> dict:
    from mindloom_train import build_model_config, load_config

    cfg = build_model_config(load_config(RECIPE, []), 65)  # the recipe's model, 65 characters
    nano = step_gemms(128, 4, 4, [(128, 512), (512, 128)], 65, 12, 64)
    ours = step_gemms(cfg.hidden_size, cfg.num_layers, cfg.num_heads,
                      [(cfg.hidden_size, cfg.ffn_hidden_size)] * 2
                      + [(cfg.ffn_hidden_size, cfg.hidden_size)], 65, 12, 64)  # fmt: skip
    return {"nanoGPT": gemm_floor(nano, threads), "mindloom": gemm_floor(ours, threads)}


# ---------------------------------------------------------------------------------------
# mindloom


def run_mindloom(iters: int, threads: int, work: Path, t_launch: float, kernels: str) -> dict:
    import json

    from mindloom_train import Trainer, load_config

    overrides = [
        f"training.train_iters={iters}",
        f"lr_scheduler.decay_iters={iters}",
        f"run_dir={work / 'mindloom'}",
        f"context.num_threads={threads}",
        "monitor.progress_bar=false",
        "monitor.log_interval=25",
        f"model.kernels={kernels}",
    ]
    cfg = load_config(RECIPE, overrides)
    # tokenizer and data once, outside the timed part (nanoGPT's prepare.py is not timed)
    from mindloom_train import prepare_dataset, prepare_tokenizer, tokenizer_dir

    t_launch_prep = time.time()
    prepare_tokenizer(cfg, lambda m: None)
    tok = tokenizer_dir(cfg)
    prepare_dataset(cfg, cfg.train_dataset, "train", tok, lambda m: None)
    prepare_dataset(cfg, cfg.eval_dataset, "eval", tok, lambda m: None)
    t0_wall = time.time()
    trainer = Trainer(cfg, console=open(os.devnull, "w"))  # noqa: SIM115
    t0 = time.perf_counter()
    code = trainer.run()
    wall = time.perf_counter() - t0
    if code != 0:
        raise SystemExit(
            f"error: the mindloom run failed (exit {code}); see {cfg.run_dir}/train.log"
        )
    recs = [
        json.loads(line) for line in (Path(cfg.run_dir) / "metrics.jsonl").read_text().splitlines()
    ]
    step_times = [r["step_time_s"] for r in recs if "event" not in r][1:]  # first window compiles
    tokens = cfg.training.global_batch_size * cfg.train_dataset.seq_length
    # data preparation is nanoGPT's prepare.py, untimed there: leave it out here too
    prep_s = t0_wall - t_launch_prep
    evals = [(r["step"], r["loss"], r["time"] - t_launch - prep_s)
             for r in recs if r.get("event") == "eval"]  # fmt: skip
    return {
        "wall_s": wall,
        "tokens_per_s": tokens / statistics.median(step_times),
        "val_loss": trainer.last_eval[0],
        "iters": iters,
        "evals": evals,
        "kernels": kernels_in_use(trainer, kernels),
    }


def kernels_in_use(trainer, asked: str) -> str:
    from mindloom_model import Llama

    model = trainer.model if isinstance(trainer.model, Llama) else None
    fused = getattr(model, "loss_kernel", None) is not None if model is not None else None
    return f"model.kernels={asked}" + ("" if fused is None else f" (fused kernels in use: {fused})")


def time_to(evals, target: float) -> float | None:
    """Seconds from process launch until the held-out loss first reached `target`."""
    return next((t for _, loss, t in evals if loss <= target), None)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iters", type=int, default=2000)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--only", choices=["mindloom", "nanogpt"], default=None)
    parser.add_argument("--json", default=None, help=argparse.SUPPRESS)  # a child's result
    parser.add_argument("--t-launch", type=float, default=None, help=argparse.SUPPRESS)
    parser.add_argument(
        "--nanogpt-dir", type=Path, default=None,
        help="a karpathy/nanoGPT checkout: also run its own train.py in this run",
    )  # fmt: skip
    parser.add_argument(
        "--kernels", choices=("auto", "portable"), default="auto",
        help="mindloom's model.kernels (auto, the default: the fused CPU kernels)",
    )  # fmt: skip
    parser.add_argument(
        "--no-roofline", action="store_true", help="skip timing the step's matrix products alone"
    )
    args = parser.parse_args(argv)
    t_launch = args.t_launch if args.t_launch is not None else time.time()
    os.environ.setdefault("GLOG_v", "3")
    os.environ.setdefault("OMP_NUM_THREADS", str(args.threads))
    print(f"load average at start: {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs; "
          f"OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY', '(unset: default)')}")  # fmt: skip
    from mindloom_data import bundled_corpus

    text = bundled_corpus().read_text(encoding="utf-8")
    results = {}
    names = {"nanogpt": "nanoGPT (PyTorch)", "mindloom": "mindloom (MindSpore)"}
    if args.only is None:
        # each in a process of its own, one after the other: in one process, MindSpore's
        # step measured ~20% slower after torch had started its OpenMP pool
        import json
        import subprocess

        for which in ("nanogpt", "mindloom"):
            with tempfile.NamedTemporaryFile(suffix=".json") as out:
                cmd = [sys.executable, os.path.abspath(__file__), "--only", which,
                       "--iters", str(args.iters), "--threads", str(args.threads),
                       "--json", out.name, "--t-launch", str(time.time()),
                       "--kernels", args.kernels]  # fmt: skip
                subprocess.run(cmd, check=True)
                results[names[which]] = json.loads(Path(out.name).read_text())
        if args.nanogpt_dir is not None:
            print("running karpathy/nanoGPT's train.py ...", flush=True)
            results["real nanoGPT train.py"] = run_real_nanogpt(
                args.nanogpt_dir.expanduser(), args.iters, args.threads
            )
    else:
        with tempfile.TemporaryDirectory(prefix="nanogpt-bench-") as tmp:
            what = {
                "nanogpt": "nanoGPT (PyTorch eager",
                "mindloom": "mindloom (MindSpore graph mode",
            }[args.only]
            print(f"running {what}, {args.threads} threads, "
                  f"{args.iters} iters) in process {os.getpid()} ...", flush=True)  # fmt: skip
            if args.only == "nanogpt":
                results[names["nanogpt"]] = run_nanogpt(text, args.iters, args.threads, t_launch)
            else:
                results[names["mindloom"]] = run_mindloom(
                    args.iters, args.threads, Path(tmp), t_launch, args.kernels
                )
        if args.json:
            import json

            Path(args.json).write_text(json.dumps(results[names[args.only]]))
            return 0
    print()
    print(f"{'run':24s} {'wall s':>8s} {'ms/step':>8s} {'tokens/s':>10s} {'held-out loss':>14s}")
    for name, r in results.items():
        print(f"{name:24s} {r['wall_s']:8.1f} {12 * 64 / r['tokens_per_s'] * 1e3:8.1f} "
              f"{r['tokens_per_s']:10.0f} {r['val_loss']:14.4f}")  # fmt: skip
    if "mindloom (MindSpore)" in results:
        print(f"mindloom ran with: {results['mindloom (MindSpore)'].get('kernels', '?')}")
    m, t = results.get("mindloom (MindSpore)"), results.get("nanoGPT (PyTorch)")
    if m and t:
        print(f"\nmindloom / nanoGPT: tokens/s x{m['tokens_per_s'] / t['tokens_per_s']:.2f}, "
              f"wall time x{t['wall_s'] / m['wall_s']:.2f} faster")  # fmt: skip
        for peer_name in ("nanoGPT (PyTorch)", "real nanoGPT train.py"):
            peer = results.get(peer_name)
            if not peer:
                continue
            target = peer["val_loss"]
            mine, theirs = time_to(m["evals"], target), time_to(peer["evals"], target)
            if mine is None:
                print(f"to {peer_name}'s final held-out loss {target:.4f}: mindloom never "
                      f"reached it (best {min(e[1] for e in m['evals']):.4f})")  # fmt: skip
            else:
                print(f"to {peer_name}'s final held-out loss {target:.4f} from process start: "
                      f"mindloom {mine:.1f} s, {peer_name} {theirs:.1f} s: "
                      f"x{theirs / mine:.2f} sooner")  # fmt: skip
    if m and t and not args.no_roofline:
        tokens = 12 * 64
        floor = roofline(args.threads)
        t_step = tokens / t["tokens_per_s"]
        m_step = tokens / m["tokens_per_s"]
        print(f"\nwhat 1.5x nanoGPT takes: a step in {t_step / 1.5 * 1e3:.1f} ms "
              f"(nanoGPT's median step: {t_step * 1e3:.1f} ms; mindloom's: {m_step * 1e3:.1f} ms)")  # fmt: skip
        for name, (sec, flops) in floor.items():
            print(f"  {name:9s} step: {flops / 1e9:.2f} GFLOP in matrix products; those products "
                  f"alone, timed one by one in torch at their shapes: {sec * 1e3:.1f} ms")  # fmt: skip
    print(f"load average at end: {os.getloadavg()[0]:.1f}")
    print("(machine: shared 2-core CPU; figures are noisy, see the README)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
