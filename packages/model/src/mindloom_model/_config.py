"""ModelConfig and the presets: plain Python, no MindSpore.

Importing this module (or `mindloom_model.ModelConfig`, `get_preset`, `preset_names`)
never imports MindSpore, so a train config can be validated on a machine without it.
The dtype names are checked here; `_llama` maps them to MindSpore dtypes.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

__all__ = ["ModelConfig", "get_preset", "preset_names", "DTYPE_NAMES"]

# the precision names ModelConfig accepts (param_dtype, compute_dtype)
DTYPE_NAMES = ("bfloat16", "float16", "float32")


@dataclass
class ModelConfig:
    vocab_size: int = 256
    hidden_size: int = 64  # D
    num_layers: int = 2
    num_heads: int = 4  # H, query heads
    num_kv_heads: int | None = None  # KV; None = num_heads (multi-head); < H = grouped-query
    ffn_hidden_size: int | None = None  # F; None = Llama rule: 8/3 * D rounded up to multiple_of
    multiple_of: int = 256  # rounding for the Llama FFN rule
    max_seq_len: int = 32  # the context the model is trained for (HF max_position_embeddings)
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    tie_embeddings: bool = False  # lm_head shares embed.weight
    dropout: float = 0.0  # on embeddings, attention probabilities and residual branches
    # precision policy: parameters (master weights) are kept in param_dtype; matmuls run
    # in compute_dtype; norms, softmax, logits and the loss are always fp32.
    param_dtype: str = "float32"
    compute_dtype: str = "float32"  # "bfloat16" | "float16" | "float32"
    # initialization: normal(0, init_std); wo and w2 additionally scaled by 1/sqrt(2*layers)
    init_std: float = 0.02
    embed_init_std: float | None = None  # None = init_std
    head_init_std: float | None = None  # None = init_std (untied head only)
    init_seed: int = 0
    # activation recompute: "none" | "full" (every layer) | "selected" (recompute_layers)
    recompute: str = "none"
    recompute_layers: list[int] = field(default_factory=list)
    # "eager" is the portable ops path; "flash" uses ops.flash_attention_score on Ascend
    # and falls back to "eager" elsewhere (logged once)
    attention_impl: str = "eager"
    # "auto": on the CPU backend, fused C++ kernels for norms, SwiGLU, attention and the
    # loss (compiled on first use; without a compiler, the portable ops, logged once);
    # "portable": MindSpore's own ops everywhere (see _kernels/). Ascend keeps its own
    # ops either way. auto measured 1.3-1.5x the portable step (the model README)
    kernels: str = "auto"
    # --- model family. "llama" reads only the fields above; "deepseek_v3" (MLA attention,
    # DeepSeekMoE, multi-token prediction: see _deepseek.py) also reads the fields below,
    # named as in Hugging Face's DeepseekV3Config so config.json maps one to one.
    family: str = "llama"
    # RoPE scaling (deepseek_v3): None, or YaRN {"type": "yarn", "factor",
    # "original_max_position_embeddings", "beta_fast", "beta_slow", "mscale", "mscale_all_dim"}
    rope_scaling: dict | None = None
    q_lora_rank: int | None = None  # rank of the compressed query; None = a plain q_proj
    kv_lora_rank: int = 0  # width of the joint key/value latent (what the KV cache stores)
    qk_nope_head_dim: int = 0  # per-head query/key width without RoPE
    qk_rope_head_dim: int = 0  # per-head query width with RoPE; the RoPE key is shared by heads
    v_head_dim: int = 0  # per-head value width
    rope_interleave: bool = True  # RoPE on interleaved pairs (DeepSeek's layout)
    n_routed_experts: int = 0  # E
    n_shared_experts: int = 0  # always-on experts, moe_intermediate_size wide each
    num_experts_per_tok: int = 0  # k, routed experts per token
    moe_intermediate_size: int = 0  # Fm, width of one expert
    n_group: int = 1  # expert groups; a token picks topk_group groups, then k experts in them
    topk_group: int = 1
    routed_scaling_factor: float = 1.0  # multiplies the (normalised) top-k weights
    norm_topk_prob: bool = True
    first_k_dense_replace: int = 0  # the first layers keep a dense SwiGLU (ffn_hidden_size)
    scoring_func: str = "sigmoid"
    # tokens an expert takes at most, as a multiple of the even share N*k/E; None = dropless
    moe_capacity_factor: float | None = None
    # auxiliary-loss-free balancing: after each optimizer step every expert's selection
    # bias moves by this much towards the mean load (sign rule of DeepSeek-V3)
    moe_bias_update_speed: float = 0.001
    moe_aux_loss_weight: float = 0.0  # sequence-wise balance loss; 0 = off
    num_nextn_predict_layers: int = 0  # multi-token prediction depth
    mtp_loss_weight: float = 0.3  # lambda: total = main + lambda * mean(MTP losses)

    def __post_init__(self):
        if self.num_kv_heads is None:
            self.num_kv_heads = self.num_heads
        if self.ffn_hidden_size is None:
            f = int(2 * 4 * self.hidden_size / 3)
            self.ffn_hidden_size = self.multiple_of * math.ceil(f / self.multiple_of)
        self.recompute_layers = list(self.recompute_layers)
        self.validate()

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    def validate(self) -> None:
        def bad(msg):
            raise ValueError(f"model config: {msg}")

        for key in ("vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads"):
            v = getattr(self, key)
            if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
                bad(f"{key} must be a positive integer, found {v!r}")
        if self.family not in ("llama", "deepseek_v3"):
            bad(f"family must be 'llama' or 'deepseek_v3', found {self.family!r}")
        if self.family == "deepseek_v3":
            from mindloom_model._deepseek_config import validate_deepseek

            validate_deepseek(self, bad)
        elif self.rope_scaling is not None:
            bad("rope_scaling is read by the deepseek_v3 family only (Llama uses plain RoPE)")
        if self.family == "llama" and self.hidden_size % self.num_heads:
            bad(f"num_heads={self.num_heads} does not divide hidden_size={self.hidden_size}")
        if self.num_heads % self.num_kv_heads:
            bad(f"num_kv_heads={self.num_kv_heads} does not divide num_heads={self.num_heads}")
        if self.family == "llama" and self.head_dim % 2:
            bad(f"head_dim={self.head_dim} (hidden_size/num_heads) must be even for RoPE")
        for key in ("param_dtype", "compute_dtype"):
            if getattr(self, key) not in DTYPE_NAMES:
                bad(f"{key} must be one of {list(DTYPE_NAMES)}, found {getattr(self, key)!r}")
        if not 0.0 <= self.dropout < 1.0:
            bad(f"dropout must be in [0, 1), found {self.dropout!r}")
        if self.recompute not in ("none", "full", "selected"):
            bad(f"recompute must be 'none', 'full' or 'selected', found {self.recompute!r}")
        for i in self.recompute_layers:
            if not 0 <= i < self.num_layers:
                bad(f"recompute_layers entry {i} is not a layer index in [0, {self.num_layers})")
        if self.kernels not in ("auto", "portable"):
            bad(f"kernels must be 'auto' or 'portable', found {self.kernels!r}")
        if self.attention_impl not in ("eager", "flash"):
            bad(f"attention_impl must be 'eager' or 'flash', found {self.attention_impl!r}")

    @classmethod
    def from_dict(cls, d: dict) -> ModelConfig:
        known = {f.name for f in dataclasses.fields(cls)}
        for key in d:
            if key not in known:
                raise ValueError(f"model config: unknown key {key!r}")
        return cls(**d)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    # ------------------------------------------------------------------ accounting

    def num_params(self, include_embeddings: bool = True) -> int:
        """Exact number of parameters of `Llama(self)`.

        include_embeddings=False leaves out the token embedding table (a lookup, not a
        matmul); an untied lm_head is a matmul and stays in.
        """
        if self.family == "deepseek_v3":
            from mindloom_model._deepseek_config import deepseek_num_params

            return deepseek_num_params(self, include_embeddings)
        d, f, dh = self.hidden_size, self.ffn_hidden_size, self.head_dim
        attn = d * self.num_heads * dh * 2 + d * self.num_kv_heads * dh * 2  # wq, wo, wk, wv
        per_layer = attn + 3 * d * f + 2 * d  # + w1, w2, w3 + two norms
        n = self.num_layers * per_layer + d  # + final norm
        head = 0 if self.tie_embeddings else self.vocab_size * d
        n += head
        if include_embeddings:
            n += self.vocab_size * d
        return n

    def flops_per_token(self, seq_length: int | None = None) -> float:
        """Training FLOPs per token (forward + backward), the MFU numerator.

        6 * N_matmul + 12 * L * H * Dh * S, where N_matmul counts every weight used in a
        matmul (all non-embedding parameters plus the output head, also when it is tied)
        and the second term is the attention score and value products (2 matmuls of
        2*S*H*Dh FLOPs per token per layer forward, times 3 for forward+backward),
        counted over the full S x S square as in PaLM's MFU definition.
        """
        s = self.max_seq_len if seq_length is None else seq_length
        if self.family == "deepseek_v3":
            from mindloom_model._deepseek_config import deepseek_flops_per_token

            return deepseek_flops_per_token(self, s)
        n_matmul = self.num_params(include_embeddings=False)
        if self.tie_embeddings:
            n_matmul += self.vocab_size * self.hidden_size
        return 6.0 * n_matmul + 12.0 * self.num_layers * self.num_heads * self.head_dim * s


# what the two CPU-sized DeepSeek-V3 presets share (routing and MTP as the published
# model, scaled down): they differ only in sizes
_DEEPSEEK_CPU = dict(
    family="deepseek_v3",
    rms_norm_eps=1e-6,
    n_shared_experts=1,
    num_experts_per_tok=2,
    n_group=4,
    topk_group=2,
    routed_scaling_factor=2.5,
    first_k_dense_replace=1,
    num_nextn_predict_layers=1,
)

_PRESETS = {
    # runs in seconds on CPU; GQA on so the tests exercise it
    "debug": dict(
        vocab_size=256,
        hidden_size=64,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        ffn_hidden_size=128,
        max_seq_len=32,
    ),
    # nanoGPT's CPU recipe (4 layers, 4 heads, 128 wide, block 64, char vocab 65)
    "shakespeare-char": dict(
        vocab_size=65,
        hidden_size=128,
        num_layers=4,
        num_heads=4,
        ffn_hidden_size=384,
        max_seq_len=64,
        tie_embeddings=True,
    ),
    # ~17M parameters with its untied head
    "17m": dict(
        vocab_size=8000,
        hidden_size=384,
        num_layers=6,
        num_heads=6,
        ffn_hidden_size=1024,
        max_seq_len=256,
    ),
    # the seed user's 1B table: bf16 compute, norms/softmax in fp32
    "llama-1b": dict(
        vocab_size=32000,
        hidden_size=1024,
        num_layers=24,
        num_heads=16,
        ffn_hidden_size=4096,
        max_seq_len=2048,
        compute_dtype="bfloat16",
    ),
    "llama2-7b": dict(
        vocab_size=32000,
        hidden_size=4096,
        num_layers=32,
        num_heads=32,
        ffn_hidden_size=11008,
        max_seq_len=4096,
        compute_dtype="bfloat16",
    ),
    # ---- the DeepSeek-V3 family (see _deepseek.py)
    # a few hundred thousand parameters: trains in seconds on the CPU
    "deepseek-v3-debug": dict(
        **_DEEPSEEK_CPU,
        vocab_size=256,
        hidden_size=64,
        num_layers=3,
        num_heads=4,
        ffn_hidden_size=128,
        max_seq_len=32,
        q_lora_rank=32,
        kv_lora_rank=32,
        qk_nope_head_dim=16,
        qk_rope_head_dim=8,
        v_head_dim=16,
        n_routed_experts=8,
        moe_intermediate_size=32,
    ),
    # ~25M parameters in all, ~6M active per token: the CPU demo size
    "deepseek-v3-small": dict(
        **_DEEPSEEK_CPU,
        vocab_size=8000,
        hidden_size=256,
        num_layers=6,
        num_heads=8,
        ffn_hidden_size=1024,
        max_seq_len=256,
        q_lora_rank=128,
        kv_lora_rank=64,
        qk_nope_head_dim=32,
        qk_rope_head_dim=16,
        v_head_dim=32,
        n_routed_experts=16,
        moe_intermediate_size=256,
    ),
    # the published DeepSeek-V3 (671B + the 14B MTP module): for accounting and memory
    # estimates; never instantiated here
    "deepseek-v3-671b": dict(
        family="deepseek_v3",
        vocab_size=129280,
        hidden_size=7168,
        num_layers=61,
        num_heads=128,
        ffn_hidden_size=18432,
        max_seq_len=163840,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        rope_scaling={
            "type": "yarn",
            "factor": 40.0,
            "original_max_position_embeddings": 4096,
            "beta_fast": 32,
            "beta_slow": 1,
            "mscale": 1.0,
            "mscale_all_dim": 1.0,
        },
        q_lora_rank=1536,
        kv_lora_rank=512,
        qk_nope_head_dim=128,
        qk_rope_head_dim=64,
        v_head_dim=128,
        n_routed_experts=256,
        n_shared_experts=1,
        num_experts_per_tok=8,
        moe_intermediate_size=2048,
        n_group=8,
        topk_group=4,
        routed_scaling_factor=2.5,
        first_k_dense_replace=3,
        num_nextn_predict_layers=1,
        compute_dtype="bfloat16",
    ),
}


def get_preset(name: str, **overrides) -> ModelConfig:
    if name not in _PRESETS:
        raise ValueError(f"unknown model preset {name!r}; known: {', '.join(_PRESETS)}")
    return ModelConfig.from_dict({**_PRESETS[name], **overrides})


def preset_names() -> list[str]:
    return list(_PRESETS)
