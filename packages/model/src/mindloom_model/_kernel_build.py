"""Building the fused CPU kernels' library (`_kernels/`), without MindSpore: the memory
estimate asks `buildable()` before any model exists.

The C++ source ships in the package and is compiled on first use into the user's cache,
`$MINDLOOM_CACHE_DIR` or `$XDG_CACHE_HOME/mindloom` or `~/.cache/mindloom`, under
`kernels/<hash of source, compiler and flags>/`: built into a temporary file and renamed
into place, under a file lock, so concurrent msrun workers build it once. The compiler is
`$CXX` (default `g++`).
"""

from __future__ import annotations

import fcntl
import functools
import hashlib
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

__all__ = ["build_library", "buildable"]

_HERE = Path(__file__).parent / "_kernels"
# compiled into one library
_SOURCES = [
    _HERE / "kernels.cpp",
    _HERE / "attention.cpp",
    _HERE / "experts.cpp",
    _HERE / "dispatch.cpp",
]
_HEADERS = [_HERE / "kernels.h"]
_FLAGS = [
    "-O3",
    "-std=c++17",
    "-fPIC",
    "-shared",
    "-fopenmp-simd",
    "-pthread",
    "-fno-math-errno",
    "-ffp-contract=fast",  # FMA in the AVX2 and AVX-512 builds (ISO C++ mode turns it off)
]


def _cache_root() -> Path:
    if os.environ.get("MINDLOOM_CACHE_DIR"):
        return Path(os.environ["MINDLOOM_CACHE_DIR"])
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "mindloom"


@functools.lru_cache(maxsize=1)
def _source_digest() -> bytes:
    """The shipped C++ source, hashed once per process (the memory estimate asks
    `buildable()` for every layout it tries)."""
    return hashlib.sha256(b"\0".join(p.read_bytes() for p in (*_SOURCES, *_HEADERS))).digest()


def _library_file() -> tuple[str, Path]:
    """($CXX, where its build of the current source lives)."""
    cxx = os.environ.get("CXX", "g++")
    key = hashlib.sha256(_source_digest() + "\0".join([cxx, *_FLAGS]).encode()).hexdigest()[:16]
    return cxx, _cache_root() / "kernels" / key / "libmindloom_kernels.so"


def _compiler_found(cxx: str) -> bool:
    return bool(cxx.strip()) and shutil.which(cxx.split()[0]) is not None


def buildable() -> bool:
    """Whether `kernels: auto` will have its library: built already, or a compiler to build
    it is on PATH (a compiler that then fails is only found out by building)."""
    cxx, lib = _library_file()
    return lib.exists() or _compiler_found(cxx)


def build_library() -> Path:
    """The compiled library's path, building it if needed; raises RuntimeError on failure."""
    cxx, lib = _library_file()
    if lib.exists():
        return lib
    if not _compiler_found(cxx):
        raise RuntimeError(f"no C++ compiler (CXX={cxx!r} not found)")
    out_dir = lib.parent
    out_dir.mkdir(parents=True, exist_ok=True)
    with open(out_dir / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another worker may be building it right now
        if lib.exists():
            return lib
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=out_dir)
        os.close(fd)
        objs = [f"{tmp}.{i}.o" for i in range(len(_SOURCES))]
        try:
            # the sources compile side by side (attention.cpp takes ~2/3 of the time), then link
            steps = [
                [[*cxx.split(), *_FLAGS, "-c", "-o", o, str(s)] for o, s in zip(objs, _SOURCES)]
            ]
            steps.append([[*cxx.split(), *_FLAGS, "-o", tmp, *objs]])
            for step in steps:
                procs = [subprocess.Popen(c, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                          text=True) for c in step]  # fmt: skip
                for proc in procs:
                    out = proc.communicate(timeout=300)[0]
                    if proc.returncode != 0:
                        msg = out.strip().splitlines()
                        raise RuntimeError(
                            f"{cxx} failed (exit {proc.returncode}): {msg[0] if msg else 'no output'}"
                        )
            if os.path.getsize(tmp) == 0:
                raise RuntimeError(f"{cxx} wrote an empty library")
            os.replace(tmp, lib)  # atomic: a reader never sees half a library
        finally:
            for path in (tmp, *objs):
                if os.path.exists(path):
                    os.unlink(path)
    return lib
