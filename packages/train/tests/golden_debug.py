"""The golden run of issue 21's redesign: `configs/debug.yaml` for 20 steps.

`record(run_dir)` reduces a finished run to what a refactor must keep: per-step loss, grad
norm and lr, the held-out losses, and per checkpoint tensor its SHA-256 (byte identity on the
machine that recorded it) plus its sum, sum of squares and eight sampled values (closeness
anywhere else). `python golden_debug.py RUN_DIR OUT.json` writes the record; the test in
test_train_golden.py compares a fresh run with the committed one.
"""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path

import numpy as np

OVERRIDES = {
    "training.train_iters": 20,
    "monitor.log_interval": 1,
    "checkpoint.save_interval": 10,
    "training.eval_interval": 10,
    # recorded on MindSpore's own ops, before `kernels: auto` became the default: the
    # redesign's golden run compares the trainer, not the fused kernels (which agree with
    # the portable path to ~1e-6, test_model_kernels.py)
    "model.kernels": "portable",
}


def _tensor_record(arr: np.ndarray) -> dict:
    flat = np.ascontiguousarray(arr).reshape(-1)
    f64 = flat.astype(np.float64)
    picks = np.linspace(0, flat.size - 1, num=min(8, flat.size)).astype(np.int64)
    return {
        "dtype": str(arr.dtype),
        "shape": list(arr.shape),
        "sha256": hashlib.sha256(flat.tobytes()).hexdigest(),
        "sum": float(f64.sum()),
        "sumsq": float((f64 * f64).sum()),
        "samples": [float(f64[i]) for i in picks],
    }


def record(run_dir: Path) -> dict:
    from safetensors.numpy import load_file

    run_dir = Path(run_dir)
    steps, evals = {}, {}
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        rec = json.loads(line)
        if rec.get("event") == "eval":
            evals[str(rec["step"])] = rec["loss"]
        elif "event" not in rec:
            steps[str(rec["step"])] = {k: rec[k] for k in ("loss", "grad_norm", "lr")}
    tensors = {}
    for ckpt in sorted((run_dir / "checkpoints").glob("step_*")):
        for f in sorted(ckpt.glob("*.safetensors")):
            for name, arr in sorted(load_file(str(f)).items()):
                tensors[f"{ckpt.name}/{f.name}/{name}"] = _tensor_record(arr)
    return {"steps": steps, "evals": evals, "tensors": tensors}


if __name__ == "__main__":
    out = record(Path(sys.argv[1]))
    Path(sys.argv[2]).write_text(json.dumps(out, indent=1, sort_keys=True) + "\n")
