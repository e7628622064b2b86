"""What a run builds before its loop: the tokenizer and tokenized data, the model (from the
`model` section or a Hugging Face directory) with the checks that need its ModelConfig,
and the packed datasets."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mindloom_train._config import Config, ConfigError
from mindloom_train._errors import TrainError


@dataclass
class BuiltModel:
    model: Any  # Llama or DeepseekV3
    mcfg: Any  # its mindloom_model.ModelConfig
    loss_net: Any  # the model with its loss
    params: list  # the trainable parameters
    buffers: list  # state that is not trained but checkpointed (the MoE selection biases)


def _from_hf(cfg: Config, hf: str, vocab_size: int, log: Callable[[str], None]):
    from mindloom_model import load_hf

    from mindloom_train._modelcfg import _DTYPE

    over: dict[str, Any] = {"compute_dtype": _DTYPE[cfg.precision.compute_dtype]}
    if "dropout" in cfg.model:
        over["dropout"] = cfg.model["dropout"]
    try:
        model = load_hf(hf, **over)
    except (ValueError, OSError) as exc:
        raise TrainError(f"model.init_from_hf: {exc}") from None
    mcfg = model.config
    if vocab_size > mcfg.vocab_size:
        raise TrainError(
            f"model.init_from_hf: the tokenizer has {vocab_size} ids but the model "
            f"only {mcfg.vocab_size}"
        )
    if mcfg.max_seq_len < cfg.train_dataset.seq_length:
        raise TrainError(
            f"model.init_from_hf: max_seq_len {mcfg.max_seq_len} < train_dataset.seq_length "
            f"{cfg.train_dataset.seq_length}"
        )
    log(f"model: weights from Hugging Face directory {hf}")
    return model


def build_model(cfg: Config, runtime, vocab_size: int, log: Callable[[str], None]) -> BuiltModel:
    from mindloom_model import DeepseekV3, Llama, LlamaWithLoss

    from mindloom_train._modelcfg import build_model_config
    from mindloom_train._moe import MoELossNet, is_moe

    hf = cfg.model.get("init_from_hf")
    if hf:
        model = _from_hf(cfg, hf, vocab_size, log)
        mcfg = model.config
    else:
        mcfg = build_model_config(cfg, vocab_size)
        model = Llama(mcfg) if not is_moe(mcfg) else DeepseekV3(mcfg)
    moe = is_moe(mcfg)
    loss_net = LlamaWithLoss(model) if not moe else MoELossNet(model)
    params = list(model.trainable_params())
    buffers = [p for p in model.get_parameters() if not p.requires_grad]
    if moe and not buffers:
        raise ConfigError(
            f"config key model.first_k_dense_replace: {mcfg.first_k_dense_replace} of "
            f"{mcfg.num_layers} layers dense and no MTP MoE block leaves no router to train"
        )
    if moe and runtime.use_engine:
        from mindloom_train._modelcfg import _check_deepseek_layout

        _check_deepseek_layout(cfg)  # again: a Hugging Face model skips build_model_config
        if not getattr(runtime, "compiled_pp", False):  # (refused there too)
            raise ConfigError(
                "config parallelism: family deepseek_v3 trains under the compiled data, "
                "tensor, expert and pipeline parallel steps only"
            )
    if moe and getattr(runtime, "compiled_tp", False):
        # the family is known only now: DeepSeek-V3's tensor parallel is the compiled
        # expert-parallel step with its model split by deepseek_tp_plan (_ep_step)
        runtime.compiled_tp, runtime.compiled_ep = False, True
    if runtime.groups is not None:
        from mindloom_parallel import ParallelConfigError

        t = cfg.training
        try:
            runtime.pcfg.check(mcfg, runtime.world, t.global_batch_size,
                               t.micro_batch_size, cfg.train_dataset.seq_length)  # fmt: skip
        except ParallelConfigError as exc:
            raise ConfigError(f"config parallelism: {exc}") from None
    return BuiltModel(model, mcfg, loss_net, params, buffers)


@dataclass
class PreparedData:
    """The tokenizer and the tokenized prefixes of a run, before any model exists."""

    tok: Any
    tok_path: Path
    train_prefixes: list
    eval_prefixes: list | None
    contract: dict


def prepare_data(cfg: Config, log: Callable[[str], None]) -> PreparedData:
    """The tokenizer and tokenized prefixes (trained / tokenized first if the config asks)."""
    from mindloom_train import _data

    tok = _data.prepare_tokenizer(cfg, log)
    tok_path = _data.tokenizer_dir(cfg) if not cfg.tokenizer.path else Path(cfg.tokenizer.path)
    train = _data.prepare_dataset(cfg, cfg.train_dataset, "train", tok_path, log)
    held = (
        _data.prepare_dataset(cfg, cfg.eval_dataset, "eval", tok_path, log)
        if cfg.eval_dataset is not None
        else None
    )
    contract = _data.data_contract(train, held, tok)
    same = "; the held-out data's match" if held else ""
    log(f"data: {_data.describe_contract(contract)}{same}")
    return PreparedData(tok, tok_path, train, held, contract)


def build_datasets(cfg: Config, data: PreparedData, dp_size: int):
    """The packed train dataset and the held-out one (None without eval_dataset)."""
    from mindloom_train import _data

    t = cfg.training
    train = _data.build_dataset(cfg, cfg.train_dataset, data.train_prefixes,
                                t.train_iters * t.global_batch_size, "train", data.tok)  # fmt: skip
    held = None
    if data.eval_prefixes is not None:
        n_eval = t.eval_iters * t.micro_batch_size * dp_size
        held = _data.build_dataset(cfg, cfg.eval_dataset, data.eval_prefixes, n_eval, "eval",
                                   data.tok)  # fmt: skip
    return train, held
