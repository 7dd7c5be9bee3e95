"""Warm start in a new process: plan every entry through the index alone, counting the pack
files opened (through kvstore.files.open_own), then fetch one entry.

Moved verbatim from a program string in tests/system/test_store.py; run as
``python -m tests.support.programs.store_warm_start JSON`` (see ``tests.support.children.run_module``).
"""


def main() -> None:
    import json, sys
    import kvstore.files
    reads = []
    real = kvstore.files.open_own
    def counting(path):  # every pack file read is opened through open_own
        reads.append(str(path))
        return real(path)
    kvstore.files.open_own = counting

    from kvstore import KVStore
    from kvstore.identity import Identity
    job = json.loads(sys.argv[1])
    out = {"plans": []}
    with KVStore(job["dir"]) as s:
        s.stats()
        for name, toks in job["entries"]:
            who = Identity.from_components({"test": name}, name=name)
            plan = s.disk.plan(who, toks)
            out["plans"].append(None if plan is None else plan.n)
        out["reads_before"] = len(reads)
        name, toks = job["entries"][job["fetch"]]
        f = s.fetch(Identity.from_components({"test": name}, name=name), toks)
        out["fetched"] = [f.n, f.source]
        out["reads_after"] = sorted(reads)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
