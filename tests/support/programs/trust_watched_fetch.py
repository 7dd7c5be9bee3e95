"""Fetch synthetic entries in a new process, collecting kvstore's warnings and counters;
optionally a gc in another process runs between each lookup and its restore.

Moved verbatim from a program string in tests/system/test_trust.py; run as
``python -m tests.support.programs.trust_watched_fetch JSON`` (see ``tests.support.children.run_module``).
"""


def main() -> None:
    import json, logging, sys
    from kvstore import KVStore
    from kvstore.identity import Identity
    a = json.loads(sys.argv[1])
    if a.get("gc_between"):  # a gc in another process between a lookup and its restore
        import subprocess
        import kvstore.disk as kd
        real = kd.DiskTier.restore
        def gc_then_restore(self, *args, **kw):
            subprocess.run([sys.executable, "-m", "kvstore.cli", "gc", "--max-bytes", "0", "--cache-dir",
                            a["cache"]], check=True, capture_output=True)
            return real(self, *args, **kw)
        kd.DiskTier.restore = gc_then_restore
    warned = []
    logging.getLogger("kvstore").addHandler(
        type("H", (logging.Handler,), {"emit": lambda s, r: warned.append(r.getMessage())})(logging.WARNING))
    ident = Identity(bytes.fromhex(a["digest"]), a["info"])
    with KVStore(a["cache"], chunk_tokens=a["chunk"]) as s:
        n = [s.fetch(ident, t).n for t in a["prompts"]]
        st = s.stats()
    counts = {k: st[k] for k in ("corrupt", "races", "warnings_suppressed")}
    print(json.dumps({"n": n, "warned": warned, "stats": counts}))


if __name__ == "__main__":
    main()
