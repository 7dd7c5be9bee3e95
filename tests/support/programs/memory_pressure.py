"""A store under real memory pressure, in a memory cgroup the test made: fills its memory
tier, then answers the test's commands on stdin ("wait_shrink", "wait_grow", "check"),
one JSON line each on stdout.

``python -m tests.support.programs.memory_pressure JSON`` with JSON = {"cgroup": procs file
to join, "dir": cache dir, "floor": bytes, "entries": N, "layers": L}.
"""

from __future__ import annotations

import json
import os
import sys
import time


def main() -> None:
    job = json.loads(sys.argv[1])
    with open(job["cgroup"], "w") as f:  # join the test's cgroup before allocating anything
        f.write(str(os.getpid()))
    import mlx.core as mx

    import tests.support.stores as U
    from kvstore import KVStore
    from tests.support.caches import ident, rand_tokens, synth_kv_cache

    who = ident("pressure")
    prompts = [rand_tokens(512, 100 + i) for i in range(job["entries"])]
    digests = []
    store = KVStore(job["dir"], max_entries=1000, memory_floor=job["floor"])
    for i, toks in enumerate(prompts):
        cache = synth_kv_cache(job["layers"], 8, len(toks), 128, seed=i)
        digests.append(U.cache_digest(cache))
        store.insert(who, toks, cache)
        del cache
    store.flush()
    mx.clear_cache()  # the test's own arrays: only the store's snapshots hold memory now

    def stats() -> dict:
        s = store.stats()
        return {k: s.get(k) for k in ("memory_bytes", "memory_entries", "memory_budget_bytes",
                                      "memory_available_bytes", "memory_floor_bytes", "evictions_pressure",
                                      "dropped_writes", "write_errors")}

    def wait(cond, seconds: float = 60) -> dict:
        t0 = time.monotonic()
        while time.monotonic() - t0 < seconds:
            s = stats()
            if cond(s):
                return dict(s, waited=round(time.monotonic() - t0, 2), ok=True)
            time.sleep(0.1)
        return dict(stats(), ok=False)

    print(json.dumps(dict(stats(), phase="filled")), flush=True)
    low = None
    for line in sys.stdin:
        cmd = line.strip()
        if cmd == "wait_shrink":  # the hog holds its memory now
            out = wait(lambda s: (s["evictions_pressure"] or 0) > 0)
            low = out["memory_budget_bytes"]
        elif cmd == "wait_grow":  # the hog is gone
            out = wait(lambda s: s["memory_budget_bytes"] > (low or 0) + (256 << 20))
        elif cmd == "check":  # every entry still served, bit for bit, from memory or disk
            got = []
            for toks, digest in zip(prompts, digests):
                f = store.fetch(who, toks)
                got.append({"n": f.n, "source": f.source,
                            "same": f.cache is not None and U.cache_digest(f.cache) == digest})
            out = {"fetched": got, **stats()}
            store.close()
        else:
            out = {"error": f"unknown command {cmd!r}"}
        print(json.dumps(out), flush=True)
        if cmd == "check":
            return


if __name__ == "__main__":
    main()
