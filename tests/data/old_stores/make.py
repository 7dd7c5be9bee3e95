"""Write the cache directories in this folder with kvstore's landed versions, as their own
code wrote them: ``format-N-<commit>.tar.gz`` (format 2 and 3, which today's kvstore sets
aside; format 4 by the previous landed version, which it restores in place).

Run from a full clone (the commits must be there): ``python tests/data/old_stores/make.py``.
Each version's ``kvstore`` package is taken out with ``git archive`` into a temp folder and
run in a child with that folder first on ``PYTHONPATH`` (this checkout's ``tests.support``
after it, for the synthetic caches): the stores hold ``PROMPTS`` under identity
``ident("old-store")``, prompt i's cache ``synth_kv_cache(1, 1, len, 4, seed=i)``.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[2]
VERSIONS = {"format-2-a21c03f": "a21c03f", "format-3-d37dbcc": "d37dbcc", "format-4-5209c45": "5209c45"}
PROMPTS = [(12 + 5 * i, 300 + i) for i in range(3)]  # (tokens, seed of rand_tokens)

_WRITE = r"""
import sys
from kvstore import KVStore
from tests.support.caches import ident, rand_tokens, synth_kv_cache
s = KVStore(sys.argv[1], chunk_tokens=16)
for i, (n, seed) in enumerate(eval(sys.argv[2])):
    s.insert(ident("old-store"), rand_tokens(n, seed=seed), synth_kv_cache(1, 1, n, 4, seed=i))
    assert s.flush()
s.close()
"""


def make(name: str, commit: str, tmp: Path) -> Path:
    code = tmp / f"code-{commit}"
    code.mkdir()
    tar = subprocess.run(["git", "-C", str(ROOT), "archive", commit, "kvstore"], check=True, capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(code)], input=tar, check=True)
    cache = tmp / name
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(code), str(ROOT)]))
    subprocess.run([sys.executable, "-c", _WRITE, str(cache), repr(PROMPTS)], check=True, env=env, cwd=str(tmp))
    for junk in cache.glob("index/writer-*"):
        junk.unlink()
    out = HERE / f"{name}.tar.gz"
    with tarfile.open(out, "w:gz") as t:
        t.add(cache, arcname=name)
    return out


if __name__ == "__main__":
    with tempfile.TemporaryDirectory() as d:
        for name, commit in VERSIONS.items():
            out = make(name, commit, Path(d))
            print(out.name, out.stat().st_size)
