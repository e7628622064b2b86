"""Train's config modules: imports in one direction, no MindSpore on the validation path,
the dead key refused."""

from __future__ import annotations

import ast
import subprocess
import sys
import textwrap
from pathlib import Path
from types import SimpleNamespace

import pytest
from mindloom_train._config import ConfigError, from_dict

SRC = Path(__file__).resolve().parents[1] / "src" / "mindloom_train"


def _import_graph() -> dict[str, set[str]]:
    """module -> the mindloom_train modules it imports, at any depth of the file (lazy
    imports inside functions count: they are cycles waiting for the first call)."""
    graph: dict[str, set[str]] = {}
    for path in SRC.glob("*.py"):
        mod = path.stem
        deps: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module:
                if node.module.startswith("mindloom_train."):
                    deps.add(node.module.split(".")[1])
                elif node.module == "mindloom_train":
                    deps.update(a.name for a in node.names if (SRC / f"{a.name}.py").exists())
        graph[mod] = deps - {mod}
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    found, state = [], {}

    def visit(node: str, stack: list[str]) -> None:
        state[node] = "open"
        for dep in sorted(graph.get(node, ())):
            if state.get(dep) == "open":
                found.append(stack[stack.index(dep) :] + [dep])
            elif dep not in state:
                visit(dep, [*stack, dep])
        state[node] = "done"

    for node in sorted(graph):
        if node not in state:
            visit(node, [node])
    return found


def test_train_modules_import_each_other_without_cycles():
    # __init__ re-exports lazily by name (PEP 562) and is imported by nobody inside
    graph = {m: d for m, d in _import_graph().items() if m != "__init__"}
    assert _cycles(graph) == []


def test_config_layers_import_in_one_direction():
    graph = _import_graph()
    # _health (the monitor.health settings and rules) is a leaf: stdlib only
    assert not graph.get("_health")
    assert graph["_schema"] <= {"_errors", "_health"}
    assert graph["_parse"] <= {"_errors"}
    assert graph["_modelcfg"] <= {"_errors", "_parse", "_schema"}
    assert graph["_checks"] <= {"_errors", "_parse", "_schema", "_modelcfg", "_health"}


def test_the_dead_shuffle_key_is_refused_naming_it():
    for section in ("train_dataset", "eval_dataset"):
        data = {"train_dataset": {"data_prefix": ["x"]}}
        data[section] = {"data_prefix": ["x"], "shuffle": False}
        with pytest.raises(ConfigError) as exc:
            from_dict(data, check_model=False)
        assert str(exc.value).startswith(
            f"config key {section}.shuffle: removed: it was never read"
        )
        assert "\n" not in str(exc.value)


def test_resume_does_not_count_the_retired_shuffle_setting_as_drift():
    from mindloom_train._checkpointing import CheckpointManager
    from mindloom_train._schema import drift_hash

    cfg = from_dict({"train_dataset": {"data_prefix": ["x"]}}, check_model=False)
    logged: list[str] = []
    manager = SimpleNamespace(cfg=cfg, log=logged.append)
    before = {**cfg.drift_settings(), "train_dataset.shuffle": True}  # an older checkpoint
    common = {"drift": {"hash": drift_hash(before), "settings": before}}
    CheckpointManager._check_drift(manager, common, "ckpt")  # no ConfigError
    assert logged == []
    changed = {**before, "seed": 99}
    with pytest.raises(ConfigError, match=r"resume would change seed \(seed: 99 ->"):
        CheckpointManager._check_drift(
            manager, {"drift": {"hash": drift_hash(changed), "settings": changed}}, "ckpt"
        )


def test_validating_a_config_does_not_import_mindspore():
    code = textwrap.dedent("""
        import sys
        from mindloom_train import from_dict
        from_dict({"model": {"preset": "debug", "vocab_size": None, "dropout": 0.1},
                   "train_dataset": {"data_prefix": ["x"]}})
        assert "mindspore" not in sys.modules, sorted(m for m in sys.modules if "mindspore" in m)[:5]
    """)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]


def test_train_itself_imports_no_mindspore_while_validating():
    # what train's own modules import on the from_dict path, with mindloom_model's import
    # of MindSpore taken out of the picture (the part engineer "forward" makes lazy)
    code = textwrap.dedent("""
        import sys
        sys.modules["mindspore"] = None  # any import of it fails
        from mindloom_train import from_dict
        from_dict({"train_dataset": {"data_prefix": ["x"]}}, check_model=False)
    """)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]


def test_every_public_name_resolves_and_nothing_private_is_exported():
    import mindloom_train

    for name in mindloom_train.__all__:
        assert getattr(mindloom_train, name) is not None, name
    assert not [n for n in mindloom_train.__all__ if n.startswith("_") and n != "__version__"]
