"""What would make a run fit (`_memory`): the estimate again with one change each
(recompute, ZeRO-1, TP, PP, a smaller micro-batch), then a combination."""

from __future__ import annotations

import dataclasses
from typing import Any


def _variant(cfg, **changes):
    import copy

    new = copy.deepcopy(cfg)
    for dotted, value in changes.items():
        section, key = dotted.split(".")
        setattr(getattr(new, section), key, value)
    return new


def _suggestions(cfg, est, *, nproc, device, mcfg, runtime_bytes, ranks_per_host,
                 estimate) -> list[dict]:  # fmt: skip
    # `estimate`: _memory_estimate.estimate, passed in (that module calls this one)
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
        out += _combined(cfg, nproc, device, mcfg, runtime_bytes, estimate)
    return out


def _combined(cfg, nproc, device, mcfg, runtime_bytes, estimate) -> list[dict]:
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
