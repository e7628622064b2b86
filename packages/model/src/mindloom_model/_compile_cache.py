"""A graph compile cache that is safe to share: one entry per graph identity, published
atomically, verified on every hit.

MindSpore 2.10's own compile cache (MS_COMPILER_CACHE_ENABLE) is unsafe to use as is:
- it keys a graph only on a hash of the entry script's non-site-packages imports, so a
  changed Python constant baked into the graph (rms_norm_eps, rope_theta, a shape derived
  from the config) loads the old graph silently;
- its files are named by a process-wide counter of cached compiles
  (`DIR/rank_N/graph_cache/compile_cache_<k>.mindir`), so two processes that compile
  graphs in different orders load each other's graphs; and the directory is fixed at
  the first cached compile of a process (setting another `compile_cache_path` later is
  ignored), so "one directory per graph" cannot be had from MindSpore itself;
- after one miss, a process never loads a cached graph again (its staleness check is
  sticky), so one process that runs several configs gains nothing.

What this module does instead: MindSpore's cache points, once per process, at a private
directory nobody else sees, and is switched on only around the compiles it is asked to do
(`CompileCache.run`), with its own staleness check skipped (MS_DEV_FORCE_USE_COMPILE_CACHE):
the key is the check. Before each such compile the entry for that graph's own key (sha256
of every mindloom source file, the MindSpore and Python versions, the caller's context --
the resolved config, rank, world size --, the graph's role, the constants its cells hold,
its parameters and its inputs' shapes and dtypes) is copied, checked against its manifest,
to the file name MindSpore will read next; on a miss MindSpore compiles and writes that
file, which is published to the shared store under the key only after the compiled graph
ran, with an atomic rename. Every file is removed from the private directory after each
compile, so a counter that drifted can never load a stale file: it only misses.

MindSpore's side (the private directory, its file names under msrun, the switch) is
`_compile_cache_ms`.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

from mindloom_model._compile_cache_ms import PROCESS, cache_file_index

__all__ = ["CompileCache", "compile_cache_dir", "mindloom_source_digest"]

ENV_DIR = "MINDLOOM_COMPILE_CACHE"  # the store when the caller sets none
DEFAULT_DIR = "~/.cache/mindloom/compile"
GRAPH_FILE = "graph.mindir"
MANIFEST = "manifest.json"
FORMAT = 1  # bump when the entry layout changes: old entries then simply miss


def compile_cache_dir(configured: str | None = None) -> Path:
    """The store: `configured` (a config's own setting), else $MINDLOOM_COMPILE_CACHE (a
    whole test suite, a cluster's shared disk), else ~/.cache/mindloom/compile."""
    chosen = configured or os.environ.get(ENV_DIR) or DEFAULT_DIR
    return Path(chosen).expanduser()


_SOURCE_DIGEST: str | None = None
_SOURCE_SUFFIXES = (".py", ".cpp", ".cc", ".h")


def mindloom_source_digest() -> str:
    """sha256 over the path and bytes of every source file (.py, and the C++ of the fused
    kernels, whose library a graph names) of every installed `mindloom_*` package: any code
    change (a planted bug included) makes every key new."""
    global _SOURCE_DIGEST
    if _SOURCE_DIGEST is None:
        import importlib.util
        import pkgutil

        h = hashlib.sha256()
        names = sorted({m.name for m in pkgutil.iter_modules() if m.name.startswith("mindloom_")})
        for name in names:
            spec = importlib.util.find_spec(name)
            for root in sorted(spec.submodule_search_locations or []) if spec else []:
                paths = (p for p in Path(root).rglob("*") if p.suffix in _SOURCE_SUFFIXES)
                for path in sorted(paths):
                    h.update(f"{name}/{path.relative_to(root).as_posix()}\0".encode())
                    h.update(path.read_bytes())
                    h.update(b"\0")
        _SOURCE_DIGEST = h.hexdigest()
    return _SOURCE_DIGEST


def _file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _signature(value: Any) -> Any:
    """What of an input a compiled graph depends on: shape and dtype of a tensor, the
    value of anything else (MindSpore bakes Python scalars and None into the graph)."""
    shape, dtype = getattr(value, "shape", None), getattr(value, "dtype", None)
    if shape is not None and dtype is not None:
        return ["tensor", list(shape), str(dtype)]
    if isinstance(value, (tuple, list)):
        return [type(value).__name__, [_signature(v) for v in value]]
    return [type(value).__name__, repr(value)]


_SCALARS = (bool, int, float, str, type(None))
# set by MindSpore as a cell is called or compiled: not part of what the graph computes
_VOLATILE = frozenset({"arguments_key", "is_top_cell", "phase", "compile_phase", "current_phase"})


def _cell_constants(cell) -> list:
    """Every sub-cell's class and its public scalar attributes (an eps, a flag, a tuple of
    decay flags) and its primitives' attributes (a dropout seed): the Python values a
    graph bakes in that the cell itself holds. A value computed inside `construct` from
    elsewhere is not seen: the caller's `context` must hold it."""
    from mindspore.ops import Primitive

    out = []
    for name, sub in cell.cells_and_names():
        consts = {}
        for attr, value in sorted(vars(sub).items()):
            if attr.startswith("_") or attr in _VOLATILE:
                continue
            if isinstance(value, _SCALARS):
                consts[attr] = value
            elif isinstance(value, (tuple, list)) and all(isinstance(v, _SCALARS) for v in value):
                consts[attr] = list(value)
            elif isinstance(value, Primitive):
                consts[attr] = {k: repr(v) for k, v in sorted(value.attrs.items())}
        out.append([name, f"{type(sub).__module__}.{type(sub).__qualname__}", consts])
    return out


class CompileCache:
    """Compiled graphs of one run, from and into the store at `store`.

    `context` is what the caller knows a graph depends on beyond its code, parameters and
    inputs (a resolved config, rank, world size): it goes into every key as canonical
    JSON. `run(role, cell, *args)` calls the cell; when that call compiles a graph (its
    first call, or new input shapes) the graph comes from the store when a verified entry
    exists, and is published there otherwise. `log` gets one line per refused entry and
    the summary."""

    def __init__(self, store: str | Path, context: dict[str, Any], *, rank: int = 0,
                 log: Callable[[str], None] = print, enabled: bool = True):  # fmt: skip
        self.store = Path(store).expanduser()
        self.rank = rank
        self.log = log
        self.hits = self.misses = self.refused = 0
        self.enabled = enabled
        self._seen: dict[int, set] = {}  # id(cell) -> input signatures already compiled
        self._cells: list = []  # keeps the ids above from being reused
        if not enabled:
            return
        if os.environ.get("MS_COMPILER_CACHE_ENABLE") not in (None, "", "0"):
            self.log("compile cache: off (MS_COMPILER_CACHE_ENABLE is set: MindSpore's own "
                     "cache, which keys on neither constants nor shapes, is in charge)")  # fmt: skip
            self.enabled = False
            return
        import platform

        import mindspore as ms

        self._base = {
            "format": FORMAT,
            "mindloom_sources": mindloom_source_digest(),
            "mindspore": ms.__version__,
            "python": platform.python_version(),
            "device_target": ms.get_context("device_target"),
            "ms_env": {
                k: v for k, v in sorted(os.environ.items()) if k.startswith(("MS_DEV_", "MS_JIT"))
            },
            "context": context,
        }

    # ----------------------------------------------------------------- keys

    def key(self, role: str, cell, args: tuple) -> str:
        params = [[p.name, list(p.shape), str(p.dtype)] for p in cell.get_parameters()]
        ident = {**self._base, "role": role, "cell": f"{type(cell).__module__}.{type(cell).__qualname__}",
                 "constants": _cell_constants(cell), "parameters": params,
                 "inputs": [_signature(a) for a in args]}  # fmt: skip
        blob = json.dumps(ident, sort_keys=True, separators=(",", ":"), default=str)
        return hashlib.sha256(blob.encode()).hexdigest()

    # ----------------------------------------------------------------- the call

    def run(self, role: str, cell, *args):
        """`cell(*args)`, compiled through the store when this call compiles."""
        if not self.enabled or PROCESS.broken:
            return cell(*args)
        sig = json.dumps([_signature(a) for a in args], default=str)
        seen = self._seen.setdefault(id(cell), set())
        if sig in seen:
            return cell(*args)
        seen.add(sig)
        self._cells.append(cell)
        try:
            PROCESS.start(self.rank)
        except OSError as exc:  # no private directory: compile as if there were no cache
            PROCESS.broken = f"no private directory ({exc})"
        if PROCESS.broken:
            self.log(f"compile cache: off for this process ({PROCESS.broken})")
            return cell(*args)
        key = self.key(role, cell, args)
        entry = self.store / key[:2] / key
        slot = PROCESS.slot()
        staged = self._stage(entry, slot)
        before = len(cell.compile_cache)
        # MindSpore 2.10's cached compile replaces sys.stderr (and sys.__stderr__) with a
        # bare fd-2 printer: output still reaches fd 2, but whatever the caller had put there
        # (pytest's capsys, a notebook's stream, a redirect_stderr) stops receiving it
        streams = sys.stdout, sys.stderr, sys.__stdout__, sys.__stderr__
        try:
            with PROCESS.enabled():
                out = cell(*args)
            _sync(out)  # the compiled graph ran, not only compiled
        except BaseException:
            PROCESS.clear()
            raise
        finally:
            sys.stdout, sys.stderr, sys.__stdout__, sys.__stderr__ = streams
        compiled = len(cell.compile_cache) > before
        written = PROCESS.written()
        try:
            if compiled:
                PROCESS.check()
            if PROCESS.broken:
                self.misses += 1
                self.log(f"compile cache: off for this process ({PROCESS.broken})")
            else:
                self._account(role, entry, slot, staged, compiled, written)
        finally:
            PROCESS.clear()
        return out

    def _account(self, role, entry, slot, staged, compiled, written) -> None:
        if not compiled:  # MindSpore reused a graph of its own: no file read or written
            return
        PROCESS.next_index += 1
        if not written and staged is None:
            # MindSpore wrote no file this module recognises (a new naming scheme?):
            # nothing can be published, and guessing further could load a wrong graph
            PROCESS.broken = f"MindSpore wrote no cache file for {role}"
            self.misses += 1
            self.log(f"compile cache: off for this process ({PROCESS.broken})")
            return
        if [p.name for p in written] != [slot.name]:
            # something else compiled under the switch, or the counter is not where we
            # think: nothing is published, and the counter follows MindSpore's files
            PROCESS.next_index = (
                max(cache_file_index(p) for p in written) + 1 if written else PROCESS.next_index
            )
            self.misses += 1
            self.log(f"compile cache: {role}: MindSpore's files were {[p.name for p in written]}, "
                     f"expected {slot.name}; not published")  # fmt: skip
            return
        if staged is not None and _file_sha256(slot) == staged:
            self.hits += 1
            return
        self.misses += 1
        self._publish(entry, slot, role)

    def _stage(self, entry: Path, slot: Path) -> str | None:
        """Copy a verified entry to `slot`; its sha256, or None (no usable entry)."""
        if not entry.is_dir():
            return None
        try:
            manifest = json.loads((entry / MANIFEST).read_text())
            want = manifest["files"][GRAPH_FILE]
            shutil.copyfile(entry / GRAPH_FILE, slot)
            got = _file_sha256(slot)  # the bytes MindSpore will read, not the store's
            if got != want:
                raise ValueError(f"{GRAPH_FILE} sha256 {got[:12]} != manifest {want[:12]}")
            return got
        except (OSError, ValueError, KeyError, TypeError) as exc:
            slot.unlink(missing_ok=True)
            self.refused += 1
            self.log(f"compile cache: entry {entry} refused ({exc}); discarded, compiling afresh")
            _discard(entry)
            return None

    def _publish(self, entry: Path, slot: Path, role: str) -> None:
        tmp = entry.parent / f".tmp-{entry.name}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        try:
            tmp.mkdir(parents=True)
            shutil.copyfile(slot, tmp / GRAPH_FILE)
            manifest = {"format": FORMAT, "role": role, "mindspore_version": self._base["mindspore"],
                        "files": {GRAPH_FILE: _file_sha256(tmp / GRAPH_FILE)}}  # fmt: skip
            (tmp / MANIFEST).write_text(json.dumps(manifest, indent=1))
            for name in (GRAPH_FILE, MANIFEST):
                with open(tmp / name, "rb") as f:
                    os.fsync(f.fileno())
            os.rename(tmp, entry)  # atomic; fails when another process published first
        except OSError:
            pass  # the other publisher's entry stands (or the store is read-only)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)

    def summary(self) -> str:
        if not self.enabled:
            return "compile cache: off"
        return (f"compile cache: {self.hits} hits, {self.misses} misses"
                + (f", {self.refused} refused" if self.refused else "") + f" ({self.store})")  # fmt: skip


def _discard(entry: Path) -> None:
    """Move a bad entry out of the way atomically, then delete it."""
    trash = entry.parent / f".bad-{entry.name}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    try:
        os.rename(entry, trash)
    except OSError:
        return  # another process got there first
    shutil.rmtree(trash, ignore_errors=True)


def _sync(out: Any) -> None:
    """Wait until the graph has run (a failure raises here, before anything is published)."""
    first = out[0] if isinstance(out, (tuple, list)) and out else out
    if hasattr(first, "asnumpy"):
        first.asnumpy()
