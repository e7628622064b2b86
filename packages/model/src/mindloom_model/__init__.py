"""mindloom_model: see the package README."""

from mindloom_model.__about__ import __version__

__all__ = ["__version__"]
