"""mindloom_monitor: a terminal monitor for mindloom run directories; see the README.

Importing the package does not import Textual: the record parsing and statistics
(`parse_line`, `RunData`) and the run reader the app polls (`RunSource`, whose batches
`apply_batch` folds into a `RunData`) are plain Python, and `MonitorApp` is loaded on first use.
"""

from mindloom_monitor.__about__ import __version__
from mindloom_monitor._records import Event, Metric, parse_line
from mindloom_monitor._source import RunSource, apply_batch
from mindloom_monitor._stats import RunData, Settings

__all__ = [
    "__version__",
    "Event",
    "Metric",
    "MonitorApp",
    "RunData",
    "RunSource",
    "Settings",
    "apply_batch",
    "main",
    "parse_line",
]


def __getattr__(name: str):
    if name == "MonitorApp":
        from mindloom_monitor._app import MonitorApp

        return MonitorApp
    if name == "main":  # the `mindloom-monitor` command, main(argv) -> exit code
        from mindloom_monitor._cli import main

        return main
    raise AttributeError(f"module 'mindloom_monitor' has no attribute {name!r}")
