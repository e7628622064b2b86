"""Per-rank memory estimate of a training run, before anything is built.

Bytes for the most-loaded rank of the layout: parameters, gradients (and the fp32
accumulation buffers of a multi-micro-batch step), AdamW moments (ZeRO-1 partitions whole
parameters over the data-parallel ranks, see `mindloom_parallel.zero_owners`), activations per
layer and per pipeline stage under recompute none / selected / full, communication
buffers, the runtime's own memory (CPU: the RSS of an imported MindSpore with its context,
measured; see the README), and a fragmentation reserve.

The activation inventory follows Korthikanti et al. 2022 ("Reducing Activation
Recomputation in Large Transformer Models", Sec. 4): every tensor a layer keeps for its
backward, written out for the Llama block this package trains (RMSNorm normalised in
fp32, GQA keys/values expanded to every query head before the score matmul, SwiGLU, the
fp32 softmax, fp32 logits and loss) and for the DeepSeek-V3 block (MLA, MoE). The same
inventory machinery with Korthikanti's GPT block reproduces the paper's sbh(34 + 5as/h)
(packages/train/tests/test_train_memory.py checks it, and the weight+optimizer bytes of
Megatron-LM's theoretical memory report).

Pure Python: no MindSpore import, so `mindloom estimate-memory` answers in well under a
second and the trainer can refuse a run before it allocates anything.

The code is split by concern (issue 21: modules of ~400 lines at most); every name is
importable from here as before:
- `_memory_devices`: the device table, runtime constants, precision policy, device choice;
- `_memory_activations`: the saved-tensor inventories (GPT, Llama, DeepSeek-V3 blocks);
- `_memory_estimate`: `estimate`, `Estimate`, parameter sharding;
- `_memory_advice`: the suggestions when a run does not fit;
- `_memory_report`: `format_table`, `preflight`.
"""

from __future__ import annotations

from mindloom_train._memory_activations import (  # noqa: F401
    TensorSaved,
    cpu_graph_intermediates,
    deepseek_blocks,
    gpt_block,
    layer_activation_bytes,
    llama_block,
)
from mindloom_train._memory_advice import _combined, _suggestions, _variant, _with  # noqa: F401
from mindloom_train._memory_devices import (  # noqa: F401
    _BYTES,
    _SHORT,
    DEVICES,
    GiB,
    MiB,
    Policy,
    _cfg_error,
    _parse_mem,
    check_precision,
    host_memory_bytes,
    resolve_device,
)
from mindloom_train._memory_estimate import (  # noqa: F401
    Estimate,
    _model_config,
    _stage_param_sizes,
    _static_bytes,
    _tokenizer_vocab,
    _zero_max_share,
    estimate,
)
from mindloom_train._memory_report import _fmt, format_table, preflight  # noqa: F401

__all__ = [
    "DEVICES",
    "Estimate",
    "Policy",
    "TensorSaved",
    "check_precision",
    "estimate",
    "format_table",
    "gpt_block",
    "layer_activation_bytes",
    "preflight",
]


def measure_runtime_bytes() -> int:
    """RSS of this process after importing MindSpore and mindloom_train and setting the
    CPU context: the runtime baseline (run in a fresh process)."""
    import mindspore as ms

    import mindloom_train._trainer  # noqa: F401  (what a training process has imported)

    ms.set_context(mode=ms.GRAPH_MODE, device_target="CPU")
    from mindloom_train._metrics import mem_rss_mb

    return int(mem_rss_mb() * MiB)


if __name__ == "__main__":
    import sys

    if sys.argv[1:] == ["--measure-runtime"]:
        print(f"runtime RSS {measure_runtime_bytes() / MiB:.1f} MiB")
