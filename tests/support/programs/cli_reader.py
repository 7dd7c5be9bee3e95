"""A reader process fetching every prompt in rounds while gc / verify --fix run alongside it:
counts hits, misses and errors, compares restored tensors with a prefill and runs the oracle
on some hits, until the stop file appears.

Moved verbatim from a program string in tests/system/test_cli.py; run as
``python -m tests.support.programs.cli_reader JSON`` (see ``tests.support.children.run_module``).
"""


def main() -> None:
    import json, sys, time
    from pathlib import Path
    import numpy as np
    from kvstore import KVStore, Identity
    from tools.testing.model_builds import load_model
    from tools.testing.oracle import check_restore, prefill
    P = json.loads(sys.argv[1])
    model, tok = load_model("tiny-llama")
    gone = Identity.from_components(P["gone_components"], name="gone-model", path=P["gone_path"])
    refs = {n: [(np.array(c.keys[..., :len(t), :]), np.array(c.values[..., :len(t), :])) for c in prefill(model, t)]
            for n, t in P["prompts"].items()}
    res = {"fetches": 0, "hits": 0, "partial": 0, "misses": 0, "errors": [], "wrong": [], "oracle_runs": 0,
           "rounds": 0, "round_ends": []}
    stop, ready = Path(P["stop"]), Path(P["ready"])
    deadline = time.time() + P["max_seconds"]
    with KVStore(P["cache_dir"], chunk_tokens=64, max_entries=0) as store:
        store.register(gone.digest, gone)
        while not stop.exists() and time.time() < deadline:
            for name, toks in P["prompts"].items():
                who = gone.digest if name == "D" else P["model_dir"]
                q = toks + [10, 33]
                res["fetches"] += 1
                try:
                    f = store.fetch(who, q)
                    if f.cache is None:
                        res["misses"] += 1
                        continue
                    res["hits"] += 1
                    res["partial"] += f.n < len(toks)
                    for layer, (k, v) in zip(f.cache, refs[name]):
                        if layer.offset != f.n or not (np.allclose(np.array(layer.keys[..., :f.n, :]), k[..., :f.n, :], atol=1e-4)
                                                       and np.allclose(np.array(layer.values[..., :f.n, :]), v[..., :f.n, :], atol=1e-4)):
                            res["wrong"].append(f"{name}: restored tensors differ (n={f.n})")
                            break
                    if res["hits"] % 7 == 1:
                        res["oracle_runs"] += 1
                        r = check_restore(model, q, f.cache, f.n, n_gen=3)
                        if not r.ok:
                            res["wrong"].append(f"{name}: oracle {r.detail}")
                except Exception as e:
                    res["errors"].append(f"{name}: {type(e).__name__}: {e}")
            res["rounds"] += 1
            res["round_ends"].append(time.time())
            ready.touch()
    res["stats"] = {k: v for k, v in store.stats().items() if isinstance(v, (int, float))}
    print(json.dumps(res))


if __name__ == "__main__":
    main()
