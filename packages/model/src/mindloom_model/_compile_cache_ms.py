"""MindSpore's side of the compile cache (`_compile_cache`): once per process, the private
directory its cache points at, the names of the files it reads and writes, and the switch
around each cached compile.

Every worker of an msrun job does the same. Once MindSpore's cluster is initialized (`init()`)
its file name carries the node's role, `rank_N/graph_cache/MS_WORKERcompile_cache_<k>.mindir`
(compile_cache_manager.cc: `GetCompileCachePath` puts `GetRole()`, the initialized
ClusterContext's node role, in front; `_role_prefix`); N is MindSpore's global rank, the
`rank` a caller passes. Plain data parallel needs no more (the group file is read only in
auto / semi-auto parallel mode). The rank stays in the caller's context: a data-parallel
job's ranks compile the same graph text, but sharing gains nothing (they compile it at the
same moment) and a graph that bakes in a rank-dependent value would load another rank's.
"""

from __future__ import annotations

import atexit
import os
import re
import shutil
import tempfile
from pathlib import Path

__all__ = ["PROCESS", "cache_file_index"]


_DIR_PREFIX = "mindloom-compile-"


def sweep_dead_dirs(tmp: str | None = None) -> list[Path]:
    """Remove the private directories of processes that are gone: atexit never runs in a
    SIGKILLed worker (an msrun job killed on a timeout, an OOM kill). A directory whose
    process lives (or whose pid was reused) is left; returns the ones removed."""
    gone = []
    for d in Path(tmp or tempfile.gettempdir()).glob(f"{_DIR_PREFIX}*-*"):
        pid = d.name[len(_DIR_PREFIX) :].split("-", 1)[0]
        if not pid.isdigit() or int(pid) == os.getpid():
            continue
        try:
            os.kill(int(pid), 0)
            continue  # alive, or another user's live process
        except ProcessLookupError:
            pass
        except PermissionError:
            continue
        shutil.rmtree(d, ignore_errors=True)
        gone.append(d)
    return gone


class _Process:
    """MindSpore's side, once per process: the private directory its cache points at, the
    index of the file its next cached compile reads or writes, and the rank directory."""

    def __init__(self) -> None:
        self.root: Path | None = None
        self.graph_dir: Path | None = None
        self.next_index = 0
        self.broken: str | None = None  # why the cache is off for this process

    def start(self, rank: int) -> None:
        """Point MindSpore at a private directory, once per process (MindSpore fixes the
        directory at the first cached compile of a process)."""
        if self.root is not None or self.broken:
            return
        sweep_dead_dirs()
        self.root = Path(tempfile.mkdtemp(prefix=f"{_DIR_PREFIX}{os.getpid()}-"))
        atexit.register(shutil.rmtree, self.root, True)
        self._entry_script()
        os.environ["MS_COMPILER_CACHE_PATH"] = str(self.root)
        self.graph_dir = self.root / f"rank_{rank}" / "graph_cache"
        self.graph_dir.mkdir(parents=True)

    def _entry_script(self) -> None:
        """MindSpore reads the dependency hash it no longer decides on (see `_Enabled`) from
        the entry script, `sys.argv[0]` at its import; a process started with `python -c`
        (a pytest-xdist worker, a notebook) has no such file and every cached compile then
        fails ("No such file or directory: .../-c"). Point it at an empty script here."""
        from mindspore.graph import api

        entry = getattr(api, "entry_script_path", None)
        if entry is not None and os.path.isfile(entry):
            return
        if not hasattr(api, "entry_script_path"):
            self.broken = "this MindSpore has no entry_script_path to check"
            return
        empty = self.root / "entry_script.py"
        empty.write_text("")
        api.entry_script_path = str(empty)

    def check(self) -> None:
        """After a cached compile: MindSpore wrote under the rank directory expected."""
        stray = [p for p in self.root.glob("rank_*/graph_cache/*.mindir")
                 if cache_file_index(p) >= 0 and p.parent != self.graph_dir]  # fmt: skip
        if stray:
            self.broken = f"MindSpore wrote {stray[0]}, not under {self.graph_dir}"

    def enabled(self):
        return _Enabled()

    def slot(self) -> Path:
        return self.graph_dir / f"{_role_prefix()}compile_cache_{self.next_index}.mindir"

    def written(self) -> list[Path]:
        return sorted(
            (p for p in self.graph_dir.glob("*.mindir") if cache_file_index(p) >= 0),
            key=cache_file_index,
        )

    def clear(self) -> None:
        for p in self.root.glob("rank_*/graph_cache/*.mindir"):
            if cache_file_index(p) >= 0:
                p.unlink()


# MindSpore's cache file name: the cluster role (see _role_prefix), then the counter
_CACHE_FILE = re.compile(r"(?:MS_[A-Z]+)?compile_cache_(\d+)\.mindir")


def cache_file_index(path: Path) -> int:
    m = _CACHE_FILE.fullmatch(path.name)
    return int(m.group(1)) if m else -1


def _role_prefix() -> str:
    """The start of the file name MindSpore reads and writes for a cached compile. Once
    its cluster is up (`init()` under msrun: MS_ROLE set, then `init_cluster`) the name
    carries the node's role: `GetCompileCachePath` in compile_cache_manager.cc is
    `rank_N/graph_cache/` + `GetRole()` + `compile_cache_<k>.mindir`, and `GetRole()` is
    the ClusterContext's node role (`MS_WORKER` for a worker) when the cluster is
    initialized, else empty. A wrong guess here only misses: the file staged under the
    other name is not read, MindSpore compiles and writes a second file, and `_account`
    publishes nothing when the files it finds are not exactly the one slot."""
    role = os.environ.get("MS_ROLE", "")
    if not role:
        return ""
    from mindspore.communication import GlobalComm

    return role if GlobalComm.INITED else ""


class _Enabled:
    """MindSpore's cache on for the compiles inside the block only (its environment switch
    is read at each compile; set_context's would log a deprecation warning each time).

    MS_DEV_FORCE_USE_COMPILE_CACHE skips MindSpore's own staleness check (a hash of the
    entry script's imports outside site-packages), which is both too weak (it sees no
    constant, no config, no installed mindloom code) and too strict: after one cache miss
    a process never loads a cached graph again. The key of the entry staged here is the
    staleness check instead."""

    def __enter__(self):
        self.old = os.environ.get("MS_COMPILER_CACHE_ENABLE")
        os.environ["MS_COMPILER_CACHE_ENABLE"] = "1"
        os.environ["MS_DEV_FORCE_USE_COMPILE_CACHE"] = "1"

    def __exit__(self, *exc):
        if self.old is None:
            os.environ.pop("MS_COMPILER_CACHE_ENABLE", None)
        else:
            os.environ["MS_COMPILER_CACHE_ENABLE"] = self.old
        os.environ.pop("MS_DEV_FORCE_USE_COMPILE_CACHE", None)
        return False


PROCESS = _Process()  # one per process: MindSpore fixes its cache directory once
