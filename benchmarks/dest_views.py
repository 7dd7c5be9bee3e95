"""A restore's per-segment bookkeeping (issue 47, item 2): giving every segment of a
chunked SmolLM2-shaped entry its destinations in the final arrays, the two ways
``segments.SegmentRead`` offers, in one process on the same arrays and headers:

- ``sliced``: ``add`` with a numpy token slice of every array per segment (the path
  before ``TokenRuns``: a slice, a reshape and a memoryview per run, per segment and
  tensor);
- ``token_runs``: ``add_tokens`` with ``TokenRuns`` made once per array (memoryview
  slices per segment).

No bytes are read: this times only the Python that decides where they go (the part of a
restore that grew with the number of segments). ``python -m benchmarks.dest_views
--tokens 131072`` writes ``results/dest_views.json``.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any

from . import common as C

NAME = "dest_views"
CHUNK = 256


def _headers(shape: dict[str, Any], n: int) -> list[Any]:
    from kvstore import segments

    out = []
    for lo in range(0, n, CHUNK):
        hi = min(n, lo + CHUNK)
        t = (1, shape["kv_heads"], hi - lo, shape["head_dim"])
        specs = {f"{i}.{kv}": ("F32", t) for i in range(shape["layers"]) for kv in ("keys", "values")}
        specs = dict(sorted(specs.items()))
        out.append((lo, hi, segments.Header({}, specs, 8, b"")))
    return out


def _once(how: str, arrays: dict[str, Any], heads: list[Any]) -> float:
    from kvstore import segments
    from kvstore.records import Segment

    t0 = time.perf_counter()
    runs = {n: segments.TokenRuns(a) for n, a in arrays.items()} if how == "token_runs" else {}
    for lo, hi, h in heads:
        nbytes = sum(4 * t[1] * t[2] * t[3] for _, t in h.specs.values())
        r = segments.SegmentRead(-1, Segment(b"\0" * 16, 0, 8 + nbytes, b"\0" * 16), h)
        if how == "token_runs":
            r.add_tokens(runs, lo, hi)
        else:
            r.add({n: a[..., lo:hi, :] for n, a in arrays.items()})
    return time.perf_counter() - t0


def run(n: int, reps: int) -> dict[str, Any]:
    import numpy as np

    shape = C.kv_shape("smollm2")
    heads = _headers(shape, n)
    arrays = {name: np.zeros((1, shape["kv_heads"], n, shape["head_dim"]), np.float32) for name in heads[0][2].specs}
    got: dict[str, list[float]] = {"sliced": [], "token_runs": []}
    for rep in range(reps):
        for how in (("sliced", "token_runs") if rep % 2 == 0 else ("token_runs", "sliced")):
            got[how].append(_once(how, arrays, heads))
    med = {how: C.median(xs) for how, xs in got.items()}
    return {"tokens": n, "segments": len(heads), "tensors": len(arrays), "reps": reps, "seconds": got,
            "median_s": med, "token_runs_vs_sliced": med["token_runs"] / med["sliced"],
            "loadavg1": C.loadavg1()}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.dest_views", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=131072)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--out", default=str(C.REPO_ROOT / "benchmarks" / "results"))
    a = ap.parse_args(argv)
    doc = run(a.tokens, a.reps)
    C.write_json(Path(a.out), NAME, doc)
    print(C.table(f"Destinations of {doc['segments']} segments x {doc['tensors']} tensors ({a.tokens} tokens), "
                  f"median of {a.reps}, load {doc['loadavg1']}",
                  ["sliced (before)", "token_runs (now)", "now / before"],
                  [[C.fmt(doc["median_s"]["sliced"], "s"), C.fmt(doc["median_s"]["token_runs"], "s"),
                    f"{doc['token_runs_vs_sliced']:.2f}x"]]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
