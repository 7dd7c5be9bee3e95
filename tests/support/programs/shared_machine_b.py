"""Machine B of the two-machine shared-tier test: a fresh store fetches each prompt (from the
shared tier), digests what it got and optionally runs the oracle / a cold prefill.

Moved verbatim from a program string in tests/system/test_shared_tier.py; run as
``python -m tests.support.programs.shared_machine_b JSON`` (see ``tests.support.children.run_module``).
"""


def main() -> None:
    import json, sys
    import tests.support.stores as U
    from kvstore import KVStore
    from tools.testing.model_builds import MODELS, load_model, model_path
    from tools.testing.oracle import check_restore, prefill

    job = json.loads(sys.argv[1])
    out = {}
    for fam, P in job["prompts"].items():
        model, _ = load_model(fam)
        kv = MODELS[fam].cache_kwargs
        with KVStore(job["dir"] + "/" + fam, chunk_tokens=U.CHUNK, shared=job["url"], **job["kw"][fam]) as s:
            rt0 = s.stats()["shared_round_trips"]
            f = s.fetch(model_path(fam), P)
            st = s.stats()
            res = {"n": f.n, "source": f.source, "round_trips": st["shared_round_trips"] - rt0,
                   "hits_shared": st["hits_shared"], "corrupt": st["corrupt"], "rejected": st["shared_rejected"],
                   "trim_hits": st["shared_trim_hits"]}
            if f.cache is not None:
                res["digest"] = U.cache_digest(f.cache)
                if job.get("cold"):  # a cold prefill of exactly the tokens the hit claims
                    res["cold"] = U.cache_digest(prefill(model, P[: f.n], **kv))
                if job["oracle"]:
                    r = check_restore(model, P, f.cache, f.n, n_gen=8, **kv)
                    res.update(ok=bool(r.ok), detail=r.detail)
        out[fam] = res
    print(json.dumps(out))


if __name__ == "__main__":
    main()
