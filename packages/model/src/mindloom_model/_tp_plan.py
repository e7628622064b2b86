"""How tensor parallelism splits a model, as data: {module path pattern: style}.

The model declares the plan; `mindloom_parallel` applies it from outside (nothing is
stored on the model). Plain Python, no MindSpore.
"""

from __future__ import annotations

__all__ = ["TP_STYLES", "deepseek_tp_plan", "llama_tp_plan"]

# style -> what the applier does with a module whose path matches
TP_STYLES = {
    "colwise": "Linear: keep a block of output rows (whole heads), weight axis 0",
    "rowwise": "Linear: keep a block of input columns, then the region exit (sum over tp)",
    "vocab": "Embedding: keep a block of vocabulary rows, other ids give zeros, then the exit",
    "region_entry": "norm: the norm, then the region entry (f, or the sequence all-gather)",
    "local_heads": "attention: its head counts divided by tp",
    "mlp_entry": "MLP: the region entry in front of it (its w1/w3 colwise, w2 rowwise)",
    "partial_grad": (
        "kept whole inside a region: each rank's gradient is a partial sum over its heads, "
        "all-reduced over tp before the update"
    ),
}


def llama_tp_plan() -> dict[str, str]:
    """{fnmatch pattern over `Llama` module paths: style}. A pattern that matches nothing
    (`lm_head` when the head is tied to `embed`) is skipped."""
    return {
        "embed": "vocab",
        "layers.*.attn_norm": "region_entry",
        "layers.*.attn": "local_heads",
        "layers.*.attn.wq": "colwise",
        "layers.*.attn.wk": "colwise",
        "layers.*.attn.wv": "colwise",
        "layers.*.attn.wo": "rowwise",
        "layers.*.mlp_norm": "region_entry",
        "layers.*.mlp.w1": "colwise",
        "layers.*.mlp.w3": "colwise",
        "layers.*.mlp.w2": "rowwise",
        "norm": "region_entry",
        "lm_head": "colwise",
    }


def deepseek_tp_plan(first_k_dense_replace: int) -> dict[str, str]:
    """{fnmatch pattern over `DeepseekV3` module paths: style} (expert_tp = 1).

    MLA splits over heads, Megatron's way: the region entry sits on `attn_norm`, the
    per-head up-projections (`q_b_proj` / `q_proj`, `kv_b_proj`) keep whole heads, `wo` is
    row-parallel. The low-rank down-projections and their norms (`q_a_*`, `kv_a_*`, whose
    RoPE key every head shares) stay whole on each rank; inside the region each rank's
    gradient of them is the part its own heads need, so they are `partial_grad`.
    Dense layers' MLPs (the first `first_k_dense_replace`) split as Llama's; in a MoE
    layer only the shared experts split (`mlp_entry`: the entry on the MLP's own input,
    since the router and the routed experts run whole on every rank of the group on the
    same tokens, and an entry on `mlp_norm` would add their input gradient tp times).
    The vocabulary stays whole (embedding, head, MTP projection): each rank computes the
    full logits and the model's own losses.
    """
    plan: dict[str, str] = {}
    for block in ("layers.*", "mtp.*.block"):
        plan.update({
            f"{block}.attn_norm": "region_entry",
            f"{block}.attn": "local_heads",
            f"{block}.attn.q_proj": "colwise",
            f"{block}.attn.q_b_proj": "colwise",
            f"{block}.attn.kv_b_proj": "colwise",
            f"{block}.attn.wo": "rowwise",
            f"{block}.attn.q_a_proj": "partial_grad",
            f"{block}.attn.q_a_norm": "partial_grad",
            f"{block}.attn.kv_a_proj": "partial_grad",
            f"{block}.attn.kv_a_norm": "partial_grad",
            f"{block}.mlp.shared": "mlp_entry",
            f"{block}.mlp.shared.w1": "colwise",
            f"{block}.mlp.shared.w3": "colwise",
            f"{block}.mlp.shared.w2": "rowwise",
        })  # fmt: skip
    for i in range(first_k_dense_replace):  # dense layers (a MoE layer's mlp has no w1)
        plan.update({
            f"layers.{i}.mlp_norm": "region_entry",
            f"layers.{i}.mlp.w1": "colwise",
            f"layers.{i}.mlp.w3": "colwise",
            f"layers.{i}.mlp.w2": "rowwise",
        })  # fmt: skip
    return plan
