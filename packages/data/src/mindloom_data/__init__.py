"""mindloom_data: clean, deduplicate and tokenize corpora (no MindSpore)."""

from mindloom_data.__about__ import __version__
from mindloom_data._corpus import bundled_corpus

__all__ = ["__version__", "bundled_corpus"]
