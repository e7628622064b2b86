"""mindloom-train (and the benchmarks) use mindloom_parallel through its public names only:
no `mindloom_parallel._module` import, and every imported name is in its `__all__`."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]


def _imports_from_parallel():
    files = sorted((ROOT / "packages" / "train" / "src").rglob("*.py"))
    files += sorted((ROOT / "benchmarks").glob("*.py"))
    for path in files:
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith(
                "mindloom_parallel"
            ):
                yield path, node
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.name.startswith("mindloom_parallel."):
                        yield path, ast.ImportFrom(alias.name, [], 0, lineno=node.lineno)


def test_train_imports_only_public_parallel_names():
    import mindloom_parallel

    public = set(mindloom_parallel.__all__)
    bad = []
    for path, node in _imports_from_parallel():
        where = f"{path.relative_to(ROOT)}:{node.lineno}"
        if node.module != "mindloom_parallel":
            bad.append(f"{where}: imports {node.module}")
        bad += [f"{where}: {a.name} not in __all__" for a in node.names if a.name not in public]
    assert not bad, bad
