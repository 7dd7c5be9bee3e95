"""A new process opens the store, fetches every prompt (plus a short user turn) and checks each
hit with the oracle (tests/system/test_cli.py's template store).

Moved verbatim from a program string in tests/system/test_cli.py; run as
``python -m tests.support.programs.cli_fetch JSON`` (see ``tests.support.children.run_module``).
"""


def main() -> None:
    import json, sys
    from pathlib import Path
    from kvstore import KVStore, Identity
    from tools.testing.model_builds import load_model
    from tools.testing.oracle import check_restore
    P = json.loads(sys.argv[1])
    model, tok = load_model("tiny-llama")
    gone = Identity.from_components(P["gone_components"], name="gone-model", path=P["gone_path"])
    out = {}
    with KVStore(P["cache_dir"], chunk_tokens=64, max_entries=0) as store:
        store.register(gone.digest, gone)
        for name, toks in P["prompts"].items():
            who = gone.digest if name in P["gone"] else P["model_dir"]
            q = toks + P["suffix"]
            f = store.fetch(who, q)
            ok = None
            if f.cache is not None:
                ok = check_restore(model, q, f.cache, f.n, n_gen=4).ok
            out[name] = {"n": f.n, "source": f.source, "oracle": ok}
    print(json.dumps(out))


if __name__ == "__main__":
    main()
