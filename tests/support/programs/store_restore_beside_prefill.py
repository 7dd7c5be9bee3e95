"""Disk restores on one thread while another runs mlx-lm's prefill loop (forward step,
``mx.eval``, ``mx.clear_cache()``), as ``kvstore serve --preload-background`` does beside a
live request. Prints how far each thread got; if the two deadlock, faulthandler prints
every thread's stack and exits 1 after ``payload["timeout"]`` seconds.

Each thread that ran MLX work calls ``mx.clear_streams()`` last, as MLX 0.32 asks of every
thread (mlx-lm's generation thread included): otherwise MLX destroys the thread's stream in
its C++ thread-local destructors after ``join`` has returned, and if the interpreter is
finalizing by then the process aborts ("terminate called without an active exception",
rc -6, ml-explore/mlx#4110) after every check passed. kvstore's own threads do the same
(``kvstore.hoststate.release_streams``).

Run as ``python -m tests.support.programs.store_restore_beside_prefill JSON``
(``{"dir", "restores", "timeout"}``; see ``tests.support.children.run_module``).
"""


def main() -> None:
    import faulthandler
    import json
    import sys
    import threading

    import mlx.core as mx

    from kvstore import KVStore
    from tests.support.caches import assert_synth, ident, rand_tokens, synth

    job = json.loads(sys.argv[1])
    faulthandler.dump_traceback_later(job["timeout"], exit=True)
    who, toks = ident("beside-prefill"), rand_tokens(300, seed=3)
    done = {"restores": 0, "prefill_steps": 0}
    with KVStore(job["dir"], chunk_tokens=64) as s:
        s.insert(who, toks, synth(toks))
        s.flush()
        stop = threading.Event()

        def restores() -> None:  # the preload thread
            try:
                for _ in range(job["restores"]):
                    s.memory.clear()
                    f = s.fetch(who, toks)
                    assert (f.n, f.source) == (len(toks), "disk"), (f.n, f.source)
                    assert_synth(f.cache, toks)
                    done["restores"] += 1
            finally:
                stop.set()
                mx.clear_streams()

        def prefill() -> None:  # mlx-lm's generation thread (generate.py, prompt processing)
            w = mx.random.normal((256, 256))
            while not stop.is_set():
                x = mx.random.normal((1, 64, 256))
                mx.eval(x @ w)
                mx.clear_cache()
                done["prefill_steps"] += 1
            mx.clear_streams()

        threads = [threading.Thread(target=restores), threading.Thread(target=prefill)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        done["corrupt"] = s.stats()["corrupt"]
    faulthandler.cancel_dump_traceback_later()
    print(json.dumps(done))


if __name__ == "__main__":
    main()
