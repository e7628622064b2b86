"""How fast should DeepSeek-V3's expert bias move? A NumPy simulation, no MindSpore.

    python docs/moe_bias_speed.py

A fixed router (weights N(0, 0.02^2) as the presets initialise them) over RMS-normalised
token vectors that share one common direction (so some experts are preferred, as in a
real model), DeepSeek-V3's group-limited top-k (4 groups, 2 kept, k=2) and the
auxiliary-loss-free update b_e += speed * sign(mean load - load_e) after every step of
2048 fresh tokens. Printed per model width and speed: the spread of the router scores
(mean over tokens of their std over experts), the imbalance (max/mean load) at step 1,
its minimum, and its mean and maximum over the last 15 of 40 steps.
"""

from __future__ import annotations

import numpy as np


def route(choice, n_group, topk_group, k):
    """Token-slot counts per expert of group-limited top-k over choice [N, E]."""
    n, e = choice.shape
    per = e // n_group
    group_score = np.sort(choice.reshape(n, n_group, per), -1)[..., -2:].sum(-1)
    keep = np.argsort(-group_score, -1, kind="stable")[:, :topk_group]
    kept = np.zeros((n, n_group), bool)
    np.put_along_axis(kept, keep, True, 1)
    masked = np.where(np.repeat(kept, per, 1), choice, -np.inf)
    top = np.argsort(-masked, -1, kind="stable")[:, :k]
    return np.bincount(top.ravel(), minlength=e)


def simulate(d, e, speed, steps=40, n=2048, common=1.0, seed=0, std=0.02):
    rng = np.random.default_rng(seed)
    w = rng.normal(0, std, (e, d))
    m = rng.normal(0, 1, d)
    b = np.zeros(e)
    imbalance = []
    for _ in range(steps):
        x = common * m + rng.normal(0, 1, (n, d))
        x /= np.sqrt((x**2).mean(1, keepdims=True))
        s = 1 / (1 + np.exp(-(x @ w.T)))
        load = route(s + b, 4, 2, 2)
        imbalance.append(load.max() / load.mean())
        b += speed * np.sign(load.mean() - load)
    return s.std(1).mean(), imbalance


def main(argv=None) -> int:
    for name, d, e in (("debug", 64, 8), ("small", 256, 16), ("d=1024", 1024, 16)):
        for speed in (0.001, 0.003, 0.01, 0.03):
            spread, imb = simulate(d, e, speed)
            print(f"{name:7s} score spread {spread:.4f} speed {speed:<6} speed/spread "
                  f"{speed / spread:5.2f} imbalance step1 {imb[0]:.2f} min {min(imb):.2f} "
                  f"mean(last 15) {np.mean(imb[-15:]):.2f} max(last 15) {max(imb[-15:]):.2f}")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
