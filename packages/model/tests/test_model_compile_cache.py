"""mindloom_model.CompileCache on tiny graphs: each graph loads its own entry whatever the
compile order, a bad entry is refused and compiled afresh, concurrent publishers leave one
valid entry. Values are checked against NumPy; the store is a fresh directory per test."""

from __future__ import annotations

import json
import sys
import threading
from pathlib import Path

import mindspore as ms
import numpy as np
import pytest
from mindloom_model import CompileCache
from mindspore import Tensor, nn, ops

ms.set_context(device_target="CPU")
# graph mode for every test here, whatever mode an earlier test in this process left
# (in PyNative nothing compiles, so nothing would be cached)
pytestmark = pytest.mark.usefixtures("graph_mode")

X = np.array([0.5, 1.0, 2.0], np.float32)


class Affine(nn.Cell):  # a constant baked into the graph
    def __init__(self, k: float):
        super().__init__()
        self.k = k

    def construct(self, x):
        return x * self.k + 1


class ExpScale(nn.Cell):
    def __init__(self, k: float):
        super().__init__()
        self.k = k

    def construct(self, x):
        return ops.exp(x) * self.k


REFERENCE = {"affine": lambda x: x * 2.0 + 1, "exp": lambda x: np.exp(x) * 3.0}
MAKE = {"affine": lambda: Affine(2.0), "exp": lambda: ExpScale(3.0)}


def _cache(store: Path, lines: list[str] | None = None) -> CompileCache:
    return CompileCache(
        store, {"test": "compile-cache"}, log=(lines if lines is not None else []).append
    )


def _run_all(cache: CompileCache, order: list[str]) -> dict[str, np.ndarray]:
    out = {}
    for role in order:
        out[role] = cache.run(role, MAKE[role](), Tensor(X)).asnumpy()
    return out


def _entries(store: Path) -> list[Path]:
    return sorted(p for p in store.glob("*/*") if not p.name.startswith("."))


def test_each_graph_loads_its_own_entry_in_either_compile_order(tmp_path):
    first = _cache(tmp_path)
    got = _run_all(first, ["affine", "exp"])
    assert (first.hits, first.misses) == (0, 2)
    # MindSpore names its files by a per-process counter: the reversed order would load
    # each other's graphs from one shared directory
    again = _cache(tmp_path)
    got_rev = _run_all(again, ["exp", "affine"])
    assert (again.hits, again.misses) == (2, 0)
    for role, ref in REFERENCE.items():
        np.testing.assert_allclose(got[role], ref(X), rtol=1e-6)
        np.testing.assert_allclose(got_rev[role], ref(X), rtol=1e-6)
    # a new input shape is a graph of its own
    wide = np.arange(5, dtype=np.float32)
    np.testing.assert_allclose(again.run("affine", Affine(2.0), Tensor(wide)).asnumpy(),
                               REFERENCE["affine"](wide), rtol=1e-6)  # fmt: skip
    assert (again.hits, again.misses) == (2, 1)
    assert len(_entries(tmp_path)) == 3


def test_a_changed_constant_misses(tmp_path):
    """MindSpore's own cache gives the old graph here (the constant is baked in)."""
    cache = _cache(tmp_path)
    cache.run("affine", Affine(2.0), Tensor(X)).asnumpy()
    changed = _cache(tmp_path)  # the same context: only the cell's attribute differs
    out = changed.run("affine", Affine(5.0), Tensor(X)).asnumpy()
    np.testing.assert_allclose(out, X * 5.0 + 1, rtol=1e-6)
    assert (changed.hits, changed.misses) == (0, 1)


