"""How every parameter is split across ranks, and pure-numpy cut / assemble, so a
checkpoint written under one layout loads under another (dp2 -> dp1, tp2 -> tp1,
pp2 -> pp1 and back). No MindSpore here: the checkpoint code and its tests can use it
anywhere.

A tensor's entry (``TensorSpec``): its global shape, the axis split over tensor-parallel
ranks (None: every TP rank holds it whole), and the pipeline stages that hold it. Data-
parallel ranks always hold identical copies. A rank's tensors are named by their global
module path, whatever the layout.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np

__all__ = [
    "TensorSpec",
    "tensor_layout",
    "layout_metadata",
    "expert_metadata",
    "shard_tensor",
    "assemble_tensor",
    "rank_tensor_names",
    "rank_state",
    "assemble_state",
]


@dataclass(frozen=True)
class TensorSpec:
    name: str
    global_shape: tuple[int, ...]
    tp_axis: int | None  # axis split over the TP group, None = replicated
    pp_stages: tuple[int, ...]  # the pipeline stages holding it

    def local_shape(self, tp: int) -> tuple[int, ...]:
        s = list(self.global_shape)
        if self.tp_axis is not None:
            s[self.tp_axis] //= tp
        return tuple(s)

    def to_json(self) -> dict:
        d = asdict(self)
        d["global_shape"] = list(self.global_shape)
        d["pp_stages"] = list(self.pp_stages)
        return d


def _get(cfg, key):
    return cfg[key] if isinstance(cfg, dict) else getattr(cfg, key)


def tensor_layout(model_cfg, pcfg) -> dict[str, TensorSpec]:
    """Every parameter of ``Llama(model_cfg)`` under ``pcfg`` (a ParallelConfig or dict)."""
    pp = _get(pcfg, "pp")
    d = _get(model_cfg, "hidden_size")
    v = _get(model_cfg, "vocab_size")
    nl = _get(model_cfg, "num_layers")
    nh = _get(model_cfg, "num_heads")
    nkv = _get(model_cfg, "num_kv_heads") or nh
    f = _get(model_cfg, "ffn_hidden_size")
    tied = bool(_get(model_cfg, "tie_embeddings"))
    dh = d // nh
    last = pp - 1
    per = nl // pp
    out: dict[str, TensorSpec] = {}

    def add(name, shape, axis, stages):
        out[name] = TensorSpec(name, tuple(shape), axis, tuple(sorted(set(stages))))

    add("embed.weight", (v, d), 0, [0, last] if tied else [0])
    for i in range(nl):
        st = [i // per]
        p = f"layers.{i}."
        add(p + "attn_norm.weight", (d,), None, st)
        add(p + "attn.wq.weight", (nh * dh, d), 0, st)
        add(p + "attn.wk.weight", (nkv * dh, d), 0, st)
        add(p + "attn.wv.weight", (nkv * dh, d), 0, st)
        add(p + "attn.wo.weight", (d, nh * dh), 1, st)
        add(p + "mlp_norm.weight", (d,), None, st)
        add(p + "mlp.w1.weight", (f, d), 0, st)
        add(p + "mlp.w2.weight", (d, f), 1, st)
        add(p + "mlp.w3.weight", (f, d), 0, st)
    add("norm.weight", (d,), None, [last])
    if not tied:
        add("lm_head.weight", (v, d), 0, [last])
    return out


def layout_metadata(model_cfg, pcfg) -> dict:
    """JSON-ready description for a checkpoint's metadata.json."""
    get = (lambda k: pcfg[k]) if isinstance(pcfg, dict) else (lambda k: getattr(pcfg, k))
    return {
        "parallel": {k: get(k) for k in ("dp", "tp", "pp")},
        "rank_order": "rank = pp_rank * (dp * tp) + dp_rank * tp + tp_rank",
        "tensors": {n: s.to_json() for n, s in tensor_layout(model_cfg, pcfg).items()},
        **({"expert_parallel": expert_metadata(model_cfg, pcfg)} if _ep(pcfg) > 1 else {}),
    }


def _ep(pcfg) -> int:
    return int(pcfg.get("ep", 1) if isinstance(pcfg, dict) else getattr(pcfg, "ep", 1))


