"""The activation inventory of the memory estimate (`_memory`): every tensor a layer
keeps for its backward (Korthikanti et al. 2022, Sec. 4), for the GPT, Llama and
DeepSeek-V3 blocks, and the CPU graph's extra intermediates."""

from __future__ import annotations

from dataclasses import dataclass

# ---------------------------------------------------------------------------------------
# activations: an inventory of saved tensors


@dataclass(frozen=True)
class TensorSaved:
    """One tensor a layer keeps for its backward: elements = tokens * width (or, with
    `scores`, micro_batch * heads * s * s), `nbytes` per element, split over TP ranks
    when `tp_split` (head- or FFN-sharded), over TP ranks with sequence parallelism when
    `sp_split` (the replicated norm/residual region)."""

    name: str
    width: float  # per token; for scores: heads
    nbytes: int
    tp_split: bool = False
    sp_split: bool = False
    scores: bool = False
    in_selective: bool = False  # recomputed under Korthikanti's selective recompute

    def bytes(self, b: int, s: int, tp: int, sp: bool) -> float:
        n = b * self.width * (s * s if self.scores else s) * self.nbytes
        if self.tp_split or (self.sp_split and sp):
            n /= tp
        return n


def gpt_block(h: int, a: int, ffn: int | None = None, dropout: bool = True) -> list[TensorSaved]:
    """Korthikanti et al. 2022 Sec. 4.1's GPT block in 16-bit: what its Table 2 counts."""
    f = 4 * h if ffn is None else ffn
    out = [
        TensorSaved("attn layernorm input", h, 2, sp_split=True),
        TensorSaved("qkv input", h, 2, sp_split=True),
        # kept under selective recompute: the inputs of the recomputed QK^T/softmax/PV
        TensorSaved("q, k", 2 * h, 2, tp_split=True),
        TensorSaved("softmax output", a, 2, tp_split=True, scores=True, in_selective=True),
        TensorSaved("v", h, 2, tp_split=True),
        TensorSaved("proj input", h, 2, tp_split=True),
        TensorSaved("mlp layernorm input", h, 2, sp_split=True),
        TensorSaved("fc1 input", h, 2, sp_split=True),
        TensorSaved("gelu input", f, 2, tp_split=True),
        TensorSaved("fc2 input", f, 2, tp_split=True),
    ]
    if dropout:
        out += [
            TensorSaved("attn dropout mask", a, 1, tp_split=True, scores=True, in_selective=True),
            TensorSaved(
                "attn dropout output", a, 2, tp_split=True, scores=True, in_selective=True
            ),  # fmt: skip
            TensorSaved("attn residual dropout mask", h, 1, sp_split=True),
            TensorSaved("mlp residual dropout mask", h, 1, sp_split=True),
        ]
    return out


def llama_block(mcfg, c: int) -> list[TensorSaved]:
    """The Llama block of mindloom_model as written (c: compute bytes per element)."""
    h, a, dh, f = mcfg.hidden_size, mcfg.num_heads, mcfg.head_dim, mcfg.ffn_hidden_size
    out = [
        # RMSNorm normalises an fp32 copy; its backward reads that copy
        TensorSaved("attn_norm fp32", h, 4, sp_split=True),
        TensorSaved("qkv input", h, c, sp_split=True),
        TensorSaved("q (after RoPE)", a * dh, c, tp_split=True),
        # GQA: k and v are broadcast to every query head before the score matmul
        TensorSaved("k, v (expanded)", 2 * a * dh, c, tp_split=True),
        TensorSaved("softmax output fp32", a, 4, tp_split=True, scores=True),
        TensorSaved("wo input", a * dh, c, tp_split=True),
        TensorSaved("mlp_norm fp32", h, 4, sp_split=True),
        TensorSaved("w1/w3 input", h, c, sp_split=True),
        # SwiGLU: w1 out (silu's input), silu out, w3 out, their product (w2's input)
        TensorSaved("swiglu (4 x ffn)", 4 * f, c, tp_split=True),
    ]
    if c != 4:
        out.append(TensorSaved("probs in compute dtype", a, c, tp_split=True, scores=True))
    if mcfg.dropout > 0:
        out += [
            TensorSaved("attn dropout mask+output", a, 1 + c, tp_split=True, scores=True),
            TensorSaved("residual dropout masks", 2 * h, 1, sp_split=True),
        ]
    return out


