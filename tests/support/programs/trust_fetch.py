"""Fetch each prompt under the synthetic identity in a new process: tokens served and counters,
or the exception opening the store raised (error and message).

Moved verbatim from a program string in tests/system/test_trust.py; run as
``python -m tests.support.programs.trust_fetch JSON`` (see ``tests.support.children.run_module``).
"""


def main() -> None:
    import json, sys
    from kvstore import KVStore
    from kvstore.identity import Identity
    a = json.loads(sys.argv[1])
    ident = Identity(bytes.fromhex(a["digest"]), a["info"])
    try:
        s = KVStore(a["cache"], chunk_tokens=a["chunk"], shared_dir=a.get("shared", False))
    except Exception as e:
        print(json.dumps({"error": type(e).__name__, "message": str(e)}))
        raise SystemExit(0)
    with s:
        got = [s.fetch(ident, t).n for t in a["prompts"]]
        if a.get("model"):  # a model directory: its identity reads the digest memo
            got.append(s.fetch(a["model"], [1, 2, 3]).n)
        st = s.stats()
    print(json.dumps({"n": got, "disk": s.disk is not None or st.get("disk_off") is None,
                      "stats": {k: st[k] for k in ("corrupt", "races", "warnings_suppressed", "misses")}}))


if __name__ == "__main__":
    main()
