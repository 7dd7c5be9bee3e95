"""Disk tier in a new process: open each case's directory with a plain KVStore(dir), fetch P
(memory empty, so it comes from disk), run the oracle, and report per family/case.

Moved verbatim from a program string in tests/system/test_store.py; run as
``python -m tests.support.programs.store_disk_fetch JSON`` (see ``tests.support.children.run_module``).
"""


def main() -> None:
    import json, pickle, sys
    import tests.support.stores as U
    from kvstore import KVStore
    from tools.testing.model_builds import load_model

    jobs = json.loads(sys.argv[1])
    out = {}
    for job in jobs:
        model, _ = load_model(job["family"])
        ref = pickle.loads(open(job["ref"], "rb").read())
        for case in job["cases"]:
            # a plain KVStore(dir) (plus the engine's KV quantisation): chunk size and everything
            # else come from the directory
            with KVStore(case["dir"], **job["store_kw"]) as s:
                assert s.disk.chunk == U.CHUNK
                f = s.fetch(job["path"], job["P"])
                res = U.check_fetched(model, f, job["P"], ref, oracle=case["oracle"], trim1=case["trim1"],
                                    kv=job["kv"])
                if f.cache is not None:
                    again = s.fetch(job["path"], job["P"])
                    res["refetch"] = [again.n, again.source, U.cache_digest(again.cache)]
                res["stats"] = {k: s.stats()[k] for k in ("hits_disk", "hits_memory", "misses", "corrupt")}
            out[job["family"] + "/" + case["name"]] = res
    print(json.dumps(out))


if __name__ == "__main__":
    main()
