"""No code reaches into another package's private modules: packages, their tests, the
benchmarks and these tests use each package's public names (its `__all__`), so a private
module can be renamed or split without breaking a neighbour. The white-box benchmarks that
time a package's inner parts are listed below with their reason."""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
OWN = {  # the package folder whose source and tests may use its own private modules
    "data": "mindloom_data",
    "tokenizer": "mindloom_tokenizer",
    "model": "mindloom_model",
    "parallel": "mindloom_parallel",
    "train": "mindloom_train",
    "monitor-tui": "mindloom_monitor",
}
WHITE_BOX = {
    # times each health monitor's cells against the plain step: builds the runner by hand
    "benchmarks/health_overhead.py": "mindloom_train",
    # times the distributed checkpoint writer and reader against the rank-0 path
    "benchmarks/checkpoint_io.py": "mindloom_train",
    # --rope-ab rebuilds the attention path before RoPE moved into the kernel (RoPE as ops
    # in front of KernelAttention) to time the fused kernel against it
    "benchmarks/step_profile.py": "mindloom_model",
}


def _files() -> list[Path]:
    out = sorted((ROOT / "benchmarks").glob("*.py")) + sorted((ROOT / "tests").glob("*.py"))
    for pkg in OWN:
        out += sorted((ROOT / "packages" / pkg).glob("src/**/*.py"))
        out += sorted((ROOT / "packages" / pkg).glob("tests/**/*.py"))
    return out


def _private_uses(tree: ast.AST) -> list[tuple[int, str, str]]:
    """(line, package, private module) for every import of a mindloom package's private
    module: `import a._b`, `from a._b import x` and `from a import _b`."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            mods = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            mods = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        else:
            continue
        seen = []
        for mod in mods:
            parts = mod.split(".")
            if parts[0].startswith("mindloom_") and len(parts) > 1 and parts[1].startswith("_"):
                private = ".".join(parts[:2])
                if parts[1] not in ("__about__", "__version__") and private not in seen:
                    seen.append(private)
                    found.append((node.lineno, parts[0], private))
    return found


def test_nothing_imports_another_package_private_module():
    bad = []
    for path in _files():
        rel = path.relative_to(ROOT).as_posix()
        own = next((m for d, m in OWN.items() if rel.startswith(f"packages/{d}/")), None)
        allowed = {own, WHITE_BOX.get(rel)}
        for line, pkg, mod in _private_uses(ast.parse(path.read_text(), rel)):
            if pkg not in allowed:
                bad.append(f"{rel}:{line}: {mod}")
    assert not bad, "private modules of another package:\n" + "\n".join(bad)


def test_the_scan_sees_each_form_of_a_private_import():
    src = "import mindloom_data._pack\nfrom mindloom_train._step import TrainStep\n" \
          "from mindloom_train import _checkpoint as ck\nfrom mindloom_model import Llama\n"  # fmt: skip
    assert [m for _, _, m in _private_uses(ast.parse(src))] == [
        "mindloom_data._pack", "mindloom_train._step", "mindloom_train._checkpoint",
    ]  # fmt: skip


@pytest.mark.parametrize("module", sorted(OWN.values()))
def test_every_public_name_resolves(module):
    """Each name in `__all__` is importable (the lazy ones load their module)."""
    mod = importlib.import_module(module)
    missing = [n for n in mod.__all__ if not hasattr(mod, n)]
    assert not missing, f"{module}.__all__ names what it does not have: {missing}"


@pytest.mark.parametrize("package", ["train", "parallel"])
def test_the_architecture_page_names_every_module(package):
    """docs/architecture.md has one line per module of train and parallel (issue 21): a
    module added without its line fails here."""
    page = (ROOT / "docs" / "architecture.md").read_text()
    src = ROOT / "packages" / package / "src" / OWN[package]
    missing = [p.name for p in sorted(src.glob("_*.py"))
               if p.name != "__about__.py" and f"`{p.name}`" not in page]  # fmt: skip
    assert not missing, f"docs/architecture.md does not name {package}'s {missing}"
