"""mindloom_model: a Llama-family decoder in MindSpore. See the package README.

`ModelConfig`, the presets, the tensor-parallel plan and the safetensors codec are plain Python: importing them
does not import MindSpore. Every other name imports its module (and MindSpore) on first
use, through the module `__getattr__` below.
"""

from mindloom_model.__about__ import __version__
from mindloom_model._config import ModelConfig, get_preset, preset_names
from mindloom_model._kernel_build import buildable as cpu_kernels_buildable
from mindloom_model._safetensors import (
    SafetensorsError,
    encode_safetensors,
    read_safetensors,
    read_safetensors_header,
    write_safetensors,
)
from mindloom_model._tp_plan import TP_STYLES, deepseek_tp_plan, llama_tp_plan

__all__ = [
    "CompileCache",
    "CounterDropout",
    "DeepseekV3",
    "DeepseekV3WithLoss",
    "HFFormatError",
    "Llama",
    "LlamaWithLoss",
    "ModelConfig",
    "MoE",
    "SafetensorsError",
    "TP_STYLES",
    "__version__",
    "attention_bias",
    "causal_lm_loss",
    "llama_loss",
    "compile_cache_dir",
    "cpu_kernels_buildable",
    "dropout_key",
    "dropout_site",
    "encode_safetensors",
    "generate",
    "get_preset",
    "llama_tp_plan",
    "deepseek_tp_plan",
    "deepseek_hf_config",
    "load_hf",
    "mindloom_source_digest",
    "moe_route_reference",
    "moe_routers",
    "preset_names",
    "read_safetensors",
    "read_safetensors_header",
    "rope_cos_sin",
    "save_hf",
    "square_sums_kernel",
    "adamw_kernel",
    "update_expert_bias",
    "write_safetensors",
    "yarn_inv_freq",
]

# name -> the private module that defines it; each of these modules imports MindSpore
_LAZY = {
    "CompileCache": "_compile_cache",
    "compile_cache_dir": "_compile_cache",
    "mindloom_source_digest": "_compile_cache",
    "DeepseekV3": "_deepseek",
    "DeepseekV3WithLoss": "_deepseek",
    "MoE": "_deepseek",
    "moe_route_reference": "_deepseek",
    "moe_routers": "_deepseek",
    "update_expert_bias": "_deepseek",
    "yarn_inv_freq": "_deepseek",
    "CounterDropout": "_dropout",
    "dropout_key": "_dropout",
    "dropout_site": "_dropout",
    "generate": "_generate",
    "HFFormatError": "_hf_files",
    "deepseek_hf_config": "_hf_deepseek",
    "load_hf": "_hf",
    "save_hf": "_hf",
    "Llama": "_llama",
    "square_sums_kernel": "_kernels",
    "adamw_kernel": "_kernels",
    "LlamaWithLoss": "_llama",
    "attention_bias": "_llama",
    "causal_lm_loss": "_llama",
    "llama_loss": "_llama",
    "rope_cos_sin": "_llama",
}


def __getattr__(name):
    if name in _LAZY:
        import importlib

        value = getattr(importlib.import_module(f"mindloom_model.{_LAZY[name]}"), name)
        globals()[name] = value  # later look-ups skip this function
        return value
    raise AttributeError(f"module 'mindloom_model' has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(__all__))
