"""Parameter values per rank of a layout, by family, for the memory estimate
(`_memory_estimate`): Llama from `mindloom_parallel.tensor_layout`, DeepSeek-V3 from its
parameter counts and `mindloom_model.deepseek_tp_plan`'s split."""

from __future__ import annotations

import math

__all__: list[str] = []


def _stage_param_sizes(mcfg, tp: int, pp: int) -> list[list[int]]:
    """Sizes of the local tensors of each pipeline stage (one TP rank)."""
    if mcfg.family == "llama":
        from mindloom_parallel import tensor_layout

        specs = tensor_layout(mcfg, {"dp": 1, "tp": tp, "pp": pp}).values()
        return [
            [math.prod(sp.local_shape(tp)) for sp in specs if st in sp.pp_stages]
            for st in range(pp)
        ]
    # deepseek_v3: layers split evenly (MTP with the last stage); under tp the plan's
    # matrices split (`_tp_split_values`), the rest whole on every tp rank: the
    # vocabulary, routers, routed experts (split by ep instead) and MLA down-projections
    v, h = mcfg.vocab_size, mcfg.hidden_size
    head = 0 if mcfg.tie_embeddings else v * h
    body = mcfg.num_params(include_embeddings=False) - head - h
    split = _tp_split_values(mcfg) if tp > 1 else 0
    stages = [[int((body - split + split / tp) / pp)] for _ in range(pp)]
    stages[0].append(v * h)
    stages[-1] += [h] + ([head] if head else ([v * h] if pp > 1 else []))
    return stages


def _tp_split_values(mcfg) -> int:
    """Values of the tensors `deepseek_tp_plan` splits over tp: per block (trunk and MTP)
    the per-head query and KV up-projections and the output projection; the shared
    experts of MoE blocks; the MLPs of the dense layers."""
    d, h = mcfg.hidden_size, mcfg.num_heads
    dn, dr, dv = mcfg.qk_nope_head_dim, mcfg.qk_rope_head_dim, mcfg.v_head_dim
    q_in = d if mcfg.q_lora_rank is None else mcfg.q_lora_rank
    attn = q_in * h * (dn + dr) + mcfg.kv_lora_rank * h * (dn + dv) + h * dv * d
    dense = mcfg.first_k_dense_replace
    moe = mcfg.num_layers - dense + mcfg.num_nextn_predict_layers
    shared = 3 * d * mcfg.moe_intermediate_size * mcfg.n_shared_experts
    blocks = mcfg.num_layers + mcfg.num_nextn_predict_layers
    return blocks * attn + moe * shared + dense * 3 * d * mcfg.ffn_hidden_size


def _routed_expert_values(mcfg) -> int:
    """Values of all routed experts (w1, w2, w3 of E experts in every MoE block: the trunk
    layers from `first_k_dense_replace` on and each MTP depth): what ep splits."""
    if mcfg.family == "llama" or not mcfg.n_routed_experts:
        return 0
    blocks = (mcfg.num_layers - mcfg.first_k_dense_replace) + mcfg.num_nextn_predict_layers
    return blocks * mcfg.n_routed_experts * 3 * mcfg.hidden_size * mcfg.moe_intermediate_size


def _expert_split(mcfg, ep: int, pp: int, stages: list[list[int]], notes: list[str]) -> list[int]:
    """Expert parallel: each rank keeps E/ep routed experts of every MoE block (their
    weights, gradients and moments), split over stages like the rest, whole under tp.
    Takes them out of each stage's body in place; returns the local expert values per
    stage (0 without ep)."""
    local_expert = [0] * pp
    if ep > 1:
        routed = _routed_expert_values(mcfg) / pp
        local_expert = [int(routed / ep)] * pp
        for st in range(pp):
            stages[st][0] -= int(routed) - local_expert[st]  # the body holds the experts
        notes.append(f"ep={ep}: {mcfg.n_routed_experts // ep} of "
                     f"{mcfg.n_routed_experts} routed experts per rank; activations as ep=1")  # fmt: skip
    return local_expert
