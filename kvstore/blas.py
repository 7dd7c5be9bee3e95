"""Debian's OpenBLAS for MLX's float32 matmuls on Linux, when it is installed.

mlx's Linux CPU wheel does float32 matmuls in a slow reference BLAS (~6 GFLOPS here);
preloading OpenBLAS (``apt-get install libopenblas0-pthread``) makes float32 prefill
10-18x faster. ``kvstore serve``, ``kvstore warm``, the demo and the benchmarks call
``preload_openblas()`` before mlx is imported: it re-executes the process (same pid,
interpreter flags, arguments and environment) with the library in ``LD_PRELOAD``.
``KVSTORE_NO_OPENBLAS=1`` keeps the reference BLAS. A no-op on macOS (Metal) and where the
library is not installed; the tests never depend on it.
"""

from __future__ import annotations

import os
import platform
import sys
from pathlib import Path

OPT_OUT = "KVSTORE_NO_OPENBLAS"
_announced = False


def openblas_path() -> Path:
    """Where Debian's ``libopenblas0-pthread`` puts its BLAS for this machine's architecture."""
    return Path(f"/usr/lib/{platform.machine()}-linux-gnu/openblas-pthread/libblas.so.3")


def in_use() -> str:
    """The BLAS this process runs with: "openblas" (the library is mapped into it),
    "metal" (macOS) or "reference"."""
    if sys.platform == "darwin":
        return "metal"
    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:
        return "reference"
    lib = openblas_path()
    return "openblas" if str(lib) in maps or os.path.realpath(lib) in maps else "reference"


def preload_environment() -> dict[str, str]:
    """The ``LD_PRELOAD`` that gives a process (this one re-executed, or any server a
    benchmark starts beside ``kvstore serve``) the BLAS kvstore's commands run with:
    OpenBLAS where installed and not opted out, else {} (MLX's reference BLAS). A side by
    side on different BLAS would measure the BLAS: float32 prefill differs ~15x."""
    lib = openblas_path()
    if sys.platform != "linux" or os.environ.get(OPT_OUT) or not lib.exists():
        return {}
    preload = os.environ.get("LD_PRELOAD", "")
    return {"LD_PRELOAD": ":".join(p for p in (str(lib), preload) if p) if str(lib) not in preload else preload}


def preload_openblas() -> None:
    """Re-execute this process with OpenBLAS preloaded when it is installed, not loaded yet
    and not opted out (``KVSTORE_NO_OPENBLAS``); otherwise return. Never loops: a process
    whose ``LD_PRELOAD`` already names the library is left alone."""
    extra = preload_environment()
    if not extra or extra["LD_PRELOAD"] == os.environ.get("LD_PRELOAD", ""):
        return
    env = dict(os.environ, **extra)
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    try:  # sys.orig_argv keeps `-m module` / `-c code`, which sys.argv loses
        os.execve(sys.executable, [sys.executable, *sys.orig_argv[1:]], env)
    except OSError:
        return


def describe() -> str:
    """One line: the BLAS in use and how to change it."""
    kind, lib = in_use(), openblas_path()
    if kind == "openblas":
        return f"BLAS: OpenBLAS ({lib}, preloaded; {OPT_OUT}=1 keeps MLX's reference BLAS)"
    if kind == "metal":
        return "BLAS: Metal (macOS; nothing to preload)"
    if os.environ.get(OPT_OUT):
        return f"BLAS: MLX's reference CPU BLAS ({OPT_OUT} is set)"
    if sys.platform == "linux" and not lib.exists():
        return ("BLAS: MLX's reference CPU BLAS (float32 prefill is ~15x faster with OpenBLAS: "
                "apt-get install libopenblas0-pthread)")
    return f"BLAS: MLX's reference CPU BLAS ({lib} could not be preloaded)"


def announce() -> None:
    """Print ``describe()`` to stderr, once per process."""
    global _announced
    if not _announced:
        _announced = True
        print(f"kvstore: {describe()}", file=sys.stderr, flush=True)
