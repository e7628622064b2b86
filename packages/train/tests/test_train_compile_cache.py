"""The run's compile cache (`context.compile_cache`): a warm run equals an uncached run of
the same config step for step, a changed graph constant misses and gives the uncached
value, and every key `GRAPH_FREE_KEYS` leaves out of the graph key is proven to change no
compiled graph.

One module fixture makes six short in-process runs of a one-layer model that compiles
every graph a Llama run of the compiled runner builds with two micro-batches (accum_step,
update_step, stats_step -- the fused last micro-batch and update of a log step, which also
carries MaxLogits for Llama --, eval_step; the fused train_step is a one-micro-batch run's,
and the separate logit_stats forward is DeepSeek-V3's only): uncached, cold, warm, rms_norm_eps changed, every graph-free key
changed (into a second store), and warm again without a held-out set."""

from __future__ import annotations

import copy
import json
import re
import shutil
from pathlib import Path

import pytest
from mindloom_train._config import from_dict
from mindloom_train._graph_cache import GRAPH_FREE_KEYS, GRAPH_FREE_SECTIONS
from train_testutil import TINY_MODEL, base_config, events, run_config, step_records

ROLES = {"accum_step", "update_step", "stats_step", "eval_step"}
# the values a step record carries that depend on timing or memory, not on the graphs
TIMING = re.compile(r"time|tokens_per_s|mfu|wait|rss|mem|comm|_s$|_s_ranks$")


def _config(prepared, run_dir: Path, store: Path | None, **model) -> dict:
    cfg = base_config(
        prepared, run_dir,
        model={**TINY_MODEL, **model},
        training={"train_iters": 3, "global_batch_size": 4, "micro_batch_size": 2,
                  "eval_iters": 1, "eval_interval": 0},
        monitor={"log_interval": 2, "numerics": True, "max_logits": True},
    )  # fmt: skip
    cfg["context"] = (
        {"compile_cache": "off"} if store is None else {"compile_cache_dir": str(store)}
    )
    return cfg


def _copy_prefix(prefix: str, dest: Path) -> str:
    src = Path(prefix)
    for f in src.parent.glob(src.name + ".*"):
        shutil.copy(f, dest / f.name)
    return str(dest / src.name)


def _alternates(prepared, tmp: Path) -> dict[str, object]:
    """A different value for every graph-free key: explicit for paths and choices,
    otherwise derived from the value's type (so a key added to GRAPH_FREE_KEYS is
    changed here without anyone remembering to)."""
    (tmp / "alt_data").mkdir()
    tok = tmp / "alt_tok"
    shutil.copytree(prepared["tokenizer"], tok)
    return {
        "run_dir": str(tmp / "alt_run"),
        "context.compile_cache": None,  # the switch itself: with "off" nothing is cached
        "context.compile_cache_dir": None,  # this run writes to a store of its own
        "tokenizer.path": str(tok),
        "train_dataset.data_prefix": [_copy_prefix(prepared["train"], tmp / "alt_data")],
        # GRAPH_FREE_SECTIONS: the held-out set's keys but its sequence length (an input
        # shape of the evaluation graph, in its key as such)
        "eval_dataset.data_prefix": [_copy_prefix(prepared["eval"], tmp / "alt_data")],
        "eval_dataset.pack_mode": "best_fit",
        "eval_dataset.mask_eos_loss": True,
        "training.time_limit_s": 3600.0,
        "lr_scheduler.type": "wsd",
        "lr_scheduler.decay_iters": 5,
        "checkpoint.save_path": str(tmp / "alt_ckpt"),
        "checkpoint.resume": "never",
        # a weights-only start from the uncached run's last checkpoint (run before this one)
        "checkpoint.init_from": str(tmp / "ref" / "checkpoints" / "step_00000003"),
    }


def _changed(value):
    if isinstance(value, bool):
        return not value
    if isinstance(value, int):
        return value + 1
    if isinstance(value, float):
        return value * 2 + 1
    raise AssertionError(f"no derived alternate for {value!r}: give one in _alternates")


def _apply(cfg: dict, explicit: dict) -> dict:
    cfg = copy.deepcopy(cfg)
    resolved = from_dict(cfg).to_dict()
    sections = [k for k in explicit if k.split(".")[0] in GRAPH_FREE_SECTIONS]
    for dotted in [*GRAPH_FREE_KEYS, *sections]:
        *parents, leaf = dotted.split(".")
        if dotted in explicit:
            value = explicit[dotted]
            if value is None:
                continue
        else:
            section = resolved
            for name in parents:
                section = section[name]
            value = _changed(section[leaf])
        target = cfg
        for name in parents:
            target = target.setdefault(name, {})
        target[leaf] = value
    return cfg


def _cache_line(run_dir: Path) -> str:
    lines = [x for x in (run_dir / "train.log").read_text().splitlines() if "compile cache:" in x]
    assert len(lines) == 1, lines
    return lines[0]


def _counts(run_dir: Path) -> tuple[int, int]:
    m = re.search(r"compile cache: (\d+) hits, (\d+) misses", _cache_line(run_dir))
    return int(m.group(1)), int(m.group(2))


def _graph_records(run_dir: Path) -> dict:
    """Every step record without its timing/memory fields, and the held-out loss."""
    recs = {s: {k: v for k, v in r.items() if not TIMING.search(k)}
            for s, r in step_records(run_dir).items()}  # fmt: skip
    return {"steps": recs, "eval": [e["loss"] for e in events(run_dir, "eval")]}


