"""mindloom_tokenizer: see the package README."""

from mindloom_tokenizer.__about__ import __version__

__all__ = ["__version__"]
