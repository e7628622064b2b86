"""How tensor parallelism splits a Llama, as data: {module path pattern: style}.

The model declares the plan; `mindloom_parallel` applies it from outside (nothing is
stored on the model). Plain Python, no MindSpore.
"""

from __future__ import annotations

__all__ = ["TP_STYLES", "llama_tp_plan"]

# style -> what the applier does with a module whose path matches
TP_STYLES = {
    "colwise": "Linear: keep a block of output rows (whole heads), weight axis 0",
    "rowwise": "Linear: keep a block of input columns, then the region exit (sum over tp)",
    "vocab": "Embedding: keep a block of vocabulary rows, other ids give zeros, then the exit",
    "region_entry": "norm: the norm, then the region entry (f, or the sequence all-gather)",
    "local_heads": "attention: its head counts divided by tp",
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
