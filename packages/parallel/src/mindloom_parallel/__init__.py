"""mindloom_parallel: see the package README."""

from mindloom_parallel.__about__ import __version__

__all__ = ["__version__"]