_NUMBER_IN_NAME = re.compile(r"\d+")


def _canonical_graphs(store: Path) -> dict[str, dict[str, str]]:
    """role -> {key: the compiled graph as text}. MindSpore's names carry process-wide
    counters and merge orders, its `compile_phase` a timestamp and its table of
    primitives comes in no fixed order: node names become their number of first
    appearance, other strings' numbers are masked, the table is sorted. Constants (raw
    tensor bytes, integer and float fields), op types and the nodes in their order are
    kept."""
    from google.protobuf import text_format
    from mindspore.train import mind_ir_pb2

    out: dict[str, dict[str, str]] = {}
    for entry in sorted(p for p in store.glob("*/*") if not p.name.startswith(".")):
        role = json.loads((entry / "manifest.json").read_text())["role"]
        proto = mind_ir_pb2.ModelProto()
        proto.ParseFromString((entry / "graph.mindir").read_bytes())
        blocks: list[list[str]] = []
        names: dict[str, str] = {}  # a node name -> its number by first appearance
        for line in text_format.MessageToString(proto).splitlines():
            if "compile_phase" in line:
                continue
            if not line.startswith(" ") and not line.startswith("}"):
                blocks.append([])
            field, _, value = line.strip().partition(": ")
            in_table = blocks and blocks[-1] and blocks[-1][0].startswith("primitives")
            if field in ("input", "output", "name") and value.startswith('"') and not in_table:
                line = f"{line[: len(line) - len(line.lstrip())]}{field}: n{names.setdefault(value, str(len(names)))}"
            elif field != "raw_data" and '"' in line:
                line = _NUMBER_IN_NAME.sub("#", line)
            blocks[-1].append(line)
        prims = sorted("\n".join(b) for b in blocks if b[0].startswith("primitives"))
        rest = ["\n".join(b) for b in blocks if not b[0].startswith("primitives")]
        out.setdefault(role, {})[entry.name] = "\n".join(rest + prims)
    return out


@pytest.fixture(scope="module")
def runs(prepared, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("ccache")
    store, alt_store = tmp / "store", tmp / "alt_store"
    ref = _config(prepared, tmp / "ref", None)
    ref["checkpoint"]["verify_integrity"] = True  # its checkpoint is the alt run's init_from
    cfgs = {
        "ref": ref,
        "cold": _config(prepared, tmp / "cold", store),
        "warm": _config(prepared, tmp / "warm", store),
        "alt": _apply(_config(prepared, tmp / "alt", alt_store), _alternates(prepared, tmp)),
        "eps": _config(prepared, tmp / "eps", store, rms_norm_eps=1e-2),
        "noeval": _config(prepared, tmp / "noeval", store),
    }
    del cfgs["noeval"]["eval_dataset"]  # after warm: its training graphs are in the store
    for name, cfg in cfgs.items():
        assert run_config(cfg) == 0, name
    return {name: Path(cfg["run_dir"]) for name, cfg in cfgs.items()}, store, alt_store


def test_warm_run_equals_the_uncached_run(runs):
    dirs, store, _ = runs
    assert _counts(dirs["cold"]) == (0, len(ROLES))
    assert _counts(dirs["warm"]) == (len(ROLES), 0)
    assert "compile cache" not in (dirs["ref"] / "train.log").read_text()
    ref = _graph_records(dirs["ref"])
    assert ref["eval"] and set(ref["steps"]) == {2, 3}  # log_interval 2, and the last step
    assert "max_logit" in json.dumps(ref["steps"][2])  # the statistics graphs ran
    assert _graph_records(dirs["cold"]) == ref
    assert _graph_records(dirs["warm"]) == ref
    assert set(_canonical_graphs(store)) == ROLES


def test_a_run_without_a_held_out_set_loads_the_training_graphs(runs):
    """GRAPH_FREE_SECTIONS: the same run without `eval_dataset` finds every training graph
    the runs with one published (and builds no evaluation graph); its steps are theirs."""
    dirs, _, _ = runs
    assert _counts(dirs["noeval"]) == (len(ROLES) - 1, 0)
    assert _graph_records(dirs["noeval"])["steps"] == _graph_records(dirs["ref"])["steps"]


def test_changed_graph_constant_misses_and_gives_the_uncached_value(runs):
    """With the default run's graphs in the store, MindSpore's own cache gave the default
    run's losses here. Every graph misses, i.e. is compiled from source in that run (no
    entry is read: the cold run shows such a run equals an uncached one); the constant
    moves the losses, so a stale graph would have shown."""
    dirs, _, _ = runs
    assert _counts(dirs["eps"]) == (0, len(ROLES))
    eps, ref = _graph_records(dirs["eps"]), _graph_records(dirs["ref"])
    assert eps["steps"][3]["loss"] != ref["steps"][3]["loss"]


def test_graph_free_keys_change_no_graph(runs):
    """Each key of GRAPH_FREE_KEYS changed at once: the same keys, and the same compiled
    graphs (MindSpore's own output, compared as text) as the default config's."""
    dirs, store, alt_store = runs
    assert _counts(dirs["alt"]) == (0, len(ROLES))
    default, changed = _canonical_graphs(store), _canonical_graphs(alt_store)
    for role in ROLES:
        # the store also holds the rms_norm_eps run's graphs: compare with the default's
        (key,) = set(changed[role])
        assert key in default[role], f"{role}: the graph-free keys moved the key"
        assert changed[role][key] == default[role][key], (
            f"{role}: a graph-free key changed the graph"
        )