@pytest.mark.parametrize("damage", ["another graph", "truncated", "no manifest"])
def test_a_bad_entry_is_refused_in_one_line_and_compiled_afresh(tmp_path, damage):
    _run_all(_cache(tmp_path), ["affine", "exp"])
    by_role = {json.loads((e / "manifest.json").read_text())["role"]: e for e in _entries(tmp_path)}
    bad = by_role["affine"]
    if damage == "another graph":  # a valid graph, the wrong one: only the manifest knows
        (bad / "graph.mindir").write_bytes((by_role["exp"] / "graph.mindir").read_bytes())
    elif damage == "truncated":
        data = (bad / "graph.mindir").read_bytes()
        (bad / "graph.mindir").write_bytes(data[: len(data) // 2])
    else:
        (bad / "manifest.json").unlink()
    lines: list[str] = []
    cache = _cache(tmp_path, lines)
    got = _run_all(cache, ["affine", "exp"])
    np.testing.assert_allclose(got["affine"], REFERENCE["affine"](X), rtol=1e-6)
    np.testing.assert_allclose(got["exp"], REFERENCE["exp"](X), rtol=1e-6)
    assert (cache.hits, cache.misses, cache.refused) == (1, 1, 1)
    assert len(lines) == 1 and str(bad) in lines[0] and "refused" in lines[0], lines
    # compiled afresh and published again, valid
    again = _cache(tmp_path)
    _run_all(again, ["affine"])
    assert (again.hits, again.refused) == (1, 0)


def test_concurrent_publishers_leave_one_valid_entry(tmp_path):
    """Eight publishers of one key at once, each with different bytes: the first rename
    wins, the others drop theirs, nothing half-written or temporary is left."""
    cache = _cache(tmp_path)
    entry = tmp_path / "ab" / ("ab" + "0" * 62)
    slots = []
    for i in range(8):
        slot = tmp_path / f"slot{i}.mindir"
        slot.write_bytes(bytes([i]) * (1 << 20))
        slots.append(slot)
    barrier = threading.Barrier(len(slots))

    def publish(slot: Path) -> None:
        barrier.wait()
        cache._publish(entry, slot, "role")

    threads = [threading.Thread(target=publish, args=(s,)) for s in slots]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(p.name for p in entry.parent.iterdir()) == [entry.name]
    manifest = json.loads((entry / "manifest.json").read_text())
    data = (entry / "graph.mindir").read_bytes()
    assert len(set(data)) == 1 and len(data) == 1 << 20  # one publisher's bytes, whole
    import hashlib

    assert manifest["files"]["graph.mindir"] == hashlib.sha256(data).hexdigest()
    # a later publisher never replaces a published entry
    first = data[0]
    cache._publish(entry, slots[(first + 1) % 8], "role")
    assert (entry / "graph.mindir").read_bytes()[0] == first


def test_generate_loads_its_decoder_graphs_for_another_model_of_the_same_config(tmp_path):
    """`generate(..., compile_cache=)`: the prompt and one-token decoder graphs are published
    once and loaded for another model of the same config (other weights: the loaded graphs
    must read that model's parameters), and a config change that only shows up as a value
    baked into the graph (rope_theta -> the RoPE table) is a miss, not a stale hit."""
    import dataclasses

    from mindloom_model import Llama, generate, get_preset

    def cache(cfg):
        return CompileCache(tmp_path, {"model": dataclasses.asdict(cfg)}, log=[].append)

    cfg = get_preset("debug", num_layers=1, max_seq_len=16, init_std=0.2, embed_init_std=1.0)
    prompt = np.random.default_rng(3).integers(0, cfg.vocab_size, (2, 4))
    first = cache(cfg)
    stderr = sys.stderr  # pytest's capture: a cached compile must leave it in place
    generate(Llama(cfg, seed=1), prompt, 5, temperature=0, compile_cache=first)
    assert (first.hits, first.misses) == (0, 2)
    assert sys.stderr is stderr, "MindSpore's cached compile replaced sys.stderr"

    other = Llama(cfg, seed=2)
    again = cache(cfg)
    got = generate(other, prompt, 5, temperature=0, compile_cache=again)
    assert (again.hits, again.misses) == (2, 0)
    # the independent path: the uncached full forward's argmax, token by token
    np.testing.assert_array_equal(got, generate(other, prompt, 5, temperature=0, use_cache=False))

    theta = dataclasses.replace(cfg, rope_theta=500.0)
    changed = cache(theta)
    generate(Llama(theta, seed=2), prompt, 5, temperature=0, compile_cache=changed)
    assert (changed.hits, changed.misses) == (0, 2)


def test_private_dirs_of_dead_processes_are_swept(tmp_path):
    """A SIGKILLed worker never runs its atexit: its private MindSpore cache directory is
    removed by the next process that starts one (pid in the name; a live pid's is kept).
    Plant: the liveness check removed -> the live process' directory goes too."""
    import subprocess

    from mindloom_model._compile_cache_ms import sweep_dead_dirs

    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        made = {
            "dead": tmp_path / f"mindloom-compile-{dead.pid}-abc",
            "live": tmp_path / f"mindloom-compile-{live.pid}-def",
            "old": tmp_path / "mindloom-compile-xyz",  # before pids were in the name: kept
        }
        for d in made.values():
            (d / "rank_0" / "graph_cache").mkdir(parents=True)
        assert sweep_dead_dirs(str(tmp_path)) == [made["dead"]]
        assert not made["dead"].exists() and made["live"].is_dir() and made["old"].is_dir()
    finally:
        live.kill()
        live.wait()
