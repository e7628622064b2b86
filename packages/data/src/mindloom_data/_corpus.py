"""The corpus shipped inside the package, so the demo and tests need no download."""

from __future__ import annotations

from pathlib import Path


def bundled_corpus() -> Path:
    """Path of tiny Shakespeare (about 1.1 MB of public-domain plain text)."""
    return Path(__file__).with_name("corpora") / "tinyshakespeare.txt"
