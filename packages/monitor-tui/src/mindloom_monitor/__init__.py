"""mindloom_monitor: see the package README."""

from mindloom_monitor.__about__ import __version__

__all__ = ["__version__"]
