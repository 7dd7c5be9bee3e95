"""Machine A of the two-machine shared-tier test: prefill a prefix on every family and insert
it into a store backed by the shared tier.

Moved verbatim from a program string in tests/system/test_shared_tier.py; run as
``python -m tests.support.programs.shared_machine_a JSON`` (see ``tests.support.children.run_module``).
"""


def main() -> None:
    import json, sys
    import tests.support.stores as U
    from tests.support.prompts import text_prompt
    from kvstore import KVStore
    from tools.testing.model_builds import MODELS, load_model, model_path
    from tools.testing.oracle import prefill

    job = json.loads(sys.argv[1])
    out = {}
    for fam in job["families"]:
        model, tok = load_model(fam)
        kv = MODELS[fam].cache_kwargs
        P = text_prompt(tok, job["L"], seed=len(fam))
        S = P[: job["Ls"]]
        cache = prefill(model, S, **kv)
        with KVStore(job["dir"] + "/" + fam, chunk_tokens=U.CHUNK, shared=job["url"], **job["kw"][fam]) as s:
            s.insert(model_path(fam), S, cache)
            s.flush(60)
            st = s.stats()
        out[fam] = {"P": P, "digest": U.cache_digest(cache), "published": st["shared_published"],
                    "errors": st["shared_errors"]}
    print(json.dumps(out))


if __name__ == "__main__":
    main()
