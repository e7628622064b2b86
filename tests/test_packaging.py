"""The monorepo's packaging promises: six independent wheels, and the light packages
(data, tokenizer, monitor) never pulling in MindSpore."""

from __future__ import annotations

import re
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = {
    "data": ("mindloom_data", "mindloom-data"),
    "tokenizer": ("mindloom_tokenizer", "mindloom-tokenizer"),
    "model": ("mindloom_model", "mindloom-model"),
    "parallel": ("mindloom_parallel", "mindloom-parallel"),
    "train": ("mindloom_train", "mindloom-train"),
    "monitor-tui": ("mindloom_monitor", "mindloom-monitor"),
}


def _about_version(pkg_dir: str, module: str) -> str:
    text = (ROOT / "packages" / pkg_dir / "src" / module / "__about__.py").read_text()
    match = re.search(r'__version__\s*=\s*"([^"]+)"', text)
    assert match, f"no __version__ in {pkg_dir}"
    return match.group(1)


def _uv() -> list[str]:
    return [sys.executable, "-m", "uv"]


@pytest.mark.parametrize("module", ["mindloom_data", "mindloom_tokenizer", "mindloom_monitor"])
def test_light_packages_never_import_mindspore(module: str) -> None:
    # MindSpore is installed in this environment, so a stray import would be caught.
    import importlib.util

    assert importlib.util.find_spec("mindspore") is not None
    code = (
        f"import sys, {module}, pkgutil, importlib\n"
        f"for m in pkgutil.walk_packages({module}.__path__, '{module}.'):\n"
        "    if not m.name.endswith('__main__'):  # importing it would run the CLI\n"
        "        importlib.import_module(m.name)\n"
        "assert 'mindspore' not in sys.modules, sorted(k for k in sys.modules if 'mindspore' in k)[:3]\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


@pytest.fixture(scope="module")
def wheels(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    out = tmp_path_factory.mktemp("wheels")
    built = {}
    for pkg_dir, (module, dist) in PACKAGES.items():
        subprocess.run(
            [
                *_uv(),
                "build",
                "--wheel",
                "--quiet",
                "-o",
                str(out),
                str(ROOT / "packages" / pkg_dir),
            ],
            check=True,
            timeout=300,
        )
        version = _about_version(pkg_dir, module)
        path = out / f"{dist.replace('-', '_')}-{version}-py3-none-any.whl"
        assert path.exists(), sorted(p.name for p in out.iterdir())
        built[pkg_dir] = path
    return built


def test_six_wheels_with_their_own_versions(wheels: dict[str, Path]) -> None:
    assert len(wheels) == 6
    for pkg_dir, wheel in wheels.items():
        module, dist = PACKAGES[pkg_dir]
        with zipfile.ZipFile(wheel) as zf:
            names = zf.namelist()
            assert f"{module}/__about__.py" in names
            assert f"{module}/py.typed" in names
            meta = next(n for n in names if n.endswith(".dist-info/METADATA"))
            metadata = zf.read(meta).decode()
        assert f"Name: {dist}" in metadata
        assert f"Version: {_about_version(pkg_dir, module)}" in metadata


def test_dependencies_point_one_way(wheels: dict[str, Path]) -> None:
    allowed = {
        "data": {"mindloom-tokenizer"},
        "tokenizer": set(),
        "model": set(),
        "parallel": {"mindloom-model"},
        "train": {"mindloom-data", "mindloom-tokenizer", "mindloom-model", "mindloom-parallel"},
        "monitor-tui": set(),
    }
    for pkg_dir, wheel in wheels.items():
        with zipfile.ZipFile(wheel) as zf:
            meta = next(n for n in zf.namelist() if n.endswith(".dist-info/METADATA"))
            requires = [
                line.split(":", 1)[1].strip()
                for line in zf.read(meta).decode().splitlines()
                if line.startswith("Requires-Dist:")
            ]
        ours = {
            re.split(r"[<>=!~ ;\[]", r, maxsplit=1)[0] for r in requires if r.startswith("mindloom")
        }
        assert ours == allowed[pkg_dir], (pkg_dir, ours)
        no_ms = {"data", "tokenizer", "monitor-tui"}
        if pkg_dir in no_ms:
            assert not any(r.startswith("mindspore") for r in requires), (pkg_dir, requires)


def test_data_wheel_alone_in_a_bare_venv(wheels: dict[str, Path], tmp_path: Path) -> None:
    venv = tmp_path / "venv"
    subprocess.run(
        [*_uv(), "venv", "--quiet", "-p", sys.executable, str(venv)], check=True, timeout=120
    )
    python = venv / "bin" / "python"
    # The tokenizer wheel comes along because mindloom-data declares it; nothing else of ours.
    subprocess.run(
        [*_uv(), "pip", "install", "--quiet", "--python", str(python)]
        + [str(wheels["data"]), str(wheels["tokenizer"])],
        check=True,
        timeout=600,
    )
    subprocess.run(
        [str(python), "-c", "import mindloom_data, sys; assert 'mindspore' not in sys.modules"],
        check=True,
        timeout=120,
    )
    out = subprocess.run(
        [str(venv / "bin" / "mindloom-data"), "--version"],
        check=True,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert _about_version("data", "mindloom_data") in out.stdout
    freeze = subprocess.run(
        [*_uv(), "pip", "freeze", "--python", str(python)],
        check=True,
        capture_output=True,
        text=True,
        timeout=120,
    ).stdout
    assert "mindspore" not in freeze
