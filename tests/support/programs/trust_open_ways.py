"""Open a cache directory each way asked (KVStore raising, LRUPromptCache, shared_dir=True)
and report what happened: opened, the StoreOpenError text, or LRU's disk state and warning.

Moved verbatim from a program string in tests/system/test_trust.py; run as
``python -m tests.support.programs.trust_open_ways JSON`` (see ``tests.support.children.run_module``).
"""


def main() -> None:
    import json, logging, sys
    from kvstore import KVStore, LRUPromptCache, StoreOpenError
    a = json.loads(sys.argv[1])
    seen = []
    Seen = type("Seen", (logging.Handler,), {"emit": lambda s, r: seen.append(r.getMessage())})
    logging.getLogger("kvstore").addHandler(Seen())
    out = {}
    for way in a["ways"]:
        if way == "lru":
            lru = LRUPromptCache(cache_dir=a["cache"])
            out["lru"] = {"disk": lru.store.disk is not None, "warned": seen[-1:]}
            lru.close()
            continue
        try:
            KVStore(a["cache"], shared_dir=way == "shared").close()
            out[way] = "opened"
        except StoreOpenError as e:
            out[way] = str(e)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
