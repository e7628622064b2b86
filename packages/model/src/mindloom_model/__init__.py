"""mindloom_model: a Llama-family decoder in MindSpore. See the package README."""

from mindloom_model.__about__ import __version__
from mindloom_model._deepseek import (
    DeepseekV3,
    DeepseekV3WithLoss,
    moe_route_reference,
    moe_routers,
    update_expert_bias,
    yarn_inv_freq,
)
from mindloom_model._dropout import CounterDropout, dropout_key, dropout_site
from mindloom_model._generate import generate
from mindloom_model._hf import HFFormatError, load_hf, save_hf
from mindloom_model._llama import (
    Llama,
    LlamaWithLoss,
    ModelConfig,
    attention_bias,
    causal_lm_loss,
    get_preset,
    preset_names,
    rope_cos_sin,
)

__all__ = [
    "CounterDropout",
    "DeepseekV3",
    "DeepseekV3WithLoss",
    "HFFormatError",
    "Llama",
    "LlamaWithLoss",
    "ModelConfig",
    "__version__",
    "attention_bias",
    "causal_lm_loss",
    "dropout_key",
    "dropout_site",
    "generate",
    "get_preset",
    "load_hf",
    "moe_route_reference",
    "moe_routers",
    "preset_names",
    "rope_cos_sin",
    "save_hf",
    "update_expert_bias",
    "yarn_inv_freq",
]
