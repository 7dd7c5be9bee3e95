"""One node of a two-node exo group (MLX's ring backend on 127.0.0.1), for
``tests/system/test_exo.py``: each node has its own cache directory holding a different prefix of
the prompt; ``get_kv_cache`` must give both the same number of tokens, each equal to a cold
prefill; then an add under memory pressure on one node evicts on both (exo's maximum over
the group).

Run as ``python -m tests.support.programs.exo_group JSON`` with ``MLX_HOSTFILE`` and
``MLX_RANK`` set (``{"family", "dir", "held", "snapshot", "pressure"}``).
"""


def main() -> None:
    import json
    import os
    import sys

    import mlx.core as mx

    from kvstore.adapters.exo import ExoPrefixCache
    from tests.support.programs.exo_generate import Snapshot
    from tools.testing import oracle
    from tools.testing.model_builds import load_model, model_path

    job = json.loads(sys.argv[1])
    group = mx.distributed.init(backend="ring", strict=True)
    rank = group.rank()
    readings = list(job["pressure"][rank])

    class Pressured(ExoPrefixCache):
        def get_memory_used_percentage(self) -> float:  # this node's reading, then exo's max
            local = readings.pop(0) if readings else 0.0
            return float(mx.max(mx.distributed.all_gather(mx.array([local]), group=self._group)).item())

    model, _ = load_model(job["family"])
    prompt = [3 + (i * 53) % 240 for i in range(100)]
    held = job["held"][rank]
    shard = {"kind": "PipelineShardMetadata", "model_id": "tiny", "start_layer": 0, "end_layer": 4,
             "n_layers": 4, "device_rank": rank, "world_size": 2}
    pc = Pressured(group, model_path=model_path(job["family"]), shard=shard, cache_dir=f"{job['dir']}/{rank}",
                   chunk_tokens=64, threshold=0.5)
    snaps = []
    if job["snapshot"] and job["snapshot"] < held:
        at = oracle.prefill(model, prompt[: job["snapshot"]])
        snaps = [Snapshot([c if type(c).__name__ == "ArraysCache" else None for c in at], job["snapshot"])]
    pc.add_kv_cache(mx.array(prompt[:held] + [7]), oracle.prefill(model, prompt[:held]), snaps)
    cache, remaining, index, _ = pc.get_kv_cache(model, mx.array(prompt))
    n = len(prompt) - len(remaining)
    ok = oracle.check_restore(model, prompt, cache, n, n_gen=4).ok if n else None
    pc.add_kv_cache(mx.array(prompt[:30]), oracle.prefill(model, prompt[:30]))
    print(json.dumps({"rank": rank, "n": n, "index": index, "oracle": ok, "entries": len(pc.prompts),
                      "pid": os.getpid()}))
    pc.close()


if __name__ == "__main__":
    main()
