"""mindloom_train: see the package README."""

from mindloom_train.__about__ import __version__

__all__ = ["__version__"]