def expert_metadata(model_cfg, pcfg) -> dict:
    """How the routed experts ([E, ...] tensors `*.mlp.experts.w1/w2/w3`, axis 0 = global
    expert index) were split when the checkpoint was written: ep rank i held experts
    [i * E/ep, (i + 1) * E/ep). The tensors themselves are saved whole (global indices),
    so any ep loads them."""
    e = int(_get(model_cfg, "n_routed_experts"))
    ep = _ep(pcfg)
    per = e // ep
    return {
        "ep": ep,
        "expert_dp": _get(pcfg, "dp") // ep,
        "n_routed_experts": e,
        "expert_axis": 0,
        "tensors": "*.mlp.experts.w1, *.mlp.experts.w2, *.mlp.experts.w3 (and their moments)",
        "ep_rank_experts": [[i * per, (i + 1) * per] for i in range(ep)],
        "rank_order": "dp_rank = edp_rank * ep + ep_rank",
    }


def shard_tensor(full: np.ndarray, spec: TensorSpec, tp_rank: int, tp: int) -> np.ndarray:
    """The block of ``full`` that TP rank ``tp_rank`` of ``tp`` holds."""
    if tuple(full.shape) != spec.global_shape:
        raise ValueError(f"{spec.name}: shape {tuple(full.shape)} != global {spec.global_shape}")
    if spec.tp_axis is None or tp == 1:
        return full
    n = spec.global_shape[spec.tp_axis] // tp
    idx = [slice(None)] * full.ndim
    idx[spec.tp_axis] = slice(tp_rank * n, (tp_rank + 1) * n)
    return np.ascontiguousarray(full[tuple(idx)])


def assemble_tensor(shards: list[np.ndarray], spec: TensorSpec) -> np.ndarray:
    """The full tensor from the TP shards in TP-rank order (one shard if replicated)."""
    if spec.tp_axis is None:
        full = shards[0]
    else:
        full = np.concatenate(shards, axis=spec.tp_axis)
    if tuple(full.shape) != spec.global_shape:
        raise ValueError(
            f"{spec.name}: assembled shape {tuple(full.shape)} != global {spec.global_shape}"
        )
    return full


def rank_tensor_names(layout: dict[str, TensorSpec], pp_rank: int) -> list[str]:
    return [n for n, s in layout.items() if pp_rank in s.pp_stages]


def _pcfg(pcfg):
    from mindloom_parallel._config import ParallelConfig

    if isinstance(pcfg, dict):
        return ParallelConfig(**{k: pcfg[k] for k in ("dp", "tp", "pp") if k in pcfg})
    return pcfg


def rank_state(
    full_state: dict[str, np.ndarray], model_cfg, pcfg, rank: int
) -> dict[str, np.ndarray]:
    """Cut a full state (name -> global array) into what ``rank`` holds under ``pcfg``."""
    from mindloom_parallel._groups import rank_coords

    pcfg = _pcfg(pcfg)

    _, tp_rank, pp_rank = rank_coords(rank, pcfg)
    layout = tensor_layout(model_cfg, pcfg)
    missing = [n for n in rank_tensor_names(layout, pp_rank) if n not in full_state]
    if missing:
        raise KeyError(f"full state lacks {len(missing)} tensors, first {missing[0]!r}")
    tp = _get(pcfg, "tp")
    return {
        n: shard_tensor(np.asarray(full_state[n]), layout[n], tp_rank, tp)
        for n in rank_tensor_names(layout, pp_rank)
    }


def assemble_state(
    rank_states: dict[int, dict[str, np.ndarray]], model_cfg, pcfg
) -> dict[str, np.ndarray]:
    """Full tensors from per-rank states (``{rank: {name: local array}}``). Only the ranks
    of one data-parallel replica are needed; extra replicas are ignored."""
    from mindloom_parallel._groups import coords_rank

    pcfg = _pcfg(pcfg)
    layout = tensor_layout(model_cfg, pcfg)
    tp = _get(pcfg, "tp")
    full = {}
    for name, spec in layout.items():
        stage = spec.pp_stages[0]
        shards = []
        for t in range(tp if spec.tp_axis is not None else 1):
            r = coords_rank(0, t, stage, pcfg)
            st = rank_states.get(r)
            if st is None or name not in st:
                raise KeyError(f"{name}: no shard from rank {r} (tp {t}, pp {stage})")
            shards.append(np.asarray(st[name]))
        full[name] = assemble_tensor(shards, spec)
    return full
