"""Use Debian's OpenBLAS for MLX's float32 matmuls on Linux, when it is installed.

mlx's Linux CPU wheel does float32 matmuls in a slow reference BLAS (~6 GFLOPS here);
preloading OpenBLAS (``apt-get install libopenblas0-pthread``) makes float32 prefill
10-18x faster. Used by the demo and the benchmarks, never by the tests (they must not
depend on it). A no-op on macOS, where MLX runs on Metal.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

OPENBLAS = Path("/usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3")


def in_use() -> str:
    """What BLAS this process runs with: "openblas" or "reference"/"metal"."""
    if sys.platform == "darwin":
        return "metal"
    return "openblas" if str(OPENBLAS) in os.environ.get("LD_PRELOAD", "") else "reference"


def reexec_with_openblas() -> None:
    """Re-run this process with OpenBLAS preloaded if it is installed and not yet loaded.
    Set KVSTORE_NO_OPENBLAS=1 to keep the reference BLAS."""
    if sys.platform != "linux" or os.environ.get("KVSTORE_NO_OPENBLAS") or not OPENBLAS.exists():
        return
    if str(OPENBLAS) in os.environ.get("LD_PRELOAD", ""):
        return
    env = dict(os.environ)
    env["LD_PRELOAD"] = ":".join(p for p in (str(OPENBLAS), env.get("LD_PRELOAD", "")) if p)
    os.execve(sys.executable, [sys.executable, *sys.argv], env)
