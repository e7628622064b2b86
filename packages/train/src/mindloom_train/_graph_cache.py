"""The run's compile cache (mindloom_model.CompileCache): what of the config goes into
every graph's key, and the one place a run's cache is made.

A graph's key holds the whole resolved config in canonical JSON minus `GRAPH_FREE_KEYS`
only: keys that reach no compiled graph (paths, intervals, the learning-rate schedule and
the step count, which the step reads from its `hyper` input). Each was proven so by
`test_train_compile_cache.py::test_graph_free_keys_change_no_graph`, which changes every
one of them and compares the graphs MindSpore compiles; a key added here without such a
change fails that test. Anything a config file can name that is not listed stays in the
key, and the model config as resolved (a preset, `init_from_hf`'s config.json, the
tokenizer's vocabulary) goes in as well.

`eval_dataset` is left out whole, present or not: the held-out set reaches the evaluation
graph only as the shape of its batches, which every key holds as an input shape, and no
training graph at all. A run without a held-out set (tests leave it out to compile no
evaluation graph) thus loads the training graphs of the same run with one, measured on
issue 21's train suite: 108 distinct graphs, 97 without this section in the key."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from mindloom_train._config import Config

__all__ = ["GRAPH_FREE_KEYS", "GRAPH_FREE_SECTIONS", "graph_context", "make_compile_cache"]

GRAPH_FREE_KEYS = (
    "run_dir",
    "context.compile_cache",
    "context.compile_cache_dir",
    "tokenizer.path",  # the vocabulary reaches the graphs as parameter shapes (in the key)
    "train_dataset.data_prefix",
    "training.train_iters",
    "training.eval_interval",
    "training.eval_iters",
    "training.time_limit_s",
    "lr_scheduler.type",  # the learning rate is an input of the step (hyper)
    "lr_scheduler.lr",
    "lr_scheduler.min_lr",
    "lr_scheduler.warmup_iters",
    "lr_scheduler.decay_iters",
    "monitor.log_interval",
    "monitor.progress_bar",
    "parallelism.comm_timeout_s",
    "parallelism.first_step_timeout_s",
    "checkpoint.save_path",
    "checkpoint.save_interval",
    "checkpoint.keep_last",
    "checkpoint.save_at_end",
    "checkpoint.resume",
    "checkpoint.verify_integrity",
    "checkpoint.async_save",
    "checkpoint.init_from",  # weights-only start: values, not graphs
    "checkpoint.override_schedule",
    "checkpoint.override_drift",
)


# left out whole, present or not (the module's docstring)
GRAPH_FREE_SECTIONS = ("eval_dataset",)


def graph_context(cfg: Config, mcfg, rank: int, world: int, dp_size: int) -> dict[str, Any]:
    """What a graph depends on beyond its code, parameters and inputs."""
    d = cfg.to_dict()
    for name in GRAPH_FREE_SECTIONS:
        d.pop(name, None)
    for dotted in GRAPH_FREE_KEYS:
        *parents, leaf = dotted.split(".")
        section = d
        for name in parents:
            section = section.get(name) if isinstance(section, dict) else None
        if isinstance(section, dict):
            section.pop(leaf, None)
    model = dataclasses.asdict(mcfg) if dataclasses.is_dataclass(mcfg) else repr(mcfg)
    return {"config": d, "model": model, "rank": rank, "world": world, "dp": dp_size}


def make_compile_cache(cfg: Config, runtime, mcfg, log: Callable[[str], None]):
    from mindloom_model import CompileCache, compile_cache_dir

    c = cfg.context
    on = c.compile_cache == "auto" and c.mode == "graph"
    ctx = graph_context(cfg, mcfg, runtime.rank, runtime.world, runtime.dp_size)
    return CompileCache(compile_cache_dir(c.compile_cache_dir), ctx, rank=runtime.rank,
                        log=log, enabled=on)  # fmt: skip