def deepseek_blocks(mcfg, c: int) -> tuple[list[TensorSaved], list[TensorSaved]]:
    """(dense layer, MoE layer) inventories of the DeepSeek-V3 block: MLA attention, then a
    dense SwiGLU (the first first_k_dense_replace layers) or DeepSeekMoE. Routed expert
    activations are per routed token copy (N*k), the even load; a capacity factor caps
    them at capacity_factor times that."""
    h, a = mcfg.hidden_size, mcfg.num_heads
    qk = mcfg.qk_nope_head_dim + mcfg.qk_rope_head_dim
    vd, kvr, qr = mcfg.v_head_dim, mcfg.kv_lora_rank, mcfg.q_lora_rank
    attn = [
        TensorSaved("attn_norm fp32", h, 4, sp_split=True),
        TensorSaved("q/kv down input", h, c, sp_split=True),
        TensorSaved("kv latent + rope key", kvr + mcfg.qk_rope_head_dim, c),
        TensorSaved("kv_norm fp32 + output", kvr, 4 + c),
        TensorSaved("q, k (nope+rope)", 2 * a * qk, c, tp_split=True),
        TensorSaved("v", a * vd, c, tp_split=True),
        TensorSaved("softmax output fp32", a, 4, tp_split=True, scores=True),
        TensorSaved("o_proj input", a * vd, c, tp_split=True),
        TensorSaved("mlp_norm fp32", h, 4, sp_split=True),
        TensorSaved("mlp input", h, c, sp_split=True),
    ]
    if qr:
        attn.append(TensorSaved("q latent + q_norm", qr, 4 + 2 * c))
    if c != 4:
        attn.append(TensorSaved("probs in compute dtype", a, c, tp_split=True, scores=True))
    dense = attn + [TensorSaved("swiglu (4 x ffn)", 4 * mcfg.ffn_hidden_size, c, tp_split=True)]
    k, e, fm = mcfg.num_experts_per_tok, mcfg.n_routed_experts, mcfg.moe_intermediate_size
    load = k if mcfg.moe_capacity_factor is None else min(k * mcfg.moe_capacity_factor, e)
    moe = attn + [
        TensorSaved("router scores fp32", 3 * e, 4),  # logits, sigmoid, biased copy
        TensorSaved("routed token copies", load * h, c),
        # routed experts run whole on every tp rank (deepseek_tp_plan: expert_tp = 1)
        TensorSaved("expert swiglu (4 x Fm x k)", 4 * fm * load, c),
        TensorSaved("expert outputs", load * h, c),
        TensorSaved("shared expert swiglu", 4 * fm * mcfg.n_shared_experts, c, tp_split=True),
    ]
    return dense, moe


def cpu_kernel_graph_intermediates(mcfg, b: int, s: int) -> tuple[float, float]:
    """(bytes per layer, bytes of the head and loss) of the same compiled CPU step with the
    fused kernels (model.kernels: auto): the forward's op outputs, of width hidden (two
    norms, q/k/v, the attention output, wo, two residual sums) and ffn (w1, w3, SwiGLU),
    live until the backward, whose gradients the runtime then reuses; attention and the
    loss hold no [S, S] or softmax tensor, so the head is the logits and their gradient.
    With the compiler term (COMPILE_CPU_KERNELS_*) fit on the 17m width with 2 and 12
    layers at 8 x 256 tokens (peaks 953 and 1903 MiB); the 6-layer preset then estimates
    1334 MiB against 1332 measured, and 2815 against 2603 at 32 x 256. Full recompute
    measured 5-6% less (not modelled: the estimate stays above)."""
    h, f = mcfg.hidden_size, mcfg.ffn_hidden_size
    g = mcfg.num_kv_heads / mcfg.num_heads
    n = b * s
    layer = 4 * n * ((8 + 2 * g) * h + 3 * f)
    if mcfg.dropout > 0:  # attention keeps the portable path (no dropout in the kernel)
        layer += 4 * b * mcfg.num_heads * s * s * 6
    return layer, 4 * n * 2 * mcfg.vocab_size


def cpu_graph_intermediates(mcfg, b: int, s: int, recomputed: bool) -> tuple[float, float]:
    """(bytes per layer, bytes of the head and loss) of MindSpore's CPU backend in graph
    mode, fp32. Measured there: the compiled step keeps essentially every intermediate of
    its forward and backward alive until the step ends (no reuse across the graph; the
    17m preset at 8 x 256 peaks at ~4.3 GB where the saved-for-backward set is ~0.7 GB).
    So this counts op outputs, not saved tensors: per layer, of width hidden (the two
    RMSNorms 3 each; q/k/v and their transposes; RoPE's products, halves, concat and sum
    on q and k; GQA's expanded k and v; the attention output, its transpose and wo; w2;
    two residual sums), four of width ffn (w1, silu, w3, product) and three score-sized
    (scores, + bias, softmax); the backward makes one gradient per forward output, two
    more score-sized in the softmax backward. A recomputed layer runs its forward twice."""
    h, a, f = mcfg.hidden_size, mcfg.num_heads, mcfg.ffn_hidden_size
    g = mcfg.num_kv_heads / a
    n = b * s
    fwd_h = 3 + (1 + 2 * g) * 2 + 5 * (1 + g) + (2 if g < 1 else 0) + 3 + 1 + 3 + 1 + 1
    fwd = 4 * n * (fwd_h * h + 4 * f) + 4 * b * a * s * s * (3 + (mcfg.dropout > 0))
    bwd = fwd + 4 * b * a * s * s * 2
    layer = fwd * (2 if recomputed else 1) + bwd
    # logits, logits - max, exp; backward: d exp, d (logits - max), their sum, the
    # gather's scatter
    head = 4 * n * mcfg.vocab_size * 7 + 4 * n * h * 6
    return layer, head


def layer_activation_bytes(inventory, b, s, tp=1, sp=False, recompute="none") -> float:
    """Bytes one layer keeps for one micro-batch. recompute: none; `selective`
    (Korthikanti: attention core recomputed); `full` (only the layer input is kept)."""
    if recompute == "full":
        first = inventory[0]  # the layer input: one residual-stream tensor
        return TensorSaved("layer input", first.width, 2 if first.nbytes <= 2 else first.nbytes,
                           sp_split=True).bytes(b, s, tp, sp)  # fmt: skip
    return sum(
        t.bytes(b, s, tp, sp)
        for t in inventory
        if not (recompute == "selective" and t.in_selective)
    )
